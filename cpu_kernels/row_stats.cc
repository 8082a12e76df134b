// Each row's first argmax and log-sum-exp in one native call on the CPU (cpu_kernels/row_stats.py
// is the entry and holds the jnp reference): what greedy sampling and its logprobs read from
// the logits (paged_jax/sampler.py).
//
// Why: as XLA ops these are four passes over the vocabulary (the max, the first index holding
// it, exp and its sum), each a loop of its own; a SmolLM2 decode step spent ~0.2 ms in them
// (49,152 logits), where this reads a row three times from L2 (docs/BENCHMARKS.md section 18,
// seventh pass).
//
// Per row of x f32[R, V]: argmax i32 (the first index of the row's maximum; a row holding a NaN
// gives V - 1, as XLA's reductions do) and lse f32 = max + log(sum(exp(x - max))) (NaN for a
// row whose max is not finite, as XLA's arithmetic gives). Rows are split over XLA's threads.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>

#include "paged_attention.h"  // exp_nonpositive, exp_nonpositive8, exp_nonpositive16
#include "thread_team.h"
#include "xla/ffi/api/ffi.h"

namespace {

void row_stats(const float* x, int64_t v, int32_t* argmax, float* lse) {
  // the max, and whether the row holds a NaN
  float mx = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m16 = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (; i + 16 <= v; i += 16) {
    const __m512 xs = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(xs, xs, _CMP_UNORD_Q);
    m16 = _mm512_max_ps(xs, m16);  // a NaN lane keeps m16's (vmaxps returns its second operand)
  }
  mx = _mm512_reduce_max_ps(m16);
  nan = unordered != 0;
#elif defined(__AVX2__)
  // (the portable loops here stay scalar too: the NaN test is control flow to the compiler)
  __m256 m8 = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
  for (; i + 8 <= v; i += 8) {
    const __m256 xs = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(xs, xs, _CMP_UNORD_Q));
    m8 = _mm256_max_ps(xs, m8);  // a NaN lane keeps m8's (vmaxps returns its second operand)
  }
  alignas(32) float maxes[8];
  _mm256_store_ps(maxes, m8);
  for (float m : maxes) mx = std::max(mx, m);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < v; ++i) {
    if (std::isnan(x[i])) nan = true;
    else mx = std::max(mx, x[i]);
  }
  if (nan) {
    *argmax = int32_t(v - 1);
    *lse = NAN;
    return;
  }
  int64_t first = 0;
#if defined(__AVX512F__)
  for (const __m512 mx16 = _mm512_set1_ps(mx); first + 16 <= v; first += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + first), mx16, _CMP_EQ_OQ);
    if (hit) {
      first += __builtin_ctz(hit);
      break;
    }
  }
#elif defined(__AVX2__)
  for (const __m256 mx8 = _mm256_set1_ps(mx); first + 8 <= v; first += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + first), mx8, _CMP_EQ_OQ));
    if (hit) {
      first += __builtin_ctz(hit);
      break;
    }
  }
#endif
  while (first < v - 1 && x[first] != mx) ++first;
  *argmax = int32_t(first);
  if (!std::isfinite(mx)) {
    *lse = NAN;
    return;
  }
  // the sum of exp(x - max)
  float sum = 0.0f;
  i = 0;
#if defined(__AVX512F__)
  __m512 s16 = _mm512_setzero_ps();
  const __m512 mx16 = _mm512_set1_ps(mx);
  for (; i + 16 <= v; i += 16) s16 = _mm512_add_ps(s16, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mx16)));
  sum = _mm512_reduce_add_ps(s16);
#elif defined(__AVX2__) && defined(__FMA__)
  // (the portable loop below stays scalar: ~11 cycles an exp, paged_attention.h's exp_rows)
  __m256 s8 = _mm256_setzero_ps();
  const __m256 mx8 = _mm256_set1_ps(mx);
  for (; i + 8 <= v; i += 8) s8 = _mm256_add_ps(s8, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mx8)));
  alignas(32) float sums[8];
  _mm256_store_ps(sums, s8);
  for (float s : sums) sum += s;
#endif
  for (; i < v; ++i) sum += exp_nonpositive(x[i] - mx);
  *lse = mx + std::log(sum);
}

struct Rows {
  const float* x;
  int64_t v, rows;
  int32_t* argmax;
  float* lse;
  std::atomic<int64_t> next{0}, done{0};
};

void run_rows(Rows& job) {
  for (int64_t r; (r = job.next.fetch_add(1)) < job.rows;) {
    row_stats(job.x + r * job.v, job.v, job.argmax + r, job.lse + r);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error argmax_logsumexp(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> argmax,
                            ffi::ResultBuffer<ffi::F32> lse) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] < 1 || argmax->element_count() != xd[0] || lse->element_count() != xd[0])
    return ffi::Error::InvalidArgument("x [R, V >= 1], argmax and lse [R] expected");
  auto job = std::make_shared<Rows>();
  job->x = x.typed_data();
  job->v = xd[1];
  job->rows = xd[0];
  job->argmax = argmax->typed_data();
  job->lse = lse->typed_data();
  // A row is ~10-20 us at a 50k vocabulary: helpers for a batch's rows only.
  const int64_t helpers = paged_jax::pool_helpers(pool.num_threads(), job->rows / 2);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { run_rows(*job); });
  run_rows(*job);
  // A helper that starts late finds no row left and only drops its reference to the job.
  while (job->done.load(std::memory_order_acquire) < job->rows) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(pj_argmax_logsumexp, argmax_logsumexp,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   /* x */
                                  .Ret<ffi::Buffer<ffi::S32>>()   /* argmax */
                                  .Ret<ffi::Buffer<ffi::F32>>()); /* lse */
