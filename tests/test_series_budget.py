"""The series budget at fleet size (issue 19): what each local rank costs the node agent.

A rank of a GeminiPlugin job in full swing (stepping with a loss, a checkpoint
written, samples and tokens counted, Gemini's chunk memory and traffic known)
may cost the agent's exposition at most 25 series: the agent's own four
(up, snapshot age, alive, stopped) and the training series the rules need from
outside the process. Nothing anywhere serves a ``*_created`` series, in either
format. The in-process server keeps every series (its view is per process, not
per node).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import psutil
import pytest
from prometheus_client.core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from colossalai_exporter import TrainingMonitor, catalogue
from colossalai_exporter.node.ranks import RanksCollector
from colossalai_exporter.rankstate.families import INSIDE_ONLY, families
from colossalai_exporter.rankstate.files import prepare_run_dir, write_snapshot
from colossalai_exporter.rankstate.schema import GeminiState, Snapshot
from colossalai_exporter.web.exposition import encode_openmetrics, encode_text

BUDGET_PER_RANK = 25
LOCAL_RANKS = 8


def busy_gemini_rank(run_dir: Path) -> Snapshot:
    """A real monitor's snapshot after steps, a checkpoint and a loss; Gemini's state added
    (the plugin's poller fills it under ColossalAI; the numbers are what matter here)."""
    monitor = TrainingMonitor(serve="none", run_dir=run_dir, publish_interval=0.1)
    try:
        for _ in range(3):
            with monitor.step(samples=4, tokens=4096) as step:
                step.loss = 1.25
        with monitor.checkpoint(step=3):
            pass
        snap = monitor.snapshot()
    finally:
        monitor.close()
    assert snap.loss == 1.25 and snap.checkpoint.last_step == 3 and snap.phase == "training"
    return msgspec.structs.replace(snap, gemini=GeminiState(
        chunk_memory={"cuda": 6e9, "cpu": 2e10}, h2d=1e9, d2h=1e9))


def agent_series_by_rank(run_dir: Path, template: Snapshot) -> Counter[str]:
    me = psutil.Process(os.getpid())
    prepare_run_dir(run_dir)
    for rank in range(LOCAL_RANKS):  # eight live ranks of this node (this process's pid)
        write_snapshot(run_dir, msgspec.structs.replace(
            template, rank=rank, local_rank=rank, pid=me.pid, pid_start=me.create_time(),
            written=time.time()))
    collector = RanksCollector(run_dir)
    try:
        fams = collector.collect(time.monotonic() + 10)
    finally:
        collector.close()
    text = encode_openmetrics(fams).decode()
    per_rank: Counter[str] = Counter()
    for fam in om_parse(text):
        for sample in fam.samples:
            if "rank" in sample.labels:
                per_rank[sample.labels["rank"]] += 1
    return per_rank


def test_each_local_rank_costs_the_agent_at_most_25_series(tmp_path: Path) -> None:
    template = busy_gemini_rank(tmp_path / "monitor")
    per_rank = agent_series_by_rank(tmp_path / "run", template)
    assert sorted(per_rank) == [str(r) for r in range(LOCAL_RANKS)]
    assert max(per_rank.values()) <= BUDGET_PER_RANK, per_rank
    assert min(per_rank.values()) == max(per_rank.values())  # the same cost on every rank


def test_the_outside_view_is_the_in_process_view_less_what_only_dashboards_read(
        tmp_path: Path) -> None:
    snap = busy_gemini_rank(tmp_path)
    inside = {f.name: f for f in families(snap)}
    outside = {f.name: f for f in families(snap, now=time.time(), outside=True)}
    served_inside = {n for n, f in inside.items() if f.samples}
    served_outside = {n for n, f in outside.items() if f.samples}
    family_names = {catalogue.get(n).family_name for n in INSIDE_ONLY}
    assert family_names <= served_inside  # the in-process view serves all of them
    assert not family_names & set(outside)
    # the monitor's own errors: outside, only the places that failed
    assert served_outside == served_inside - family_names - {"colossalai_training_monitor_errors"}
    failing = msgspec.structs.replace(snap, monitor_errors={"heartbeat": 2})
    (errors,) = [f for f in families(failing, now=time.time(), outside=True)
                 if f.name == "colossalai_training_monitor_errors"]
    assert [(s.labels["where"], s.value) for s in errors.samples] == [("heartbeat", 2.0)]


Encoder = Callable[[list[Metric]], bytes]
Parser = Callable[[str], Iterable[Metric]]


@pytest.mark.parametrize(("encode", "parse"), [(encode_text, text_parse),
                                               (encode_openmetrics, om_parse)],
                         ids=["text", "openmetrics"])
def test_no_created_series_in_either_format(tmp_path: Path, encode: Encoder,
                                            parse: Parser) -> None:
    snap = busy_gemini_rank(tmp_path)
    for view in (families(snap), families(snap, now=time.time(), outside=True)):
        body = encode(view).decode()
        assert "_created" not in body
        names = {s.name for f in parse(body) for s in f.samples}
        assert names <= catalogue.known_sample_names(), names - catalogue.known_sample_names()


def test_the_info_serves_each_value_under_its_own_label(tmp_path: Path) -> None:
    """The info's values, set as the monitor sets them, come back under their own names in
    both views: its label list was once kept twice, and a label added to the catalogue
    served every later value under its neighbour's name (the run as world_size)."""
    monitor = TrainingMonitor(serve="none", run_dir=tmp_path, publish_interval=30.0,
                              world_size=4, record_signals=False)
    try:
        monitor.set_info(pipeline_stage=1, plugin="HybridParallelPlugin", pp_size=2)
        snap = monitor.snapshot()
    finally:
        monitor.close()
    for outside in (False, True):
        (info,) = [s for fam in families(snap, outside=outside) if fam.name ==
                   "colossalai_training" for s in fam.samples]
        assert info.labels["run"] == snap.info["run"] != "", info.labels
        assert info.labels["world_size"] == "4", info.labels
        assert info.labels["pipeline_stage"] == "1", info.labels
        assert info.labels["plugin"] == "HybridParallelPlugin", info.labels
        assert set(info.labels) == set(catalogue.get("colossalai_training_info").labels)
