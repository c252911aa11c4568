"""``bridge.yml``: the bridge's one config file, validated with readable errors.

Targets are static: every URL the bridge ever sends to comes from here (or
from a file or environment variable named here), never from a request.
Secrets — heartbeat URLs carry their token, bearer tokens, HMAC keys — can be
given as ``KEY_file`` (a path; trailing newline stripped) or ``KEY_env`` (an
environment variable) instead of inline. See docs/bridge.md for every key.

The file is read through the config layer (configfile.py) like every other:
its shape is the msgspec Structs below, the targets a union tagged by
``type``. msgspec stops at a structure's first problem, and ``bridge check``
must list every one, so :func:`validate` converts each part on its own (every
top-level section, then each target) and collects what each says, in the
layer's words; what only the whole can tell (a target's URL scheme, its
secrets, two targets with one name) is checked after. :func:`load_config`
raises the first problem as a one-line :class:`ConfigError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec

from colossalai_exporter import configfile
from colossalai_exporter.bridge.matchers import (
    Matcher,
    MatcherError,
    Predicate,
    compile_selector,
    parse_selector,
)
from colossalai_exporter.configfile import (
    ConfigPath,
    LogSection,
    NonEmpty,
    Seconds,
    Section,
    WebSection,
)
from colossalai_exporter.daemon import DaemonSettings
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import load_yaml_file

DEFAULT_PORT = 9468
KINDS = ("heartbeat", "health_heartbeat", "webhook")
METHODS = ("GET", "POST", "HEAD", "PUT")
DEFAULT_HEARTBEAT_SELECTOR = ('alertname="Watchdog"',)
_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")


class TLSSettings(configfile.TLSClient, frozen=True):
    """An endpoint's ``tls`` block: the config layer's TLS client block, read as
    Prometheus reads a ``tls_config``, with what requests needs of it.

    Paths are absolute (resolved against the config file's folder). Without a
    block, HTTPS targets are verified against the CA bundle shipped with requests.
    """

    @property
    def verify(self) -> bool | str:
        """requests' ``verify=``: the CA file replaces the bundle rather than adding to it."""
        if self.insecure_skip_verify:
            return False
        return self.ca_file or True

    @property
    def cert(self) -> tuple[str, str] | None:
        """requests' ``cert=``: the client certificate and its key, or None."""
        if self.cert_file and self.key_file:
            return self.cert_file, self.key_file
        return None


@dataclass(frozen=True)
class HttpCall:
    """Where and how one kind of request goes. ``url`` is secret: never log it."""

    url: str
    method: str = "GET"
    timeout: float = 10.0
    success_codes: frozenset[int] = frozenset(range(200, 300))
    headers: tuple[tuple[str, str], ...] = ()
    tls: TLSSettings | None = None

    def redacted(self) -> str:
        """scheme://host/… : enough to tell targets apart, no path or query (tokens live there)."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.hostname or ''}/…"


@dataclass(frozen=True)
class Target:
    name: str
    kind: str
    endpoint: HttpCall
    selector: tuple[Matcher, ...] = ()
    # heartbeat
    fail_endpoint: HttpCall | None = None
    ttl: float = 300.0
    min_interval: float = 0.0
    period: float = 300.0
    # health_heartbeat
    interval: float = 60.0
    alert_ttl: float = 900.0
    # webhook
    body: str = "stable"
    signing_secret: bytes | None = field(default=None, repr=False)
    dedup_window: float = 14400.0
    max_age: float = 86400.0
    # The selector compiled into one function (see matchers.compile_selector).
    matches: Predicate = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "matches", compile_selector(self.selector))


@dataclass(frozen=True)
class RetryPolicy:
    initial_backoff: float = 1.0
    max_backoff: float = 300.0
    max_retry_after: float = 600.0


@dataclass(frozen=True)
class BridgeConfig:
    state_dir: Path
    targets: tuple[Target, ...]
    bearer_token: str | None = field(default=None, repr=False)
    max_body_bytes: int = 4 << 20
    body_timeout: float = 10.0
    delivery: RetryPolicy = RetryPolicy()
    unhealthy_after_periods: float = 3.0
    source: Path | None = None
    # How it serves and logs: the file's web: and log:, then the flags (bridge/cli.py).
    daemon: DaemonSettings = field(default_factory=lambda: DaemonSettings.on_port(DEFAULT_PORT))
    # Settings that are valid but weaken something (insecure_skip_verify): `bridge check`
    # prints them and the bridge logs them at start-up.
    warnings: tuple[str, ...] = ()

    def target(self, name: str) -> Target:
        for target in self.targets:
            if target.name == name:
                return target
        raise KeyError(name)


# The file's shape (deploy/bridge/bridge.example.yml; docs/bridge.md explains each key).
# Every secret is KEY, KEY_file or KEY_env: exactly one (see _secret).
StatusCode = Annotated[int, msgspec.Meta(ge=100, le=599)]


class EndpointSection(Section, frozen=True):
    """Where a target's requests go; a heartbeat's ``fail`` block is one of these."""

    url: NonEmpty | None = None
    url_file: ConfigPath | None = None
    url_env: NonEmpty | None = None
    method: NonEmpty | None = None  # any case, as curl takes it
    timeout: Seconds | None = None
    success_codes: Annotated[list[StatusCode], msgspec.Meta(min_length=1)] | None = None
    headers: dict[str, str] | None = None
    tls: TLSSettings | None = None


class _TargetSection(EndpointSection, frozen=True, tag_field="type"):
    name: str = ""  # checked before conversion (_target_name)
    selector: list[str] | str | None = None


class HeartbeatSection(_TargetSection, frozen=True, tag="heartbeat"):
    fail: EndpointSection | None = None
    ttl: Seconds = Seconds(300)
    min_interval: Seconds = Seconds(0)
    period: Seconds = Seconds(300)


class HealthHeartbeatSection(_TargetSection, frozen=True, tag="health_heartbeat"):
    interval: Seconds = Seconds(60)
    alert_ttl: Seconds = Seconds(900)


class WebhookSection(_TargetSection, frozen=True, tag="webhook"):
    body: Literal["stable", "alertmanager"] = "stable"
    signing_secret: NonEmpty | None = None
    signing_secret_file: ConfigPath | None = None
    signing_secret_env: NonEmpty | None = None
    dedup_window: Seconds = Seconds(14400)
    max_age: Seconds = Seconds(86400)


TargetSection = HeartbeatSection | HealthHeartbeatSection | WebhookSection
# A target whose type is known is converted as that type, so that an unknown key is
# answered with that type's keys; the union answers a missing or unknown type.
_BY_TYPE: dict[object, type[_TargetSection]] = {
    cls.__struct_config__.tag: cls for cls in (HeartbeatSection, HealthHeartbeatSection,
                                               WebhookSection)}


class ReceiverSection(Section, frozen=True):
    bearer_token: NonEmpty | None = None
    bearer_token_file: ConfigPath | None = None
    bearer_token_env: NonEmpty | None = None
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 4 << 20
    body_timeout: Seconds = Seconds(10)


class DeliverySection(Section, frozen=True):
    initial_backoff: Seconds = Seconds(1)
    max_backoff: Seconds = Seconds(300)
    max_retry_after: Seconds = Seconds(600)


class HealthSection(Section, frozen=True):
    unhealthy_after_periods: Annotated[float, msgspec.Meta(ge=1)] = 3.0


class BridgeFile(Section, frozen=True):
    """The top level. Fields in alphabetical order: an unknown key lists them so.
    ``targets`` is converted one target at a time (see the module docstring)."""

    delivery: Any = None
    health: Any = None
    log: Any = None
    receiver: Any = None
    state_dir: Any = None
    targets: Any = None
    web: Any = None


class _Problems:
    """Every problem (and warning) found, one line each, naming the file and the key."""

    def __init__(self, source: Path | None) -> None:
        self.source = str(source) if source else "bridge config"
        self.base = source.parent.absolute() if source else Path.cwd()
        self.items: list[str] = []
        self.warnings: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.items.append(f"{self.source}: {where}: {message}" if where
                          else f"{self.source}: {message}")

    def warn(self, where: str, message: str) -> None:
        self.warnings.append(f"{self.source}: {where}: warning: {message}")

    def convert(self, data: Any, kind: Any, at: str) -> Any:
        """``data`` as ``kind`` through the config layer, every problem kept (one per
        key); with problems, what the rest converted to, for the checks after, or None."""
        value, problems = configfile.convert_all({} if data is None else data, kind,
                                                 self.source, self.base, at=at)
        self.items.extend(problems)
        return value

    def positive(self, where: str, seconds: float) -> None:
        if seconds <= 0:
            self.add(where, "must be greater than 0")


def _secret(section: Section, key: str, where: str, problems: _Problems, *,
            required: bool) -> str | None:
    """``key``, ``key_file`` or ``key_env`` of ``section``: exactly one (none if optional)."""
    given = [k for k in (key, f"{key}_file", f"{key}_env") if getattr(section, k) is not None]
    if len(given) > 1:
        problems.add(where, f"give only one of {', '.join(given)}")
        return None
    if not given:
        if required:
            problems.add(where, f"{key} (or {key}_file, {key}_env) is required")
        return None
    which = given[0]
    value = str(getattr(section, which))
    try:
        if which.endswith("_file"):
            return configfile.secret_from_file(value)
        if which.endswith("_env"):
            return configfile.secret_from_env(value)
    except ConfigError as exc:
        problems.add(f"{where}.{which}", str(exc))
        return None
    return value


def _tls(tls: TLSSettings, where: str, problems: _Problems) -> TLSSettings:
    """The files a ``tls`` block names are opened and parsed now, so a bad certificate
    fails `bridge check` instead of every delivery after start-up."""
    for key, problem in tls.problems():
        problems.add(f"{where}.{key}", problem)
    if tls.insecure_skip_verify:
        ignored = [k for k in ("ca_file", "server_name") if getattr(tls, k) is not None]
        problems.warn(f"{where}.insecure_skip_verify", "the server's certificate is not "
                      "verified: anyone on the network path can pose as this target and "
                      "receive its requests" + (f" ({', '.join(ignored)} unused)"
                                                if ignored else ""))
    return tls


def _http_call(section: EndpointSection, where: str, problems: _Problems, default_method: str,
               inherit: HttpCall | None = None) -> HttpCall | None:
    """The requests of one endpoint; what the section leaves out comes from ``inherit``.

    ``inherit`` is the target's own endpoint when this is its fail URL: the fail
    ping goes to the same service, so it needs the same method, headers (an
    API key, say), timeout, success codes and TLS, and a forgotten copy would
    show only when the watched alert resolves — when the pipeline is already
    in trouble. Headers are merged, the section's own winning by name.
    """
    url = _secret(section, "url", where, problems, required=True)
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        # The URL itself may hold a token: say what is wrong without echoing it.
        problems.add(where, "url must be an absolute http:// or https:// URL")
    tls = inherit.tls if inherit is not None else None
    if section.tls is not None:
        tls = _tls(section.tls, f"{where}.tls", problems)
        if parts.scheme == "http":
            # An error, not a warning: whoever wrote the block expects the request to be
            # encrypted and verified, and over http:// it would silently be neither.
            problems.add(f"{where}.tls", "is set but url is http://: "
                         "TLS settings apply to https:// URLs only")
    method = (section.method or (inherit.method if inherit else default_method)).upper()
    if method not in METHODS:
        problems.add(f"{where}.method", f"must be one of {', '.join(METHODS)}")
    codes = (frozenset(section.success_codes) if section.success_codes is not None
             else inherit.success_codes if inherit is not None else frozenset(range(200, 300)))
    own = {name.lower() for name in section.headers or {}}
    inherited = [(k, v) for k, v in (inherit.headers if inherit is not None else ())
                 if k.lower() not in own]
    timeout = (section.timeout if section.timeout is not None
               else inherit.timeout if inherit is not None else 10.0)
    problems.positive(f"{where}.timeout", timeout)
    return HttpCall(url=url, method=method, timeout=timeout, success_codes=codes,
                    headers=(*inherited, *(section.headers or {}).items()), tls=tls)


def _selector(items: list[str] | str | None, where: str,
              problems: _Problems) -> tuple[Matcher, ...]:
    try:
        return parse_selector([items] if isinstance(items, str) else items or [])
    except MatcherError as exc:
        problems.add(f"{where}.selector", str(exc))
        return ()


def _target_name(data: Any, index: int, problems: _Problems) -> str | None:
    """The target's name, checked before the rest: it names the target in every other
    problem (``targets[oncall].url``), and in metrics and logs instead of its URL."""
    if not isinstance(data, dict):
        problems.add(f"targets[{index}]", "must be a mapping")
        return None
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        problems.add(f"targets[{index}].name", "is required: 1-64 letters, digits, '_', '.', "
                     "'-' (it names the target in metrics and logs instead of its URL)")
        return None
    return name


def _target(data: dict[str, Any], name: str, problems: _Problems) -> Target | None:
    where = f"targets[{name}]"
    section = problems.convert(data, _BY_TYPE.get(data.get("type"), TargetSection), where)
    if section is None:
        return None
    kind = str(type(section).__struct_config__.tag)
    endpoint = _http_call(section, where, problems, "POST" if kind == "webhook" else "GET")
    if endpoint is None:
        return None
    if isinstance(section, HeartbeatSection):
        fail = None
        if section.fail is not None:  # everything but the URL defaults to the target's
            fail = _http_call(section.fail, f"{where}.fail", problems, "GET", endpoint)
        for key in ("ttl", "period"):
            problems.positive(f"{where}.{key}", getattr(section, key))
        selector = (list(DEFAULT_HEARTBEAT_SELECTOR) if section.selector is None
                    else section.selector)
        return Target(name=name, kind=kind, endpoint=endpoint, fail_endpoint=fail,
                      selector=_selector(selector, where, problems), ttl=section.ttl,
                      min_interval=section.min_interval, period=section.period)
    if isinstance(section, HealthHeartbeatSection):
        if section.selector is None:
            problems.add(f"{where}.selector", "is required: the alerts whose firing pauses "
                         "this heartbeat")
        problems.positive(f"{where}.interval", section.interval)
        if section.alert_ttl <= section.interval:
            problems.add(f"{where}.alert_ttl", "must be longer than interval (and than "
                         "Alertmanager's repeat_interval + group_interval)")
        return Target(name=name, kind=kind, endpoint=endpoint,
                      selector=_selector(section.selector, where, problems),
                      interval=section.interval, alert_ttl=section.alert_ttl)
    problems.positive(f"{where}.max_age", section.max_age)
    secret = _secret(section, "signing_secret", where, problems, required=False)
    return Target(name=name, kind=kind, endpoint=endpoint,
                  selector=_selector(section.selector, where, problems), body=section.body,
                  signing_secret=secret.encode() if secret else None,
                  dedup_window=section.dedup_window, max_age=section.max_age)


def _targets(data: Any, problems: _Problems) -> list[Target]:
    if not isinstance(data, list) or not data:
        problems.add("targets", "must be a non-empty list of heartbeat, health_heartbeat or "
                     "webhook targets")
        return []
    targets: list[Target] = []
    seen: set[str] = set()
    for index, item in enumerate(data):
        name = _target_name(item, index, problems)
        if name is None:
            continue
        if name in seen:
            problems.add(f"targets[{name}].name", "is used by two targets")
        seen.add(name)
        target = _target(item, name, problems)
        if target is not None:
            targets.append(target)
    return targets


def validate(data: Any, source: Path | None = None) -> tuple[BridgeConfig | None, list[str]]:
    """A config and an empty list, or None and every problem found (one line each).

    Warnings do not make a config invalid; they are in ``BridgeConfig.warnings``.
    """
    config, problems = _validate(data, source)
    return config, problems.items


def _validate(data: Any, source: Path | None) -> tuple[BridgeConfig | None, _Problems]:
    problems = _Problems(source)
    root = problems.convert(data, BridgeFile, "")
    if root is None:
        return None, problems
    state_dir = None
    if root.state_dir is None:
        problems.add("state_dir", "is required: the directory holding the SQLite outbox")
    else:
        state_dir = problems.convert(root.state_dir, ConfigPath, "state_dir")
    receiver = problems.convert(root.receiver, ReceiverSection, "receiver")
    token = None
    if receiver is not None:
        token = _secret(receiver, "bearer_token", "receiver", problems, required=False)
        problems.positive("receiver.body_timeout", receiver.body_timeout)
    delivery = problems.convert(root.delivery, DeliverySection, "delivery")
    if delivery is not None:
        for key in ("initial_backoff", "max_backoff", "max_retry_after"):
            problems.positive(f"delivery.{key}", getattr(delivery, key))
    health = problems.convert(root.health, HealthSection, "health")
    web = problems.convert(root.web, WebSection, "web")
    log = problems.convert(root.log, LogSection, "log")
    targets = _targets(root.targets, problems)
    if problems.items:
        return None, problems
    # No problem found: every part was converted.
    assert state_dir is not None
    assert receiver is not None
    assert delivery is not None
    assert web is not None
    assert log is not None
    daemon = DaemonSettings.on_port(DEFAULT_PORT)
    daemon.apply_file(web, log)
    return BridgeConfig(
        state_dir=Path(state_dir), targets=tuple(targets), bearer_token=token,
        max_body_bytes=receiver.max_body_bytes, body_timeout=receiver.body_timeout,
        delivery=RetryPolicy(delivery.initial_backoff, delivery.max_backoff,
                             delivery.max_retry_after),
        unhealthy_after_periods=health.unhealthy_after_periods, source=source,
        daemon=daemon, warnings=tuple(problems.warnings)), problems


def check_file(path: str | Path) -> tuple[list[str], list[str]]:
    """Every problem with the config file at ``path`` (empty when it is valid), and
    every warning (settings that are valid but weaken something)."""
    try:
        data = load_yaml_file(path, "bridge config")
    except ConfigError as exc:
        return [str(exc)], []
    problems = _validate(data, Path(path))[1]
    return problems.items, problems.warnings


def load_config(path: str | Path) -> BridgeConfig:
    """The validated config at ``path``; the first problem becomes a ConfigError."""
    data = load_yaml_file(path, "bridge config")
    config, problems = validate(data, Path(path))
    if config is None:
        more = f" (and {len(problems) - 1} more; run 'bridge check')" if len(problems) > 1 else ""
        raise ConfigError(problems[0] + more)
    return config
