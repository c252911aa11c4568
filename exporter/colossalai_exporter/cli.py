"""``colossalai-exporter <command>``: one console script, one module per command.

Each command lives in its component (``node``, ``probe``, ``bridge`` …) and is
imported only when asked for, so ``colossalai-exporter node`` never loads the
bridge's or the training side's dependencies.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.version import __version__

PROG = "colossalai-exporter"

# command -> (module with a ``main(argv) -> int``, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("colossalai_exporter.demo.cli", "a short real training run on the CPU, watched by "
             "the monitor and the node agent"),
    "node": ("colossalai_exporter.node.cli", "per-node agent: GPUs, host memory, disks, "
             "rendezvous and local training ranks"),
    "probe": ("colossalai_exporter.probe.cli", "blackbox-style prober for ColossalAI chat "
              "and inference servers"),
    "bridge": ("colossalai_exporter.bridge.cli", "durable Alertmanager webhook receiver "
               "forwarding to Vigilmon heartbeats and webhooks"),
    "rules": ("colossalai_exporter.rulesgen.cli", "render the alerting and recording rules "
              "from their one config"),
    "dashboards": ("colossalai_exporter.dashboards.cli", "write the Grafana dashboards "
                   "from their Python source"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"usage: {PROG} [--version] <command> [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", f"Run '{PROG} <command> --help' for a command's options."]
    return "\n".join(lines)


def fail(message: str) -> int:
    """Print one readable error line and return the usage-error exit code."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"{PROG} {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        return fail(f"unknown command {command!r} (commands: {', '.join(COMMANDS)})")
    module = importlib.import_module(COMMANDS[command][0])
    run: Callable[[list[str]], int] = module.main
    try:
        return run(rest)
    except ConfigError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return 130
