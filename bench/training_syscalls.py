"""Run N monitored steps with the publisher idle, for ``strace -f -c`` to count syscalls.

    PYTHONPATH=exporter strace -f -c -o /tmp/s0 python bench/training_syscalls.py 0
    PYTHONPATH=exporter strace -f -c -o /tmp/s1 python bench/training_syscalls.py 1000000

The two counts differ only by what the extra seconds of runtime cost (none,
if the hot path makes no system calls): the publisher publishes only at start
and close (interval of an hour), no server, no heartbeats.
"""

from __future__ import annotations

import sys
import tempfile

from colossalai_exporter import TrainingMonitor


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    with tempfile.TemporaryDirectory() as run_dir:
        monitor = TrainingMonitor(serve="none", run_dir=run_dir, publish_interval=3600)
        for _ in range(steps):
            with monitor.step() as step:
                step.loss = 1.0
        for _ in range(steps):
            monitor.step_done(loss=1.0)
        monitor.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
