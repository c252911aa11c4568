"""The bridge benchmark still runs, with both load generators (tiny runs).

bench/ is not part of the package and nothing else runs it, so a change to the
bridge's config or answers could leave bench/bridge_ingest.py broken until
someone needs its numbers. These runs check that it finishes and that its own
checks held (every answer a 200, every notification counted by the bridge and
delivered once the sink is up); the numbers themselves are not judged here.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, require_binary

pytestmark = pytest.mark.slow
BENCH = REPO / "bench" / "bridge_ingest.py"


def run_bench(*args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCH), "--rounds", "1", *args],
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_python_client() -> None:
    out = run_bench("--notifications", "300", "--warmup", "30", "--connections", "4",
                    "--app-route")
    assert re.search(r"round 1: do-nothing \d+/s .* App route \d+/s .* bridge \d+/s .* "
                     r"delivery \d+/s \(6\d\d deliveries\)", out), out


def test_wrk_client_sends_distinct_notifications() -> None:
    require_binary("wrk")
    # One connection keeps the backlog (and the delivery phase) small. Each new
    # notification but the 1 % of Watchdogs queues a webhook for `audit` and,
    # for 6 of the 7 alert names, one for `oncall`: about 1.85 deliveries. The
    # bridge deduplicates webhooks by group key, so if wrk's ids were not unique,
    # the 1,000 templates would give at most about 1,850 deliveries in all, about
    # one per second's worth of notifications; unique ones give 1.85 per
    # notification over the warm-up and the timed second: 3 to 4 times the rate.
    out = run_bench("--client", "wrk", "--duration", "1", "--connections", "1")
    match = re.search(r"round 1: do-nothing \d+/s .* bridge (\d+)/s .* "
                      r"\((\d+) deliveries\) \| wrk CPU/req \d+ us", out)
    assert match, out
    rate, deliveries = int(match[1]), int(match[2])
    assert deliveries > 2.5 * rate, out
