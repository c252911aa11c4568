#!/usr/bin/env bash
# Installs everything the test suite needs into .venv (and, as root, the Debian
# packages of the real Prometheus tools the tests start). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_PACKAGES=(prometheus prometheus-alertmanager prometheus-node-exporter
                 prometheus-blackbox-exporter wrk victoria-metrics)
missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "install-dev: missing Debian packages ${missing[*]} (run as root to install them)" >&2
  fi
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip -q --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip >/dev/null
"${PIP[@]}" install -e ".[dev,chat]"

# The training side is tested against real ColossalAI on the CPU (see docs/training.md).
# torch==2.13.0 is the CPU wheel this project's CI machines carry; colossalai pins an
# older torch, so it is installed without its dependency tree and its import-time
# needs are listed here instead.
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install --no-deps "colossalai==0.5.0" galore_torch bitsandbytes
"${PIP[@]}" install numpy tqdm packaging rich click contexttimer safetensors einops pydantic \
  "peft==0.13.2" "transformers==4.51.3"
