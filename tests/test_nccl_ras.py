"""NCCL's RAS service: its reports (real ones from NCCL 2.28.9, and cases built from their
format), its protocol against loopback servers that speak it (or accept and never
answer), and the node agent's ``nccl`` collector."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from colossalai_exporter.node.base import CollectorError
from colossalai_exporter.node.nccl_ras import (
    NcclRasCollector,
    RasError,
    parse_json,
    parse_text,
    query,
)

FIXTURES = Path(__file__).parent / "fixtures" / "nccl-2.28.9"


def fixture(name: str) -> str:
    # The handshake lines the capture recorded start with "#": not part of the report.
    return "\n".join(line for line in (FIXTURES / name).read_text().splitlines()
                     if not line.startswith("#"))


def rank(index: int, host: str, pid: int, allreduce: int, **status: Any) -> dict[str, Any]:
    return {"rank": index, "host": host, "pid": pid, "cuda_dev": index, "nvml_dev": index,
            "status": {"init_state": 0, "async_error": 0, "finalize_called": False,
                       "destroy_flag": False, "abort_flag": False, **status},
            "collective_counts": {"Broadcast": 0, "Reduce": 0, "AllGather": 0,
                                  "ReduceScatter": 0, "AllReduce": allreduce}}


def report(*communicators: dict[str, Any]) -> str:
    return json.dumps({"nccl_version": "2.28.9", "communicators_count": len(communicators),
                       "communicators": list(communicators),
                       "ras": {"collection_time_sec": 0.0, "timeouts_count": 0}}, indent=2)


def communicator(comm: str, ranks: list[dict[str, Any]], missing: str = "",
                 size: int | None = None) -> dict[str, Any]:
    return {"hash": comm, "size": size or len(ranks), "ranks_count": len(ranks),
            "missing_ranks_count": 0, "ranks": ranks, "missing_ranks": [], "_missing": missing}


def with_missing(text: str, missing: str) -> str:
    """Put a missing-ranks entry in NCCL 2.28.9's own (malformed) layout into ``text``."""
    return text.replace('"missing_ranks": []', f'"missing_ranks": [{missing}]', 1)


# A missing rank as NCCL 2.28.9 prints it: no comma after "nvml_dev".
MISSING_RANK_1 = """
        {
          "rank": 1,
          "host": "10.0.0.2",
          "pid": 4242,
          "cuda_dev": 1,
          "nvml_dev": 1
          "status": {
            "unresponsive": true,
            "considered_dead": false
          }
        }
      """


def test_the_real_reports_parse() -> None:
    real = parse_json(fixture("ras_verbose.json"))
    assert real.version == "2.28.9"
    (comm,) = real.communicators
    assert (comm.comm, comm.size, len(comm.ranks), comm.missing) == (
        "0x9f622d3ce89c6c91", 1, 1, ())
    assert comm.ranks[0].host == "192.0.2.2" and comm.ranks[0].pid == 437
    assert comm.ok
    text = parse_text(fixture("ras_status.txt"))
    assert text.version == "2.28.9" and not text.detailed
    assert [(c.comm, c.size, c.ok) for c in text.communicators] == [("group0", 1, True)]


def test_a_missing_rank_in_nccl_2_28_9s_malformed_json_is_read() -> None:
    body = with_missing(report(communicator("0xa1", [rank(0, "10.0.0.1", 100, 4)], size=2)),
                        MISSING_RANK_1)
    with pytest.raises(json.JSONDecodeError):
        json.loads(body)  # as NCCL prints it
    (comm,) = parse_json(body).communicators
    assert [(r.rank, r.host, r.pid, r.problems) for r in comm.missing] == [
        (1, "10.0.0.2", 4242, ("unresponsive",))]
    assert not comm.ok


def test_the_rank_behind_and_ranks_with_flags_stand_out() -> None:
    body = report(
        communicator("0xa1", [rank(0, "10.0.0.1", 100, 10), rank(1, "10.0.0.1", 101, 9),
                              rank(2, "10.0.0.2", 200, 10), rank(3, "10.0.0.2", 201, 10)]),
        communicator("0xb2", [rank(0, "10.0.0.1", 100, 5, abort_flag=True),
                              rank(1, "10.0.0.2", 200, 5, async_error=3)]),
        communicator("0xc3", [rank(0, "10.0.0.1", 100, 7), rank(1, "10.0.0.2", 200, 7)]))
    a, b, c = parse_json(body).communicators
    assert [r.problems for r in a.ranks] == [(), ("behind",), (), ()]
    assert [r.problems for r in b.ranks] == [("aborted",), ("async_error",)]
    assert c.ok and not a.ok and not b.ok


@pytest.mark.parametrize("text", ["not json at all", '{"communicators": 3}', "{",
                                  '{"communicators": [{"size": 2}]}'])
def test_what_is_not_a_report_is_a_protocol_error(text: str) -> None:
    with pytest.raises(RasError) as caught:
        parse_json(text)
    assert caught.value.reason == "protocol"
    with pytest.raises(RasError):
        parse_text(text)


# ---------------------------------------------------------------------------
# The protocol, against loopback servers
# ---------------------------------------------------------------------------
@contextmanager
def ras_server(answer: Callable[[socket.socket], None]) -> Iterator[int]:
    """A loopback server that runs ``answer`` on each connection; yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        thread.join(5)
        for conn in held:
            conn.close()


def speaks_ras(body: str, json_ok: bool = True) -> Callable[[socket.socket], None]:
    """NCCL's side of the conversation (src/ras/client.cc), then ``body`` and close."""
    def answer(conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            for line in reader:
                text = line.decode().strip()
                if text.startswith("CLIENT PROTOCOL"):
                    conn.sendall(b"SERVER PROTOCOL 2\n")
                elif text.startswith("TIMEOUT"):
                    conn.sendall(b"OK\n")
                elif text == "SET FORMAT JSON":
                    conn.sendall(b"OK\n" if json_ok else b"ERROR: Unknown command\n")
                elif text in ("STATUS", "VERBOSE STATUS"):
                    conn.sendall(body.encode())
                    conn.shutdown(socket.SHUT_WR)
                    return
        except OSError:
            return
    return answer


def never_answers(conn: socket.socket) -> None:
    """Accepts, reads, says nothing: a RAS thread wedged behind a hung peer."""
    try:
        while conn.recv(1024):
            pass
    except OSError:
        pass


def test_the_conversation_in_json_and_in_text() -> None:
    with ras_server(speaks_ras(fixture("ras_verbose.json"))) as port:
        kind, body = query("127.0.0.1", port, timeout=5)
    assert kind == "json" and parse_json(body).version == "2.28.9"
    with ras_server(speaks_ras(fixture("ras_status.txt"), json_ok=False)) as port:
        kind, body = query("127.0.0.1", port, timeout=5)
    assert kind == "text" and parse_text(body).version == "2.28.9"


def test_a_server_that_never_answers_costs_at_most_the_timeout() -> None:
    with ras_server(never_answers) as port:
        start = time.monotonic()
        with pytest.raises(RasError) as caught:
            query("127.0.0.1", port, timeout=0.5)
        assert caught.value.reason == "timeout"
        assert time.monotonic() - start < 5  # the deadline, with a loaded machine's slack


def test_a_server_that_speaks_something_else_is_a_protocol_error() -> None:
    def http(conn: socket.socket) -> None:
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    with ras_server(http) as port, pytest.raises(RasError) as caught:
        query("127.0.0.1", port, timeout=5)
    assert caught.value.reason == "protocol"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------
# The collector
# ---------------------------------------------------------------------------
def samples(families: list[Any]) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in families:
        for sample in fam.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def collector(port: int, **kwargs: Any) -> NcclRasCollector:
    return NcclRasCollector("127.0.0.1", port, timeout=2.0,
                            local_hosts=frozenset({"10.0.0.1"}), **kwargs)


def test_each_node_reports_its_communicators_and_its_own_ranks_problems() -> None:
    body = with_missing(report(
        communicator("0xa1", [rank(0, "10.0.0.1", 100, 10), rank(1, "10.0.0.1", 101, 9),
                              rank(2, "10.0.0.2", 200, 8)], size=4),
        # another node's communicator: that node reports it
        communicator("0xd4", [rank(0, "10.0.0.3", 300, 1), rank(1, "10.0.0.3", 301, 0)])),
        MISSING_RANK_1.replace('"rank": 1', '"rank": 3').replace("4242", "210"))
    with ras_server(speaks_ras(body)) as port:
        ras = collector(port, local_ranks=lambda: {100: 0, 101: 1})
        try:
            got = samples(ras.collect(time.monotonic() + 5))
        finally:
            ras.close()
    assert got["colossalai_nccl_communicator_size"] == [({"comm": "0xa1"}, 4.0)]
    assert got["colossalai_nccl_communicator_missing_ranks"] == [({"comm": "0xa1"}, 1.0)]
    assert got["colossalai_nccl_communicator_ok"] == [({"comm": "0xa1"}, 0.0)]
    # rank 1 (local) is behind; rank 2 is behind too, but on 10.0.0.2: its node says so
    assert got["colossalai_nccl_rank_collectives_behind"] == [
        ({"comm": "0xa1", "comm_rank": "1", "rank": "1"}, 1.0)]
    problems = {(s["comm_rank"], s["rank"], s["problem"], s["rank_host"])
                for s, _ in got["colossalai_nccl_rank_problem_info"]}
    assert problems == {("1", "1", "behind", "10.0.0.1"),
                        ("3", "", "unresponsive", "10.0.0.2")}


def test_a_missing_rank_of_a_run_wide_communicator_is_named_with_its_run() -> None:
    """A node that died with its agent: the survivors' RAS lists its rank as missing.
    In a communicator as large as the run (the default group: comm rank = training
    rank) it is named, with the local ranks' run; in a smaller one it cannot be."""
    body = with_missing(report(
        communicator("0xa1", [rank(0, "10.0.0.1", 100, 10), rank(1, "10.0.0.1", 101, 10),
                              rank(2, "10.0.0.2", 200, 10)], size=4)),
        MISSING_RANK_1.replace('"rank": 1', '"rank": 3').replace("4242", "310")
        .replace("10.0.0.2", "10.0.0.3"))
    sub = with_missing(report(
        communicator("0xb2", [rank(0, "10.0.0.1", 100, 10)], size=2)),
        MISSING_RANK_1.replace("10.0.0.2", "10.0.0.3"))
    for text, comm, expected in ((body, "0xa1", "3"), (sub, "0xb2", "")):
        with ras_server(speaks_ras(text)) as port:
            ras = collector(port, local_ranks=lambda: {100: 0, 101: 1},
                            local_world=lambda: ("job-9", 4))
            try:
                got = samples(ras.collect(time.monotonic() + 5))
            finally:
                ras.close()
        (missing,) = [s for s, _ in got["colossalai_nccl_rank_problem_info"]
                      if s["rank_host"] == "10.0.0.3"]
        assert (missing["comm"], missing["rank"], missing["run"]) == (comm, expected,
                                                                        "job-9"), missing


def test_nothing_listening_is_no_job_here_not_a_failure() -> None:
    ras = collector(free_port())
    try:
        got = samples(ras.collect(time.monotonic() + 5))
    finally:
        ras.close()
    assert got == {}


def test_a_server_that_never_answers_fails_the_collector_with_timeout_once() -> None:
    with ras_server(never_answers) as port:
        ras = collector(port)
        try:
            for _ in range(2):  # the second scrape waits for the same question
                with pytest.raises(CollectorError) as caught:
                    ras.collect(time.monotonic() + 0.5)
                assert caught.value.reason == "timeout"
        finally:
            ras.close()


# ---------------------------------------------------------------------------
# Real NCCL (scripts/gpu-check.sh on a GPU machine)
# ---------------------------------------------------------------------------
NCCL_LOOP = """
import os, sys, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("nccl", rank=0, world_size=1)
x = torch.ones(1024, device="cuda")
print("ready", os.getpid(), flush=True)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    dist.all_reduce(x)
    torch.cuda.synchronize()
    time.sleep(0.01)
"""


@pytest.mark.gpu
def test_real_nccl_ras_is_read_and_names_the_local_rank(tmp_path: Path) -> None:
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    script = tmp_path / "loop.py"
    script.write_text(NCCL_LOOP)
    job = subprocess.Popen([sys.executable, str(script), str(free_port())],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None
        line = job.stdout.readline()
        assert line.startswith("ready"), line
        pid = int(line.split()[1])

        def answered() -> Any:
            try:
                return query(timeout=5)
            except (ConnectionRefusedError, RasError):
                return None

        deadline = time.monotonic() + 60
        while (got := answered()) is None:
            assert time.monotonic() < deadline, "NCCL's RAS never answered on :28028"
            time.sleep(0.5)
        kind, body = got
        assert kind == "json"
        comms = parse_json(body).communicators
        assert any(r.pid == pid for c in comms for r in c.ranks), body[:2000]
        ras = NcclRasCollector(timeout=5, local_ranks=lambda: {pid: 0})
        try:
            families = samples(ras.collect(time.monotonic() + 10))
        finally:
            ras.close()
        assert families["colossalai_nccl_communicator_ok"][0][1] == 1.0, families
    finally:
        job.kill()
        job.wait(30)
