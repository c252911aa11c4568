"""The goodput rules over a full day of history (issue 19), not the few minutes a live
simulation holds.

    .venv/bin/python bench/goodput_history.py --ranks 512

Writes 24 h of what the node agents serve the goodput rules (productive and
checkpointed seconds, start time, rank_up, phase, info; one sample every 15 s,
a checkpoint every 30 minutes, one crash and restart at 12 h) for N ranks as
OpenMetrics, backfills it with ``promtool tsdb create-blocks-from openmetrics``,
starts a real Prometheus on those blocks with the shipped goodput groups
(read from rules/, evaluated every 20 s here instead of every 1 and 5 minutes)
and reports what one evaluation of each group and rule costs, from Prometheus'
own /api/v1/rules.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "exporter")]

from prometheus_helpers import launch_prometheus  # noqa: E402

STEP = 15  # seconds between samples, the shipped scrape interval
DAY = 86400
CHECKPOINT_EVERY = 1800
RESTART_AT = DAY // 2


def write_history(out: IO[str], ranks: int, end: int) -> int:
    """Every series of ``ranks`` ranks over the day ending at ``end``; samples written."""
    start = end - DAY
    times = range(start, end + 1, STEP)
    written = 0

    def series(name: str, kind: str, labels: str, value: object) -> None:
        nonlocal written
        out.write(f"# TYPE {name} {kind}\n")
        suffix = "_total" if kind == "counter" else ""
        for rank in range(ranks):
            node = rank // 8
            common = f'job="colossalai-node",instance="node-{node:04d}:9466",rank="{rank}"'
            for t in times:
                run, v = value(rank, t)  # type: ignore[operator]
                run_label = f',run="{run}"' if "run" in labels else ""
                out.write(f"{name}{suffix}{{{common}{run_label}}} {v} {t}\n")
                written += 1

    def run_of(t: int) -> str:
        return "job-1" if t < start + RESTART_AT else "job-1-restart"

    def started(t: int) -> int:
        return start if t < start + RESTART_AT else start + RESTART_AT

    def productive(rank: int, t: int) -> tuple[str, float]:
        return run_of(t), float(t - started(t)) * 0.95  # 95 % of the time in steps

    def checkpointed(rank: int, t: int) -> tuple[str, float]:
        since = t - started(t)
        return run_of(t), float(since - since % CHECKPOINT_EVERY) * 0.95

    series("colossalai_training_productive_seconds", "counter", "run", productive)
    series("colossalai_training_checkpointed_seconds", "counter", "run", checkpointed)
    series("colossalai_training_start_timestamp_seconds", "gauge", "run",
           lambda rank, t: (run_of(t), started(t)))
    series("colossalai_rank_up", "gauge", "", lambda rank, t: ("", 1))
    out.write("# TYPE colossalai_training_phase gauge\n")
    for rank in range(ranks):
        common = f'job="colossalai-node",instance="node-{rank // 8:04d}:9466",rank="{rank}"'
        for t in times:
            out.write(f'colossalai_training_phase{{{common},phase="training"}} 1 {t}\n')
            written += 1
    out.write("# TYPE colossalai_training_info gauge\n")
    for rank in range(ranks):
        common = f'job="colossalai-node",instance="node-{rank // 8:04d}:9466",rank="{rank}"'
        for t in times:
            out.write(f'colossalai_training_info{{{common},run="{run_of(t)}",'
                      f'plugin="GeminiPlugin"}} 1 {t}\n')
            written += 1
    out.write("# EOF\n")
    return written


def goodput_groups(path: Path, interval: str) -> dict[str, object]:
    """The goodput groups of a rules file, evaluated every ``interval`` here: their
    cost per evaluation is what is measured, not how often they run."""
    data = yaml.safe_load(path.read_text())
    groups = [dict(group, interval=interval) for group in data["groups"]
              if "goodput" in group["name"]]
    return {"groups": groups}


def rules_api(url: str) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"{url}/api/v1/rules", timeout=30) as response:
        groups: list[dict[str, object]] = json.load(response)["data"]["groups"]
    return groups


def observe(url: str, evaluations: int, timeout: float) -> dict[str, list[dict[str, float]]]:
    """Each group's evaluations (its own time and each rule's), ``evaluations`` of each."""
    seen: dict[str, dict[str, dict[str, float]]] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for group in rules_api(url):
            name, last = str(group["name"]), str(group["lastEvaluation"])
            if last.startswith("0001") or float(group["evaluationTime"]) == 0:  # type: ignore[arg-type]
                continue
            times = {"group": float(group["evaluationTime"])}  # type: ignore[arg-type]
            for rule in group["rules"]:  # type: ignore[attr-defined]
                times[rule["name"]] = float(rule["evaluationTime"])
            seen.setdefault(name, {})[last] = times
        if seen and all(len(v) >= evaluations for v in seen.values()):
            break
        time.sleep(1)
    return {name: list(by_time.values())[:evaluations] for name, by_time in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rules", type=Path,
                        default=REPO / "rules" / "colossalai-training.rules.yml",
                        help="the training rules file (default: the shipped one)")
    args = parser.parse_args()
    promtool = shutil.which("promtool")
    if promtool is None:
        raise SystemExit("promtool not found (apt-get install prometheus)")
    tmp = Path(tempfile.mkdtemp(prefix="goodput-history-"))
    try:
        end = int(time.time()) - 60
        source = tmp / "history.om"
        began = time.monotonic()
        with source.open("w") as out:
            samples = write_history(out, args.ranks, end)
        print(f"{args.ranks} ranks, 24 h at {STEP} s: {samples:,} samples, "
              f"{source.stat().st_size / 2**20:.0f} MiB of OpenMetrics "
              f"({time.monotonic() - began:.0f} s to write)", flush=True)
        began = time.monotonic()
        data = tmp / "data"
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(source),
                        str(data)], check=True, capture_output=True, timeout=3600)
        source.unlink()
        print(f"backfilled in {time.monotonic() - began:.0f} s", flush=True)
        rules = tmp / "goodput.rules.yml"
        rules.write_text(yaml.safe_dump(goodput_groups(args.rules, "20s"), sort_keys=False))
        config = tmp / "prometheus.yml"
        config.write_text("global: {scrape_interval: 15s, evaluation_interval: 15s}\n"
                          f"rule_files: [{rules}]\n")
        with launch_prometheus(config, data, tmp / "prometheus.log", None,
                               "--storage.tsdb.retention.time=30d") as prometheus:
            groups = observe(prometheus.url, args.repeat, timeout=600)
        print(f"\n| group, rule | one evaluation, median of {args.repeat} (min, max) |\n"
              "|---|---|")
        for name, evaluations in sorted(groups.items()):
            for key in evaluations[0]:
                values = [e[key] * 1e3 for e in evaluations]
                what = f"**{name}**" if key == "group" else f"`{key}`"
                print(f"| {what} | {statistics.median(values):.0f} ms ({min(values):.0f}, "
                      f"{max(values):.0f}) |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
