# syntax=docker/dockerfile:1.7
#
# coldstart: a slim image for Ray Serve LLM replicas that start in seconds.
#
#   docker build -t coldstart:0.1.0 .
#   docker run --gpus all --shm-size=8g -p 8000:8000 \
#       -v /mnt/nvme/models:/models:ro coldstart:0.1.0     # serves /models/llama-2-7b
#
# Why this shape (the article's "slim image" section, corrected):
# - No CUDA base image and no system CUDA toolkit. The torch wheel from PyPI
#   brings its CUDA runtime, cuBLAS, cuDNN, NCCL as nvidia-* wheels; the only
#   host piece is the driver (libcuda), which the NVIDIA container runtime
#   mounts in. A system toolkit on LD_LIBRARY_PATH would only risk shadowing
#   the wheels' libraries (`coldstart doctor` checks for that).
# - torch is its own layer, before the project, so a code change does not
#   re-download ~3 GB of CUDA libraries.
# - Weights are NOT baked in: they are mounted read-only at /models, synced to
#   local NVMe per node (see cluster.yaml, k8s/rayservice.yaml). A 13.5 GB
#   layer would make every pull and every new node slower than the load it
#   saves. To bake one anyway (an air-gapped site, a tiny model):
#     docker build --build-context models=weights/llama-2-7b \
#                  --build-arg MODEL_NAME=llama-2-7b -t coldstart:llama .
#   (`models` is a stage below; a named build context replaces it.)

# Empty unless --build-context models=DIR replaces it.
FROM scratch AS models

FROM python:3.12-slim AS runtime

ARG TORCH_VERSION=2.11.*
ARG MODEL_NAME=llama-2-7b

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # Load CUDA kernels on first use: context creation 0.3-0.4 s instead of 2.6-3.7 s.
    CUDA_MODULE_LOADING=LAZY \
    # One growing segment per stream instead of fixed blocks: no fragmentation
    # from the single big weights buffer next to many small activations.
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    # The NVIDIA container runtime reads these: which GPUs (Docker --gpus and
    # the Kubernetes device plugin override "all" with the granted ones) and
    # which driver pieces to mount (compute = libcuda, utility = nvidia-smi).
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    # Triton's compiled decode kernels: mount a volume here so a new container
    # reuses them instead of compiling at its first start.
    TRITON_CACHE_DIR=/var/cache/coldstart/triton \
    # Ray Serve's HTTP proxy reads each request's whole body before it routes it
    # to a replica (deployments/server/proxy.py): a client that stalls after its
    # headers holds no replica's slot. Here for every way the image runs Serve
    # (serve run, KubeRay's serveConfigV2, which keeps only the applications).
    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.server.proxy:middlewares

# rsync: the Ray cluster launcher copies its bootstrap files and file_mounts into
# the container with `rsync -e "docker exec"`. gcc + libc6-dev: Triton builds its
# small kernel-launcher stubs with the system C compiler at the first start
# (without them the fused decode kernels turn themselves off and plain torch runs).
# No CUDA packages from apt.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends rsync gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch with its bundled CUDA libraries: pinned, alone in its layer.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"

RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin coldstart \
    && mkdir -p /models /var/cache/coldstart/triton \
    && chown coldstart:coldstart /models /var/cache/coldstart/triton

WORKDIR /app
COPY pyproject.toml README.md ./
COPY weights/ weights/
COPY deployments/ deployments/
# Every module compiled now (pip's own compile skips nothing it installs, but this makes it
# explicit and covers the whole of site-packages): with PYTHONDONTWRITEBYTECODE=1 a container
# never writes .pyc files, so whatever is not compiled here is compiled by every replica's start.
RUN pip install --no-cache-dir . \
    && python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && python -c "import deployments, weights"
# serve_config.gpu.yaml = serve_config.yaml for GPU nodes (python k8s/sync.py):
# one GPU per replica, model at /models/llama-2-7b, proxy on 0.0.0.0
COPY serve_config.yaml serve_config.gpu.yaml serve_config.zero.yaml ./

COPY --from=models --chown=coldstart:coldstart / /models/${MODEL_NAME}/

# numeric, so Kubernetes runAsNonRoot can verify it without /etc/passwd
USER 1000:1000
VOLUME ["/models", "/var/cache/coldstart/triton"]
# 8000: Serve HTTP proxy; 8265: Ray dashboard; 8080: Ray metrics export
EXPOSE 8000 8265 8080

# The Serve proxy answers /-/healthz once it is up. It says nothing about
# whether the replicas are warm: the deployment's check_health gates routing.
# slim has no curl, so Python does the request. Kubernetes ignores HEALTHCHECK
# (KubeRay sets its own probes); Docker shows it in `docker ps` and can act on it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/-/healthz', timeout=4)"]

CMD ["serve", "run", "serve_config.gpu.yaml"]
