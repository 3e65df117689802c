# syntax=docker/dockerfile:1
# The gateway alone (`sluice serve`): the package without extras, so no torch in this image. A
# replica serves sluice workers (--worker-url) and OpenAI-compatible upstreams (--upstream).
# Built from the repository root (.dockerignore keeps the context to the package's files):
#
#   docker build -f deploy/docker/gateway.Dockerfile -t sluicegate-gateway:0.1.0 .
#
# Every flag of `sluice serve` also reads SLUICE_<FLAG> from the environment, so the image is
# configured by flags after the image name or by environment (`-e SLUICE_REDIS_URL=…`); flags
# win. Keep the port in SLUICE_PORT: the health check reads it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway/ gateway/
COPY workers/ workers/
COPY adapters/ adapters/
COPY policies/ policies/
COPY safety/ safety/
COPY wire/ wire/
COPY common/ common/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install /wheels/sluicegate-*.whl
RUN groupadd --system --gid 10001 sluice \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/sluice \
       --shell /usr/sbin/nologin sluice
USER 10001:10001
WORKDIR /home/sluice
ENV SLUICE_HOST=0.0.0.0 \
    SLUICE_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SLUICE_PORT', '8000') + '/healthz', timeout=2)"]
# Exec form: `sluice` is PID 1 and gets SIGTERM itself, which starts its drain
# (docs/operations/shutdown.md); give it --shutdown-timeout plus a margin before SIGKILL.
ENTRYPOINT ["sluice", "serve"]
