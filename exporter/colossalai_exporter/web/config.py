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
from typing import Any, Literal

import msgspec

from colossalai_exporter import configfile
from colossalai_exporter.configfile import TLS_VERSIONS, ConfigPath, Section, TLSVersion
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import load_yaml_file

log = logging.getLogger(__name__)

__all__ = ["TLS_VERSIONS", "TLSConfig", "WebConfig", "load_web_config", "parse_web_config"]

ClientAuthType = Literal["NoClientCert", "RequestClientCert", "RequireAnyClientCert",
                         "VerifyClientCertIfGiven", "RequireAndVerifyClientCert"]
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
IGNORED_TLS_KEYS = ("cipher_suites", "prefer_server_cipher_suites", "curve_preferences")


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


# The file's shape, exporter-toolkit's keys; unknown keys at any depth are errors.
class TLSServerSection(Section, frozen=True):
    cert_file: ConfigPath | None = None
    key_file: ConfigPath | None = None
    client_auth_type: ClientAuthType = "NoClientCert"
    client_ca_file: ConfigPath | None = None
    min_version: TLSVersion = "TLS12"
    max_version: TLSVersion | None = None
    # Accepted so that one web config serves Go exporters and ours alike; said once
    # at start-up because a cipher restriction that silently does nothing is a trap.
    cipher_suites: list[str] | None = None
    prefer_server_cipher_suites: bool | None = None
    curve_preferences: list[str] | None = None


class HttpServerSection(Section, frozen=True):
    headers: dict[str, str] = msgspec.field(default_factory=dict)


class WebFile(Section, frozen=True):
    tls_server_config: TLSServerSection | None = None
    basic_auth_users: dict[str, str] = msgspec.field(default_factory=dict)
    http_server_config: HttpServerSection = HttpServerSection()


def _tls(section: TLSServerSection | None, where: str) -> TLSConfig | None:
    if section is None or section == TLSServerSection():
        return None
    for key in IGNORED_TLS_KEYS:
        if getattr(section, key) is not None:
            log.warning(f"{where}.{key} is accepted for compatibility with exporter-toolkit "
                        "and ignored: Python's OpenSSL defaults apply (docs/web-config.md)")
    if section.cert_file is None or section.key_file is None:
        missing = "cert_file" if section.cert_file is None else "key_file"
        raise ConfigError(f"{where}.{missing} is required")
    if CLIENT_AUTH_TYPES[section.client_auth_type][1] and section.client_ca_file is None:
        raise ConfigError(f"{where}.client_auth_type {section.client_auth_type} needs "
                          "client_ca_file")
    return TLSConfig(
        cert_file=Path(section.cert_file),
        key_file=Path(section.key_file),
        client_auth_type=section.client_auth_type,
        client_ca_file=Path(section.client_ca_file) if section.client_ca_file else None,
        min_version=section.min_version,
        max_version=section.max_version,
    )


def _users(users: dict[str, str], where: str) -> dict[str, bytes]:
    for user, hashed in users.items():
        if not hashed.startswith(_BCRYPT_PREFIXES) or len(hashed) != 60:
            raise ConfigError(f"{where}: the password hash of user {user!r} is not a bcrypt "
                              "hash ($2a$/$2b$/$2y$, 60 characters)")
    return {user: hashed.encode() for user, hashed in users.items()}


def parse_web_config(data: Any, source: Path | None = None) -> WebConfig:
    """Validate a loaded YAML document (``source`` names it in errors, and relative
    paths in it are relative to its folder)."""
    where = str(source) if source else "web config"
    base = source.parent.absolute() if source else Path.cwd()
    file = configfile.convert(data if data is not None else {}, WebFile, where, base)
    tls = _tls(file.tls_server_config, f"{where}: tls_server_config")
    config = WebConfig(tls=tls, basic_auth_users=_users(file.basic_auth_users,
                                                        f"{where}: basic_auth_users"),
                       headers=dict(file.http_server_config.headers), source=source)
    if tls is not None:
        tls.ssl_context()  # fail now, at start-up, on unreadable certificates
    return config


def load_web_config(path: str | Path | None) -> WebConfig:
    """Read ``--web.config.file``; ``None`` or an empty path means no TLS and no auth."""
    if not path:
        return WebConfig()
    return parse_web_config(load_yaml_file(path, "web config"), Path(path))
