#!/usr/bin/env bash
# CUDA checks (issue 14), for a machine with an NVIDIA GPU; about 5 minutes.
#   1. the CUDA cases of the device tests: Triton paged attention and KV copies compiled for
#      real against the torch references, the engine on CUDA (bf16/float32, int8) against the
#      CPU engine, KV moved between CUDA pools through the wire, quantized matmuls on CUDA;
#   2. the engine benchmark on CUDA (tiny model unless MODEL is set): c=1 per-token latency
#      against the device's copy bandwidth bound, c=4/16 throughput.
# Needs a Python with a CUDA build of torch, triton and requirements.txt (PY, default
# .venv/bin/python). Writes $OUT (default bench_out/cuda): pytest log and the bench JSON/PNG.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench_out/cuda}
MODEL=${MODEL:-models/tiny-target}
DTYPE=${DTYPE:-float32}
mkdir -p "$OUT"
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PYEOF
status=0
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -k cuda -rs \
    tests/kernels/test_device_kernels.py tests/engine/test_device.py tests/engine/test_quant.py \
    2>&1 | tee "$OUT/pytest.log" || status=$?
timeout 210 "$PY" scripts/bench_engine.py --model "$MODEL" --dtype "$DTYPE" --device cuda \
    --prompts 4 --max-tokens 32 --quantize ,int8,int4 --batched , --out "$OUT" \
    2>&1 | tee "$OUT/bench.log" || status=$?
exit $status
