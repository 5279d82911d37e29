#!/usr/bin/env bash
# Issue 32 item 6 on a machine with two GPUs: the distributed tests over NCCL (DDP, FSDP2, the LSE merge, Ulysses
# attention and one tiny-Wan training step under Ulysses) and the timing of one Wan training step on one GPU and
# under Ulysses over two (dev/two_gpu_wan.py). Logs, the table and JSON go to $OUT (default /tmp/attn_qat_two_gpu).
#   bash dev/two_gpu.sh            # ~2 min on 2 H100s once attn_qat/_C is built (the build adds its own time)
# diffusers, which the Wan parts need, is installed from the wheels in .whl/ when the machine lacks it (a wheel is
# skipped when its package is there already, unless older than the wheel for the packages diffusers sets a floor on).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/attn_qat_two_gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export ATTN_QAT_COMMIT="${ATTN_QAT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
start=$SECONDS
elapsed() { echo "[$((SECONDS - start)) s] $*"; }

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], 'GPUs', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"

if compgen -G ".whl/*.whl" >/dev/null; then
    wheels=$(python3 - <<'EOF'
import glob, importlib.metadata as md, os
try:
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.version import Version
FLOORED = {"diffusers", "huggingface_hub", "safetensors"}
for wheel in sorted(glob.glob(".whl/*.whl")):
    name, version = os.path.basename(wheel).split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is None or (name.lower() in FLOORED and Version(have) < Version(version)):
        print(wheel)
EOF
)
    if [ -n "$wheels" ]; then
        elapsed "installing $(echo $wheels | wc -w) wheels into /tmp/site: $(echo $wheels | xargs -n1 basename | tr '\n' ' ')"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
            || { echo "wheel install failed"; exit 1; }
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import diffusers; print('diffusers', diffusers.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"

bash dev/build_cuda.sh . "$OUT/build.log" || exit 1
elapsed "extension ready"

status=0
timeout 120 python3 -m pytest tests/test_distributed.py tests/test_sequence_parallel.py -q -rs -m "" 2>&1 | tee "$OUT/tests.log" | tail -30
status=$((status | PIPESTATUS[0]))
elapsed "tests done (status $status)"

timeout 100 python3 dev/two_gpu_wan.py --out "$OUT/two_gpu_wan.json" 2>&1 | grep -v "UserWarning\|return torch.rms_norm" | tee "$OUT/two_gpu_wan.log"
status=$((status | PIPESTATUS[0]))
elapsed "timing done (status $status)"
exit $status
