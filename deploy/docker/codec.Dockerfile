# syntax=docker/dockerfile:1.7
# kvrelay codec: the HTTP (OpenAI/Anthropic) and public gRPC front door. No torch.
#
#   docker build -f deploy/docker/codec.Dockerfile -t kvrelay-codec:0.1.0 \
#     --build-arg VERSION=0.1.0 --build-arg MODEL_FINGERPRINT=<hex> .
#
# The build context is the repository root. No model is baked in: the codec reads the tokenizer and
# chat template from the model directory mounted at run time (--model), checked against its manifest.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir pip==26.3 setuptools==84.2.1
WORKDIR /src
COPY pyproject.toml README.md deploy/docker/constraints.txt ./
# All of services/ but the benchmarks: codec.Dockerfile.dockerignore leaves services/bench out.
COPY services ./services
# Direct dependencies are pinned in pyproject.toml, the whole closure in constraints.txt
# (scripts/image_constraints.py). The codec extra has no torch.
RUN pip install --no-cache-dir --constraint constraints.txt ".[codec]"

FROM ${PYTHON_IMAGE} AS runtime
ARG VERSION=0.1.0
ARG MODEL_FINGERPRINT=unset
LABEL org.opencontainers.image.title="kvrelay-codec" \
      org.opencontainers.image.description="kvrelay codec: HTTP and public gRPC front door (no torch)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.kvrelay.component="codec" \
      dev.kvrelay.model-fingerprint="${MODEL_FINGERPRINT}"
RUN groupadd --system --gid 10001 kvrelay \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/kvrelay --create-home \
      --shell /usr/sbin/nologin kvrelay
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/kvrelay-healthcheck deploy/docker/kvrelay-verify-model /usr/local/bin/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVRELAY_IMAGE_VERSION=${VERSION} \
    KVRELAY_IMAGE_MODEL_FINGERPRINT=${MODEL_FINGERPRINT}
WORKDIR /home/kvrelay
USER 10001:10001
EXPOSE 8000 50052
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["kvrelay-healthcheck", "http", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["kvrelay"]
# On 0.0.0.0 the codec needs API keys (KVRELAY_AUTH__KEYS_FILE), or KVRELAY_AUTH__ALLOW_OPEN=true to serve
# anyone: it refuses open mode off loopback (docs/admission.md).
CMD ["codec", "--router", "router:50051", "--model", "/models/current", "--host", "0.0.0.0", "--port", "8000"]
