#!/usr/bin/env bash
# Run the HTTP layer's tests (tests/test_web.py) against other uvicorn releases, before
# widening the range pyproject.toml pins: web/server.py extends uvicorn's httptools
# protocol through parts uvicorn does not promise to keep.
#   bash scripts/check-uvicorn.sh 0.30.6 0.56.0
# Needs PyPI; each version goes into a scratch folder put first on PYTHONPATH, so the
# project's virtualenv is left as it is. The canary test is skipped for versions
# outside the pinned range (that is what is being tried), the behaviour tests are not.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
for version in "$@"; do
  scratch=$(mktemp -d)
  .venv/bin/pip install -q --no-deps --target "$scratch" "uvicorn==$version"
  if COLOSSALAI_EXPORTER_TRY_UVICORN=1 PYTHONPATH="$scratch" \
      .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_web.py; then
    echo "uvicorn $version: passed"
  else
    echo "uvicorn $version: FAILED"; status=1
  fi
  rm -rf "$scratch"
done
exit $status
