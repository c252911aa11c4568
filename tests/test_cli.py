"""The console script's own behaviour: version, help, unknown commands."""

from __future__ import annotations

import re

import pytest

from colossalai_exporter.cli import COMMANDS
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


HELPS = [*([name] for name in COMMANDS), ["bridge", "check"], ["bridge", "outbox"],
         ["node", "check"]]


@pytest.mark.parametrize("command", HELPS, ids=" ".join)
def test_every_help_is_plain_text_and_explains_every_option(command: list[str]) -> None:
    result = run_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    # Plain text for a terminal: no reStructuredText from docstrings.
    assert not re.search(r"``|:(mod|class|func|meth|attr):`", text), text
    # A sentence saying what the command does, after the usage lines.
    usage, _, rest = text.partition("\n\n")
    assert usage.startswith("usage: colossalai-exporter") and rest.strip(), text
    assert not rest.lstrip().startswith(("options:", "positional arguments:")), text
    # Every option and argument has a help text: argparse puts it on the option's own
    # line or indented on the next one.
    lines = text.splitlines()
    for index, line in enumerate(lines):
        # an option or argument alone on its line (single spaces only: no help after it)
        entry = re.match(r"^  (-\S+|\{\S+\}|[a-z_]+)(?: \S+)*$", line)
        if entry is None or line.strip() in ("-h, --help",):
            continue
        following = lines[index + 1] if index + 1 < len(lines) else ""
        assert following.startswith(" " * 8) and following.strip(), (
            f"{' '.join(command)}: {line.strip()!r} has no help text")
