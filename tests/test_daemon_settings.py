"""One DaemonSettings for node, probe and bridge: the same four settings from the
file's ``web:`` and ``log:`` and from the same flags, a flag winning over the file
and the file over the daemon's own default port."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from colossalai_exporter.bridge import config as bridge_config
from colossalai_exporter.daemon import DaemonSettings
from colossalai_exporter.flags import ArgumentParser, add_common_flags
from colossalai_exporter.node import config as node_config
from colossalai_exporter.probe import config as probe_config

FILE_SECTIONS = ("web: {listen_address: '127.0.0.1:7001', config_file: web.yml}\n"
                 "log: {level: debug, format: json}\n")
BRIDGE_REST = "state_dir: state\ntargets: [{name: ok, type: heartbeat, url: 'https://x/y'}]\n"


def node_settings(path: Path | None, argv: list[str]) -> DaemonSettings:
    parser = ArgumentParser()
    add_common_flags(parser, node_config.DEFAULT_PORT)
    node_config.add_node_flags(parser)
    args = parser.parse_args([*argv, *(["--config.file", str(path)] if path else [])])
    return node_config.load_config(args, env={}).daemon


def probe_settings(path: Path | None, argv: list[str]) -> DaemonSettings:
    parser = ArgumentParser()
    add_common_flags(parser, probe_config.DEFAULT_PORT)
    args = parser.parse_args([*argv, *(["--config.file", str(path)] if path else [])])
    return probe_config.load_config(args).daemon


def bridge_settings(path: Path | None, argv: list[str]) -> DaemonSettings:
    # The bridge needs a file (its targets); "no file" here means one without web: or log:.
    assert path is not None
    parser = ArgumentParser()
    add_common_flags(parser, bridge_config.DEFAULT_PORT)
    args = parser.parse_args(argv)
    config = bridge_config.load_config(path)
    config.daemon.apply_flags(args)
    return config.daemon


DAEMONS = {"node": (node_settings, 9466), "probe": (probe_settings, 9467),
           "bridge": (bridge_settings, 9468)}


def write(tmp_path: Path, daemon: str, sections: str) -> Path:
    path = tmp_path / f"{daemon}.yml"
    path.write_text(sections + (BRIDGE_REST if daemon == "bridge" else ""))
    return path


@pytest.mark.parametrize("daemon", DAEMONS)
def test_defaults_are_the_daemons_own_port_info_and_logfmt(tmp_path: Path, daemon: str) -> None:
    load, port = DAEMONS[daemon]
    assert load(write(tmp_path, daemon, ""), []) == DaemonSettings(f":{port}", None, "info",
                                                                   "logfmt")


@pytest.mark.parametrize("daemon", DAEMONS)
def test_the_files_web_and_log_sections_replace_the_defaults(tmp_path: Path, daemon: str) -> None:
    load, _ = DAEMONS[daemon]
    settings = load(write(tmp_path, daemon, FILE_SECTIONS), [])
    # The web config's path is the file's neighbour, whatever the working directory.
    assert settings == DaemonSettings("127.0.0.1:7001", str(tmp_path / "web.yml"), "debug",
                                      "json")


@pytest.mark.parametrize("daemon", DAEMONS)
def test_flags_win_over_the_file(tmp_path: Path, daemon: str) -> None:
    load, _ = DAEMONS[daemon]
    settings = load(write(tmp_path, daemon, FILE_SECTIONS),
                    ["--web.listen-address", ":7002", "--web.config.file", "/etc/w.yml",
                     "--log.level", "warn", "--log.format", "logfmt"])
    assert settings == DaemonSettings(":7002", "/etc/w.yml", "warn", "logfmt")


def test_a_parser_without_the_daemon_flags_leaves_the_settings_alone() -> None:
    # `node check` serves and logs nothing: its parser has none of the four flags.
    settings = DaemonSettings("127.0.0.1:7001", "web.yml", "debug", "json")
    settings.apply_flags(argparse.Namespace(config_file=None))
    assert settings == DaemonSettings("127.0.0.1:7001", "web.yml", "debug", "json")
