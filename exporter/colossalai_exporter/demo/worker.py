"""The training loop one demo rank runs: ColossalAI, plain torch DDP, or plain Python.

Run by the demo as ``python -m colossalai_exporter.demo.worker`` (under
torchrun for the torch backends, as plain processes with ``RANK``/``WORLD_SIZE``
otherwise). It is deliberately the loop a user would write, so the demo shows
the monitor's real integration rather than a simulation of it: the ColossalAI
backend boosts a model with ``TorchDDPPlugin`` and saves checkpoints through
the watched Booster.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from colossalai_exporter.training import TrainingMonitor

BACKENDS = ("colossalai", "torch", "plain")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="colossalai_exporter.demo.worker")
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-seconds", type=float, required=True)
    parser.add_argument("--stall-after", type=int, default=0)
    parser.add_argument("--stall-for", type=float, default=0.0)
    parser.add_argument("--checkpoint-every", type=int, required=True)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-timeout", type=float, required=True)
    return parser.parse_args(argv)


class PlainModel:
    """y = w·x + b fitted by SGD in pure Python: a loss that falls, with no torch at all."""

    def __init__(self, rank: int) -> None:
        self.rng = random.Random(rank)
        self.w, self.b = 0.0, 0.0

    def train_step(self) -> float:
        xs = [self.rng.uniform(-1, 1) for _ in range(8)]
        ys = [3.0 * x + 0.5 + self.rng.gauss(0, 0.05) for x in xs]
        errors = [self.w * x + self.b - y for x, y in zip(xs, ys, strict=True)]
        self.w -= 0.1 * 2 * sum(e * x for e, x in zip(errors, xs, strict=True)) / len(xs)
        self.b -= 0.1 * 2 * sum(errors) / len(xs)
        return sum(e * e for e in errors) / len(errors)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"w": self.w, "b": self.b}))


def torch_setup(backend: str, monitor_factory: Callable[[], TrainingMonitor]) -> tuple[
        TrainingMonitor, Callable[[], Any], Callable[[Path, int], None]]:
    """Model, optimizer and checkpoint function for the two torch backends."""
    import torch

    torch.manual_seed(0)
    model: Any = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                     torch.nn.Linear(64, 1))
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion: Any = torch.nn.MSELoss()
    if backend == "colossalai":
        import colossalai
        from colossalai.booster import Booster
        from colossalai.booster.plugin import TorchDDPPlugin

        monitor = monitor_factory()  # first, as docs/training.md shows
        colossalai.launch_from_torch(backend="gloo", verbose=False)
        booster = Booster(plugin=TorchDDPPlugin())
        # boost() watches the Booster: its save_model calls become checkpoints.
        model, optimizer, criterion, _, _ = monitor.boost(booster, model, optimizer, criterion)

        def backward(loss: Any) -> None:
            booster.backward(loss, optimizer)

        def save(path: Path, step: int) -> None:
            booster.save_model(model, str(path))
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        monitor = monitor_factory()
        dist.init_process_group("gloo")
        model = DistributedDataParallel(model)

        def backward(loss: Any) -> None:
            loss.backward()

        def save(path: Path, step: int) -> None:
            with monitor.checkpoint(step=step):
                if monitor.rank == 0:
                    torch.save(model.module.state_dict(), path)

    def train_step() -> Any:
        x = torch.randn(16, 32)
        y = x[:, :1] * 2.0 + 0.1
        loss = criterion(model(x), y)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()  # a tensor: the monitor reads it off the hot path

    return monitor, train_step, save


def hang_like_a_kernel_that_never_returns(seconds: float) -> None:
    """The demo's stall: this rank stops, as one stuck in a kernel does; the other
    ranks then wait for it inside their next all-reduce.

    Named so that the stall evidence file (every thread's Python stack) and
    TrainingHangSuspect's description (its innermost frame) show where it is.
    """
    deadline = time.monotonic() + seconds if seconds > 0 else float("inf")
    while time.monotonic() < deadline:
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)

    def make_monitor() -> TrainingMonitor:
        return TrainingMonitor(host=args.host, port=args.port, run_dir=args.run_dir,
                               step_timeout=args.step_timeout, publish_interval=0.5)

    if args.backend == "plain":
        monitor = make_monitor()
        plain = PlainModel(monitor.rank)
        train_step: Callable[[], Any] = plain.train_step

        def plain_save(path: Path, step: int) -> None:
            with monitor.checkpoint(step=step):
                plain.save(path)
        save: Callable[[Path, int], None] = plain_save
    else:
        monitor, train_step, save = torch_setup(args.backend, make_monitor)
    rank = monitor.rank
    # SIGUSR1 makes this rank stop stepping, as --stall-after does: sent to one
    # rank of a DDP job, the others hang inside their next all-reduce, which is
    # what a real hang of one rank does to a job.
    stall_requested = threading.Event()
    signal.signal(signal.SIGUSR1, lambda signum, frame: stall_requested.set())
    stalled_at = 0
    try:
        for i in range(1, args.steps + 1):
            with monitor.step(samples=16) as step:
                step.loss = train_step()
                time.sleep(args.step_seconds)  # stands in for the real work of a step
            if args.checkpoint_every and i % args.checkpoint_every == 0:
                # torch backends: rank 0 writes one file for the job; plain: each rank its own.
                name = f"step{i}.pt" if args.backend != "plain" else f"step{i}-rank{rank}.json"
                save(args.checkpoint_dir / name, i)
            if i == args.stall_after or stall_requested.is_set():
                print(f"rank {rank}: stalling after step {i}", flush=True)
                hang_like_a_kernel_that_never_returns(args.stall_for)
                stalled_at = i
                break
        if stalled_at:  # the run did not do its steps: say so rather than "finished"
            monitor.fail(f"stopped stepping after step {stalled_at} (demo --stall-after)")
        else:
            monitor.finish()
    except BaseException as exc:
        monitor.fail(exc)
        raise
    finally:
        monitor.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
