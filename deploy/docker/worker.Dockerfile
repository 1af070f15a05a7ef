# syntax=docker/dockerfile:1.7
# kvrelay worker: the engine behind the internal gRPC API, as a prefill, decode or colocated replica
# (`kvrelay worker --role ...`). Two variants, as build targets:
#
#   docker build -f deploy/docker/worker.Dockerfile --target worker-cpu  -t kvrelay-worker:0.1.0-cpu  .
#   docker build -f deploy/docker/worker.Dockerfile --target worker-cuda -t kvrelay-worker:0.1.0-cuda .
#
# worker-cpu takes torch from PyTorch's CPU wheel index (no CUDA libraries, a much smaller image);
# worker-cuda takes the CUDA 12.8 build, whose wheels bring the CUDA runtime, cuBLAS and NCCL, so a node
# needs only the NVIDIA driver and container toolkit. No weights are baked in: the model directory is
# mounted (or fetched by an init container) and checked against its manifest.json.
#
# The engine's CPU kernels (services/engine/ops/kernels.c) are C built with the system compiler at
# first use; the image carries gcc and builds them once, here, into XDG_CACHE_HOME (every variant: with
# and without AVX-VNNI, since this host need not be the node's CPU), so a pod with a
# read-only root filesystem finds them ready. The apt pins follow the pinned base image (Debian 12).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc=4:12.2.0-3 libc6-dev=2.36-9+deb12u14 \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 kvrelay \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/kvrelay --create-home \
      --shell /usr/sbin/nologin kvrelay
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/opt/kvrelay/cache

FROM base AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv \
 && pip install --no-cache-dir pip==26.3 setuptools==84.2.1
WORKDIR /src
COPY pyproject.toml README.md deploy/docker/constraints.txt ./
# All of services/ but the benchmarks: worker.Dockerfile.dockerignore leaves services/bench out.
COPY services ./services

FROM build AS build-cpu
# torch alone from PyTorch's CPU index (2.13.0 matches 2.13.0+cpu); its dependencies, and everything
# else, come from PyPI at the versions in constraints.txt.
RUN pip install --no-cache-dir --no-deps \
      --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir --constraint constraints.txt ".[worker,codec]"

FROM build AS build-cuda
# The CUDA build of the same torch; its nvidia-* dependencies (CUDA runtime, cuBLAS, NCCL), pinned
# exactly by torch's own metadata, come from PyPI in the second step.
RUN pip install --no-cache-dir --no-deps \
      --index-url https://download.pytorch.org/whl/cu128 torch==2.13.0 \
 && pip install --no-cache-dir --constraint constraints.txt ".[worker,codec]"

FROM base AS worker-cpu
ARG VERSION=0.1.0
ARG MODEL_FINGERPRINT=unset
LABEL org.opencontainers.image.title="kvrelay-worker" \
      org.opencontainers.image.description="kvrelay worker (prefill/decode/colocated), CPU torch" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.kvrelay.component="worker" \
      dev.kvrelay.variant="cpu" \
      dev.kvrelay.model-fingerprint="${MODEL_FINGERPRINT}"
COPY --from=build-cpu /opt/venv /opt/venv
COPY deploy/docker/kvrelay-healthcheck deploy/docker/kvrelay-verify-model /usr/local/bin/
RUN python -c "import shutil; from services.engine.ops import build; \
build.build_every_variant(shutil.which('cc'), build.default_cache_dir())" \
 && chmod -R a+rX /opt/kvrelay
ENV KVRELAY_IMAGE_VERSION=${VERSION} \
    KVRELAY_IMAGE_MODEL_FINGERPRINT=${MODEL_FINGERPRINT}
WORKDIR /home/kvrelay
USER 10001:10001
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD ["kvrelay-healthcheck", "grpc", "127.0.0.1:50051", "--service", "kvrelay.liveness"]
ENTRYPOINT ["kvrelay"]
CMD ["worker", "--role", "colocated", "--model", "/models/current", "--host", "0.0.0.0", "--port", "50051"]

FROM base AS worker-cuda
ARG VERSION=0.1.0
ARG MODEL_FINGERPRINT=unset
LABEL org.opencontainers.image.title="kvrelay-worker" \
      org.opencontainers.image.description="kvrelay worker (prefill/decode/colocated), CUDA 12.8 torch with NCCL" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.kvrelay.component="worker" \
      dev.kvrelay.variant="cuda" \
      dev.kvrelay.model-fingerprint="${MODEL_FINGERPRINT}"
COPY --from=build-cuda /opt/venv /opt/venv
COPY deploy/docker/kvrelay-healthcheck deploy/docker/kvrelay-verify-model /usr/local/bin/
RUN python -c "import shutil; from services.engine.ops import build; \
build.build_every_variant(shutil.which('cc'), build.default_cache_dir())" \
 && chmod -R a+rX /opt/kvrelay
ENV KVRELAY_IMAGE_VERSION=${VERSION} \
    KVRELAY_IMAGE_MODEL_FINGERPRINT=${MODEL_FINGERPRINT} \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /home/kvrelay
USER 10001:10001
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
  CMD ["kvrelay-healthcheck", "grpc", "127.0.0.1:50051", "--service", "kvrelay.liveness"]
ENTRYPOINT ["kvrelay"]
CMD ["worker", "--role", "colocated", "--model", "/models/current", "--host", "0.0.0.0", "--port", "50051"]
