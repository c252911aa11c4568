"""What telling a data loader's start from a later batch costs: the second look at a
rank idle past the threshold with its training thread in ``data``.

training/unannounced.py calls ``activity.data_loader_starting`` once a publish (about
once a second), on the publisher's thread, only for a rank that has gone a while
without a step and is sampled in the data loader: a second walk up the training
thread's stack and, at the iterator's ``__next__``, a read of that frame's locals.
Timed here beside the ordinary sample, against a thread waiting for a fresh
iterator's first batch, in the loader itself and with one worker process::

    .venv/bin/python bench/data_loader_start.py
"""

from __future__ import annotations

import argparse
import threading
import time
import timeit
from collections.abc import Callable, Iterator

import torch

from colossalai_exporter.training.activity import data_loader_starting, sample


def per_call(function: Callable[[int | None], object], ident: int | None,
             calls: int) -> float:
    """Microseconds a call of ``function(ident)``, the best of five runs of ``calls``."""
    return min(timeit.repeat(lambda: function(ident), number=calls, repeat=5)) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    gate = threading.Event()

    class FirstBatchLate(torch.utils.data.IterableDataset[torch.Tensor]):
        def __iter__(self) -> Iterator[torch.Tensor]:
            gate.wait(120)
            yield torch.zeros(1)

    for workers in (0, 1):
        gate.clear()
        loader = torch.utils.data.DataLoader(FirstBatchLate(), batch_size=None,
                                             num_workers=workers)
        thread = threading.Thread(target=list, args=(loader,))
        thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not data_loader_starting(thread.ident):
            time.sleep(0.01)
        assert data_loader_starting(thread.ident), "never seen at the loader's start"
        ident = thread.ident
        looks = {name: per_call(function, ident, args.calls)
                 for name, function in (("sample", sample),
                                        ("data_loader_starting", data_loader_starting))}
        print(f"num_workers={workers}: sample {looks['sample']:.1f} us, "
              f"data_loader_starting {looks['data_loader_starting']:.1f} us (best of 5)")
        gate.set()
        thread.join(60)


if __name__ == "__main__":
    main()
