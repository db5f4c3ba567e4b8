#!/usr/bin/env bash
# GPU steps for one device call (run from the repository root; results and logs go to $OUT, default /tmp/out).
#
# Prepare on the build machine: `python -m kerneltools build --capability 9.0 --aot-capability 8.0,9.0` (carried
# as `build`: the six architectures' cubins of both CUDA variants would not fit the carry) and the wheels
# docs/development.md lists (carried as `.whl`), then for example
#   bash benchmarks/device_run.sh tests model
# The `ptxas` step also needs `build-ptxas13` (docs/prebuilt.md, "On the device").
# Steps, in the order given (each time-limited; a failing step does not stop the later ones):
#   tests       the GPU test suite of the kernel (tests/kernel)
#   prebuilt    the prebuilt kernels' GPU tests (same bits as the JIT; CUDA 12.9's cubins; a fresh process compiles
#               nothing, on the compiled variant and on torch-cuda alone)
#   cold        the cold-start benchmark (fresh processes, empty Triton cache; COLD_ARGS: extra options)
#   coldnoarch  the cold-start benchmark, eager against the kernelized model loaded from torch-cuda alone
#   ptxas       build/'s prebuilt cubins (CUDA 12.9's ptxas) against build-ptxas13's (CUDA 13's), one process
#   rule        where the fused gate/up GEMM wins (the measurement behind the shipped rule)
#   callcost    each op's host cost per call: build-before/'s compiled variant (another commit, built the same way)
#               against build/'s, with an A/A copy (benchmarks/call_cost.py --device cuda)
#   tools       the GPU tests of the tooling (transformers models, the kernels Benchmark workloads)
#   model       the whole-model benchmark (MODEL_ARGS: extra options, e.g. "--model all --rounds 3"; MODEL_TIMEOUT:
#               its limit in seconds, default 560; SERVE_TIMEOUT likewise for serve)
#   serve       batch-1 serving (prefill by prompt length, generate) of the Gemma 3 4B shape in the four modes,
#               torch.compile with its default dynamic shapes, GPU time beside wall (SERVE_ARGS: extra options)
#   serveab     the serve rows of build-before/ (another commit, built the same way) and then of build/, one process
#               each on the same machine, compile and kernelized+compile (SERVE_ARGS as for serve; SERVE_TIMEOUT each;
#               GEGLU_COMMIT_BEFORE labels build-before's report)
#   hostcost    where a compiled kernelized forward's host time goes at a batch-1 prompt (benchmarks/host_cost_probe.py;
#               HOSTCOST_ARGS: extra options, e.g. "--length 256,2048")
#   peak        what is live at the peak of one compiled batch-1 prefill, compile against kernelized+compile
#               (benchmarks/peak_probe.py; PEAK_ARGS: extra options, e.g. "--warm-lengths 33,34,64,256,1024,2048",
#               the lengths the serve rows call before 4096; PEAK_TIMEOUT: its limit in seconds, default 300)
#   pointwise   the pointwise kernels against eager, torch.compile and Liger, with the autograd rows
#   mlp         the whole MLP layer
#   moe         the Gemma 4 MoE experts benchmark
#   profile     the profiling analysis (kernels per forward, CPU time, recompiles)
#   sanitize    compute-sanitizer's memcheck over the compiled ops
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
export GEGLU_BUILD_DIR=$PWD/build
# The build tree carries its own copy of the package's Python files: refuse a stale one (it would test old code).
for f in $(cd torch-ext/geglu && find . -name '*.py' ! -name _ops.py ! -path '*/__pycache__/*'); do
  for variant in build/torch-stable-abi*/ build/torch-cuda/; do
    cmp -s "torch-ext/geglu/$f" "$variant$f" || { echo "error: $variant is stale (torch-ext/geglu/$f differs): run" \
      "'python -m kerneltools build --capability 9.0 --aot-capability 8.0,9.0' before the device call"; exit 1; }
  done
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader

step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2
  shift 2
  echo "=== $name ($(date +%T))"
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -v -i "kernel mapping\|dirty git tree\|USDT" "$OUT/$name.log" | tail -n "${TAIL:-30}"
  echo "=== $name rc=$rc"
}

serve() {  # serve NAME BUILD SECONDS MODES COMMIT: the serve benchmark of the Gemma 3 4B shape on BUILD's variant
  step "$1" "$3" env GEGLU_BUILD_DIR="$PWD/$2" GEGLU_COMMIT="$5" python3 -m kerneltools bench --build-dir "$2" \
    --out "$OUT/$1" --model gemma3-4b --parts serve --modes "$4" --profile ${SERVE_ARGS:-}
}

for s in "$@"; do
  case $s in
    tests) step tests 420 python3 -m pytest tests/kernel -q -p no:cacheprovider -m gpu ;;
    prebuilt) step prebuilt 480 python3 -m pytest tests/kernel/test_prebuilt.py -q -p no:cacheprovider -m gpu ;;
    cold) step cold 560 python3 -m kerneltools bench --cold-start --build-dir build --out "$OUT" ${COLD_ARGS:-} ;;
    coldnoarch) step coldnoarch 560 python3 -m kerneltools bench --cold-start --build-dir build \
        --cold-modes eager,kernelized-noarch --out "$OUT/cold-noarch" ;;
    ptxas) step ptxas 200 python3 benchmarks/prebuilt_ptxas.py --build-dir build \
        --other build-ptxas13 --out "$OUT" ;;
    rule) step rule 300 python3 -m kerneltools.bench.fused_rule --build-dir build --out "$OUT" ;;
    callcost) step callcost 300 python3 benchmarks/call_cost.py --device cuda --out "$OUT/call-cost" \
        --build before="$(ls -d build-before/torch-stable-abi*/ | head -1)" \
        --build after="$(ls -d build/torch-stable-abi*/ | head -1)" \
        --build before-copy="$(ls -d build-before/torch-stable-abi*/ | head -1)" ;;
    tools) step tools 400 python3 -m pytest tests/tools/test_transformers_kernelize.py \
        tests/tools/test_kernels_benchmark.py -q -p no:cacheprovider ;;
    model) step model "${MODEL_TIMEOUT:-560}" python3 -m kerneltools bench --build-dir build --out "$OUT/model" ${MODEL_ARGS:---model all} ;;
    pointwise) step pointwise 560 python3 -m kerneltools bench --build-dir build --dtype bfloat16 --no-max-autotune \
        --no-mlp --out "$OUT/pointwise" ;;
    serve) serve serve build "${SERVE_TIMEOUT:-560}" eager,kernelized,compile,kernelized+compile "${GEGLU_COMMIT:-}" ;;
    serveab) serve serve-build-before build-before "${SERVE_TIMEOUT:-280}" compile,kernelized+compile \
          "${GEGLU_COMMIT_BEFORE:-}"
        serve serve-build build "${SERVE_TIMEOUT:-280}" compile,kernelized+compile "${GEGLU_COMMIT:-}" ;;
    hostcost) step hostcost 300 python3 benchmarks/host_cost_probe.py --build-dir build --out "$OUT/hostcost" \
        ${HOSTCOST_ARGS:-} ;;
    peak) step peak "${PEAK_TIMEOUT:-300}" python3 benchmarks/peak_probe.py --build-dir build --out "$OUT/peak" \
        ${PEAK_ARGS:-} ;;
    mlp) step mlp 300 python3 -m kerneltools bench --build-dir build --mlp-only --out "$OUT/mlp" ;;
    moe) step moe 200 python3 -m kerneltools.bench.moe --build-dir build --out "$OUT" ${MOE_ARGS:-} ;;
    profile) step profile 240 python3 -m kerneltools profile --build-dir build --out "$OUT" ;;
    sanitize) step sanitize 300 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --error-exitcode 1 python3 -m kerneltools.sanitize ;;
    *) echo "unknown step $s" ;;
  esac
done
