// Paged attention of decoding sequences (one query token each) on the CPU: each (sequence,
// KV head) reads its pages straight from the cache through its block table, its live keys
// only, in one pass over K (scores of the KV head's query heads) and one over V, with no
// gathered copy of a page (cpu_kernels/paged_attention.py is the entry; the XLA path of
// paged_jax/attention/xla.py is its reference).
//
// Inputs: q f32[T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (f32 or bf16);
// block_tables i32[S, W]; seq_lens i32[S]; query_start_loc i32[S + 1]; num_seqs i32[1];
// attributes sm_scale and sliding_window (i32; 0 means none: the token at position
// seq_len - 1 sees every key, else keys seq_len - sliding_window .. seq_len - 1 only, and the
// key loops start there, so pages wholly before the window are never read). Output
// f32[T, Hq, D]: the attention of every token of a sequence with exactly one query token;
// every other row (prefill chunks, padding) is zero. Query head j reads KV head j / (Hq / Hkv).
//
// (sequence, KV head) tasks are split over the kernels' helper threads (thread_team.h) from an
// atomic counter; the calling thread works too. Where the rows are a prefill chunk's tokens,
// one a row (paged_jax/attention/xla.py token_rows), a task takes a tile of consecutive rows
// that reads each key once for all of them (Job::make_tiles, run_tile_avx2).
//
// The kernel itself, shared by paged_attention.cc (the attention's own handler) and decoder_layer.cc.

#ifndef PAGED_JAX_PAGED_ATTENTION_H_
#define PAGED_JAX_PAGED_ATTENTION_H_

#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {


inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t bf16) {
  uint32_t bits = uint32_t(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// exp(x) for x <= 0 (scores minus their max), vectorizable (no libm call): x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7, under f32's
// rounding of the terms), times 2^n built in the exponent bits. Below -87 it is 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split in two: r is exact
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes (its steps, with the power of two applied by vscalefps).
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes (its steps, the power of two built in the exponent bits).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

// Each of `rows` rows of len scores becomes exp(score - m) in place, with m[g] its row's
// largest score and l[g] the sum of the row's exps (softmax's numerator and denominator).
// The exps are the SIMD steps above where built: the compiler leaves a loop of the portable
// exp scalar (its rounding and clamp are control flow to it), ~11 cycles an exp on a Zen 1, as
// long as a prefill row's scores took (docs/BENCHMARKS.md section 18, fourteenth pass). The
// SiLU of decoder_layer.cc and the logsumexp of row_stats.cc use them for the same reason.
inline void exp_rows(float* scores, int64_t rows, int64_t len, float* m, float* l) {
  for (int64_t g = 0; g < rows; ++g) {
    float* p = scores + g * len;
    float mx = p[0];
    for (int64_t t = 1; t < len; ++t) mx = std::max(mx, p[t]);
    float sum = 0.0f;
    int64_t t = 0;
#if defined(__AVX512F__)
    __m512 s16 = _mm512_setzero_ps();
    for (; t + 16 <= len; t += 16) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(p + t), _mm512_set1_ps(mx)));
      _mm512_storeu_ps(p + t, e);
      s16 = _mm512_add_ps(s16, e);
    }
    sum = _mm512_reduce_add_ps(s16);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 s8 = _mm256_setzero_ps();
    for (; t + 8 <= len; t += 8) {
      const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(mx)));
      _mm256_storeu_ps(p + t, e);
      s8 = _mm256_add_ps(s8, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, s8);
    for (float x : lanes) sum += x;
#endif
    for (; t < len; ++t) {
      p[t] = exp_nonpositive(p[t] - mx);
      sum += p[t];
    }
    m[g] = mx;
    l[g] = sum;
  }
}

template <typename KV>
struct Job {
  const float* q;
  const KV* k;
  const KV* v;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* qsl;
  float* out;
  int64_t width, block_size, hkv, group, dim;
  float scale;
  int64_t window;  // keys a query sees (itself included); 0: all
  std::vector<int64_t> seqs;  // the decoding sequences
  // Tiles of seqs: tile i is seqs[tiles[i]] .. seqs[tiles[i + 1] - 1] (make_tiles); a task
  // is a (tile, KV head).
  std::vector<int64_t> tiles;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  int64_t num_tiles() const { return int64_t(tiles.size()) - 1; }

  // Groups seqs into tiles of up to max_rows consecutive rows that are consecutive tokens of
  // one sequence (token rows of a prefill chunk, paged_jax/attention/xla.py token_rows): each
  // row one position past the one before, the same pages in its block table, its output the
  // next row of out, and the tile's first row's pages for all of its keys (rows of two
  // sequences may join where that holds: their math is then the same). A tile reads each key
  // once for all its rows (run_tile).
  void make_tiles(int64_t max_rows) {
    tiles.assign(1, 0);
    for (size_t i = 1; i < seqs.size(); ++i) {
      const int64_t a = seqs[i - 1], b = seqs[i], head = seqs[tiles.back()] * width;
      const bool joins = int64_t(i) - tiles.back() < max_rows && b == a + 1 && seq_lens[b] == seq_lens[a] + 1 &&
                         qsl[b] == qsl[a] + 1 &&
                         std::equal(tables + head, tables + head + (seq_lens[b] + block_size - 1) / block_size,
                                    tables + b * width);
      if (!joins) tiles.push_back(int64_t(i));
    }
    if (!seqs.empty()) tiles.push_back(int64_t(seqs.size()));
  }
};

// First key the decoding query (at position seq_len - 1) sees.
template <typename KV>
inline int64_t first_key(const Job<KV>& job, int64_t len) {
  return job.window > 0 ? std::max<int64_t>(0, len - job.window) : 0;
}

// Attention of one (sequence, KV head) over its keys k0 .. k1 - 1, unnormalized: for each of
// its query heads g, m[g] the largest score, l[g] the sum of exp(score - m[g]) and o[g] the
// values weighted by those exps. run_task divides o by l; decoder_layer.cc merges the partial
// results of several key ranges of one task (flash-decoding) when a lone sequence's few tasks
// would leave a thread idle.
template <typename KV>
void attend_keys(const Job<KV>& job, int64_t seq, int64_t h, int64_t k0, int64_t k1, std::vector<float>& scores,
                 float* m, float* l, float* o) {
  const int64_t row = job.qsl[seq], bs = job.block_size, g_num = job.group, dim = job.dim, len = k1 - k0;
  const int64_t hq = job.hkv * g_num;
  const float* q = job.q + (row * hq + h * g_num) * dim;  // this KV head's query heads, back to back
  const int32_t* table = job.tables + seq * job.width;
  scores.resize(g_num * len);  // scores[g * len + i] is key k0 + i
  for (int64_t t = k0; t < k1; ++t) {
    const KV* key = job.k + ((int64_t(table[t / bs]) * bs + t % bs) * job.hkv + h) * dim;
    for (int64_t g = 0; g < g_num; ++g) {
      const float* qg = q + g * dim;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < dim; ++d) acc += qg[d] * to_f32(key[d]);
      scores[g * len + t - k0] = acc * job.scale;
    }
  }
  exp_rows(scores.data(), g_num, len, m, l);
  std::fill(o, o + g_num * dim, 0.0f);
  for (int64_t t = k0; t < k1; ++t) {
    const KV* value = job.v + ((int64_t(table[t / bs]) * bs + t % bs) * job.hkv + h) * dim;
    for (int64_t g = 0; g < g_num; ++g) {
      const float p = scores[g * len + t - k0];
      float* og = o + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) og[d] += p * to_f32(value[d]);
    }
  }
}

// f(i, key_or_value) for the keys first .. end - 1 of a (sequence, KV head), a page at a time
// (one division per page, not per key). A head's slots are short strided reads (dim values
// every hkv * dim) that the hardware prefetchers do not follow, so every slot asks for the same
// slot of the next page, and a pass over the keys asks for the values' slots too (`later`: the
// cache the next pass reads) into L2: a one-sequence decode's attention took 27 -> 20 us a
// SmolLM2 layer at 300 tokens of f32 pages (docs/BENCHMARKS.md section 18, seventh pass).
template <typename KV, typename F>
inline void for_each_slot(const Job<KV>& job, const KV* cache, const int32_t* table, int64_t h, int64_t first,
                          int64_t end, F f, const KV* later = nullptr) {
  const int64_t bs = job.block_size, stride = job.hkv * job.dim, bytes = job.dim * int64_t(sizeof(KV));
  for (int64_t t = first; t < end;) {
    const int64_t off = t % bs, n = std::min(bs - off, end - t);
    const KV* slot = cache + ((int64_t(table[t / bs]) * bs + off) * job.hkv + h) * job.dim;
    const char* ahead = t + n < end ? reinterpret_cast<const char*>(
        cache + (int64_t(table[(t + n) / bs]) * bs * job.hkv + h) * job.dim) : nullptr;
    for (int64_t i = 0; i < n; ++i, slot += stride) {
      if (ahead != nullptr)
        for (int64_t j = 0; j < bytes; j += 64) _mm_prefetch(ahead + i * stride * int64_t(sizeof(KV)) + j, _MM_HINT_T0);
      if (later != nullptr)
        for (int64_t j = 0; j < bytes; j += 64)
          _mm_prefetch(reinterpret_cast<const char*>(later + (slot - cache)) + j, _MM_HINT_T1);
      f(t - first + i, slot);
    }
    t += n;
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// attend_keys with kG query heads per KV head and head_dim 16 * kC held in registers (the
// generic loops' per-key loop set-up cost more than their arithmetic at head_dim 64).
template <typename KV, int kG, int kC>
void attend_keys_avx512(const Job<KV>& job, int64_t seq, int64_t h, int64_t k0, int64_t k1,
                        std::vector<float>& scores, float* m, float* l, float* o) {
  const int64_t row = job.qsl[seq], len = k1 - k0, dim = 16 * kC, hq = job.hkv * kG;
  const float* q = job.q + (row * hq + h * kG) * dim;
  const int32_t* table = job.tables + seq * job.width;
  scores.resize(kG * len);
  __m512 qv[kG][kC];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * dim + 16 * c), _mm512_set1_ps(job.scale));
  float* s = scores.data();
  for_each_slot(job, job.k, table, h, k0, k1, [&](int64_t i, const KV* key) {
    __m512 kv[kC];
    for (int c = 0; c < kC; ++c) kv[c] = load16(key + 16 * c);
    for (int g = 0; g < kG; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < kC; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
      s[g * len + i] = _mm512_reduce_add_ps(acc);
    }
  }, job.v);
  exp_rows(scores.data(), kG, len, m, l);
  __m512 ov[kG][kC];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) ov[g][c] = _mm512_setzero_ps();
  for_each_slot(job, job.v, table, h, k0, k1, [&](int64_t i, const KV* value) {
    __m512 vv[kC];
    for (int c = 0; c < kC; ++c) vv[c] = load16(value + 16 * c);
    for (int g = 0; g < kG; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * len + i]);
      for (int c = 0; c < kC; ++c) ov[g][c] = _mm512_fmadd_ps(p, vv[c], ov[g][c]);
    }
  });
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) _mm512_storeu_ps(o + g * dim + 16 * c, ov[g][c]);
}

template <typename KV, int kC>
bool attend_keys_group(const Job<KV>& job, int64_t seq, int64_t h, int64_t k0, int64_t k1,
                       std::vector<float>& scores, float* m, float* l, float* o) {
  switch (job.group) {
#define PJ_GROUP(g) \
  case g: attend_keys_avx512<KV, g, kC>(job, seq, h, k0, k1, scores, m, l, o); return true;
    PJ_GROUP(1) PJ_GROUP(2) PJ_GROUP(3) PJ_GROUP(4) PJ_GROUP(5) PJ_GROUP(6) PJ_GROUP(7) PJ_GROUP(8)
#undef PJ_GROUP
    default: return false;
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The 8 sums of a[0..7]'s lanes, as one register (lane j: the sum of a[j]).
inline __m256 sum8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // u0: a[0..3]'s sums of lanes 0-3, then of lanes 4-7 (u1 likewise a[4..7])
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// attend_keys on AVX2 (8 floats a register) with kG query heads per KV head and head_dim
// 8 * kC: the scores of a key from the key held in registers, then the values kP registers of
// each query head's output at a time (kG * kP accumulators fit the 16 registers). Like the
// AVX-512 loops it serves a split key range too, where the generic loops' per-key set-up
// would cost more than their arithmetic (docs/BENCHMARKS.md, tenth pass, measures both).
template <typename KV, int kG, int kC>
void attend_keys_avx2(const Job<KV>& job, int64_t seq, int64_t h, int64_t k0, int64_t k1,
                      std::vector<float>& scores, float* m, float* l, float* o) {
  constexpr int kP = kG <= 3 ? 4 : kG <= 6 ? 2 : 1;
  static_assert(kC % kP == 0, "kP columns divide the head");
  const int64_t row = job.qsl[seq], len = k1 - k0, dim = 8 * kC, hq = job.hkv * kG;
  const float* q = job.q + (row * hq + h * kG) * dim;
  const int32_t* table = job.tables + seq * job.width;
  scores.resize(kG * len);  // scores[g * len + i] is key k0 + i
  float* s = scores.data();
  alignas(32) float qs[kG * 8 * kC];  // the query heads, scaled
  for (int64_t j = 0; j < kG * dim; ++j) qs[j] = q[j] * job.scale;
  for_each_slot(job, job.k, table, h, k0, k1, [&](int64_t i, const KV* key) {
    __m256 kv[kC];
    for (int c = 0; c < kC; ++c) kv[c] = load8(key + 8 * c);
    for (int g = 0; g < kG; ++g) {
      __m256 a0 = _mm256_mul_ps(_mm256_load_ps(qs + g * dim), kv[0]), a1 = _mm256_setzero_ps();
      for (int c = 1; c < kC; ++c) {
        const __m256 t = _mm256_load_ps(qs + g * dim + 8 * c);
        if (c & 1) a1 = _mm256_fmadd_ps(t, kv[c], a1); else a0 = _mm256_fmadd_ps(t, kv[c], a0);
      }
      s[g * len + i] = hsum8(_mm256_add_ps(a0, a1));
    }
  }, job.v);
  exp_rows(s, kG, len, m, l);
  for (int c0 = 0; c0 < kC; c0 += kP) {
    __m256 acc[kG][kP];
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kP; ++c) acc[g][c] = _mm256_setzero_ps();
    for_each_slot(job, job.v, table, h, k0, k1, [&](int64_t i, const KV* value) {
      __m256 vv[kP];
      for (int c = 0; c < kP; ++c) vv[c] = load8(value + 8 * (c0 + c));
      for (int g = 0; g < kG; ++g) {
        const __m256 p = _mm256_set1_ps(s[g * len + i]);
        for (int c = 0; c < kP; ++c) acc[g][c] = _mm256_fmadd_ps(p, vv[c], acc[g][c]);
      }
    });
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kP; ++c) _mm256_storeu_ps(o + g * dim + 8 * (c0 + c), acc[g][c]);
  }
}

template <typename KV, int kC>
bool attend_keys_group(const Job<KV>& job, int64_t seq, int64_t h, int64_t k0, int64_t k1,
                       std::vector<float>& scores, float* m, float* l, float* o) {
  switch (job.group) {
#define PJ_GROUP(g) \
  case g: attend_keys_avx2<KV, g, kC>(job, seq, h, k0, k1, scores, m, l, o); return true;
    PJ_GROUP(1) PJ_GROUP(2) PJ_GROUP(3) PJ_GROUP(4) PJ_GROUP(5) PJ_GROUP(6) PJ_GROUP(7) PJ_GROUP(8)
#undef PJ_GROUP
    default: return false;
  }
}

// Rows a tile takes (Job::make_tiles): the query vectors of 4 rows of a group of 3 (SmolLM2)
// are 12, what the loops below keep in flight per key.
constexpr int64_t kTileRows = 4;

// The attention of one tile's rows (consecutive tokens of one sequence: row r of n at key end
// end0 + r) for KV head h, normalized, with head_dim 8 * kC: each key and value is read once
// for the tile's n * group query vectors, where a row at a time reads them once a row (a
// prefill chunk of T tokens otherwise reads a sequence's keys T times). Keys k0 .. k1 - 1 (k0
// the first row's first, k1 the last row's end); a row's scores outside its own keys are 0
// after the softmax, so they add exactly nothing to its values' sum.
template <typename KV, int kC>
void run_tile_avx2(const Job<KV>& job, int64_t tile, int64_t h) {
  const int64_t first_row = job.seqs[job.tiles[tile]], n = job.tiles[tile + 1] - job.tiles[tile];
  const int64_t g_num = job.group, nq = n * g_num, dim = 8 * kC, hq = job.hkv * g_num, bs = job.block_size;
  const int64_t end0 = job.seq_lens[first_row], k0 = first_key(job, end0), k1 = end0 + n - 1;
  const int64_t len = k1 - k0, lp = (len + 3) / 4 * 4;  // scores rows padded to whole 4-key steps
  const int32_t* table = job.tables + first_row * job.width;
  thread_local std::vector<const KV*> slots;  // each key's, then each value's (the last repeats as padding)
  thread_local std::vector<float> scores, qs;  // scores[v * lp + i]: query vector v, key k0 + i
  slots.resize(2 * lp);
  const KV** keys = slots.data();
  const KV** values = keys + lp;
  for (int64_t i = 0; i < lp; ++i) {
    const int64_t t = k0 + std::min(i, len - 1), slot = (int64_t(table[t / bs]) * bs + t % bs) * job.hkv + h;
    keys[i] = job.k + slot * dim;
    values[i] = job.v + slot * dim;
  }
  // Query vector v = r * group + g: row r's query head h * group + g, scaled.
  qs.resize(nq * dim + dim);  // + one spare vector: an odd count's last pair repeats it
  for (int64_t r = 0; r < n; ++r) {
    const float* q = job.q + (job.qsl[first_row + r] * hq + h * g_num) * dim;
    for (int64_t j = 0; j < g_num * dim; ++j) qs[r * g_num * dim + j] = q[j] * job.scale;
  }
  std::copy(qs.begin() + (nq - 1) * dim, qs.begin() + nq * dim, qs.begin() + nq * dim);
  scores.resize((nq + 1) * lp);
  float* s = scores.data();
  const float* qv = qs.data();
  // Scores, 4 keys x 2 query vectors at a time: 8 registers of partial sums, 6 loads for 8 FMAs.
  for (int64_t b = 0; b < lp; b += 4) {
    if (b + 8 < lp)  // the step after next's keys
      for (int j = 0; j < 4; ++j)
        for (int64_t x = 0; x < dim * int64_t(sizeof(KV)); x += 64)
          _mm_prefetch(reinterpret_cast<const char*>(keys[b + 8 + j]) + x, _MM_HINT_T0);
    const KV* kp[4] = {keys[b], keys[b + 1], keys[b + 2], keys[b + 3]};
    for (int64_t v = 0; v < nq; v += 2) {
      const float *q0 = qv + v * dim, *q1 = q0 + dim;
      __m256 a[8];
      for (int j = 0; j < 4; ++j) {
        const __m256 kv = load8(kp[j]);
        a[j] = _mm256_mul_ps(_mm256_loadu_ps(q0), kv);
        a[4 + j] = _mm256_mul_ps(_mm256_loadu_ps(q1), kv);
      }
      for (int c = 1; c < kC; ++c) {
        const __m256 x0 = _mm256_loadu_ps(q0 + 8 * c), x1 = _mm256_loadu_ps(q1 + 8 * c);
        for (int j = 0; j < 4; ++j) {
          const __m256 kv = load8(kp[j] + 8 * c);
          a[j] = _mm256_fmadd_ps(x0, kv, a[j]);
          a[4 + j] = _mm256_fmadd_ps(x1, kv, a[4 + j]);
        }
      }
      const __m256 sums = sum8x8(a);  // vector v's 4 scores, then v + 1's
      _mm_storeu_ps(s + v * lp + b, _mm256_castps256_ps128(sums));
      _mm_storeu_ps(s + (v + 1) * lp + b, _mm256_extractf128_ps(sums, 1));
    }
  }
  // Softmax numerators of each row's own keys; 0 elsewhere.
  thread_local std::vector<float> stats;
  stats.resize(2 * nq);
  for (int64_t v = 0; v < nq; ++v) {
    const int64_t end = end0 + v / g_num, lo = first_key(job, end) - k0, hi = end - k0;
    float* row = s + v * lp;
    exp_rows(row + lo, 1, hi - lo, &stats[v], &stats[nq + v]);
    std::fill(row, row + lo, 0.0f);
    std::fill(row + hi, row + lp, 0.0f);
  }
  // Values, in blocks of 64 keys (16 KB of f32 values at head_dim 64, kept in L1 across the
  // passes), 3 query vectors x 4 registers of a head at a time.
  constexpr int kP = 4, kV = 3;
  static_assert(kC % kP == 0, "kP columns divide the head");
  for (int64_t b0 = 0; b0 < lp; b0 += 64) {
    const int64_t b1 = std::min(lp, b0 + 64);
    for (int64_t v0 = 0; v0 < nq; v0 += kV) {
      const int nv = int(std::min<int64_t>(kV, nq - v0));
      for (int c0 = 0; c0 < kC; c0 += kP) {
        __m256 acc[kV][kP];
        float* o[kV];
        for (int u = 0; u < kV; ++u) {
          const int64_t v = v0 + std::min(u, nv - 1);
          o[u] = job.out + (job.qsl[first_row + v / g_num] * hq + h * g_num + v % g_num) * dim + 8 * c0;
          for (int c = 0; c < kP; ++c) acc[u][c] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o[u] + 8 * c);
        }
        const float* p[kV];
        for (int u = 0; u < kV; ++u) p[u] = s + (v0 + std::min(u, nv - 1)) * lp;
        for (int64_t i = b0; i < b1; ++i) {  // kV weights, kV * kP sums and a value: the 16 registers
          __m256 w[kV];
          for (int u = 0; u < kV; ++u) w[u] = _mm256_broadcast_ss(p[u] + i);
          for (int c = 0; c < kP; ++c) {
            const __m256 vv = load8(values[i] + 8 * (c0 + c));
            for (int u = 0; u < kV; ++u) acc[u][c] = _mm256_fmadd_ps(w[u], vv, acc[u][c]);
          }
        }
        // (all kV: a repeated vector's sums are its own, and a loop to nv kept acc in memory)
        for (int u = 0; u < kV; ++u)
          for (int c = 0; c < kP; ++c) _mm256_storeu_ps(o[u] + 8 * c, acc[u][c]);
      }
    }
  }
  for (int64_t v = 0; v < nq; ++v) {
    float* o = job.out + (job.qsl[first_row + v / g_num] * hq + h * g_num + v % g_num) * dim;
    const float inv = 1.0f / stats[nq + v];
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

template <typename KV>
bool run_tile_any(const Job<KV>& job, int64_t tile, int64_t h) {
  if (job.dim == 64) return run_tile_avx2<KV, 8>(job, tile, h), true;
  if (job.dim == 128) return run_tile_avx2<KV, 16>(job, tile, h), true;
  return false;
}
#endif

#if defined(__AVX512F__) || !defined(__AVX2__) || !defined(__FMA__)
// Tiles of one row: the AVX-512 builds' row loops were not measured against run_tile_avx2 (the
// tiles' gain was measured on an AVX2-only CPU, docs/BENCHMARKS.md), the portable loops have none.
constexpr int64_t kTileRows = 1;
template <typename KV>
bool run_tile_any(const Job<KV>&, int64_t, int64_t) { return false; }
#endif

// attend_keys on the fastest loops this build has for the shape.
template <typename KV>
void attend_keys_any(const Job<KV>& job, int64_t seq, int64_t h, int64_t k0, int64_t k1, std::vector<float>& scores,
                     float* m, float* l, float* o) {
#if defined(__AVX512F__)
  if (job.dim == 64 && attend_keys_group<KV, 4>(job, seq, h, k0, k1, scores, m, l, o)) return;
  if (job.dim == 128 && attend_keys_group<KV, 8>(job, seq, h, k0, k1, scores, m, l, o)) return;
#elif defined(__AVX2__) && defined(__FMA__)
  if (job.dim == 64 && attend_keys_group<KV, 8>(job, seq, h, k0, k1, scores, m, l, o)) return;
  if (job.dim == 128 && attend_keys_group<KV, 16>(job, seq, h, k0, k1, scores, m, l, o)) return;
#endif
  attend_keys(job, seq, h, k0, k1, scores, m, l, o);
}

// The attention of one (sequence, KV head): its keys in one range, the outputs divided by l.
template <typename KV>
void run_task(const Job<KV>& job, int64_t seq, int64_t h, std::vector<float>& scores) {
  const int64_t end = job.seq_lens[seq], g_num = job.group, dim = job.dim, hq = job.hkv * g_num;
  float* out = job.out + (job.qsl[seq] * hq + h * g_num) * dim;
  thread_local std::vector<float> stats;  // m, then l (kept: a task allocating its own cost a malloc)
  stats.resize(2 * g_num);
  attend_keys_any(job, seq, h, first_key(job, end), end, scores, stats.data(), stats.data() + g_num, out);
  for (int64_t g = 0; g < g_num; ++g) {
    const float inv = 1.0f / stats[g_num + g];
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] *= inv;
  }
}

// The attention of one (tile, KV head): its rows together, or a lone row on its own.
template <typename KV>
void run_tile(const Job<KV>& job, int64_t tile, int64_t h, std::vector<float>& scores) {
  if (job.tiles[tile + 1] - job.tiles[tile] > 1 && run_tile_any(job, tile, h)) return;
  for (int64_t i = job.tiles[tile]; i < job.tiles[tile + 1]; ++i) run_task(job, job.seqs[i], h, scores);
}

template <typename KV>
void run_tasks(Job<KV>& job) {
  const int64_t num_tasks = job.num_tiles() * job.hkv;
  thread_local std::vector<float> scores;  // grown once per thread, not per call
  for (int64_t i; (i = job.next.fetch_add(1)) < num_tasks;) {
    run_tile(job, i / job.hkv, i % job.hkv, scores);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace

#endif  // PAGED_JAX_PAGED_ATTENTION_H_
