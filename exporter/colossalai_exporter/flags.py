"""Command-line conventions shared by every server: Go-exporter style flags.

``--web.listen-address``, ``--web.config.file``, ``--log.level``,
``--log.format`` and ``--config.file`` mean the same in every command, and a
bad flag is one readable line with exit code 2 (argparse alone prints the
whole usage first).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.logs import FORMATS, LEVELS


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`ConfigError` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def add_common_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--config.file", dest="config_file", default=None, metavar="PATH",
                        help="YAML config file; flags and environment variables override it")
    parser.add_argument("--web.listen-address", dest="listen_address", default=None,
                        metavar="HOST:PORT", help=f"address to listen on (default :{default_port})")
    parser.add_argument("--web.config.file", dest="web_config_file", default=None,
                        metavar="PATH",
                        help="exporter web config: TLS, client certificates, basic auth")
    parser.add_argument("--log.level", dest="log_level", default=None, choices=LEVELS,
                        help="debug, info, warn or error (default info)")
    parser.add_argument("--log.format", dest="log_format", default=None, choices=FORMATS,
                        help="logfmt or json (default logfmt)")


def load_yaml_file(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A YAML mapping from ``path``; any problem is one ConfigError line naming the file."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {source}: {exc.strerror}") from None
    import yaml  # only with a config file: a tenth of the agent's start-up otherwise

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{what} {source} is not valid YAML{at}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {source} must be a YAML mapping, got {type(data).__name__}")
    return data
