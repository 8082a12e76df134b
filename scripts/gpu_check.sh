#!/usr/bin/env bash
# One prepared GPU run for the paged-attention kernels (issue 7): at most 180 s of tests and
# 270 s of benchmark, so under 8 minutes on an H200 with the start.
#   1. the kernel tests with interpret off (tests pick interpret mode only on a CPU backend),
#      f32 and bf16, ragged mixed batches, NaN-poisoned foreign pages, CUDA lowering;
#   2. scripts/gpu_bench_attention.py: copy bandwidth, decode 64x4096 (+ ragged), prefill
#      TFLOP/s, against jax's own paged_attention and contiguous attention; prints a table
#      and writes gpu_bench_attention.json to $OUT (the device tool) or results/.
#
#   bash scripts/gpu_check.sh             # on the GPU machine (python3 with jax[cuda])
#   bash scripts/gpu_check.sh --dry-run   # anywhere: CPU, interpret mode, tiny shapes, a test subset
# PYTHON=/path/to/python overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the GPU image does not have the project installed
export PYTHONUNBUFFERED=1

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if python3 -c "import jax" 2>/dev/null; then PY=python3; else PY=/work/venv/bin/python; fi
fi
TESTS=(tests/test_paged_attention.py tests/test_kv_cache_write.py tests/test_cuda_lowering.py)

if [[ $DRY_RUN == 1 ]]; then
  echo "== dry run: CPU, interpret mode, tiny shapes =="
  export JAX_PLATFORMS=cpu
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" -k "mixed or lowers or donated or launch_configs"
  timeout 300 "$PY" scripts/gpu_bench_attention.py --dry-run --out "${OUT:-${TMPDIR:-/tmp}}" --budget-s 120
  exit 0
fi

echo "== GPU =="
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv || true
export JAX_PLATFORMS=cuda
# f32 checks of the XLA path and the references must not run in TF32.
export JAX_DEFAULT_MATMUL_PRECISION=highest
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== kernel tests, interpret off =="
set +e
timeout 180 "$PY" -m pytest -q -p no:cacheprovider --maxfail=10 --timeout=90 "${TESTS[@]}" 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
TESTS_RC=${PIPESTATUS[0]}
set -e
unset JAX_DEFAULT_MATMUL_PRECISION  # the benchmark measures bf16 at the default precision
echo "== benchmark =="
timeout 270 "$PY" scripts/gpu_bench_attention.py --budget-s 170 ${OUT:+--out "$OUT"}
echo "kernel tests exit code: $TESTS_RC"
exit "$TESTS_RC"
