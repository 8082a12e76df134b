#!/usr/bin/env bash
# One prepared GPU run, sections in priority order under one deadline (GPU_CHECK_BUDGET_S,
# default 330 s) so a leased H200's minutes go to what matters most; a section that would
# start past the deadline is skipped and says so, and one section's failure never stops the
# next. Sections (--only a,b,... runs a subset, for a rerun):
#   tests     the kernel tests with interpret off (tests pick interpret mode only on a CPU
#             backend), 4 pytest workers sharing the GPU (no preallocation): paged attention
#             f32/bf16, ragged mixed batches, NaN-poisoned foreign pages, sliding windows,
#             quantized pages (test_kv_quant), the MLA latent kernel, KV writes, CUDA lowering,
#             the packed-weight matmuls and the attention table (default impl is "triton");
#   attention scripts/gpu_bench_attention.py: copy bandwidth, decode 64x4096 (+ ragged),
#             prefill TFLOP/s, against jax's own paged_attention and contiguous attention;
#   e2e       scripts/gpu_bench_e2e.py: LLM engine tokens/s, random weights: Llama-3.2-1B bf16
#             at batch 64, SmolLM2-135M's shapes in bf16 and int8 (q8_0) weights at batch 1
#             and 64 (issue 26's compact-weight decode). Needs cbor2, which the GPU image lacks
#             (with llguidance and gguf): carry their wheels in .whl/ (git-ignored):
#               python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                 --implementation cp --platform manylinux_2_28_x86_64 -d .whl \
#                 cbor2==6.3.0 llguidance gguf
#   matmul    scripts/bench_quant_matmul.py: SmolLM2's 30 layers of matmuls over packed q8_0 /
#             q4_1 / bf16 weights (XLA's dequantize + dot on a GPU) vs f32, 1 and 16 rows;
#   cmdbuf    the SmolLM2 bf16 batch-1 row (a decode step taken apart) with XLA:GPU's command
#             buffers (CUDA graphs) as they default, off, and with conditionals and loops in them
#             too: is the fixed per-step cost kernel launches;
#   kvquant   scripts/gpu_bench_kv_quant.py: decode 64x4096 over bf16 vs fp8 / int8 pages;
#   offload   page copies in place, swap / host-tier hits equal dense greedy (issue 15);
#   tp        scripts/bench_tensor_parallel.py --native --tp 1: tp=1 plain and on a one-device
#             mesh (shard_map around the Triton kernel).
# Everything printed goes to $OUT/gpu_check.log too, and the last step folds the JSONs and the
# tests' junit XML into $OUT/gpu_check.json (scripts/gpu_check_summary.py).
#
#   bash scripts/gpu_check.sh [--only tests,e2e]   # on the GPU machine (python3 with jax[cuda])
# Every section at its cap is more than one device call's 10 minutes: the first H200 run
# (docs/BENCHMARKS.md section 8) needed ~200 s for the tests with 8 workers and ~190 s for
# the end-to-end rows (compiles included), so a 15-minute lease takes two calls:
#   GPU_CHECK_BUDGET_S=420 bash scripts/gpu_check.sh --only tests,attention,kvquant,matmul
#   GPU_CHECK_BUDGET_S=420 bash scripts/gpu_check.sh --only e2e,offload,tp
#   E2E_PRESET=smollm2-135m bash scripts/gpu_check.sh --only e2e   # one preset's end-to-end rows
#   E2E_BATCH=1 ...                                 # one batch size's rows (batch 1 takes a step apart)
#   GPU_TESTS_K="fp8 or packed" ... --only tests    # a subset of the kernel tests (pytest -k)
#   bash scripts/gpu_check.sh --dry-run            # anywhere: CPU, interpret mode, tiny shapes
# PYTHON=/path/to/python overrides the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the GPU image does not have the project installed
export PYTHONUNBUFFERED=1

DRY_RUN=0
ONLY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --only) ONLY="$2"; shift ;;
    *) echo "unknown argument $1 (--dry-run, --only a,b)"; exit 2 ;;
  esac
  shift
done

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  # the GPU image's python3 has jax; a checkout set up as README says has .venv/
  if python3 -c "import jax" 2>/dev/null; then PY=python3; else PY=.venv/bin/python; fi
fi
RESULTS="${OUT:-${TMPDIR:-/tmp}/gpu_check}"
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/gpu_check.log") 2>&1

TESTS=(tests/test_paged_attention.py tests/test_kv_cache_write.py tests/test_cuda_lowering.py tests/test_mla_attention.py
       tests/test_kv_quant.py tests/test_attention_registry.py tests/test_quant_matmul.py)

if [[ $DRY_RUN == 1 ]]; then
  echo "== dry run: CPU, interpret mode, tiny shapes =="
  export JAX_PLATFORMS=cpu
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" -k "mixed or lowers or donated or launch_configs" \
    --junitxml="$RESULTS/gpu_tests.xml"
  timeout 300 "$PY" scripts/gpu_bench_attention.py --dry-run --out "$RESULTS" --budget-s 120
  timeout 300 "$PY" scripts/gpu_bench_kv_quant.py --dry-run --out "$RESULTS"
  timeout 300 "$PY" scripts/bench_quant_matmul.py --quick --out "$RESULTS"
  timeout 300 "$PY" scripts/gpu_bench_e2e.py --dry-run --out "$RESULTS"
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_offload_engine.py -k "page_copies"
  timeout 300 "$PY" scripts/bench_tensor_parallel.py --quick --native --tp 1 --out "$RESULTS"
  "$PY" scripts/gpu_check_summary.py "$RESULTS"
  exit 0
fi

DEADLINE=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-330} ))
FAILED=()
# section NAME CAP_S command...: runs under min(CAP_S, time left), skipped when under 15 s left
section() {
  local name=$1 cap=$2; shift 2
  if [[ -n "$ONLY" && ",$ONLY," != *",$name,"* ]]; then return; fi
  local left=$(( DEADLINE - $(date +%s) ))
  if (( left < 15 )); then echo "== $name: skipped, ${left}s left of the budget =="; FAILED+=("$name:skipped"); return; fi
  local limit=$(( cap < left ? cap : left ))
  echo "== $name (at most ${limit}s) =="
  local start=$(date +%s)
  # SIGINT first: pytest still writes its junit XML and summary, a script its partial JSON
  timeout -s INT -k 20 "$limit" "$@"
  local rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - start ))s =="
  (( rc == 0 )) || FAILED+=("$name:$rc")
}

echo "== GPU =="
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv || true
export JAX_PLATFORMS=cuda
if ! "$PY" -c "import cbor2, llguidance" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
# jax's persistent compilation cache: a section's later rows (and a rerun on a warm machine) reuse programs
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}"

# f32 checks of the XLA path and the references must not run in TF32; workers share the GPU.
JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false \
  section tests 220 "$PY" -m pytest -q -p no:cacheprovider -n 8 --dist loadfile --timeout=100 --tb=short \
  --junitxml="$RESULTS/gpu_tests.xml" -o addopts="" -rfE ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} "${TESTS[@]}"
# the benchmarks measure bf16 at the default precision
section attention 100 "$PY" scripts/gpu_bench_attention.py --budget-s 70 --out "$RESULTS"
section e2e 200 "$PY" scripts/gpu_bench_e2e.py --budget-s 150 ${E2E_PRESET:+--preset "$E2E_PRESET"} \
  ${E2E_BATCH:+--batch "$E2E_BATCH"} --out "$RESULTS"
cmdbuf() {  # the batch-1 SmolLM2 bf16 row under three command-buffer settings, each its own process
  set -o pipefail
  local rc=0 name flags
  for name in default off graphs_with_control_flow; do
    case $name in
      default) flags="" ;;
      off) flags="--xla_gpu_enable_command_buffer=" ;;
      graphs_with_control_flow) flags="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1" ;;
    esac
    echo "-- command buffers: $name (XLA_FLAGS=$flags)"
    XLA_FLAGS="$flags" "$PY" scripts/gpu_bench_e2e.py --preset smollm2-135m --batch 1 --weight-dtype bfloat16 \
      --out "$RESULTS/cmdbuf_$name" | tail -3 || rc=1
  done
  return $rc
}
export -f cmdbuf
export PY RESULTS
section cmdbuf 120 bash -c cmdbuf
section kvquant 75 "$PY" scripts/gpu_bench_kv_quant.py --out "$RESULTS"
# 6 layers, not 30: the first run spent its 35 s compiling 30 layers in five formats
section matmul 60 "$PY" scripts/bench_quant_matmul.py --layers 6 --rows 1 16 --repeats 10 --out "$RESULTS"
JAX_DEFAULT_MATMUL_PRECISION=highest section offload 90 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
  --timeout=80 tests/test_offload_engine.py -k "page_copies or heavy or brings"
section tp 90 "$PY" scripts/bench_tensor_parallel.py --quick --native --tp 1 --out "$RESULTS"
"$PY" scripts/gpu_check_summary.py "$RESULTS" || true
echo "sections not passed: ${FAILED[*]:-none}"
(( ${#FAILED[@]} == 0 ))
