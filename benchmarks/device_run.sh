#!/usr/bin/env bash
# One device call's work on the H200 (the device tool runs it in the repository root; results go to $OUT).
# Prepare here first: `python -m kerneltools build --capability 9.0` (carried as `build`) and the wheels in `.whl`
# (docs/status.md lists them; carried as `.whl`). Then, e.g.:
#   run(command="bash benchmarks/device_run.sh overhead tune tests", carry=["build", ".whl"])
# Steps (in the order given): overhead, autograd, smallm, tune, tests, tests-mlp (the MLP and layer tests),
# transformers, fused (the fused-kernel sweep at 8192x4096x14336; fused-2304 at 8192x2304x9216), mlp (the whole-MLP
# table alone), gemms (the training step GEMM by GEMM), packed (the packed-weight gate/up kernel probe), epi-ceiling
# (the forward if the gate/up kernel's epilogue were free), bwd (the fused
# backward and the training step with the fused kernels; BWD_ARGS passes options, e.g. "--no-sweep --compile"), ws-test (the Gluon backward's GPU tests), ws-fwd-test (the Gluon forward's), node-test (the training node's tests), ws-power (SM clock and power per backward variant), ws-diag and
# ws-ncu (why the Gluon backward is slow: timings, and ncu's speed-of-light and memory sections), ws-stalls (its
# warp stall reasons), ws-source (ncu's per-instruction SASS stall samples of one variant, WS_ONLY=label regex; WS_DIAG_ONLY filters ws-diag alike), bench (bf16 with peers and the whole MLP; bench-fast: without max-autotune), bench-other (fp16 and
# fp32, ours and eager), profile, sanitize, moe (the Gemma 4 MoE experts benchmark, kerneltools.bench.moe),
# moe-test (the MoE model and experts tests of the transformers integration, GPU variants included).
# Each step is time-limited and logged to $OUT/<step>.log; a failing step does not stop the later ones.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH GEGLU_BUILD_DIR=$PWD/build
export GEGLU_COMMIT=${GEGLU_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
# The build tree carries its own copy of the package's Python files: refuse a stale one (it would test old code).
for f in torch-ext/geglu/*.py; do
  for variant in build/torch-stable-abi*/; do
    cmp -s "$f" "$variant$(basename "$f")" || { echo "error: $variant is stale ($f differs): run" \
      "'python -m kerneltools build --capability 9.0' here before the device call"; exit 1; }
  done
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader

step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2
  shift 2
  echo "=== $name ($(date +%T))"
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-40}" "$OUT/$name.log"
  echo "=== $name rc=$rc"
}

for s in "$@"; do
  case $s in
    overhead) step overhead 120 python3 benchmarks/launch_overhead.py --build-dir build ;;
    autograd) step autograd 120 python3 benchmarks/autograd_overhead.py --build-dir build ;;
    smallm) step smallm 120 python3 benchmarks/mlp_small_m.py --build-dir build ;;
    tune) step tune 300 python3 benchmarks/tune_triton.py --build-dir build --flat-only ;;
    tests) step tests 300 python3 -m pytest tests/kernel -q -x -p no:cacheprovider ;;
    transformers) step transformers 400 python3 -m pytest tests/tools/test_transformers_kernelize.py -q -x \
        -p no:cacheprovider ;;
    fused) step fused 420 python3 benchmarks/bench_fused_mlp.py --build-dir build --shapes 8192x4096x14336 \
        --sweep epilogue --no-bwd-sweep --out "$OUT" ;;
    tests-mlp) step tests-mlp 540 python3 -m pytest tests/kernel/test_fused_mlp.py tests/kernel/test_layers.py \
        tests/kernel/test_mlp_train.py -q -x -s \
        -p no:cacheprovider ;;
    fused-2304) step fused-2304 300 python3 benchmarks/bench_fused_mlp.py --build-dir build --shapes 8192x2304x9216 \
        --sweep epilogue --no-bwd-sweep --out "$OUT" ;;
    decision) step decision 200 python3 benchmarks/fused_decision.py --build-dir build ;;
    packed) step packed 400 python3 benchmarks/packed_probe.py --build-dir build ;;
    epi-ceiling) step epi-ceiling 300 python3 benchmarks/epi_ceiling.py --build-dir build ${EPI_ARGS:-} ;;
    ws-test) step ws-test 300 python3 -m pytest tests/kernel/test_fused_mlp.py -q -x -p no:cacheprovider \
        -k "warp_specialised or gluon_backward" ;;
    ws-fwd-test) step ws-fwd-test 300 python3 -m pytest tests/kernel/test_fused_mlp.py -q -x -p no:cacheprovider \
        -k "gluon_forward" ;;
    node-test) step node-test 200 python3 -m pytest tests/kernel/test_fused_mlp.py -q -x -p no:cacheprovider \
        -k "training_node or fused_training" ;;
    ws-power) step ws-power 150 python3 benchmarks/ws_power.py --build-dir build ;;
    ws-diag) step ws-diag 200 python3 benchmarks/ws_diag.py --build-dir build --only "${WS_DIAG_ONLY:-}" ;;
    ws-ncu) TAIL=80 step ws-ncu 300 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis -k regex:'gemm|nvjet|dgeglu' python3 benchmarks/ws_diag.py --build-dir build \
        --once --shapes 8192x2304x9216 --only "${WS_DIAG_ONLY:-}" ;;
    ws-stalls) TAIL=200 step ws-stalls 200 ncu --section WarpStateStats --section SchedulerStats \
        -k regex:'down_dgeglu_ws' python3 benchmarks/ws_diag.py --build-dir build --once --shapes 8192x2304x9216 ;;
    ws-source) TAIL=60 step ws-source 240 ncu --section WarpStateStats --section SchedulerStats --section SourceCounters \
        --section InstructionStats -k regex:'down_dgeglu_ws' --launch-count 1 -f -o "$OUT/ws-source" \
        python3 benchmarks/ws_diag.py --build-dir build --once --shapes 8192x2304x9216 --only "${WS_ONLY:-default}"
      ncu -i "$OUT/ws-source.ncu-rep" --page details >"$OUT/ws-source-details.txt" 2>&1
      ncu -i "$OUT/ws-source.ncu-rep" --page source --csv --print-source sass >"$OUT/ws-source-sass.csv" 2>&1
      tail -n 5 "$OUT/ws-source-sass.csv"; wc -c "$OUT"/ws-source* ;;
    bwd) step bwd 560 python3 benchmarks/bwd_probe.py --build-dir build ${BWD_ARGS:-} ;;
    gemms) step gemms 300 python3 benchmarks/mlp_train_gemms.py --build-dir build ;;
    mlp) step mlp 300 python3 -m kerneltools bench --build-dir build --mlp-only --out "$OUT/mlp" ;;
    bench) step bench 560 python3 -m kerneltools bench --build-dir build --dtype bfloat16 --out "$OUT/bf16" ;;
    bench-fast) step bench 420 python3 -m kerneltools bench --build-dir build --dtype bfloat16 --no-max-autotune \
        --out "$OUT/bf16" ;;
    bench-other) step bench-fp16 200 python3 -m kerneltools bench --build-dir build --dtype float16 --no-peers --no-mlp \
        --out "$OUT/fp16"; step bench-fp32 200 python3 -m kerneltools bench --build-dir build --dtype float32 \
        --no-peers --no-mlp --out "$OUT/fp32" ;;
    moe) step moe 170 python3 -m kerneltools.bench.moe --build-dir build --out "$OUT" ;;
    moe-test) step moe-test 300 python3 -m pytest tests/tools/test_transformers_kernelize.py -q -x -p no:cacheprovider \
        -k "moe or experts" ;;
    profile) step profile 240 python3 -m kerneltools profile --build-dir build --out "$OUT" ;;
    sanitize) step sanitize 300 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --error-exitcode 1 python3 -m kerneltools.sanitize ;;
    *) echo "unknown step $s" ;;
  esac
done
