"""How a daemon serves and logs: one :class:`DaemonSettings` for node, probe and bridge.

Every daemon takes the same four settings, Go-exporter style, from the same two
places: the config file's ``web:`` and ``log:`` sections
(:class:`~colossalai_exporter.configfile.WebSection`,
:class:`~colossalai_exporter.configfile.LogSection`) and the flags
``--web.listen-address``, ``--web.config.file``, ``--log.level`` and
``--log.format`` (:func:`~colossalai_exporter.flags.add_common_flags`). A flag
wins over the file, the file over the default.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from colossalai_exporter.configfile import LogSection, WebSection
from colossalai_exporter.logs import setup_logging

if TYPE_CHECKING:
    from colossalai_exporter.web.config import WebConfig


@dataclass
class DaemonSettings:
    #: ``[HOST]:PORT``; the default port is the daemon's own
    listen_address: str
    #: the exporter web config (TLS, client certificates, basic auth); None: plain HTTP
    web_config_file: str | None = None
    log_level: str = "info"
    log_format: str = "logfmt"

    @classmethod
    def on_port(cls, port: int) -> DaemonSettings:
        """The defaults of a daemon listening on ``port`` on every interface."""
        return cls(listen_address=f":{port}")

    def apply_file(self, web: WebSection, log: LogSection) -> None:
        """The file's ``web:`` and ``log:`` values replace the defaults."""
        self.listen_address = web.listen_address or self.listen_address
        self.web_config_file = web.config_file or self.web_config_file
        self.log_level = log.level or self.log_level
        self.log_format = log.format or self.log_format

    def apply_flags(self, args: argparse.Namespace) -> None:
        """Flags given replace the file's values. A parser without the daemon flags
        (``node check`` serves and logs nothing) leaves every value as it was."""
        for item in fields(self):
            value = getattr(args, item.name, None)
            if value is not None:
                setattr(self, item.name, value)

    def start_logging(self) -> None:
        setup_logging(self.log_level, self.log_format)

    def web_config(self) -> WebConfig:
        """The web config file's contents; ConfigError (one line) when it is bad."""
        from colossalai_exporter.web import load_web_config

        return load_web_config(self.web_config_file)
