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
python -m pytest "$@"
