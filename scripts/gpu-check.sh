#!/usr/bin/env bash
# The checks that need a real NVIDIA GPU and driver, which CI machines do not
# have: the tests marked `gpu` (real NVML, the agent on real GPUs, a CUDA
# training loop under torch's sync debug mode with its loss read off the device
# without a wait, a real CUDA out-of-memory, a real GeminiPlugin run whose loss
# arrives and whose JIT kernel build shows as phase kernels; ColossalAI and the
# wheels FACTS.md lists, with TORCH_CUDA_ARCH_LIST and MAX_JOBS set; NCCL's status
# of work in flight, as the monitor reads it for the agent's watchdog verdicts) and
# the node-agent benchmark with its gpu collector reading real GPUs. Needs the
# test dependencies, torch with CUDA for the training tests, and
# prometheus-node-exporter and promtool on PATH. Results go to DIR.
#
#   bash scripts/gpu-check.sh [DIR]        (default: gpu-check/)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/exporter${PYTHONPATH:+:$PYTHONPATH}"
rc=0

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia-smi.txt"

echo "== tests marked gpu"
"$py" -m pytest -p no:cacheprovider -m gpu -v \
  tests/test_gpu_real_nvml.py tests/test_training_cuda.py tests/test_training_gemini_gpu.py \
  tests/test_nccl_ras.py tests/test_training_flight_recorder.py \
  2>&1 | tee "$out/pytest.log" || rc=1
grep -q " skipped\| SKIPPED" "$out/pytest.log" && { echo "gpu-check: a gpu test was skipped"; rc=1; }

echo "== one exposition of the agent on this node"
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$py" -m colossalai_exporter node --web.listen-address "127.0.0.1:$port" \
  --no-collector.rendezvous --log.level warn &
agent=$!
"$py" - "$port" "$out/metrics.txt" <<'PY' || rc=1
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/metrics"
deadline = time.monotonic() + 30
while True:
    try:
        body = urllib.request.urlopen(url, timeout=5).read()
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
open(sys.argv[2], "wb").write(body)
PY
kill "$agent"; wait "$agent"
promtool check metrics < "$out/metrics.txt" || rc=1

echo "== node agent vs node_exporter, gpu collector on real GPUs, scraped as Prometheus does"
"$py" bench/node_scrape.py --scrapes 300 --starts 3 2>&1 | tee "$out/node_scrape.txt" || rc=1
echo "== the same without asking for gzip"
"$py" bench/node_scrape.py --scrapes 300 --starts 3 --accept-encoding identity 2>&1 \
  | tee "$out/node_scrape_identity.txt" || rc=1
echo "== the same without the gpu collector"
"$py" bench/node_scrape.py --scrapes 300 --starts 3 -- --no-collector.gpu 2>&1 \
  | tee "$out/node_scrape_no_gpu.txt" || rc=1
exit $rc
