"""The console script's own behaviour: version, help, unknown commands."""

from __future__ import annotations

from colossalai_exporter.version import __version__
from conftest import run_cli


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"colossalai-exporter {__version__}"


def test_unknown_command_is_one_line_and_exit_2() -> None:
    result = run_cli("frobnicate")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "colossalai-exporter: error: unknown command 'frobnicate' "
        "(commands: demo, node, probe, bridge, rules, dashboards)"
    ]


def test_no_command_prints_usage_and_exit_2() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "usage: colossalai-exporter" in result.stdout
