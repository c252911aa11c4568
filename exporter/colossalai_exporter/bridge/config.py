"""``bridge.yml``: the bridge's one config file, validated with readable errors.

Targets are static: every URL the bridge ever sends to comes from here (or
from a file or environment variable named here), never from a request.
Secrets — heartbeat URLs carry their token, bearer tokens, HMAC keys — can be
given as ``KEY_file`` (a path; trailing newline stripped) or ``KEY_env`` (an
environment variable) instead of inline. See docs/bridge.md for every key.

:func:`validate` collects every problem (``bridge check`` prints them all);
:func:`load_config` raises the first as a one-line :class:`ConfigError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from colossalai_exporter import configfile
from colossalai_exporter.bridge.matchers import (
    Matcher,
    MatcherError,
    Predicate,
    compile_selector,
    parse_selector,
)
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import load_yaml_file

KINDS = ("heartbeat", "health_heartbeat", "webhook")
BODIES = ("stable", "alertmanager")
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
    # Settings that are valid but weaken something (insecure_skip_verify): `bridge check`
    # prints them and the bridge logs them at start-up.
    warnings: tuple[str, ...] = ()

    def target(self, name: str) -> Target:
        for target in self.targets:
            if target.name == name:
                return target
        raise KeyError(name)


def parse_duration(value: Any) -> float:
    """``250ms``, ``10s``, ``5m``, ``4h``, ``1d`` or a number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError("must be a duration like 10s, 5m or 4h")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        try:  # the config layer's one grammar
            seconds = configfile.parse_duration(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a duration like 10s, 5m or 4h") from None
    else:
        raise ValueError(f"{value!r} is not a duration like 10s, 5m or 4h")
    if seconds < 0:
        raise ValueError("must not be negative")
    return seconds


class _Problems:
    """Collects problems (and warnings) with the key path each is about."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.items: list[str] = []
        self.warnings: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.items.append(f"{self.source}: {where}: {message}" if where
                          else f"{self.source}: {message}")

    def warn(self, where: str, message: str) -> None:
        self.warnings.append(f"{self.source}: {where}: warning: {message}")

    @property
    def base(self) -> Path:
        """The folder relative paths are relative to: the config file's."""
        return Path(self.source).parent.absolute() if self.source else Path.cwd()

    def path(self, value: str) -> Path:
        """A path from the config: relative ones are relative to the config file's folder."""
        path = Path(value)
        if not path.is_absolute() and self.source:
            path = Path(self.source).parent / path
        return path


class _Section:
    """One mapping of the config, with typed getters that record problems."""

    def __init__(self, data: Any, where: str, problems: _Problems, allowed: set[str]) -> None:
        self.where = where
        self.problems = problems
        if data is None:
            data = {}
        if not isinstance(data, dict):
            problems.add(where, f"must be a mapping, got {type(data).__name__}")
            data = {}
        self.data: dict[str, Any] = data
        for key in sorted(set(data) - allowed, key=str):
            problems.add(where, configfile.unknown_key(key, sorted(allowed)))

    def _at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def duration(self, key: str, default: float, *, positive: bool = False) -> float:
        if key not in self.data:
            return default
        try:
            value = parse_duration(self.data[key])
        except ValueError as exc:
            self.problems.add(self._at(key), str(exc))
            return default
        if positive and value <= 0:
            self.problems.add(self._at(key), "must be greater than 0")
            return default
        return value

    def string(self, key: str, default: str | None = None,
               choices: tuple[str, ...] | None = None) -> str | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str):
            self.problems.add(self._at(key), f"must be a string, got {type(value).__name__}")
            return default
        if choices and value not in choices:
            self.problems.add(self._at(key), f"must be one of {', '.join(choices)}, "
                              f"got {value!r}")
            return default
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            self.problems.add(self._at(key), f"must be true or false, got {value!r}")
            return default
        return value

    def integer(self, key: str, default: int, minimum: int = 0) -> int:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.problems.add(self._at(key), f"must be an integer >= {minimum}")
            return default
        return value

    def secret(self, key: str, *, required: bool) -> str | None:
        """``key``, ``key_file`` or ``key_env``: exactly one (or none when optional)."""
        given = [k for k in (key, f"{key}_file", f"{key}_env") if k in self.data]
        if len(given) > 1:
            self.problems.add(self.where, f"give only one of {', '.join(given)}")
            return None
        if not given:
            if required:
                self.problems.add(self.where, f"{key} (or {key}_file, {key}_env) is required")
            return None
        which = given[0]
        value = self.data[which]
        if not isinstance(value, str) or not value:
            self.problems.add(self._at(which), "must be a non-empty string")
            return None
        try:
            if which.endswith("_file"):
                return configfile.secret_from_file(self.problems.path(value))
            if which.endswith("_env"):
                return configfile.secret_from_env(value)
        except ConfigError as exc:
            self.problems.add(self._at(which), str(exc))
            return None
        return value


_ENDPOINT_KEYS = {"url", "url_file", "url_env", "method", "timeout", "success_codes", "headers",
                  "tls"}
_TARGET_KEYS = {
    "heartbeat": {"name", "type", "selector", "fail", "ttl", "min_interval", "period"},
    "health_heartbeat": {"name", "type", "selector", "interval", "alert_ttl"},
    "webhook": {"name", "type", "selector", "body", "signing_secret", "signing_secret_file",
                "signing_secret_env", "dedup_window", "max_age"},
}


def _tls(data: Any, where: str, problems: _Problems) -> TLSSettings:
    """The ``tls`` block at ``where``; files are opened and parsed now, so a bad
    certificate fails `bridge check` instead of every delivery after start-up."""
    try:
        tls = configfile.convert({} if data is None else data, TLSSettings, problems.source,
                                 problems.base, at=where)
    except ConfigError as exc:
        problems.items.append(str(exc))
        return TLSSettings()
    for key, problem in tls.problems():
        problems.add(f"{where}.{key}", problem)
    if tls.insecure_skip_verify:
        ignored = [k for k in ("ca_file", "server_name") if getattr(tls, k) is not None]
        problems.warn(f"{where}.insecure_skip_verify", "the server's certificate is not "
                      "verified: anyone on the network path can pose as this target and "
                      "receive its requests" + (f" ({', '.join(ignored)} unused)"
                                                if ignored else ""))
    return tls


def _endpoint(section: _Section, default_method: str, *, required: bool = True,
              inherit: HttpCall | None = None) -> HttpCall | None:
    """An endpoint from its section; what the section leaves out comes from ``inherit``.

    ``inherit`` is the target's own endpoint when this is its fail URL: the fail
    ping goes to the same service, so it needs the same method, headers (an
    API key, say), timeout, success codes and TLS, and a forgotten copy would
    show only when the watched alert resolves — when the pipeline is already
    in trouble. Headers are merged, the section's own winning by name.
    """
    url = section.secret("url", required=required)
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        # The URL itself may hold a token: say what is wrong without echoing it.
        section.problems.add(section.where, "url must be an absolute http:// or https:// URL")
    tls = inherit.tls if inherit is not None else None
    if "tls" in section.data:
        tls = _tls(section.data["tls"], f"{section.where}.tls", section.problems)
        if parts.scheme == "http":
            # An error, not a warning: whoever wrote the block expects the request to be
            # encrypted and verified, and over http:// it would silently be neither.
            section.problems.add(f"{section.where}.tls", "is set but url is http://: "
                                 "TLS settings apply to https:// URLs only")
    if inherit is not None:
        default_method = inherit.method
    method = (section.string("method", default_method) or default_method).upper()
    if method not in METHODS:
        section.problems.add(f"{section.where}.method", f"must be one of {', '.join(METHODS)}")
    codes_value = section.data.get("success_codes")
    codes: frozenset[int] = (inherit.success_codes if inherit is not None
                             else frozenset(range(200, 300)))
    if codes_value is not None:
        if not isinstance(codes_value, list) or not codes_value or not all(
                isinstance(c, int) and not isinstance(c, bool) and 100 <= c <= 599
                for c in codes_value):
            section.problems.add(f"{section.where}.success_codes",
                                 "must be a non-empty list of HTTP status codes (100-599)")
        else:
            codes = frozenset(codes_value)
    headers_value = section.data.get("headers") or {}
    headers: tuple[tuple[str, str], ...] = ()
    if not isinstance(headers_value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers_value.items()):
        section.problems.add(f"{section.where}.headers", "must map header names to strings")
    else:
        own = {name.lower() for name in headers_value}
        inherited = [(k, v) for k, v in (inherit.headers if inherit is not None else ())
                     if k.lower() not in own]
        headers = (*inherited, *headers_value.items())
    timeout = section.duration("timeout", inherit.timeout if inherit is not None else 10.0,
                               positive=True)
    return HttpCall(url=url, method=method, timeout=timeout, success_codes=codes,
                    headers=headers, tls=tls)


def _selector(section: _Section, default: tuple[str, ...]) -> tuple[Matcher, ...]:
    items = section.data.get("selector", list(default))
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        section.problems.add(f"{section.where}.selector",
                             'must be a list of matchers like alertname="Watchdog"')
        return ()
    try:
        return parse_selector(items)
    except MatcherError as exc:
        section.problems.add(f"{section.where}.selector", str(exc))
        return ()


def _target(data: Any, index: int, problems: _Problems) -> Target | None:
    where = f"targets[{index}]"
    if not isinstance(data, dict):
        problems.add(where, "must be a mapping")
        return None
    kind = data.get("type")
    if kind not in KINDS:
        problems.add(f"{where}.type", f"must be one of {', '.join(KINDS)}, got {kind!r}")
        return None
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        problems.add(f"{where}.name", "is required: 1-64 letters, digits, '_', '.', '-' "
                     "(it names the target in metrics and logs instead of its URL)")
        name = f"#{index}"
    else:
        where = f"targets[{name}]"
    section = _Section(data, where, problems, _TARGET_KEYS[kind] | _ENDPOINT_KEYS)
    endpoint = _endpoint(section, "POST" if kind == "webhook" else "GET")
    if endpoint is None:
        return None
    if kind == "heartbeat":
        fail_endpoint = None
        if data.get("fail") is not None:
            # Everything but the URL defaults to the target's (see _endpoint).
            fail_endpoint = _endpoint(_Section(data["fail"], f"{where}.fail", problems,
                                               _ENDPOINT_KEYS), "GET", inherit=endpoint)
        return Target(name=name, kind=kind, endpoint=endpoint,
                      selector=_selector(section, DEFAULT_HEARTBEAT_SELECTOR),
                      fail_endpoint=fail_endpoint,
                      ttl=section.duration("ttl", 300.0, positive=True),
                      min_interval=section.duration("min_interval", 0.0),
                      period=section.duration("period", 300.0, positive=True))
    if kind == "health_heartbeat":
        if "selector" not in data:
            problems.add(f"{where}.selector", "is required: the alerts whose firing pauses "
                         "this heartbeat")
        target = Target(name=name, kind=kind, endpoint=endpoint,
                        selector=_selector(section, ()),
                        interval=section.duration("interval", 60.0, positive=True),
                        alert_ttl=section.duration("alert_ttl", 900.0, positive=True))
        if target.alert_ttl <= target.interval:
            problems.add(f"{where}.alert_ttl", "must be longer than interval (and than "
                         "Alertmanager's repeat_interval + group_interval)")
        return target
    secret = section.secret("signing_secret", required=False)
    return Target(name=name, kind=kind, endpoint=endpoint, selector=_selector(section, ()),
                  body=section.string("body", "stable", BODIES) or "stable",
                  signing_secret=secret.encode() if secret else None,
                  dedup_window=section.duration("dedup_window", 14400.0),
                  max_age=section.duration("max_age", 86400.0, positive=True))


def validate(data: Any, source: Path | None = None) -> tuple[BridgeConfig | None, list[str]]:
    """A config and an empty list, or None and every problem found (one line each).

    Warnings do not make a config invalid; they are in ``BridgeConfig.warnings``.
    """
    config, problems = _validate(data, source)
    return config, problems.items


def _validate(data: Any, source: Path | None) -> tuple[BridgeConfig | None, _Problems]:
    problems = _Problems(str(source) if source else "bridge config")
    root = _Section(data, "", problems, {"state_dir", "receiver", "delivery", "targets",
                                        "health"})
    state_dir = root.string("state_dir")
    if not state_dir:
        problems.add("state_dir", "is required: the directory holding the SQLite outbox")
    receiver = _Section(root.data.get("receiver"), "receiver", problems,
                        {"bearer_token", "bearer_token_file", "bearer_token_env",
                         "max_body_bytes", "body_timeout"})
    token = receiver.secret("bearer_token", required=False)
    max_body = receiver.integer("max_body_bytes", 4 << 20, minimum=1024)
    body_timeout = receiver.duration("body_timeout", 10.0, positive=True)
    delivery_section = _Section(root.data.get("delivery"), "delivery", problems,
                                {"initial_backoff", "max_backoff", "max_retry_after"})
    delivery = RetryPolicy(
        initial_backoff=delivery_section.duration("initial_backoff", 1.0, positive=True),
        max_backoff=delivery_section.duration("max_backoff", 300.0, positive=True),
        max_retry_after=delivery_section.duration("max_retry_after", 600.0, positive=True),
    )
    health = _Section(root.data.get("health"), "health", problems, {"unhealthy_after_periods"})
    periods = health.data.get("unhealthy_after_periods", 3)
    if isinstance(periods, bool) or not isinstance(periods, int | float) or periods < 1:
        problems.add("health.unhealthy_after_periods", "must be a number >= 1")
        periods = 3
    targets_data = root.data.get("targets")
    targets: list[Target] = []
    if not isinstance(targets_data, list) or not targets_data:
        problems.add("targets", "must be a non-empty list of heartbeat, health_heartbeat or "
                     "webhook targets")
    else:
        for i, item in enumerate(targets_data):
            target = _target(item, i, problems)
            if target is not None:
                targets.append(target)
        seen: set[str] = set()
        for target in targets:
            if target.name in seen:
                problems.add(f"targets[{target.name}].name", "is used by two targets")
            seen.add(target.name)
    if problems.items:
        return None, problems
    assert state_dir is not None
    state_path = Path(state_dir)
    if not state_path.is_absolute() and source is not None:
        state_path = source.parent / state_path
    return BridgeConfig(state_dir=state_path, targets=tuple(targets), bearer_token=token,
                        max_body_bytes=max_body, body_timeout=body_timeout, delivery=delivery,
                        unhealthy_after_periods=float(periods), source=source,
                        warnings=tuple(problems.warnings)), problems


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
