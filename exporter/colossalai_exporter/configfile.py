"""One config layer: a YAML file into typed structures that refuse unknown keys at any depth.

A component declares its file's shape as :class:`Section` subclasses (frozen
msgspec Structs with ``forbid_unknown_fields``) and reads it with :func:`load`:
one YAML loader (:func:`~colossalai_exporter.flags.load_yaml_file`), msgspec's
strict conversion, and any problem as one :class:`ConfigError` line that names
the file and the key's path::

    node.yml: web: unknown key `listen_adress`
    node.yml: gpu.expected: expected `int` >= 0, got -1

Two value types every component shares:

* :class:`Seconds` — a Prometheus-style duration (``30s``, ``1m30s``, ``500ms``,
  ``1h``) or a plain number of seconds; one grammar, :func:`parse_duration`.
* :class:`ConfigPath` — a path; a relative one is relative to the config
  file's folder (not to the working directory the daemon was started in).

And the sections every daemon's file has (``web``, ``log``), the one TLS
client block (:class:`TLSClient`, Prometheus' ``tls_config``) that the prober
and the bridge use for the servers they call, and the one way to read a
secret kept out of the file (:func:`secret_from_file`, :func:`secret_from_env`:
the bridge's ``KEY_file``/``KEY_env``, the prober's ``header_files``).

Why msgspec rather than a validation library: it is already a dependency (the
bridge decodes notifications with it), converts and validates in one pass,
and its errors carry the key path.
"""

from __future__ import annotations

import os
import re
import ssl
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import load_yaml_file

T = TypeVar("T")

_DURATION_RE: Final = re.compile(
    r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")
_DURATION_UNITS: Final = (365 * 86400, 7 * 86400, 86400, 3600, 60, 1, 0.001)


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base of every config section: unknown keys are errors, values are read-only."""


class Seconds(float):
    """A duration in seconds, written ``30s``/``1m30s``/``500ms`` or as a number."""


class ConfigPath(str):
    """A path from a config file, made absolute against the file's folder."""

    __slots__ = ()


NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
TLSVersion = Literal["TLS10", "TLS11", "TLS12", "TLS13"]
TLS_VERSIONS: Final = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}


class WebSection(Section, frozen=True):
    """``web:`` of a daemon's file; the flags ``--web.listen-address`` and
    ``--web.config.file`` win over it."""

    listen_address: str | None = None
    config_file: ConfigPath | None = None


class LogSection(Section, frozen=True):
    """``log:`` of a daemon's file (``--log.level``, ``--log.format``)."""

    level: Literal["debug", "info", "warn", "error"] | None = None
    format: Literal["logfmt", "json"] | None = None


class DaemonFile(Section, frozen=True):
    """The sections every daemon's file starts with (daemon.DaemonSettings reads them)."""

    web: WebSection = WebSection()
    log: LogSection = LogSection()


_SSL_SOURCE_LINE: Final = re.compile(r"\s*\(_ssl\.c:\d+\)$")


def ssl_error_text(exc: ssl.SSLError) -> str:
    """OpenSSL's words for a failure, e.g. ``[X509: NO_CERTIFICATE_OR_CRL_FOUND] no
    certificate or crl found``, without the C source line Python appends."""
    return _SSL_SOURCE_LINE.sub("", exc.strerror or str(exc)) or type(exc).__name__


class TLSClient(Section, frozen=True):
    """How to call a server over TLS: Prometheus' ``tls_config``, key for key.

    Without a block (or with an empty one) the system's CA bundle verifies the
    server. ``ca_file`` replaces the bundle rather than adding to it, as in Go.
    """

    ca_file: ConfigPath | None = None
    cert_file: ConfigPath | None = None
    key_file: ConfigPath | None = None
    server_name: NonEmpty | None = None
    insecure_skip_verify: bool = False
    min_version: TLSVersion | None = None

    def problems(self) -> list[tuple[str, str]]:
        """(key, what is wrong) for every file that cannot be used, found now, at
        start-up, instead of at every connection after it."""
        found: list[tuple[str, str]] = []
        for given, missing in (("cert_file", "key_file"), ("key_file", "cert_file")):
            if getattr(self, given) is not None and getattr(self, missing) is None:
                found.append((missing, f"is required with {given}: a client certificate "
                                       "and its private key go together"))
        readable: dict[str, str] = {}
        for key in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, key)
            if path is not None:
                try:
                    with open(path, "rb"):
                        readable[key] = path
                except OSError as exc:
                    found.append((key, f"cannot read {path}: {exc.strerror}"))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if "ca_file" in readable:
            try:
                context.load_verify_locations(cafile=self.ca_file)
            except ssl.SSLError as exc:
                found.append(("ca_file", f"{self.ca_file} holds no PEM CA certificate "
                                         f"({ssl_error_text(exc)})"))
        if "cert_file" in readable and "key_file" in readable:
            try:
                # An empty password instead of none: OpenSSL would otherwise prompt on
                # the terminal for an encrypted key.
                context.load_cert_chain(readable["cert_file"], readable["key_file"],
                                        password=lambda: b"")
            except ssl.SSLError as exc:
                found.append(("cert_file", "cert_file and key_file must be a PEM "
                                           "certificate and its unencrypted private key "
                                           f"({ssl_error_text(exc)})"))
        return found

    def context(self) -> ssl.SSLContext:
        """A client context with these settings; ssl.SSLError for unusable files."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.min_version is not None:
            ctx.minimum_version = TLS_VERSIONS[self.min_version]
        if self.cert_file is not None and self.key_file is not None:
            ctx.load_cert_chain(self.cert_file, self.key_file, password=lambda: b"")
        return ctx


def secret_from_file(path: str | Path) -> str:
    """The secret a file holds, surrounding whitespace stripped (the newline of
    ``echo token > file``); ConfigError saying why when it cannot be used.

    Read when asked, not cached: callers that re-read it at use take a rotated
    secret (a renewed Kubernetes Secret, a Vault agent's file) without a restart.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None
    if not text:
        raise ConfigError(f"{path} is empty")
    return text


def secret_from_env(name: str) -> str:
    """The secret in environment variable ``name``, whitespace stripped; ConfigError when
    it is unset or empty."""
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(f"environment variable {name} is not set")
    if not value.strip():
        raise ConfigError(f"environment variable {name} is empty")
    return value.strip()


def parse_prometheus_duration(text: str) -> float:
    """Seconds in a Prometheus duration, exactly as Prometheus reads one (``1h30m``).

    For values written into Prometheus' own files (a rule's ``for``); ValueError
    otherwise (``5 min``, ``1.5m``, ``-1s``, an empty string).
    """
    match = _DURATION_RE.match(text.strip())
    if not text.strip() or match is None or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration (like 30s, 5m, 1h30m, 500ms)")
    return float(sum(int(g) * unit for g, unit in zip(match.groups(), _DURATION_UNITS,
                                                       strict=True) if g))


_DECIMAL_RE: Final = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)?$")
_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0,
                        "w": 7 * 86400.0, "y": 365 * 86400.0, None: 1.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration from a config file: ``parse_duration("1m30s") == 90``.

    Prometheus' grammar (``30s``, ``1h30m``, ``500ms``), and for the configs
    written before it was the one grammar, a single decimal value with a unit
    (``1.5s``, ``0.5m``) or a bare number of seconds (``"5"``). ValueError
    otherwise.
    """
    with_unit = _DECIMAL_RE.match(text.strip())
    if with_unit is not None:
        return float(with_unit.group(1)) * _UNIT_SECONDS[with_unit.group(2)]
    return parse_prometheus_duration(text)


def _decoder(base: Path) -> Callable[[type, Any], Any]:
    def dec_hook(kind: type, value: Any) -> Any:
        if kind is Seconds:
            if isinstance(value, bool):
                raise TypeError(f"expected a duration, got {value!r}")
            if isinstance(value, int | float):
                seconds = float(value)
            elif isinstance(value, str):
                seconds = parse_duration(value)
            else:
                raise TypeError(f"expected a duration, got {type(value).__name__}")
            if seconds < 0:
                raise ValueError(f"a duration cannot be negative, got {value!r}")
            return Seconds(seconds)
        if kind is ConfigPath:
            if not isinstance(value, str) or not value:
                raise TypeError(f"expected a path, got {value!r}")
            path = Path(value).expanduser()
            return ConfigPath(path if path.is_absolute() else base / path)
        # A type of one component's own (the rules' Prometheus Duration) parses itself.
        from_config = getattr(kind, "from_config", None)
        if from_config is not None:
            return from_config(value)
        raise NotImplementedError(kind)

    return dec_hook


_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def unknown_key(key: object, known: Any) -> str:
    """The one wording of an unknown key, in every config: ``unknown key `x` (known: a, b)``."""
    return f"unknown key `{key}` (known: {', '.join(map(str, known))})"


def describe(error: msgspec.ValidationError, kind: Any = None, at: str = "") -> str:
    """``web: unknown key `listen_adress``` from msgspec's wording; for a value
    outside a fixed set, the set, found in ``kind`` along the key's path."""
    match = _AT.match(str(error))
    assert match is not None  # the pattern matches any text
    message = match.group("message")
    message = message.replace("Object contains unknown field", "unknown key")
    message = message.replace("Object missing required field", "missing key")
    message = message[:1].lower() + message[1:]
    path = (match.group("path") or "").lstrip(".")
    if message.startswith(("invalid enum value", "invalid value")) and kind is not None:
        allowed = _literal_values(kind, path) or _tags(kind, path)
        if allowed:
            message += f" (one of: {', '.join(allowed)})"
    unknown = re.match(r"^unknown key `(?P<key>[^`]*)`$", message)
    if unknown and kind is not None:
        section = _unwrap(_type_at(kind, path))
        if isinstance(section, type) and issubclass(section, msgspec.Struct):
            tag_field = section.__struct_config__.tag_field  # a tagged Struct's `type`, say
            message = unknown_key(unknown.group("key"), [
                *([tag_field] if tag_field else []),
                *(f.encode_name for f in msgspec.structs.fields(section))])
    if at:
        path = f"{at}{path}" if path.startswith("[") else ".".join(filter(None, (at, path)))
    return f"{path}: {message}" if path else message


_SEGMENT: Final = re.compile(r"\[[^\]]*\]|[^.\[]+")


def _type_at(kind: Any, path: str) -> Any:
    """The type at ``path`` (``modules[...].prober``) in ``kind``; None when not found."""
    for segment in _SEGMENT.findall(path):
        kind = _unwrap(kind)
        if segment.startswith("["):
            args = typing.get_args(kind)
            kind = args[-1] if args else None  # list[T] -> T, dict[K, V] -> V
        elif _structs(kind):
            # A tagged union's members: the first that has the key (msgspec's error
            # does not say which member it was converting).
            kind = next((f.type for member in _structs(kind)
                         for f in msgspec.structs.fields(member) if f.encode_name == segment),
                        None)
        else:
            return None
    return kind


def _structs(kind: Any) -> list[type[msgspec.Struct]]:
    """``kind`` itself if it is a Struct, the Structs of a union of them, else none."""
    members = typing.get_args(kind) if typing.get_origin(kind) in (
        typing.Union, types.UnionType) else (kind,)
    return [m for m in members if isinstance(m, type) and issubclass(m, msgspec.Struct)]


def _tags(kind: Any, path: str) -> list[str]:
    """The tags a tagged union at ``path``'s parent takes in the key ``path`` names."""
    parent, _, key = path.rpartition(".")
    members = _structs(_unwrap(_type_at(kind, parent) if parent else kind))
    return [str(m.__struct_config__.tag) for m in members
            if m.__struct_config__.tag_field == key]


def _literal_values(kind: Any, path: str) -> list[str]:
    """The values of the Literal type at ``path`` in ``kind``."""
    kind = _unwrap(_type_at(kind, path))
    return [str(v) for v in typing.get_args(kind)] if typing.get_origin(kind) is Literal else []


def _unwrap(kind: Any) -> Any:
    """``Annotated[T, …]`` and ``T | None`` -> ``T``."""
    while True:
        if typing.get_origin(kind) is Annotated:
            kind = typing.get_args(kind)[0]
            continue
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
            kind = args[0]
            continue
        return kind


def convert(data: Any, kind: type[T], source: str = "", base: Path | None = None,
            at: str = "") -> T:
    """``data`` (parsed YAML) as ``kind``; ConfigError naming ``source`` (when given)
    and the key.

    ``at`` is where ``data`` sits in the file (``modules.chat``), for a part
    converted on its own: msgspec names a map's keys only as ``[...]``.
    """
    try:
        return msgspec.convert(data, kind, strict=True,
                               dec_hook=_decoder(base or Path.cwd()))
    except msgspec.ValidationError as exc:
        problem = describe(exc, kind, at)
        raise ConfigError(f"{source}: {problem}" if source else problem) from None


def convert_all(data: Any, kind: Any, source: str = "", base: Path | None = None,
                at: str = "") -> tuple[Any, list[str]]:
    """Like :func:`convert`, but every problem of ``data``, one per key: msgspec stops at
    the first, so each time the key at fault is set aside and the rest converted again
    (``bridge check`` lists every problem of a target). Returns the problems and what
    the rest converted to: the value itself when there was no problem; with problems,
    the value without the keys at fault (for checks that need the whole), or None
    where a key that must be there was at fault.
    """
    problems: list[str] = []
    rest = dict(data) if isinstance(data, dict) else data
    dropped: set[str] = set()
    while True:
        try:
            value = msgspec.convert(rest, kind, strict=True,
                                    dec_hook=_decoder(base or Path.cwd()))
        except msgspec.ValidationError as exc:
            match = _AT.match(str(exc))
            assert match is not None  # the pattern matches any text
            key = _SEGMENT.findall((match.group("path") or "").lstrip("."))[:1]
            missing = re.search(r"missing required field `([^`]*)`", str(exc))
            if not (missing and missing.group(1) in dropped):  # set aside by us, not absent
                problem = describe(exc, kind, at)
                problems.append(f"{source}: {problem}" if source else problem)
            unknown = re.search(r"unknown field `([^`]*)`", str(exc))
            name = unknown.group(1) if unknown and not key else key[0] if key else None
            if name is None or not isinstance(rest, dict) or name not in rest:
                return None, problems
            rest = {k: v for k, v in rest.items() if k != name}
            dropped.add(name)
            continue
        return value, problems


def load(path: str | Path, kind: type[T], what: str = "config file") -> T:
    """Read the YAML file at ``path`` as ``kind``; relative paths in it are the file's."""
    source = Path(path)
    return convert(load_yaml_file(source, what), kind, str(source), source.parent.absolute())
