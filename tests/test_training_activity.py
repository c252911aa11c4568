"""Where a rank's training thread is (training/activity.py), sampled in real processes.

The classification names the rank a hang waits for (TrainingHangSuspect), so each
activity is produced the way a job produces it: a real gloo all-reduce another rank
has not joined, a real backward, a real DataLoader, user compute; and the cost of a
sample is what the publisher pays once a second.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from colossalai_exporter.rankstate.schema import Activity
from colossalai_exporter.training.activity import sample
from conftest import cli_env, free_port, require

TWO_RANKS = textwrap.dedent("""
    import json, sys, threading, time
    import torch
    import torch.distributed as dist
    from colossalai_exporter.training.activity import sample

    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank,
                            world_size=2)
    if rank == 1:
        time.sleep(float(sys.argv[3]))      # late: rank 0 waits in all_reduce for it
        dist.all_reduce(torch.ones(4))
    else:
        main = threading.main_thread().ident
        seen = []
        def watch():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                where = sample(main)
                if where is not None and where.kind == "collective":
                    seen.append(where)
                    return
                time.sleep(0.05)
        watcher = threading.Thread(target=watch)
        watcher.start()
        dist.all_reduce(torch.ones(4))
        watcher.join()
        print(json.dumps([{"kind": w.kind, "collective": w.collective, "frame": w.frame}
                          for w in seen]))
    dist.destroy_process_group()
""")


def test_a_rank_waiting_in_all_reduce_is_in_a_collective(tmp_path: Path) -> None:
    require(importlib.util.find_spec("torch") is not None, "torch (scripts/install-dev.sh)")
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    port = str(free_port())
    # rank 1 joins only after rank 0 has been seen waiting (or 60 s): no race on speed
    late = subprocess.Popen([sys.executable, str(script), "1", port, "3"], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    waiting = subprocess.run([sys.executable, str(script), "0", port], env=cli_env(),
                             capture_output=True, text=True, timeout=120, check=False)
    late.communicate(timeout=120)
    assert waiting.returncode == 0, waiting.stderr
    seen = json.loads(waiting.stdout.strip().splitlines()[-1])
    assert seen and seen[0]["kind"] == "collective", seen
    assert seen[0]["collective"] == "all_reduce"
    assert seen[0]["frame"]  # the innermost Python frame, inside torch.distributed


def test_backward_data_compute_and_saves_are_told_apart(tmp_path: Path) -> None:
    require(importlib.util.find_spec("torch") is not None, "torch (scripts/install-dev.sh)")
    import torch

    stop = threading.Event()  # set by the watcher once it has seen what it looks for

    def busy() -> None:  # user compute: no torch frame on the stack
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline:
            sum(range(1000))

    class Slow(torch.utils.data.IterableDataset[torch.Tensor]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.01)
                yield torch.zeros(1)

    def load() -> None:
        for _ in torch.utils.data.DataLoader(Slow(), batch_size=None):
            if stop.is_set():
                return

    model = torch.nn.Linear(512, 512)
    x = torch.randn(256, 512)

    def backward() -> None:
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline:
            model(x).pow(2).sum().backward()

    class SlowFile(io.RawIOBase):  # a file on a slow filesystem, written by torch.save
        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            time.sleep(0.01)
            return len(memoryview(data).cast("B"))

    def save() -> None:
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline:
            torch.save(model.state_dict(), SlowFile())

    def save_safetensors() -> None:
        from safetensors.torch import save_file

        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline:
            save_file({"weight": x}, str(tmp_path / "model.safetensors"))

    for work, kind, frame in ((busy, "compute", "in busy"), (load, "data", "in __iter__"),
                              (backward, "backward", "_engine_run_backward"),
                              (save, "checkpoint", "in write"),
                              (save_safetensors, "checkpoint", "in save_file")):
        stop.clear()
        where = _sample_until(work, frame, stop)
        assert where.kind == kind, where


def test_waiting_for_a_child_process_is_subprocess() -> None:
    """An upload the script runs as a child process (``aws s3 cp``), waited for with
    ``subprocess``, is ``subprocess``, named by the script's line first."""
    import subprocess
    import sys

    stop = threading.Event()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def wait_for_the_child() -> None:
        while not stop.is_set():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=0.05)

    try:
        where = _sample_until(wait_for_the_child, "subprocess.py:", stop)
    finally:
        child.kill()
        child.wait(10)
    assert where.kind == "subprocess", where
    assert where.frame.startswith("test_training_activity.py:"), where


def test_a_compile_is_compile_and_a_compiled_call_is_not() -> None:
    """torch.compile compiling (a backend as slow as inductor on a large graph, called by
    dynamo's convert_frame) is ``compile``; the compiled code running, through dynamo's
    eval_frame and the backend's callable, is what that code does (here ``compute``)."""
    require(importlib.util.find_spec("torch") is not None, "torch (scripts/install-dev.sh)")
    import torch

    stop = threading.Event()
    blocking = [True]

    def wait_for_the_watcher() -> None:
        deadline = time.monotonic() + 30
        while blocking[0] and not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)

    def slow_backend(gm: Any, example_inputs: Any) -> Any:
        wait_for_the_watcher()
        return gm.forward

    def blocking_backend(gm: Any, example_inputs: Any) -> Any:
        def run_compiled(*args: Any) -> Any:
            wait_for_the_watcher()
            return gm.forward(*args)
        return run_compiled

    model = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    try:
        where = _sample_until(lambda: torch.compile(model, backend=slow_backend)(x),
                              "in wait_for_the_watcher", stop)
        assert where.kind == "compile", where
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=blocking_backend)
        blocking[0] = False
        compiled(x)  # compiled, and run once
        blocking[0] = True
        stop.clear()
        where = _sample_until(lambda: compiled(x), "in wait_for_the_watcher", stop)
        assert where.kind == "compute", where
    finally:
        torch._dynamo.reset()


def _sample_until(work: Callable[[], None], frame: str, stop: threading.Event) -> Activity:
    """Run ``work`` on the main thread until another thread samples it in ``frame``."""
    main = threading.main_thread().ident
    found: list[Activity] = []

    def watch() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not found:
            where = sample(main)
            if where is not None and frame in where.frame:
                found.append(where)
            time.sleep(0.005)
        stop.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    work()
    watcher.join(35)
    assert found, f"{frame} never seen"
    return found[0]


def test_an_upload_is_network_unless_torch_is_further_out(tmp_path: Path) -> None:
    """The script's own transfer (an HTTP PUT, as boto3 and the Hub's client make) is
    ``network``; the same socket written from inside torch.save (a file object of an
    object store's, as s3fs gives) is still ``checkpoint``, and from a DataLoader's
    dataset still ``data``."""
    require(importlib.util.find_spec("torch") is not None, "torch (scripts/install-dev.sh)")
    import http.client
    import socket

    import torch

    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts, never reads
        port = server.getsockname()[1]

        def upload() -> None:
            # An 8 MiB PUT fills the socket's buffers and times out in http.client's
            # send, again and again, until the watcher has seen it there.
            deadline = time.monotonic() + 30
            while not stop.is_set() and time.monotonic() < deadline:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=0.05)
                try:
                    connection.request("PUT", "/ckpt", body=bytes(8 << 20))
                except OSError:
                    pass
                finally:
                    connection.close()

        class StoreFile(io.RawIOBase):  # an object store's file: torch.save writes to it
            def writable(self) -> bool:
                return True

            def write(self, data: Any) -> int:
                upload()
                return len(memoryview(data).cast("B"))

        def save() -> None:
            torch.save(torch.zeros(16), StoreFile())

        class Remote(torch.utils.data.IterableDataset[torch.Tensor]):
            def __iter__(self):  # type: ignore[no-untyped-def]
                upload()
                yield torch.zeros(1)

        def load() -> None:
            for _ in torch.utils.data.DataLoader(Remote(), batch_size=None):
                return

        for work, kind in ((upload, "network"), (save, "checkpoint"), (load, "data")):
            stop.clear()
            where = _sample_until(work, "client.py:", stop)
            assert where.kind == kind, where
            # the script's own line first, then the library's it waits in
            assert where.frame.startswith("test_training_activity.py:"), where
            assert "(client.py:" in where.frame, where


def test_a_thread_that_is_not_running_python_has_no_activity() -> None:
    assert sample(None) is None
    assert sample(-1) is None  # no such thread


def test_a_phase_change_is_sampled_where_the_script_entered_it(tmp_path: Path) -> None:
    """A phase change publishes from the training thread, from inside the monitor and
    contextlib (`with monitor.checkpoint():`); the frame written is the script's line,
    not contextlib's __enter__, which a save frozen right after paged as where it was."""
    from colossalai_exporter import TrainingMonitor
    from colossalai_exporter.rankstate.files import read_snapshot, snapshot_path

    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, publish_interval=30.0,
                              record_signals=False)
    try:
        with monitor.step():
            pass
        with monitor.checkpoint(1):  # written at once, by this thread
            where = read_snapshot(snapshot_path(tmp_path, 0)).activity
    finally:
        monitor.close()
    assert where is not None, where
    assert where.frame.startswith("test_training_activity.py:"), where
    assert where.frame.endswith(" in test_a_phase_change_is_sampled_where_the_script_entered_it")


def _gated_loader_test(tmp_path: Path, before: int, expected: bool, epochs: int = 1,
                       **loader: Any) -> None:
    """A data loader whose source waits, before its batch ``before`` of the last epoch,
    for a gate file (seen by a forked worker as by the thread): what
    ``data_loader_starting`` says of the thread that waits for that batch."""
    require(importlib.util.find_spec("torch") is not None, "torch (scripts/install-dev.sh)")
    import torch

    from colossalai_exporter.training.activity import data_loader_starting
    from conftest import wait_until

    tmp_path.mkdir(exist_ok=True)
    gate, armed = tmp_path / "gate", tmp_path / "armed"

    class Gated(torch.utils.data.IterableDataset[torch.Tensor]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            for k in range(4):
                if k == before and armed.exists():
                    deadline = time.monotonic() + 30
                    while not gate.exists() and time.monotonic() < deadline:
                        time.sleep(0.01)
                yield torch.zeros(1)

    data = torch.utils.data.DataLoader(Gated(), batch_size=None, **loader)
    got: list[int] = []

    def train() -> None:
        for epoch in range(epochs):
            if epoch == epochs - 1:
                armed.touch()
            for _ in data:
                got.append(epoch)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        # The thread waits in the data loader for the gated batch (its earlier batches in,
        # for the later-batch cases): each check made only once it is seen there.
        def waiting_for_the_gated_batch() -> bool:
            where = sample(thread.ident)
            return (got.count(epochs - 1) == before and where is not None
                    and where.kind == "data")

        wait_until(waiting_for_the_gated_batch, 30, what="the wait for the gated batch")
        assert data_loader_starting(thread.ident) is expected
        assert data_loader_starting(thread.ident) is expected  # reading it changes nothing
    finally:
        gate.touch()
        thread.join(30)
    assert got.count(epochs - 1) == 4, got  # every batch given, the read none the worse


def test_a_fresh_iterators_first_batch_is_a_data_loader_start(tmp_path: Path) -> None:
    _gated_loader_test(tmp_path, before=0, expected=True)


def test_a_later_batch_is_not(tmp_path: Path) -> None:
    _gated_loader_test(tmp_path, before=2, expected=False)


def test_a_workers_first_batch_is_a_start_and_its_later_ones_are_not(tmp_path: Path) -> None:
    _gated_loader_test(tmp_path / "first", before=0, expected=True, num_workers=1)
    _gated_loader_test(tmp_path / "later", before=2, expected=False, num_workers=1)


def test_persistent_workers_starting_the_next_epoch_are_a_start(tmp_path: Path) -> None:
    _gated_loader_test(tmp_path, before=0, expected=True, epochs=2, num_workers=1,
                       persistent_workers=True)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_sampler_drawing_its_permutation_is_a_start(workers: int) -> None:
    """A map-style loader whose sampler takes its time before the first index (the
    permutation of a very large dataset), with and without workers: the thread is in
    the iterator's ``_reset`` or its first ``__next__``."""
    require(importlib.util.find_spec("torch") is not None, "torch (scripts/install-dev.sh)")
    import torch

    from colossalai_exporter.training.activity import data_loader_starting
    from conftest import wait_until

    release = threading.Event()

    class Slow(torch.utils.data.Sampler[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            release.wait(30)
            yield from range(4)

        def __len__(self) -> int:
            return 4

    data = torch.utils.data.DataLoader(list(range(4)), sampler=Slow(), batch_size=2,
                                       num_workers=workers)
    thread = threading.Thread(target=lambda: list(data))
    thread.start()
    try:
        wait_until(lambda: (sample(thread.ident) or Activity(kind="")).kind == "data", 30,
                   what="the thread in the data loader")
        assert data_loader_starting(thread.ident)
    finally:
        release.set()
        thread.join(30)


def test_no_thread_or_no_data_loader_is_no_start() -> None:
    from colossalai_exporter.training.activity import data_loader_starting

    assert not data_loader_starting(None)
    assert not data_loader_starting(threading.get_ident())  # here: no data loader
