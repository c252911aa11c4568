# syntax=docker/dockerfile:1
# colossalai-exporter: one image for the node agent, the prober and the bridge
# (`docker run IMAGE node|probe|bridge …`), plus a `demo` target with torch and
# ColossalAI for the compose stack's CPU training run.
#
#   docker build -t colossalai-exporter .                 # runtime (no torch)
#   docker build -t colossalai-exporter:demo --target demo .
#
# Stages: `build` makes wheels of the package and its dependencies; `runtime`
# installs only those wheels into a clean slim image (no compiler, no pip
# cache, no source tree); `demo` adds the training side on top of `runtime`.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
# Only what the wheel is built from (see .dockerignore), so that editing tests
# or docs does not invalidate this layer.
COPY pyproject.toml README.md ./
COPY exporter ./exporter
RUN python -m pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim AS runtime
# No .pyc writes (the root filesystem is read-only in the deploy files) and
# unbuffered logs (they go straight to the container runtime).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# A fixed uid/gid, so that hostPath mounts, PVCs (fsGroup) and file
# permissions can name it; no login shell, no home directory.
RUN groupadd --system --gid 10001 colossalai \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin colossalai \
 && install -d -o 10001 -g 10001 /var/lib/colossalai-exporter/bridge /checkpoints \
      /run/colossalai-exporter
# ^ mount points owned by that user: Docker gives a new named volume the owner of
# the image directory it is mounted on, so the bridge's outbox, the demo's
# checkpoints and the ranks' run directory are writable without running as root.
# The wheels come through a bind mount, so they never become a layer of this image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir --no-index --find-links=/wheels colossalai-exporter
USER 10001:10001
# node agent, rank-0 server (TrainingMonitor), prober, bridge
EXPOSE 9466 8766 9467 9468
ENTRYPOINT ["colossalai-exporter"]
CMD ["--help"]

# The compose stack's demo training run: torch (CPU) and ColossalAI, installed
# as scripts/install-dev.sh does (colossalai pins an older torch, so it comes
# without its dependency tree and its import-time needs are listed here).
FROM runtime AS demo
ARG TORCH_SPEC="torch==2.13.0"
# e.g. --build-arg PIP_INDEX_URL=https://download.pytorch.org/whl/cpu for a small CPU-only torch
ARG PIP_INDEX_URL
USER root
RUN python -m pip install --no-cache-dir ${PIP_INDEX_URL:+--index-url "$PIP_INDEX_URL"} "$TORCH_SPEC" \
 && python -m pip install --no-cache-dir --no-deps "colossalai==0.5.0" galore_torch bitsandbytes \
 && python -m pip install --no-cache-dir numpy tqdm packaging rich click contexttimer \
      safetensors einops pydantic "peft==0.13.2" "transformers==4.51.3"
USER 10001:10001
# ColossalAI and torch write caches under $HOME; the deploy files give /tmp a tmpfs.
ENV HOME=/tmp
CMD ["demo"]
