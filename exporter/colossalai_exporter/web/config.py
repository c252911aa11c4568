"""The exporter web config file (``--web.config.file``), as Go exporters read it.

Supported keys, with the same meaning as in prometheus/exporter-toolkit::

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert, RequestClientCert,
                                                     # RequireAnyClientCert, VerifyClientCertIfGiven
      client_ca_file: ca.crt
      min_version: TLS12                             # TLS10 … TLS13
      max_version: TLS13
    basic_auth_users:
      prometheus: $2b$12$…                           # bcrypt hashes only
    http_server_config:
      headers:
        X-Frame-Options: deny

Relative file paths are resolved against the config file's folder. Every
problem is a :class:`ConfigError` naming the file and the key.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colossalai_exporter.errors import ConfigError

log = logging.getLogger(__name__)

TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# exporter-toolkit's client_auth_type values -> (verify mode, must a CA file be given)
CLIENT_AUTH_TYPES = {
    "NoClientCert": (ssl.CERT_NONE, False),
    "RequestClientCert": (ssl.CERT_OPTIONAL, False),
    "RequireAnyClientCert": (ssl.CERT_REQUIRED, False),
    "VerifyClientCertIfGiven": (ssl.CERT_OPTIONAL, True),
    "RequireAndVerifyClientCert": (ssl.CERT_REQUIRED, True),
}
_BCRYPT_PREFIXES = ("$2a$", "$2b$", "$2y$")
# exporter-toolkit keys that Python's ssl module cannot honour as Go does.
IGNORED_TLS_KEYS = frozenset({"cipher_suites", "prefer_server_cipher_suites", "curve_preferences"})


@dataclass(frozen=True)
class TLSConfig:
    cert_file: Path
    key_file: Path
    client_auth_type: str = "NoClientCert"
    client_ca_file: Path | None = None
    min_version: str = "TLS12"
    max_version: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """Build the server-side context; unreadable files become ConfigErrors."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = TLS_VERSIONS[self.min_version]
        if self.max_version:
            ctx.maximum_version = TLS_VERSIONS[self.max_version]
        try:
            ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"tls_server_config: cannot load cert_file {self.cert_file} / key_file "
                f"{self.key_file}: {exc}"
            ) from None
        verify_mode, _ = CLIENT_AUTH_TYPES[self.client_auth_type]
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(cafile=str(self.client_ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"tls_server_config: cannot load client_ca_file {self.client_ca_file}: {exc}"
                ) from None
        elif verify_mode != ssl.CERT_NONE:
            # Python cannot accept an unverified client certificate; RequireAnyClientCert
            # and RequestClientCert need a CA here (docs/web-config.md says so).
            raise ConfigError(
                f"tls_server_config: client_auth_type {self.client_auth_type} needs "
                "client_ca_file in this implementation"
            )
        ctx.verify_mode = verify_mode
        return ctx


@dataclass(frozen=True)
class WebConfig:
    """A parsed web config; the empty default means plain HTTP, no auth."""

    tls: TLSConfig | None = None
    basic_auth_users: dict[str, bytes] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    source: Path | None = None


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _check_keys(section: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        allowed_text = ", ".join(sorted(allowed))
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {allowed_text})")


def _tls(section: dict[str, Any], base: Path, where: str) -> TLSConfig | None:
    if not section:
        return None
    _check_keys(section, {"cert_file", "key_file", "client_auth_type", "client_ca_file",
                          "min_version", "max_version", *IGNORED_TLS_KEYS}, where)
    for key in sorted(IGNORED_TLS_KEYS & set(section)):
        # Accepted so that one web config serves Go exporters and ours alike; said once
        # at start-up because a cipher restriction that silently does nothing is a trap.
        log.warning(f"{where}.{key} is accepted for compatibility with exporter-toolkit and "
                    "ignored: Python's OpenSSL defaults apply (docs/web-config.md)")
    for key in ("cert_file", "key_file"):
        if not isinstance(section.get(key), str) or not section[key]:
            raise ConfigError(f"{where}.{key} is required")
    auth = section.get("client_auth_type") or "NoClientCert"
    if auth not in CLIENT_AUTH_TYPES:
        raise ConfigError(f"{where}.client_auth_type {auth!r} is not one of "
                          f"{', '.join(CLIENT_AUTH_TYPES)}")
    for key in ("min_version", "max_version"):
        if section.get(key) is not None and section[key] not in TLS_VERSIONS:
            raise ConfigError(f"{where}.{key} {section[key]!r} is not one of "
                              f"{', '.join(TLS_VERSIONS)}")
    ca = section.get("client_ca_file")
    if CLIENT_AUTH_TYPES[auth][1] and not ca:
        raise ConfigError(f"{where}.client_auth_type {auth} needs client_ca_file")
    return TLSConfig(
        cert_file=base / section["cert_file"],
        key_file=base / section["key_file"],
        client_auth_type=auth,
        client_ca_file=base / ca if ca else None,
        min_version=section.get("min_version") or "TLS12",
        max_version=section.get("max_version"),
    )


def _users(section: dict[str, Any], where: str) -> dict[str, bytes]:
    users: dict[str, bytes] = {}
    for user, hashed in section.items():
        if not isinstance(hashed, str) or not hashed.startswith(_BCRYPT_PREFIXES) \
                or len(hashed) != 60:
            raise ConfigError(f"{where}: the password hash of user {user!r} is not a bcrypt "
                              "hash ($2a$/$2b$/$2y$, 60 characters)")
        users[str(user)] = hashed.encode()
    return users


def parse_web_config(data: Any, source: Path | None = None) -> WebConfig:
    """Validate a loaded YAML document (``source`` only names it in errors)."""
    where = str(source) if source else "web config"
    root = _mapping(data, where)
    _check_keys(root, {"tls_server_config", "basic_auth_users", "http_server_config"}, where)
    base = source.parent if source else Path.cwd()
    tls = _tls(_mapping(root.get("tls_server_config"), f"{where}: tls_server_config"),
               base, f"{where}: tls_server_config")
    users = _users(_mapping(root.get("basic_auth_users"), f"{where}: basic_auth_users"),
                   f"{where}: basic_auth_users")
    http = _mapping(root.get("http_server_config"), f"{where}: http_server_config")
    headers = {str(k): str(v) for k, v in
               _mapping(http.get("headers"), f"{where}: http_server_config.headers").items()}
    config = WebConfig(tls=tls, basic_auth_users=users, headers=headers, source=source)
    if tls is not None:
        tls.ssl_context()  # fail now, at start-up, on unreadable certificates
    return config


def load_web_config(path: str | Path | None) -> WebConfig:
    """Read ``--web.config.file``; ``None`` or an empty path means no TLS and no auth."""
    if not path:
        return WebConfig()
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read web config {source}: {exc.strerror}") from None
    import yaml  # only with a config file: a tenth of the agent's start-up otherwise

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"web config {source} is not valid YAML: "
                          f"{str(exc).splitlines()[0]}") from None
    return parse_web_config(data, source)
