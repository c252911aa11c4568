#!/usr/bin/env bash
# The whole test suite, on a fresh machine or an old one: README's "run the tests".
# Installs what the tests need (scripts/install-dev.sh), then lint, types, the
# generated-files checks and pytest. Any failure fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-dev.sh
export PATH="$PWD/.venv/bin:$PATH"

echo "== ruff"; ruff check exporter tests bench tools
echo "== mypy"; mypy
echo "== generated files are current"
python tools/metrics_docs.py --check
python -m colossalai_exporter rules --check
python -m colossalai_exporter dashboards --check
echo "== pytest"
# Two workers: the suite mostly waits on real processes (Prometheus evaluating, a job
# training, a pager's observation window), so two at once take about half the time on
# the 2-core CI machine. loadgroup keeps the tests that share one expensive fixture
# (an xdist_group mark) on one worker. `-n 0` after it runs everything in one process.
python -m pytest -n 2 --dist loadgroup "$@"
