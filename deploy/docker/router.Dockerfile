# syntax=docker/dockerfile:1.7
# kvrelay router: the internal gRPC router over the prefill and decode pools. No torch.
#
#   docker build -f deploy/docker/router.Dockerfile -t kvrelay-router:0.1.0 --build-arg VERSION=0.1.0 .
#
# The `kvrelay` command imports every subcommand's module when it builds its parser, and the codec's
# pulls in uvicorn, so the router image installs the codec extra too (still torch-free).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir pip==26.3 setuptools==84.2.1
WORKDIR /src
COPY pyproject.toml README.md deploy/docker/constraints.txt ./
# All of services/ but the benchmarks: router.Dockerfile.dockerignore leaves services/bench out.
COPY services ./services
RUN pip install --no-cache-dir --constraint constraints.txt ".[router,codec]"

FROM ${PYTHON_IMAGE} AS runtime
ARG VERSION=0.1.0
ARG MODEL_FINGERPRINT=unset
LABEL org.opencontainers.image.title="kvrelay-router" \
      org.opencontainers.image.description="kvrelay router: cost-based routing over prefill and decode pools (no torch)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.kvrelay.component="router" \
      dev.kvrelay.model-fingerprint="${MODEL_FINGERPRINT}"
RUN groupadd --system --gid 10001 kvrelay \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/kvrelay --create-home \
      --shell /usr/sbin/nologin kvrelay
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/kvrelay-healthcheck /usr/local/bin/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVRELAY_IMAGE_VERSION=${VERSION} \
    KVRELAY_IMAGE_MODEL_FINGERPRINT=${MODEL_FINGERPRINT}
WORKDIR /home/kvrelay
USER 10001:10001
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["kvrelay-healthcheck", "grpc", "127.0.0.1:50051"]
ENTRYPOINT ["kvrelay"]
CMD ["router", "--host", "0.0.0.0", "--port", "50051", "--discovery", "static", "--workers", "decode:50051"]
