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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from colossalai_exporter import configfile
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import load_yaml_file
from colossalai_exporter.probe.targets import AllowList, IPNetwork

DEFAULT_PORT = 9467
PROBERS = ("http", "tcp", "colossal_inference", "colossalchat", "health_json", "generate")
# Every reason a probe can fail with; the values of probe_failure_info{reason}.
REASONS = ("dns", "refused", "unreachable", "timeout", "tls", "connection", "protocol",
           "status", "body", "engine_error", "loading", "config")
MAX_BODY_BYTES = 1 << 20
NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")


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
class TLSOptions:
    verify: bool = True
    ca_file: str | None = None
    server_name: str | None = None


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
    tls: TLSOptions = field(default_factory=TLSOptions)
    max_body_bytes: int = MAX_BODY_BYTES

    def status_ok(self, status: int) -> bool:
        if self.valid_status_codes:
            return status in self.valid_status_codes
        return 200 <= status < 300


@dataclass(frozen=True)
class Module:
    """One way of probing: the prober kind, its timeout and its HTTP (or TCP) options."""

    name: str
    prober: str
    timeout: float = 5.0
    http: HttpOptions = field(default_factory=HttpOptions)
    tcp_tls: bool = False

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
    listen_address: str = f":{DEFAULT_PORT}"
    web_config_file: str | None = None
    log_level: str = "info"
    log_format: str = "logfmt"
    timeout_offset: float = 0.5
    max_concurrent: int = 32
    allow: AllowList = field(default_factory=AllowList)
    modules: dict[str, Module] = field(default_factory=lambda: dict(BUILTIN_MODULES))


def parse_duration(value: Any, where: str) -> float:
    """``5s``, ``500ms``, ``1m``, ``1m30s`` or a number of seconds (the config layer's
    grammar, configfile.parse_duration); positive."""
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a duration like 5s, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        try:
            seconds = configfile.parse_duration(str(value))
        except ValueError:
            raise ConfigError(f"{where} must be a duration like 5s, 500ms or 1m, "
                              f"got {value!r}") from None
    if seconds <= 0:
        raise ConfigError(f"{where} must be positive, got {value!r}")
    return seconds


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _keys(section: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(map(str, section)) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: "
                          f"{', '.join(sorted(allowed))})")


def _str_map(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    items = _mapping(value, where)
    for key, val in items.items():
        if not isinstance(val, str | int | float) or isinstance(val, bool):
            raise ConfigError(f"{where}.{key} must be a string")
    return tuple((str(k), str(v)) for k, v in items.items())


def _tls(value: Any, where: str, base: Path) -> TLSOptions:
    section = _mapping(value, where)
    _keys(section, {"insecure_skip_verify", "ca_file", "server_name"}, where)
    skip = section.get("insecure_skip_verify", False)
    if not isinstance(skip, bool):
        raise ConfigError(f"{where}.insecure_skip_verify must be true or false")
    ca = section.get("ca_file")
    if ca is not None:
        path = base / str(ca)
        if not path.is_file():
            raise ConfigError(f"{where}.ca_file {path} is not a readable file")
        ca = str(path)
    name = section.get("server_name")
    return TLSOptions(not skip, ca, str(name) if name else None)


def _json_checks(value: Any, where: str) -> tuple[JsonCheck, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list of {{field, equals[, reason]}}")
    checks: list[JsonCheck] = []
    for i, raw in enumerate(value):
        spot = f"{where}[{i}]"
        item = _mapping(raw, spot)
        _keys(item, {"field", "equals", "reason"}, spot)
        if not isinstance(item.get("field"), str) or not item["field"] or "equals" not in item:
            raise ConfigError(f"{spot} needs a string field and an equals value")
        reason = str(item.get("reason", "body"))
        if reason not in REASONS:
            raise ConfigError(f"{spot}.reason {reason!r} is not one of {', '.join(REASONS)}")
        checks.append(JsonCheck(item["field"], item["equals"], reason))
    return tuple(checks)


def _http(value: Any, where: str, base: Path, defaults: HttpOptions) -> HttpOptions:
    section = _mapping(value, where)
    _keys(section, {"method", "path", "headers", "header_files", "body", "valid_status_codes",
                    "json", "tls_config", "max_body_bytes"}, where)
    options = defaults
    if "method" in section:
        method = str(section["method"]).upper()
        if not method.isalpha():
            raise ConfigError(f"{where}.method {section['method']!r} is not an HTTP method")
        options = replace(options, method=method)
    if "path" in section:
        path = str(section["path"])
        if not path.startswith("/"):
            raise ConfigError(f"{where}.path must start with /, got {path!r}")
        options = replace(options, path=path)
    if "headers" in section:
        options = replace(options, headers=_str_map(section["headers"], f"{where}.headers"))
    if "header_files" in section:
        files = _str_map(section["header_files"], f"{where}.header_files")
        resolved = []
        for name, path_text in files:
            secret = base / path_text
            if not secret.is_file():
                raise ConfigError(f"{where}.header_files.{name}: {secret} is not a readable "
                                  "file")
            resolved.append((name, str(secret)))
        options = replace(options, header_files=tuple(resolved))
    if "body" in section:
        body = section["body"]
        if isinstance(body, dict | list):  # YAML structure: send it as JSON
            body = json.dumps(body)
        options = replace(options, body=str(body).encode())
    if "valid_status_codes" in section:
        codes = section["valid_status_codes"]
        if not isinstance(codes, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) and 100 <= c <= 599 for c in codes):
            raise ConfigError(f"{where}.valid_status_codes must be a list of HTTP status codes")
        options = replace(options, valid_status_codes=tuple(codes))
    if "json" in section:
        options = replace(options, json=_json_checks(section["json"], f"{where}.json"))
    if "tls_config" in section:
        options = replace(options, tls=_tls(section["tls_config"], f"{where}.tls_config", base))
    if "max_body_bytes" in section:
        size = section["max_body_bytes"]
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ConfigError(f"{where}.max_body_bytes must be a positive integer")
        options = replace(options, max_body_bytes=size)
    return options


def parse_module(name: str, value: Any, where: str, base: Path) -> Module:
    """One module from YAML; every problem is a ConfigError naming the key."""
    if not NAME.match(name):
        raise ConfigError(f"{where}: module name {name!r} may use only letters, digits, _ . : -")
    section = _mapping(value, where)
    _keys(section, {"prober", "timeout", "http", "tcp"}, where)
    prober = section.get("prober")
    if prober not in PROBERS:
        raise ConfigError(f"{where}.prober must be one of {', '.join(PROBERS)}, got {prober!r}")
    defaults = HttpOptions()
    timeout = 5.0
    if prober == "health_json":
        defaults = HttpOptions(path="/health")
    elif prober == "generate":
        defaults = HttpOptions(method="POST", path="/generate", body=GENERATE_BODY,
                               headers=(("Content-Type", "application/json"),))
        timeout = 30.0
    if "timeout" in section:
        timeout = parse_duration(section["timeout"], f"{where}.timeout")
    http = _http(section.get("http"), f"{where}.http", base, defaults)
    tcp = _mapping(section.get("tcp"), f"{where}.tcp")
    _keys(tcp, {"tls", "tls_config"}, f"{where}.tcp")
    if prober != "tcp" and tcp:
        raise ConfigError(f"{where}.tcp is only for prober tcp")
    if prober == "tcp" and section.get("http"):
        raise ConfigError(f"{where}.http is not for prober tcp")
    if "tls_config" in tcp:
        http = replace(http, tls=_tls(tcp["tls_config"], f"{where}.tcp.tls_config", base))
    tcp_tls = tcp.get("tls", False)
    if not isinstance(tcp_tls, bool):
        raise ConfigError(f"{where}.tcp.tls must be true or false")
    return Module(name, str(prober), timeout, http, tcp_tls)


def _allow(value: Any, where: str) -> AllowList:
    section = _mapping(value, where)
    _keys(section, {"loopback", "hosts", "networks", "ports"}, where)
    loopback = section.get("loopback", True)
    if not isinstance(loopback, bool):
        raise ConfigError(f"{where}.loopback must be true or false")
    hosts = section.get("hosts") or []
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
        raise ConfigError(f"{where}.hosts must be a list of host names or patterns")
    networks: list[IPNetwork] = []
    for item in section.get("networks") or []:
        try:
            networks.append(ipaddress.ip_network(str(item), strict=False))
        except ValueError as exc:
            raise ConfigError(f"{where}.networks: {item!r} is not a network: {exc}") from None
    ports = section.get("ports") or []
    if not isinstance(ports, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
        raise ConfigError(f"{where}.ports must be a list of port numbers")
    return AllowList(loopback, tuple(hosts), tuple(networks), tuple(ports))


TOP_KEYS = {"web", "log", "timeout_offset_seconds", "max_concurrent", "allow", "modules"}


def apply_file(config: ProbeConfig, data: dict[str, Any], source: Path) -> None:
    where = str(source)
    _keys(data, TOP_KEYS, where)
    web = _mapping(data.get("web"), f"{where}: web")
    _keys(web, {"listen_address", "config_file"}, f"{where}: web")
    config.listen_address = str(web.get("listen_address", config.listen_address))
    if web.get("config_file"):
        config.web_config_file = str(source.parent / str(web["config_file"]))
    log = _mapping(data.get("log"), f"{where}: log")
    _keys(log, {"level", "format"}, f"{where}: log")
    config.log_level = str(log.get("level", config.log_level))
    config.log_format = str(log.get("format", config.log_format))
    if "timeout_offset_seconds" in data:
        offset = data["timeout_offset_seconds"]
        if isinstance(offset, bool) or not isinstance(offset, int | float) or offset < 0:
            raise ConfigError(f"{where}: timeout_offset_seconds must be a number >= 0")
        config.timeout_offset = float(offset)
    if "max_concurrent" in data:
        count = data["max_concurrent"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{where}: max_concurrent must be a positive integer")
        config.max_concurrent = count
    config.allow = _allow(data.get("allow"), f"{where}: allow")
    for name, module in _mapping(data.get("modules"), f"{where}: modules").items():
        config.modules[str(name)] = parse_module(str(name), module,
                                                 f"{where}: modules.{name}", source.parent)


def load_config(args: argparse.Namespace) -> ProbeConfig:
    """Config file first, then flags."""
    config = ProbeConfig()
    if args.config_file:
        path = Path(args.config_file)
        apply_file(config, load_yaml_file(path), path)
    if args.listen_address:
        config.listen_address = args.listen_address
    if args.web_config_file:
        config.web_config_file = args.web_config_file
    if args.log_level:
        config.log_level = args.log_level
    if args.log_format:
        config.log_format = args.log_format
    if getattr(args, "max_concurrent", None):
        config.max_concurrent = args.max_concurrent
    return config
