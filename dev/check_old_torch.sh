#!/usr/bin/env bash
# Builds attn_qat in place against the torch installed here (meant for README's floor, torch 2.10 / 2.11, on a GPU
# machine with nvcc) and checks it there: an op's error (a bad softmax scale) must come back to Python as a
# RuntimeError on every device, not crash the interpreter; then the whole test suite.
# Usage: dev/check_old_torch.sh   (ATTN_QAT_CUDA=0 builds the CPU kernels only; MAX_JOBS defaults to 16)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python -c 'import torch, setuptools; print("torch", torch.__version__, " setuptools", setuptools.__version__)'
ATTN_QAT_CUDA="${ATTN_QAT_CUDA:-1}" MAX_JOBS="${MAX_JOBS:-16}" python setup.py build_ext --inplace

# Its own interpreter, so that a crash shows as an exit status (139: SIGSEGV, 134: SIGABRT) with faulthandler's trace.
python -X faulthandler - <<'EOF' || { echo "FAIL: an op error crashed the interpreter (exit status $?)"; exit 1; }
import torch
import attn_qat
from attn_qat import _C

print(f"attn_qat._C built with CUDA kernels: {bool(_C.with_cuda)}")
for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16, device=dev)
    for op in ("attention_forward", "nvfp4_quantize"):
        try:
            if op == "attention_forward":
                attn_qat.ops.ops.attention_forward(q, q, q, None, -0.5, 0, 0, False, True)
            else:
                attn_qat.ops.ops.nvfp4_quantize(q, 7)  # block axis out of range
        except RuntimeError as e:
            print(f"ok [{dev}] {op}: RuntimeError: {str(e).splitlines()[0][:100]}")
        else:
            raise SystemExit(f"FAIL [{dev}] {op}: no error raised")
EOF

python -m pytest tests -q -x -p no:cacheprovider
