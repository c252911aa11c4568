"""Shared test helpers: prerequisites, free ports, waiting with deadlines, CLI runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOT = REPO / "exporter"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


#: On a test that pytest-xdist was asked to keep in a group and did not (see below).
UNGROUPED = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which tags the grouped tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` (scripts/test.sh), a test marked ``xdist_group`` must
    carry its group in its node id, which is how pytest-xdist keeps the group on one
    worker. Where it does not, the group's expensive fixture (the alert path's stack)
    would run once a worker, silently; such a test fails instead, before its fixtures
    run, saying why (pytest 9.2 is such a pytest: pytest-dev/pytest-xdist#1386)."""
    if not config.getoption("loadgroup", default=False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.stash[UNGROUPED] = (
                f"--dist loadgroup does not group on pytest {pytest.__version__} "
                "(pytest-dev/pytest-xdist#1386): pin pytest lower, or run with -n 0")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if UNGROUPED in item.stash:
        pytest.fail(item.stash[UNGROUPED], pytrace=False)


def require(condition: bool, what: str) -> None:
    """Skip when a prerequisite is missing, except under CI=true, where it fails."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"prerequisite missing under CI=true: {what}")
    pytest.skip(f"prerequisite missing: {what}")


def require_binary(name: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"binary {name!r} on PATH (Debian packages, scripts/install-dev.sh)")
    assert path is not None
    return path


PROMETHEUS3_BIN = REPO / ".tools" / "prometheus3" / "usr" / "bin"


def require_prometheus3(name: str) -> str:
    """A Prometheus 3 / current Alertmanager tool (prometheus, promtool,
    prometheus-alertmanager, amtool): Debian testing's, which scripts/install-dev.sh
    unpacks beside bookworm's 2.42 and 0.25 on PATH."""
    path = PROMETHEUS3_BIN / name
    require(path.is_file() and os.access(path, os.X_OK),
            f"{path} (Prometheus 3 from Debian testing, scripts/install-dev.sh)")
    return str(path)


#: The Prometheus and Alertmanager a test stack runs: Debian bookworm's (2.42, 0.25, on
#: PATH) or Debian testing's ("current": Prometheus 3, Alertmanager 0.28 and later).
RELEASES = ("bookworm", "current")


def release_binary(release: str, name: str) -> str:
    """``name`` (prometheus, promtool, prometheus-alertmanager, amtool) of ``release``."""
    assert release in RELEASES, release
    return require_binary(name) if release == "bookworm" else require_prometheus3(name)


def stack_binaries(release: str) -> tuple[str, str]:
    """(prometheus, prometheus-alertmanager) of ``release`` (RELEASES)."""
    return release_binary(release, "prometheus"), release_binary(release, "prometheus-alertmanager")


def is_root() -> bool:
    return os.geteuid() == 0


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for running the package from this source tree in a subprocess."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SOURCE_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    env.update(extra)
    return env


def run_cli(*args: str, timeout: float = 30, env: dict[str, str] | None = None,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python -m colossalai_exporter ARGS`` to completion, output captured."""
    return subprocess.run([sys.executable, "-m", "colossalai_exporter", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=env or cli_env(), check=False, **kwargs)


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
               what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy, failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception as exc:
            last_exc = exc
        else:
            if value:
                return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                         + (f" (last error: {last_exc!r})" if last_exc else ""))


def http_get(url: str, timeout: float = 5.0,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET returning (status, headers, body) for any status, errors included."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers.items()), response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers.items()), exc.read()


class ServerProcess:
    """A command of ours run as a real process; ``url`` once it answers."""

    def __init__(self, args: list[str], port: int, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.args = args
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        # Output goes to a file, not a pipe: a chatty server can never block on a full pipe.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "colossalai_exporter", *args],
            stdout=self.log, stderr=subprocess.STDOUT, text=True,
            env=env or cli_env(), cwd=cwd)

    def wait_ready(self, path: str = "/metrics", timeout: float = 15.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.output()}")
            try:
                return http_get(self.url + path, timeout=2)[0] > 0
            except OSError:
                return False

        wait_until(ready, timeout, what=f"{self.url}{path}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        stop_process(self.proc, timeout=15)
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        self.log.close()


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``: a process a test started never outlives it."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_PORTS = random.Random(os.getpid())
# Ports handed out by any test process on this machine, with when: shared by the xdist
# workers and by any other run of the suite beside this one.
_HANDED_OUT = Path(tempfile.gettempdir()) / "colossalai-exporter-tests-ports"
# How long a port handed out stays another process's: from free_port to the server's
# own bind (Prometheus, a torchrun's store after its launcher starts) on a loaded machine.
_HANDED_OUT_FOR = 300.0


def free_port() -> int:
    """A TCP port free on every address now, for a server the test starts next.

    Chosen below the kernel's ephemeral range: a port from bind(("", 0)) is one the
    kernel also hands out as the source port of outgoing connections (every HTTP poll
    of a test, Prometheus' scrapes, another suite on the machine), so between this
    call and the server's own bind it could be taken, and the server fail with
    "Address already in use". Below the range only an explicit bind can take it: one
    of a server another test process started on a port it was handed at the same time
    (a torchrun's store failed so, beside two other suites). So no two test processes
    on the machine are handed one port within minutes of each other (a file of recent
    ports under an exclusive lock).
    """
    import fcntl

    low, _ = _ephemeral_ports()
    with open(_HANDED_OUT, "a+", encoding="ascii") as handed:
        fcntl.flock(handed, fcntl.LOCK_EX)  # released when the file closes
        handed.seek(0)
        now = time.time()
        recent: dict[int, float] = {}
        for line in handed:
            with contextlib.suppress(ValueError):
                port_text, at_text = line.split()
                if now - float(at_text) < _HANDED_OUT_FOR:
                    recent[int(port_text)] = float(at_text)
        port = _unused_port(low, recent)
        recent[port] = now
        handed.seek(0)
        handed.truncate()
        handed.writelines(f"{p} {at}\n" for p, at in recent.items())
    return port


def _unused_port(low: int, recent: dict[int, float]) -> int:
    for _ in range(200):
        port = _PORTS.randrange(10000, max(low, 10001))
        if port in recent:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))  # all addresses: the training monitor binds 0.0.0.0
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # a machine whose low ports are all taken
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server_process() -> Iterator[Callable[..., ServerProcess]]:
    """Start ``colossalai-exporter`` servers; every one is stopped after the test."""
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, path: str = "/metrics",
              port: int | None = None, ready: bool = True) -> ServerProcess:
        port = port or free_port()
        proc = ServerProcess([*args, "--web.listen-address", f"127.0.0.1:{port}"], port, env)
        started.append(proc)
        if ready:
            proc.wait_ready(path)
        return proc

    yield start
    for proc in started:
        proc.close()


@contextlib.asynccontextmanager
async def loop_gaps(interval: float) -> AsyncIterator[list[float]]:
    """Ticks on the running event loop every ``interval`` seconds while the block runs;
    the list it yields collects the time between ticks, so its max is the longest the
    loop was held up."""
    gaps = [0.0]
    done = asyncio.Event()

    async def tick() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(interval)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(tick())
    try:
        yield gaps
    finally:
        done.set()
        await ticking


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port that refuses connections for as long as the block runs.

    Bound but not listening: a connect gets ECONNREFUSED, as from a finished job's
    master, and nothing else can take the port meanwhile. A port from free_port()
    can be taken by the next process that binds an ephemeral port (gloo's ranks
    bind several), after which connects to it succeed.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


@contextlib.contextmanager
def syn_dropping_port() -> Iterator[int]:
    """A loopback port whose accept queue is full, so that it drops new SYNs as a
    firewall that drops packets does: a connect to it hangs until its timeout."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)  # never accepts
        port = int(server.getsockname()[1])
        fillers = []
        try:
            for _ in range(8):  # fill the accept queue until a connect hangs
                sock = socket.socket()
                sock.settimeout(0.2)
                try:
                    sock.connect(("127.0.0.1", port))
                except TimeoutError:
                    sock.close()
                    break
                fillers.append(sock)
            else:
                pytest.fail("the accept queue never filled")
            yield port
        finally:
            for sock in fillers:
                sock.close()


@pytest.fixture
def hung_disk_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Disk checks of a watched path named "hung" block, as a stat on a hung NFS mount
    does, until the event is set (at the latest when the test ends)."""
    from colossalai_exporter.node import disk

    release = threading.Event()
    real = disk.check_path

    def hanging(path: disk.WatchedPath) -> disk.PathStatus:
        if path.name == "hung":
            release.wait(30)
        return real(path)

    monkeypatch.setattr(disk, "check_path", hanging)
    yield release
    release.set()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "1M", *, full: bool = False) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted at ``path`` (root only), filled to the last block
    when ``full``; unmounted afterwards. A real full disk, as FACTS.md says works here."""
    require(is_root(), "root, to mount a small tmpfs as a full disk")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             check=False, capture_output=True, text=True)
    require(mounted.returncode == 0, f"mount -t tmpfs ({mounted.stderr.strip()})")
    try:
        if full:
            fill = subprocess.run(["dd", "if=/dev/zero", f"of={path / 'fill'}", "bs=4k"],
                                  capture_output=True, text=True, check=False)
            assert "No space left on device" in fill.stderr, fill.stderr
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


V1_MEMORY = Path("/sys/fs/cgroup/memory")


@contextlib.contextmanager
def limited_memory_cgroup(limit_bytes: int) -> Iterator[Path]:
    """A fresh cgroup v1 memory cgroup limited to ``limit_bytes`` (swap included, so that
    the kernel's OOM killer acts instead of swapping), removed afterwards; a process the
    test moved in and that is still alive then goes back to the test's own cgroup. Root,
    cgroup v1's memory controller and a readable /dev/kmsg (FACTS.md: these machines)."""
    require(is_root() and (V1_MEMORY / "memory.oom_control").is_file()
            and os.access("/dev/kmsg", os.R_OK),
            "root, a cgroup v1 memory controller at /sys/fs/cgroup/memory, /dev/kmsg")
    own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text()
               .splitlines() if line.split(":")[1] == "memory")
    cgroup = V1_MEMORY / f"colossalai-faults-{os.getpid()}-{random.randrange(1 << 32):08x}"
    cgroup.mkdir()
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(limit_bytes))
        if (cgroup / "memory.memsw.limit_in_bytes").exists():
            (cgroup / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        yield cgroup
    finally:
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (V1_MEMORY / own.lstrip("/") / "cgroup.procs").write_text(pid)
        wait_until(lambda: not (cgroup / "cgroup.procs").read_text().strip(), timeout=10,
                   what=f"{cgroup} empty")
        cgroup.rmdir()


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run([require_binary("openssl"), *args], cwd=cwd, check=True,
                   capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
                "-out", f"{name}.crt", cwd=d)
    return d
