#!/usr/bin/env bash
# The checks to run when a CUDA machine is lent (CI has none): the GPU tests, the GPU benchmarks
# that docs/guides/gpu.md lists, and the suite's single-process tests, each bounded in time, all
# within one ~9-minute command. Logs go to $OUT (the device tool's folder) or /tmp/moeflow-gpu-check.
# Run from the repository root with the machine's own python3 (torch with CUDA): no install needed.
#   bash scripts/gpu-check.sh [steps...]     steps: env tests kernels layer profile calibrate overlap suite
#                                             (default: all but overlap)
# BUDGET_S bounds the whole run (default 560), LAYER_ARGS adds flags to both bench layer runs, SHAPES picks
# the layer step's shapes (default "mixtral qwen"), TEST_FILES the tests step's files. The suite's
# xdist workers run one intra-op thread each (with torch's default of one per core, 12 workers on 16 cores
# oversubscribed the CPU and two CPU-heavy tests hit their 120 s timeout).
set -u
OUT=${OUT:-/tmp/moeflow-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MOEFLOW_CACHE=/tmp/moeflow-cache
PY=${PY:-python3}
DEADLINE=$((SECONDS + ${BUDGET_S:-560}))

step() {  # step NAME LIMIT_S COMMAND...: run bounded by LIMIT_S and the deadline, log to $OUT/NAME.log
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    local left=$((DEADLINE - SECONDS - 5))
    ((left < limit)) && limit=$left
    if ((limit < 10)); then echo "== $name skipped: out of time"; return; fi
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name rc=$? $((SECONDS - t0))s (limit ${limit}s)"
    grep -E "${PATTERN:-\"summary\"|passed|failed|error|Error}" "$OUT/$name.log" | tail -n "${TAIL:-12}"
}

bench() { step "$1" "$2" "$PY" -m moeflow bench "${@:3}"; }

run_step() {
    case $1 in
    env) { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
           "$PY" -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__,
                     torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'
         } 2>&1 | tee "$OUT/env.log" ;;
    tests) local files=() f
           for f in ${TEST_FILES:-tests/test_gpu.py tests/test_gpu_kernels.py tests/test_gpu_calibrate.py \
                    tests/test_triton_kernels.py tests/test_streams.py tests/test_pipeline.py}; do
               [[ -f $f ]] && files+=("$f"); done
           step tests 180 "$PY" -m pytest -q -p no:cacheprovider "${files[@]}" \
               -k "cuda or triton or gpu or nccl or grouped or encode or packed or auto or calibrate" ;;
    kernels) bench kernels 80 kernels --device cuda --dtype bf16 ;;
    layer) local shape
           for kernel in ${EXPERT_KERNELS:-ragged bmm}; do for shape in ${SHAPES:-mixtral qwen}; do
               case $shape in
               mixtral) bench "layer-mixtral-$kernel" 90 layer --device cuda --dtype bf16 --activation swiglu \
                            --num-experts 8 --model-dim 4096 --hidden-dim 14336 --tokens 8192 --top-k 2 \
                            --expert-kernel "$kernel" ${LAYER_ARGS:-} ;;
               qwen) bench "layer-qwen-$kernel" 75 layer --device cuda --dtype bf16 --activation swiglu --num-experts 64 \
                         --model-dim 2048 --hidden-dim 1408 --tokens 8192 --top-k 8 --expert-kernel "$kernel" \
                         ${LAYER_ARGS:-} ;;
               esac
           done; done ;;
    profile) PATTERN=. TAIL=70 step profile 60 "$PY" scripts/gpu_profile_layer.py ;;
    calibrate) step calibrate 90 bash -c "$PY -m moeflow calibrate --device cuda --out $OUT/profile-cuda.json \
                   && $PY -m moeflow plan --profile $OUT/profile-cuda.json ${PLAN_ARGS:-}" ;;
    overlap) bench overlap 60 overlap --device cuda --degrees 1 2 4 8 ;;
    suite) OMP_NUM_THREADS=1 step suite 600 "$PY" -m pytest -q -p no:cacheprovider -n "${JOBS:-12}" -m "not distributed" \
               --timeout 120 ;;
    *) echo "unknown step $1 (env tests kernels layer overlap suite)"; return 2 ;;
    esac
}

steps=("$@")
((${#steps[@]})) || steps=(env tests kernels layer profile calibrate suite)
for name in "${steps[@]}"; do run_step "$name"; done
