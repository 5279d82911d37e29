#!/usr/bin/env bash
# One call on the GPU machine: use the carried build of attn_qat/_C (or build here if it does not load),
# run the GPU tests and the named benchmarks, and leave logs and JSON under $OUT.
#   bash dev/gpu_session.sh [tests] [quant] [attention] [v_block_axis] [prefill] [decode] [varlen] [main]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/attn_qat_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" | tee -a "$OUT/gpu.txt"
bash dev/build_cuda.sh . "$OUT/build.log" | tee -a "$OUT/gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
status=0
for part in "$@"; do
    case "$part" in
    tests) ATTN_QAT_ERROR_LOG="$OUT/errors.jsonl" python3 -m pytest tests -q -x -rs 2>&1 | tee "$OUT/tests.log" | tail -40; status=$((status | PIPESTATUS[0])) ;;
    tests-all) ATTN_QAT_ERROR_LOG="$OUT/errors.jsonl" python3 -m pytest tests -q -rs -m "" 2>&1 | tee "$OUT/tests.log" | tail -60; status=$((status | PIPESTATUS[0])) ;;
    quant) python3 benchmarks/bench_quant.py --out "$OUT/quant.json" 2>&1 | tee "$OUT/bench_quant.log" ;;
    attention) python3 benchmarks/bench_attention.py --out "$OUT/attention.json" 2>&1 | tee "$OUT/bench_attention.log" ;;
    v_block_axis) python3 benchmarks/bench_v_block_axis.py --out "$OUT/v_block_axis.json" 2>&1 | tee "$OUT/bench_v_block_axis.log" ;;
    prefill) python3 benchmarks/bench_prefill.py --out "$OUT/prefill.json" 2>&1 | tee "$OUT/bench_prefill.log" ;;
    decode) python3 benchmarks/bench_decode.py --out "$OUT/decode.json" 2>&1 | tee "$OUT/bench_decode.log" ;;
    varlen) python3 benchmarks/bench_varlen.py --out "$OUT/varlen.json" 2>&1 | tee "$OUT/bench_varlen.log" ;;
    main) python3 -m attn_qat 2>&1 | tee "$OUT/main.log" ;;
    *) echo "unknown part $part" ;;
    esac
done
exit $status
