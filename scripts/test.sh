#!/usr/bin/env bash
# The whole test suite, on a fresh machine or an old one: README's "run the tests".
# Installs what the tests need (scripts/install-dev.sh), then lint, types, the
# generated-files checks and pytest. Any failure fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-dev.sh
export PATH="$PWD/.venv/bin:$PATH"

echo "== ruff"; ruff check exporter tests bench
echo "== mypy"; mypy
echo "== generated files are current"
python -m colossalai_exporter docs --check
python -m colossalai_exporter rules --check
python -m colossalai_exporter dashboards --check
python -m colossalai_exporter.k8s_dashboards --check
echo "== pytest"
python -m pytest "$@"
