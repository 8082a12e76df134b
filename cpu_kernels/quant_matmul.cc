// y[M, N] = x[M, K] @ W[N, K]^T with W kept in a compact format and dequantized inside the
// dot product, a row block at a time, never as a whole f32 copy (cpu_kernels/quant_matmul.py
// is the public entry and holds the numpy reference).
//
// Formats (one weight row = K inputs of one output; GGUF's own block bytes, unchanged):
//   q8_0: K/32 blocks of 34 bytes: f16 d, int8 q[32];           w = d * q
//   q4_1: K/32 blocks of 20 bytes: f16 d, f16 m, u8 qs[16];     w = d * q + m,
//         q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4
//   bf16: K u16 (bfloat16 bits);                                 w = bf16 -> f32
//
// Exact mode only: activations stay f32 and every product is f32, so the result is the f32
// dequantized matmul up to summation order (q4_1 sums d * (x . q) + m * sum(x) per block).
//
// Rows of W are split over XLA's intra-op thread pool; each task takes chunks of rows from an
// atomic counter and the calling thread works too, so no task ever waits for another.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;     // elements per q8_0 / q4_1 block
constexpr int64_t kMaxRows = 4;    // x rows sharing one unpacked weight block
constexpr int64_t kChunkRows = 32; // weight rows a task takes at once

inline float f16_to_f32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One output row n for r (<= kMaxRows) rows of x: out[i] = sum_k x[i][k] * w[n][k].
template <int kFormat>
void row_dot(const float* x, int64_t ldx, const float* xs, int r, const uint8_t* w, int64_t k, float* out);

enum Format { kQ8_0 = 0, kQ4_1 = 1, kBF16 = 2 };

#if defined(__AVX512F__)
constexpr bool kNeedsBlockSums = false;  // the AVX-512 q4_1 loop sums x per block itself
#else
constexpr bool kNeedsBlockSums = true;
#endif

#if defined(__AVX512F__)
inline __m512 bcast_f16(const uint8_t* p) { return _mm512_set1_ps(f16_to_f32(p)); }

template <>
void row_dot<kQ8_0>(const float* x, int64_t ldx, const float* xs, int r, const uint8_t* w, int64_t k, float* out) {
  // Two accumulators per row (even and odd blocks) so consecutive FMAs do not wait on each other.
  __m512 acc[2][kMaxRows];
  for (int i = 0; i < kMaxRows; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b, w += 34) {
    const __m512 d = bcast_f16(w);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 2))));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 18))));
    __m512* a = acc[b & 1];
    for (int i = 0; i < r; ++i) {
      const float* xb = x + i * ldx + b * kBlock;
      __m512 t = _mm512_mul_ps(_mm512_loadu_ps(xb), q0);
      t = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), q1, t);
      a[i] = _mm512_fmadd_ps(t, d, a[i]);
    }
  }
  for (int i = 0; i < r; ++i) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][i], acc[1][i]));
}

template <>
void row_dot<kQ4_1>(const float* x, int64_t ldx, const float* xs, int r, const uint8_t* w, int64_t k, float* out) {
  // Per block: d * (x . q) and m * x (summed at the end) into vector accumulators; even and
  // odd blocks accumulate apart (see q8_0).
  __m512 acc[2][kMaxRows];
  __m512 mins[2][kMaxRows];
  for (int i = 0; i < kMaxRows; ++i) acc[0][i] = acc[1][i] = mins[0][i] = mins[1][i] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi32(15);
  const int64_t num_blocks = k / kBlock;
  for (int64_t b = 0; b < num_blocks; ++b, w += 20) {
    const __m512 d = bcast_f16(w);
    const __m512 m = bcast_f16(w + 2);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(w + 4)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, nibble));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
    __m512* a = acc[b & 1];
    __m512* mn = mins[b & 1];
    for (int i = 0; i < r; ++i) {
      const float* xb = x + i * ldx + b * kBlock;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      __m512 t = _mm512_fmadd_ps(x1, hi, _mm512_mul_ps(x0, lo));
      a[i] = _mm512_fmadd_ps(t, d, a[i]);
      mn[i] = _mm512_fmadd_ps(_mm512_add_ps(x0, x1), m, mn[i]);
    }
  }
  for (int i = 0; i < r; ++i)
    out[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0][i], acc[1][i]), _mm512_add_ps(mins[0][i], mins[1][i])));
}

template <>
void row_dot<kBF16>(const float* x, int64_t ldx, const float* xs, int r, const uint8_t* w, int64_t k, float* out) {
  __m512 acc[kMaxRows];
  for (int i = 0; i < kMaxRows; ++i) acc[i] = _mm512_setzero_ps();
  const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
  for (int64_t j = 0; j < k; j += 16) {
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(wb + j)));
    const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    for (int i = 0; i < r; ++i) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + j), wv, acc[i]);
  }
  for (int i = 0; i < r; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#else
// Portable loops (the compiler vectorizes them for the machine it builds on).
inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <>
void row_dot<kQ8_0>(const float* x, int64_t ldx, const float* xs, int r, const uint8_t* w, int64_t k, float* out) {
  for (int i = 0; i < r; ++i) out[i] = 0;
  for (int64_t b = 0; b < k / kBlock; ++b, w += 34) {
    const float d = f16_to_f32(w);
    const int8_t* q = reinterpret_cast<const int8_t*>(w + 2);
    for (int i = 0; i < r; ++i) {
      const float* xb = x + i * ldx + b * kBlock;
      float t = 0;
      for (int j = 0; j < kBlock; ++j) t += xb[j] * float(q[j]);
      out[i] += d * t;
    }
  }
}

template <>
void row_dot<kQ4_1>(const float* x, int64_t ldx, const float* xs, int r, const uint8_t* w, int64_t k, float* out) {
  for (int i = 0; i < r; ++i) out[i] = 0;
  for (int64_t b = 0; b < k / kBlock; ++b, w += 20) {
    const float d = f16_to_f32(w), m = f16_to_f32(w + 2);
    const uint8_t* qs = w + 4;
    for (int i = 0; i < r; ++i) {
      const float* xb = x + i * ldx + b * kBlock;
      float t = 0;
      for (int j = 0; j < 16; ++j) t += xb[j] * float(qs[j] & 15) + xb[j + 16] * float(qs[j] >> 4);
      out[i] += d * t + m * xs[i * (k / kBlock) + b];
    }
  }
}

template <>
void row_dot<kBF16>(const float* x, int64_t ldx, const float* xs, int r, const uint8_t* w, int64_t k, float* out) {
  const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
  for (int i = 0; i < r; ++i) {
    float t = 0;
    for (int64_t j = 0; j < k; ++j) t += x[i * ldx + j] * bf16_to_f32(wb[j]);
    out[i] = t;
  }
}
#endif

constexpr int64_t row_bytes(int format, int64_t k) {
  return format == kQ8_0 ? k / kBlock * 34 : format == kQ4_1 ? k / kBlock * 20 : k * 2;
}

struct Work {
  const float* x;
  std::unique_ptr<float[]> xs;  // [m, k / kBlock] block sums of x (portable q4_1's min term)
  const uint8_t* w;
  float* y;
  int64_t m, n, k;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <int kFormat>
void run_chunks(Work& work) {
  const int64_t stride = row_bytes(kFormat, work.k);
  const int64_t num_chunks = (work.n + kChunkRows - 1) / kChunkRows;
  float out[kMaxRows];
  for (int64_t c; (c = work.next.fetch_add(1)) < num_chunks;) {
    const int64_t n1 = std::min(work.n, (c + 1) * kChunkRows);
    for (int64_t i0 = 0; i0 < work.m; i0 += kMaxRows) {
      const int r = int(std::min<int64_t>(kMaxRows, work.m - i0));
      for (int64_t n = c * kChunkRows; n < n1; ++n) {
        row_dot<kFormat>(work.x + i0 * work.k, work.k, work.xs.get() + i0 * (work.k / kBlock), r, work.w + n * stride, work.k, out);
        for (int i = 0; i < r; ++i) work.y[(i0 + i) * work.n + n] = out[i];
      }
    }
    work.done.fetch_add(1, std::memory_order_release);
  }
}

template <int kFormat>
ffi::Error quant_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("x and w must be 2-D");
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  if ((kFormat != kBF16 && k % kBlock) || (kFormat == kBF16 && k % 16) || wd[1] != row_bytes(kFormat, k))
    return ffi::Error::InvalidArgument("w's row bytes do not match x's inner dimension for this format");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->m = m;
  work->n = n;
  work->k = k;
  if (kFormat == kQ4_1 && kNeedsBlockSums) {
    work->xs.reset(new float[m * (k / kBlock)]);
    for (int64_t i = 0; i < m * (k / kBlock); ++i) {
      float s = 0;
      for (int j = 0; j < kBlock; ++j) s += work->x[i * kBlock + j];
      work->xs[i] = s;
    }
  }
  const int64_t num_chunks = (n + kChunkRows - 1) / kChunkRows;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_chunks - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { run_chunks<kFormat>(*work); });
  run_chunks<kFormat>(*work);
  // A helper that starts late finds no chunk left and only drops its reference to work.
  while (work->done.load(std::memory_order_acquire) < num_chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

#define PJ_DEFINE(name, format)                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, quant_matmul<format>,                       \
                                ffi::Ffi::Bind()                                  \
                                    .Ctx<ffi::ThreadPool>()                       \
                                    .Arg<ffi::Buffer<ffi::F32>>()                 \
                                    .Arg<ffi::Buffer<ffi::U8>>()                  \
                                    .Ret<ffi::Buffer<ffi::F32>>());

PJ_DEFINE(pj_quant_matmul_q8_0, kQ8_0)
PJ_DEFINE(pj_quant_matmul_q4_1, kQ4_1)
PJ_DEFINE(pj_quant_matmul_bf16, kBF16)
