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

# Prometheus 3 and a current Alertmanager beside bookworm's 2.42 and 0.25, for the
# tests that hold the rules, the routing and the NHCB conversion to both: Debian
# testing's packages, unpacked into .tools/prometheus3 (not installed, so that the
# Prometheus on PATH stays bookworm's). Go binaries that need only libc.
is_prometheus3() {  # no pipe into grep -q: under pipefail, an early exit reads as failure
  case "$("$1" --version 2>/dev/null || true)" in *"version 3."*) return 0 ;; esac
  return 1
}
fetch_prometheus3() {
  local dest=.tools/prometheus3 apt_dir suite
  is_prometheus3 "$dest/usr/bin/prometheus" && return 0
  command -v apt-get >/dev/null || { echo "install-dev: no apt-get for Prometheus 3" >&2; return 0; }
  apt_dir=$(mktemp -d)
  for suite in testing unstable; do
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
    echo "deb [trusted=yes] http://deb.debian.org/debian $suite main" > "$apt_dir/sources.list"
    local apt_opts=(-o Dir::Etc::sourcelist="$apt_dir/sources.list" -o Dir::Etc::sourceparts=/dev/null
                    -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache="$apt_dir/cache"
                    -o APT::Sandbox::User=root -qq)
    if apt-get "${apt_opts[@]}" update >/dev/null 2>&1 \
        && (cd "$apt_dir" && apt-get "${apt_opts[@]}" download prometheus promtool \
              prometheus-alertmanager >/dev/null 2>&1); then
      rm -rf "$dest" && mkdir -p "$dest"
      for deb in "$apt_dir"/*.deb; do dpkg-deb -x "$deb" "$dest"; done
      is_prometheus3 "$dest/usr/bin/prometheus" && break
    fi
    rm -f "$apt_dir"/*.deb
  done
  rm -rf "$apt_dir"
  [ -x "$dest/usr/bin/prometheus" ] || echo "install-dev: Prometheus 3 not fetched (Debian testing, unstable)" >&2
}
fetch_prometheus3

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
