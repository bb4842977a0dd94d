#!/usr/bin/env bash
# The checks to run when a CUDA machine is lent (CI has none): the GPU tests, the GPU benchmarks
# that docs/guides/gpu.md lists, and the suite's single-process tests, each bounded in time, all
# within one ~9-minute command. Logs go to $OUT (the device tool's folder) or /tmp/moeflow-gpu-check.
# Run from the repository root with the machine's own python3 (torch with CUDA): no install needed.
#   bash scripts/gpu-check.sh [steps...]     steps: env tests kernels layer static profile calibrate overlap
#                                             suite (default: all but overlap and static)
# BUDGET_S bounds the whole run (default 560), LAYER_ARGS adds flags to both bench layer runs, SHAPES picks
# the layer and static steps' shapes (default "mixtral qwen"), MODES the static step's (default "dynamic static
# graph"), TEST_FILES the tests step's files. The suite's
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

shape_args() {  # the bench layer flags of the issues' two GPU shapes (bf16, SwiGLU)
    local common="--device cuda --dtype bf16 --activation swiglu --tokens 8192"
    case $1 in
    mixtral) echo "$common --num-experts 8 --model-dim 4096 --hidden-dim 14336 --top-k 2" ;;
    qwen) echo "$common --num-experts 64 --model-dim 2048 --hidden-dim 1408 --top-k 8" ;;
    esac
}

shape_limit() { case $1 in mixtral) echo 90 ;; *) echo 75 ;; esac; }

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
    layer) local shape kernel
           for kernel in ${EXPERT_KERNELS:-ragged bmm}; do for shape in ${SHAPES:-mixtral qwen}; do
               bench "layer-$shape-$kernel" "$(shape_limit "$shape")" layer $(shape_args "$shape") \
                   --expert-kernel "$kernel" ${LAYER_ARGS:-}
           done; done ;;
    static) local shape mode  # the static step (issue 76), eager and captured, beside the dynamic one
           for shape in ${SHAPES:-mixtral qwen}; do for mode in ${MODES:-dynamic static graph}; do
               case $mode in
               dynamic) flags=(--step-shapes dynamic --expert-kernel bmm) ;;
               static) flags=(--step-shapes static) ;;
               graph) flags=(--step-shapes static --cuda-graph) ;;
               esac
               bench "static-$shape-$mode" "$(shape_limit "$shape")" layer $(shape_args "$shape") "${flags[@]}" \
                   ${LAYER_ARGS:-}
           done; done ;;
    profile) PATTERN=. TAIL=70 step profile 60 "$PY" scripts/gpu_profile_layer.py ;;
    calibrate) step calibrate 90 bash -c "$PY -m moeflow calibrate --device cuda --out $OUT/profile-cuda.json \
                   && $PY -m moeflow plan --profile $OUT/profile-cuda.json ${PLAN_ARGS:-}" ;;
    overlap) bench overlap 60 overlap --device cuda --degrees 1 2 4 8 ;;
    suite) OMP_NUM_THREADS=1 step suite 600 "$PY" -m pytest -q -p no:cacheprovider -n "${JOBS:-12}" -m "not distributed" \
               --timeout 120 ;;
    *) echo "unknown step $1 (env tests kernels layer static profile calibrate overlap suite)"; return 2 ;;
    esac
}

steps=("$@")
((${#steps[@]})) || steps=(env tests kernels layer profile calibrate suite)
for name in "${steps[@]}"; do run_step "$name"; done
