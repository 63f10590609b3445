#!/usr/bin/env bash
# Everything a machine with a GPU can check, in one call (issue 18):
#   bash tests/gpu/check_gpu.sh [OUT_DIR]
# 1. the machine (nvidia-smi) and the gpu target's preflight (backends, pinned versions, GPUs vs
#    the layout, memory per GPU, plan, max_model_len, /dev/shm), each failure with its fix;
# 2. tests/gpu: the CUDA embedding store across processes, vit_encoder's and the tiny audio
#    checkpoint's audio_encoder's TensorRT plans in FP32 and FP16 against ONNX Runtime, and
#    prefill -> decode over vLLM's NixlConnector (the gpu target's KV connector) against a
#    colocated engine (each skipped with its reason where TensorRT/torch-CUDA/nixl are missing).
# Output: OUT_DIR (default results/<date>/gpu-check) gets machine.txt, imports.txt (numpy 2 with
# vLLM, DALI and torch in one interpreter), preflight.txt, pytest.txt.
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

# numpy 2 is a known risk of the image (docs/gpu.md): numpy, vLLM, DALI and torch must
# import together in one interpreter, at their pinned versions (a python backend stub cannot be
# run without Triton; the server tests in the image show whether tensors cross it right).
"$PY" - > "$OUT/imports.txt" 2>&1 <<'PYEOF'
import importlib.metadata as md
import numpy, torch, vllm, nvidia.dali as dali
from builders.preflight import DALI_BACKEND_VERSION, PINNED_PACKAGES
print("numpy", numpy.__version__, "torch", torch.__version__, "vllm", vllm.__version__, "dali", dali.__version__)
assert numpy.__version__.startswith("2."), "the image's numpy is expected to be 2.x (vLLM needs opencv>=4.13)"
assert vllm.__version__ == PINNED_PACKAGES["vllm"], vllm.__version__
assert dali.__version__ == DALI_BACKEND_VERSION, f"nvidia.dali {dali.__version__} from {dali.__file__}"
# One tensor from numpy 2 into torch (the path the stage models take for embeddings).
array = numpy.arange(12, dtype=numpy.float32).reshape(3, 4)
assert torch.from_numpy(array).sum().item() == 66.0
print("imports together: ok")
PYEOF
echo "imports exit status $?" >> "$OUT/imports.txt"
cat "$OUT/imports.txt"

"$PY" -m builders.launcher --target gpu --check > "$OUT/preflight.txt" 2>&1
echo "preflight exit status $?" >> "$OUT/preflight.txt"
cat "$OUT/preflight.txt"

timeout 1200 "$PY" -m pytest tests/gpu -v -rs -s -p no:cacheprovider > "$OUT/pytest.txt" 2>&1
status=$?
tail -40 "$OUT/pytest.txt"
echo "gpu check: pytest exit status $status; output in $OUT"
exit $status
