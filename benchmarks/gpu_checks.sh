#!/usr/bin/env bash
# The GPU checks in one go, for a machine with one CUDA GPU and little time on it: the tests
# that skip without CUDA (tests/gpu), then the GPU records of benchmarks/ (decode throughput,
# kernel ops, the MoE layer), each under its own time cap and all under one budget, so a slow
# or failing step costs only its own share. Logs and JSON records go to OUTDIR.
#
#     benchmarks/gpu_checks.sh OUTDIR [BUDGET_SECONDS]     (PYTHON: the interpreter, python3)
#
# Exit status: 2 without CUDA; else the number of steps that failed or ran out of time.
set -u
out=${1:?usage: benchmarks/gpu_checks.sh OUTDIR [BUDGET_SECONDS]}
budget=${2:-480}
py=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
mkdir -p "$out"
start=$(date +%s)
failed=0

if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: benchmarks/gpu_checks.sh: expected a CUDA GPU, torch sees none" >&2
    exit 2
fi
"$py" - <<'EOF' | tee "$out/env.txt"
import torch, triton, transformers, deepspeed
print("gpu:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| cuda",
      torch.version.cuda, "| triton", triton.__version__, "| transformers",
      transformers.__version__, "| deepspeed", deepspeed.__version__)
EOF

# step NAME CAP_SECONDS CMD...: run CMD with its output in OUTDIR/NAME.log, under
# min(CAP, what is left of the budget); too little left and the step is skipped.
step() {
    local name=$1 cap=$2 left t rc
    shift 2
    left=$((budget - ($(date +%s) - start)))
    t=$((cap < left ? cap : left))
    if [ "$t" -lt 30 ]; then
        echo "== $name: skipped, ${left}s of the budget left"
        failed=$((failed + 1))
        return
    fi
    echo "== $name (at most ${t}s)"
    timeout "$t" "$@" >"$out/$name.log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    echo "== $name: exit $rc after $(($(date +%s) - start))s"
    tail -n 12 "$out/$name.log"
}

step gpu_tests 240 "$py" -m pytest -q -rs -p no:cacheprovider tests/gpu
step decode 210 "$py" benchmarks/decode_throughput.py --device cuda \
    --batches 1,8,32,128,512,2048 --out "$out/decode_throughput_cuda.json"
step kernels 90 "$py" benchmarks/kernels.py --device cuda --out "$out/kernels_cuda.json"
step moe_layer 180 "$py" benchmarks/moe_layer.py --device cuda --out "$out/moe_layer_cuda.json"
exit "$failed"
