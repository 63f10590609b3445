#!/usr/bin/env bash
# Everything a machine with a GPU can check, in one call (issue 18):
#   bash tests/gpu/check_gpu.sh [OUT_DIR]
# 1. the machine (nvidia-smi) and the gpu target's preflight (backends, pinned versions, GPUs vs
#    the layout, memory per GPU, plan, max_model_len, /dev/shm), each failure with its fix;
# 2. tests/gpu: the CUDA embedding store across processes, and vit_encoder's TensorRT plan in
#    FP32 and FP16 against ONNX Runtime (each skipped with its reason where TensorRT/torch-CUDA
#    are missing).
# Output: OUT_DIR (default results/<date>/gpu-check) gets machine.txt, preflight.txt, pytest.txt.
# The exit status is pytest's; a failed preflight is reported, not fatal (a bare machine lacks
# the image's backends but can still run the store and plan tests).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-results/$(date -u +%F)/gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"

{ nvidia-smi || echo "nvidia-smi failed"; "$PY" -c 'import sys; print(sys.version)'
  "$PY" - <<'PYEOF'
for name in ("torch", "tensorrt", "onnxruntime", "nvidia.dali", "vllm"):
    try:
        module = __import__(name, fromlist=["__version__"])
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:  # report every missing piece, keep going
        print(name, "unavailable:", exc)
try:
    import torch
    print("cuda available:", torch.cuda.is_available(), "devices:", torch.cuda.device_count())
except Exception as exc:
    print("torch.cuda:", exc)
PYEOF
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

"$PY" -m builders.launcher --target gpu --check > "$OUT/preflight.txt" 2>&1
echo "preflight exit status $?" >> "$OUT/preflight.txt"
cat "$OUT/preflight.txt"

timeout 1200 "$PY" -m pytest tests/gpu -v -rs -s -p no:cacheprovider > "$OUT/pytest.txt" 2>&1
status=$?
tail -40 "$OUT/pytest.txt"
echo "gpu check: pytest exit status $status; output in $OUT"
exit $status
