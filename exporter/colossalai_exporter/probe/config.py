"""Modules (what a probe checks) and the prober's config file.

Example ``probe.yml`` (every key optional; deploy/probe/probe.example.yml has more)::

    web: {listen_address: ":9467", config_file: web.yml}
    log: {level: info, format: logfmt}
    timeout_offset_seconds: 0.5       # taken off X-Prometheus-Scrape-Timeout-Seconds
    max_concurrent: 32
    allow:
      loopback: true                  # 127.0.0.0/8 and ::1
      hosts: [chat.internal, "*.inference.svc.cluster.local"]
      networks: [10.20.0.0/16]
      ports: []                       # empty: any port
    modules:
      chat_generate:
        prober: generate
        timeout: 30s
        http:
          path: /generate
          header_files: {Authorization: /run/secrets/chat-token}
          body: '{"max_new_tokens": 4, "history": [{"instruction": "ping", "response": ""}]}'

Module keys follow blackbox exporter's where they mean the same thing
(``prober``, ``timeout``, ``http.method``, ``http.headers``, ``http.body``,
``http.valid_status_codes``, ``http.tls_config.insecure_skip_verify`` and
``ca_file``, ``tcp.tls``).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from colossalai_exporter import configfile
from colossalai_exporter.configfile import (
    ConfigPath,
    DaemonFile,
    NonEmpty,
    Seconds,
    Section,
    TLSClient,
    secret_from_file,
)
from colossalai_exporter.daemon import DaemonSettings
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import load_yaml_file
from colossalai_exporter.probe.stream import StreamFormat
from colossalai_exporter.probe.targets import AllowList, IPNetwork

DEFAULT_PORT = 9467
Prober = Literal["http", "tcp", "colossal_inference", "colossalchat", "health_json", "generate",
                 "stream"]
PROBERS: tuple[str, ...] = typing.get_args(Prober)
# Every reason a probe can fail with; the values of probe_failure_info{reason}.
Reason = Literal["dns", "refused", "unreachable", "timeout", "tls", "connection", "protocol",
                 "status", "body", "engine_error", "loading", "config",
                 # a streamed generation's (prober stream; probe/stream.py)
                 "first_token_timeout", "token_gap", "truncated", "empty"]
REASONS: tuple[str, ...] = typing.get_args(Reason)
MAX_BODY_BYTES = 1 << 20
NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")
#: The TLS settings of a module (``http.tls_config``, ``tcp.tls_config``): the
#: config layer's one TLS client block.
TLSOptions = TLSClient


@dataclass(frozen=True)
class JsonCheck:
    """``field`` (dotted path into the JSON body) must equal ``equals``; else ``reason``."""

    field: str
    equals: Any
    reason: str = "body"

    def value_in(self, document: Any) -> tuple[bool, Any]:
        """(found, value) of the field in ``document``."""
        node = document
        for part in self.field.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return False, None
        return True, node


@dataclass(frozen=True)
class HttpOptions:
    method: str = "GET"
    path: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    # header name -> file holding its value (a bearer token); read at every probe
    header_files: tuple[tuple[str, str], ...] = ()
    body: bytes | None = None
    # empty: any 2xx
    valid_status_codes: tuple[int, ...] = ()
    json: tuple[JsonCheck, ...] = ()
    tls: TLSClient = field(default_factory=TLSClient)
    max_body_bytes: int = MAX_BODY_BYTES

    def status_ok(self, status: int) -> bool:
        if self.valid_status_codes:
            return status in self.valid_status_codes
        return 200 <= status < 300


@dataclass(frozen=True)
class StreamOptions:
    """How a streamed generation is read and what it must do (prober ``stream``)."""

    format: StreamFormat = "openai"
    #: from the request sent to the first non-empty token
    first_token_timeout: float = 10.0
    #: the longest wait between two tokens
    max_token_gap: float = 5.0


# (path, body) a streaming probe sends by default, per format: a tiny generation.
STREAM_REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "openai": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "ping"}], "max_tokens": 4, "stream": True}),
    "colossalchat": ("/generate/stream", {
        "max_new_tokens": 4, "history": [{"instruction": "ping", "response": ""}]}),
    "colossal_inference": ("/generate", {"prompt": "ping", "max_new_tokens": 4,
                                         "stream": True}),
}


@dataclass(frozen=True)
class Module:
    """One way of probing: the prober kind, its timeout and its HTTP (or TCP) options."""

    name: str
    prober: str
    timeout: float = 5.0
    http: HttpOptions = field(default_factory=HttpOptions)
    tcp_tls: bool = False
    stream: StreamOptions = field(default_factory=StreamOptions)

    @property
    def target_kind(self) -> str:
        return "tcp" if self.prober == "tcp" else "http"


GENERATE_BODY = json.dumps({"max_new_tokens": 4,
                            "history": [{"instruction": "ping", "response": ""}]}).encode()

BUILTIN_MODULES: dict[str, Module] = {
    "http_2xx": Module("http_2xx", "http"),
    "tcp_connect": Module("tcp_connect", "tcp"),
    "colossal_inference": Module("colossal_inference", "colossal_inference"),
    "colossalchat": Module("colossalchat", "colossalchat"),
    "health_json": Module("health_json", "health_json", http=HttpOptions(path="/health")),
    # ``generate`` is not built in: it makes the server do real work, so it runs only
    # where a config file defines a module with ``prober: generate``.
}


@dataclass
class ProbeConfig:
    daemon: DaemonSettings = field(default_factory=lambda: DaemonSettings.on_port(DEFAULT_PORT))
    timeout_offset: float = 0.5
    max_concurrent: int = 32
    allow: AllowList = field(default_factory=AllowList)
    modules: dict[str, Module] = field(default_factory=lambda: dict(BUILTIN_MODULES))


# The file's shape (deploy/probe/probe.example.yml). Module keys follow blackbox
# exporter's; unknown keys at any depth are errors naming their path.
class JsonCheckSection(Section, frozen=True):
    field: NonEmpty
    equals: Any
    reason: Reason = "body"


StatusCode = Annotated[int, msgspec.Meta(ge=100, le=599)]


class HttpSection(Section, frozen=True):
    method: Annotated[str, msgspec.Meta(pattern="^[A-Za-z]+$")] | None = None
    path: Annotated[str, msgspec.Meta(pattern="^/")] | None = None
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    header_files: dict[str, ConfigPath] = msgspec.field(default_factory=dict)
    # a string is sent as it is; YAML structure is sent as JSON
    body: str | dict[str, Any] | list[Any] | None = None
    valid_status_codes: list[StatusCode] = msgspec.field(default_factory=list)
    json: list[JsonCheckSection] = msgspec.field(default_factory=list)
    tls_config: TLSClient | None = None
    max_body_bytes: Annotated[int, msgspec.Meta(gt=0)] | None = None


class TcpSection(Section, frozen=True):
    tls: bool = False
    tls_config: TLSClient | None = None


class StreamSection(Section, frozen=True):
    format: StreamFormat = "openai"
    first_token_timeout: Seconds | None = None
    max_token_gap: Seconds | None = None


class ModuleSection(Section, frozen=True):
    prober: Prober
    timeout: Seconds | None = None
    http: HttpSection | None = None
    tcp: TcpSection | None = None
    stream: StreamSection | None = None


class AllowSection(Section, frozen=True):
    loopback: bool = True
    hosts: list[NonEmpty] = msgspec.field(default_factory=list)
    networks: list[str] = msgspec.field(default_factory=list)
    ports: list[Annotated[int, msgspec.Meta(ge=1, le=65535)]] = msgspec.field(default_factory=list)


class ProbeFile(DaemonFile, frozen=True):
    timeout_offset_seconds: Seconds | None = None
    max_concurrent: Annotated[int, msgspec.Meta(ge=1)] | None = None
    allow: AllowSection = AllowSection()
    # each module is converted on its own, so that an error names it (modules.chat.http)
    modules: dict[str, Any] = msgspec.field(default_factory=dict)


def _tls(section: TLSClient, where: str) -> TLSClient:
    for key, problem in section.problems():
        raise ConfigError(f"{where}.{key}: {problem}")
    return section


def _http(section: HttpSection, where: str, defaults: HttpOptions) -> HttpOptions:
    options = defaults
    if section.method is not None:
        options = replace(options, method=section.method.upper())
    if section.path is not None:
        options = replace(options, path=section.path)
    if section.headers:
        options = replace(options, headers=tuple(section.headers.items()))
    for name, secret in section.header_files.items():
        try:
            secret_from_file(secret)  # usable now; re-read at every probe (rotation)
        except ConfigError as exc:
            raise ConfigError(f"{where}.header_files.{name}: {exc}") from None
    if section.header_files:
        options = replace(options, header_files=tuple(
            (name, str(path)) for name, path in section.header_files.items()))
    if section.body is not None:
        body = section.body if isinstance(section.body, str) else json.dumps(section.body)
        options = replace(options, body=body.encode())
    if section.valid_status_codes:
        options = replace(options, valid_status_codes=tuple(section.valid_status_codes))
    if section.json:
        options = replace(options, json=tuple(JsonCheck(c.field, c.equals, c.reason)
                                               for c in section.json))
    if section.tls_config is not None:
        options = replace(options, tls=_tls(section.tls_config, f"{where}.tls_config"))
    if section.max_body_bytes is not None:
        options = replace(options, max_body_bytes=section.max_body_bytes)
    return options


def parse_module(name: str, value: Any, where: str, base: Path) -> Module:
    """One module from YAML; every problem is a ConfigError naming the key."""
    source, _, at = where.partition(": ")
    if not NAME.match(name):
        raise ConfigError(f"{where}: module name {name!r} may use only letters, digits, _ . : -")
    section = configfile.convert(value, ModuleSection, source, base, at)
    defaults = HttpOptions()
    timeout = 5.0
    if section.prober == "health_json":
        defaults = HttpOptions(path="/health")
    elif section.prober == "generate":
        defaults = HttpOptions(method="POST", path="/generate", body=GENERATE_BODY,
                               headers=(("Content-Type", "application/json"),))
        timeout = 30.0
    elif section.prober == "stream":
        path, body = STREAM_REQUESTS[(section.stream or StreamSection()).format]
        defaults = HttpOptions(method="POST", path=path, body=json.dumps(body).encode(),
                               headers=(("Content-Type", "application/json"),
                                        ("Accept", "text/event-stream")))
        timeout = 30.0
    if section.timeout is not None:
        if section.timeout <= 0:
            raise ConfigError(f"{where}.timeout must be positive, got {section.timeout:g}")
        timeout = float(section.timeout)
    if section.prober == "tcp" and section.http is not None:
        raise ConfigError(f"{where}.http is not for prober tcp")
    if section.prober != "tcp" and section.tcp is not None:
        raise ConfigError(f"{where}.tcp is only for prober tcp")
    if section.prober != "stream" and section.stream is not None:
        raise ConfigError(f"{where}.stream is only for prober stream")
    stream = (_stream(section.stream or StreamSection(), f"{where}.stream", timeout)
              if section.prober == "stream" else StreamOptions())
    http = _http(section.http or HttpSection(), f"{where}.http", defaults)
    tcp = section.tcp or TcpSection()
    if tcp.tls_config is not None:
        http = replace(http, tls=_tls(tcp.tls_config, f"{where}.tcp.tls_config"))
    return Module(name, section.prober, timeout, http, tcp.tls, stream)


def _stream(section: StreamSection, where: str, timeout: float) -> StreamOptions:
    limits = {"first_token_timeout": StreamOptions.first_token_timeout,
              "max_token_gap": StreamOptions.max_token_gap}
    for key in limits:
        value = getattr(section, key)
        if value is not None:
            if value <= 0:
                raise ConfigError(f"{where}.{key} must be positive, got {value:g}")
            limits[key] = float(value)
    options = StreamOptions(section.format, limits["first_token_timeout"],
                            limits["max_token_gap"])
    if options.first_token_timeout >= timeout:
        # The probe would always end as a timeout before the first token's limit.
        raise ConfigError(f"{where}.first_token_timeout ({options.first_token_timeout:g}s) "
                          f"must be shorter than the module's timeout ({timeout:g}s)")
    return options


def _allow(section: AllowSection, where: str) -> AllowList:
    networks: list[IPNetwork] = []
    for item in section.networks:
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError as exc:
            raise ConfigError(f"{where}.networks: {item!r} is not a network: {exc}") from None
    return AllowList(section.loopback, tuple(section.hosts), tuple(networks),
                     tuple(section.ports))


def apply_file(config: ProbeConfig, data: Any, source: Path) -> None:
    """Values the file sets replace the defaults (flags replace them in turn)."""
    where = str(source)
    file = configfile.convert(data if data is not None else {}, ProbeFile, where,
                              source.parent.absolute())
    config.daemon.apply_file(file.web, file.log)
    if file.timeout_offset_seconds is not None:
        config.timeout_offset = float(file.timeout_offset_seconds)
    if file.max_concurrent is not None:
        config.max_concurrent = file.max_concurrent
    config.allow = _allow(file.allow, f"{where}: allow")
    for name, module in file.modules.items():
        config.modules[str(name)] = parse_module(str(name), module,
                                                 f"{where}: modules.{name}",
                                                 source.parent.absolute())


def load_config(args: argparse.Namespace) -> ProbeConfig:
    """Config file first, then flags."""
    config = ProbeConfig()
    if args.config_file:
        path = Path(args.config_file)
        apply_file(config, load_yaml_file(path), path)
    config.daemon.apply_flags(args)
    if getattr(args, "max_concurrent", None):
        config.max_concurrent = args.max_concurrent
    return config
