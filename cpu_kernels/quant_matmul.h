// y[M, N] = x[M, K] @ W[N, K]^T with W kept in a compact format and dequantized inside the
// dot product, never as a whole f32 copy (cpu_kernels/quant_matmul.py is the public entry,
// defines the layouts and holds the numpy reference).
//
// Layouts. bf16: one row of K u16 (bfloat16 bits) per output. q8_0 and q4_1 hold GGUF's block
// values (32 inputs a block, an f16 scale d, q4_1 an f16 min m) rearranged in tiles of 16
// output rows, so one 512-bit register holds the same inputs of 16 rows: data[t] is tile t
// (rows 16t..16t+15), its K/32 tile blocks back to back; a tile block b, for lane i (row) and
// byte u (0..3) of each 32-bit lane of its L-th 64-byte load:
//   q8_0 (544 B): f16 d[16], then 8 loads:  byte = q[i][32b + 4L + u] ^ 0x80      (q + 128)
//   q4_1 (320 B): f16 d[16], f16 m[16], then 4 loads: low nibble = q[i][32b + 4L + u],
//                 high nibble = q[i][32b + 16 + 4L + u]                         (w = d q + m)
//
// Two kinds of activations:
//   f32 (exact): every product is f32 of the dequantized value, so the result is the f32
//     matmul of the dequantized weight up to summation order.
//   i8 (llama.cpp's way): x is quantized per block of 32 to int8 with scale amax / 127 (round
//     half to even), and each block's integer dot runs on AVX-512 VNNI (vpdpbusd: the weight's
//     bytes are the unsigned operand, x's the signed one) or AVX2 (vpmaddubsw + vpmaddwd). Integer sums are exact; the only
//     loss is x's rounding (docs/BENCHMARKS.md measures its quality).
//
// One call multiplies x by several weights of the same format and inputs (a layer's q, k and v,
// or gate and up): x is prepared once, and the tiles of every weight are one list of work.
// That list is split over the kernels' helper threads (thread_team.h); each takes chunks of
// tiles from an atomic counter and the calling thread works too, so no task ever waits for
// another.
//
// The kernel itself, shared by quant_matmul.cc (the matmul's own handler) and decoder_layer.cc.

#ifndef PAGED_JAX_QUANT_MATMUL_H_
#define PAGED_JAX_QUANT_MATMUL_H_

#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {


constexpr int64_t kBlock = 32;      // inputs per q8_0 / q4_1 block
constexpr int64_t kTile = 16;       // output rows per tile
// x rows sharing one pass over a tile. The AVX-512 int8 loops keep 8 rows' accumulators in
// registers (a verification step of 1 + k <= 8 tokens then reads each tile once); the f32 and
// AVX2 loops need more registers per row.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kMaxRows = 8;
#else
constexpr int kMaxRows = 4;
#endif
constexpr int kMaxRowsF32 = 4;
// Tiles a task takes at once. A decode-sized x (one pass of its rows over each tile) streams the
// weight from memory, and each thread's chunks are what the prefetch-ahead below follows: its
// first kPrefetchBytes are not asked for early, and its last are asked for by a thread that
// moves on elsewhere. Chunks of 8 tiles (~46 KB of q4_1 at K = 576) instead of 2 took a
// SmolLM2 layer's matmuls ~10% less time inside a decode step (docs/BENCHMARKS.md section 18,
// seventh pass). A larger x is compute-bound, and 2-tile chunks balance its threads' work.
inline int64_t chunk_tiles(int64_t m) { return m <= kMaxRows ? 8 : 2; }
// How far ahead of the tile block being read each loop asks for the weight's bytes: a chunk is
// a short stream (2 tiles, ~12-20 KB at K = 576) that the hardware prefetchers barely ramp up
// on, and two cores alone did not keep enough reads in flight (a 30-layer decode stack 4.6 ->
// 3.9 ms with it on a Sapphire Rapids; 2 and 8 KB ahead were no better: docs/BENCHMARKS.md).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int kMaxParts = 4;        // weights one call takes

enum Format { kQ8_0 = 0, kQ4_1 = 1, kBF16 = 2 };
enum Acts { kF32 = 0, kI8 = 1 };

constexpr int64_t tile_block_bytes(int format) { return format == kQ8_0 ? 544 : 320; }

// Asks for the bytes of the tile block kPrefetchBytes past p (one request a cache line), as
// non-temporal: a decode step streams every weight once (~100 MB for SmolLM2 against a 32 MB
// L3), and lines asked for at T0 went on into the L3 as they left the L2, pushing out what the
// step reads again (the KV pages, the activations, the host's own working set). With NTA,
// single-stream decode of SmolLM2 int8 on a Zen 5 was 1.21x (1-token context) and 1.09x
// (300 tokens) faster, greedy tokens unchanged (docs/BENCHMARKS.md section 18, seventeenth pass).
template <int64_t kBytes>
inline void prefetch_ahead(const uint8_t* p) {
  for (int64_t j = 0; j < kBytes; j += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + j, _MM_HINT_NTA);
}

inline float f16_to_f32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One weight of a call: n outputs in num_tiles tiles, its chunks numbered from first_chunk.
struct Part {
  const uint8_t* w;
  float* y;
  int64_t n, num_tiles, first_chunk;
};

struct Work {
  const float* x;
  int64_t m, k;
  Part parts[kMaxParts];
  int num_parts;
  int64_t chunk_tiles;  // chunk_tiles(m)
  int64_t num_chunks;
  // x's side inputs (prepare_x), in memory the caller attached (attach_side) or, without it,
  // memory the Work allocates and owns.
  float* xsum = nullptr;    // [m, k / 32] block sums of x (f32 activations)
  int8_t* xq = nullptr;     // [m, k] x quantized (i8 activations)
  float* xd = nullptr;      // [m, k / 32] its scales
  int32_t* xqs = nullptr;   // [m, k / 32] sums of its quantized values
  struct Free { void operator()(char* p) const { std::free(p); } };
  std::unique_ptr<char, Free> side;
  // Chunks taken (take_chunk): the low 32 bits count those taken from the front, the high 32
  // bits those taken from the back.
  std::atomic<int64_t> taken{0};
  std::atomic<int64_t> done{0};
};

// The next chunk of wk for a thread that takes them from the front (0, 1, ...) or from the back
// (num_chunks - 1, ...), or -1 when none is left: the first num_chunks takes, from either end,
// are the valid ones, so the two ends meet without a chunk taken twice. Taking from both ends
// lets each thread know before a phase opens which bytes it will read first (decoder_layer.cc
// asks for them while it waits).
inline int64_t take_chunk(Work& wk, bool from_back) {
  const int64_t old = wk.taken.fetch_add(from_back ? int64_t(1) << 32 : 1);
  const int64_t front = old & 0xffffffff, back = old >> 32;
  if (front + back >= wk.num_chunks) return -1;
  return from_back ? wk.num_chunks - 1 - back : front;
}

// out[i][lane] for r rows of x (rows i0..i0+r-1) and one tile's 16 outputs (`rows` of them
// real: the last tile of a weight whose n is not a multiple of 16 has fewer).
template <int kFormat, int kActs>
void tile_dot(const Work& wk, const uint8_t* tile, int64_t rows, int64_t i0, int r, float (*out)[kTile]);

// Portable version of every (format, activations) pair: each tile block is unpacked into
// plain arrays first (the compiler vectorizes the loops for the machine it builds on).
template <int kFormat>
void unpack_block(const uint8_t* p, float* d, float* m, int32_t (*q)[kBlock]) {
  for (int i = 0; i < kTile; ++i) {
    d[i] = f16_to_f32(p + 2 * i);
    m[i] = kFormat == kQ4_1 ? f16_to_f32(p + 32 + 2 * i) : 0.0f;
  }
  const uint8_t* qs = p + (kFormat == kQ8_0 ? 32 : 64);
  const int loads = kFormat == kQ8_0 ? 8 : 4;
  for (int L = 0; L < loads; ++L)
    for (int i = 0; i < kTile; ++i)
      for (int u = 0; u < 4; ++u) {
        const uint8_t byte = qs[L * 64 + i * 4 + u];
        if (kFormat == kQ8_0) {
          q[i][4 * L + u] = int32_t(byte) - 128;
        } else {
          q[i][4 * L + u] = byte & 15;
          q[i][16 + 4 * L + u] = byte >> 4;
        }
      }
}

template <int kFormat, int kActs>
void tile_dot_portable(const Work& wk, const uint8_t* tile, int64_t i0, int r, float (*out)[kTile]) {
  const int64_t nb = wk.k / kBlock;
  float d[kTile], m[kTile];
  int32_t q[kTile][kBlock];
  for (int i = 0; i < r; ++i)
    for (int l = 0; l < kTile; ++l) out[i][l] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    unpack_block<kFormat>(tile + b * tile_block_bytes(kFormat), d, m, q);
    for (int i = 0; i < r; ++i) {
      const int64_t row = i0 + i;
      for (int l = 0; l < kTile; ++l) {
        if (kActs == kF32) {
          const float* xb = wk.x + row * wk.k + b * kBlock;
          float t = 0.0f;
          for (int j = 0; j < kBlock; ++j) t += float(q[l][j]) * xb[j];
          out[i][l] += d[l] * t + m[l] * wk.xsum[row * nb + b];
        } else {
          const int8_t* xb = wk.xq + row * wk.k + b * kBlock;
          int32_t t = 0;
          for (int j = 0; j < kBlock; ++j) t += q[l][j] * int32_t(xb[j]);
          const float dx = wk.xd[row * nb + b];
          out[i][l] += float(t) * (d[l] * dx) + m[l] * (dx * float(wk.xqs[row * nb + b]));
        }
      }
    }
  }
}

#if defined(__AVX2__) && defined(__F16C__)
// Also where AVX-512 F + BW have no VNNI (Skylake-SP): the int8 loops are then the AVX2 ones.
inline __m256 load_f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load_f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

template <int r>
void avx_q4_1_f32(const Work& wk, const uint8_t* tile, int64_t i0, float (*out)[kTile]) {
  const int64_t nb = wk.k / kBlock;
  const __m512i nibble = _mm512_set1_epi32(15);
  __m512 acc[r];
  for (int i = 0; i < r; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = tile + b * 320;
    if (i0 == 0) prefetch_ahead<320>(p);  // later row passes find the tile in cache
    const __m512 d = load_f16x16(p), m = load_f16x16(p + 32);
    // Four chains a row (low / high nibbles, even / odd bytes) so FMAs do not wait on each other.
    __m512 part[r][4];
    for (int i = 0; i < r; ++i) part[i][0] = part[i][1] = part[i][2] = part[i][3] = _mm512_setzero_ps();
    for (int L = 0; L < 4; ++L) {
      const __m512i v = _mm512_loadu_si512(p + 64 + 64 * L);
      for (int u = 0; u < 4; ++u) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * u), nibble));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * u + 4), nibble));
        for (int i = 0; i < r; ++i) {
          const float* xb = wk.x + (i0 + i) * wk.k + b * kBlock;
          part[i][u & 1] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[4 * L + u]), part[i][u & 1]);
          part[i][2 + (u & 1)] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[16 + 4 * L + u]), part[i][2 + (u & 1)]);
        }
      }
    }
    for (int i = 0; i < r; ++i) {
      const __m512 dot = _mm512_add_ps(_mm512_add_ps(part[i][0], part[i][1]), _mm512_add_ps(part[i][2], part[i][3]));
      acc[i] = _mm512_fmadd_ps(dot, d, acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(wk.xsum[(i0 + i) * nb + b]), acc[i]);
    }
  }
  for (int i = 0; i < r; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

template <int r>
void avx_q8_0_f32(const Work& wk, const uint8_t* tile, int64_t i0, float (*out)[kTile]) {
  const int64_t nb = wk.k / kBlock;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 acc[r];
  for (int i = 0; i < r; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = tile + b * 544;
    if (i0 == 0) prefetch_ahead<544>(p);  // later row passes find the tile in cache
    const __m512 d = load_f16x16(p);
    __m512 part[r][2];
    for (int i = 0; i < r; ++i) part[i][0] = part[i][1] = _mm512_setzero_ps();
    for (int L = 0; L < 8; ++L) {
      // The stored byte is q ^ 0x80: flipped back, each byte sign-extends to q exactly.
      const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(p + 32 + 64 * L), flip);
      for (int u = 0; u < 4; ++u) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * u), 24));
        for (int i = 0; i < r; ++i) {
          const float* xb = wk.x + (i0 + i) * wk.k + b * kBlock;
          part[i][u & 1] = _mm512_fmadd_ps(q, _mm512_set1_ps(xb[4 * L + u]), part[i][u & 1]);
        }
      }
    }
    for (int i = 0; i < r; ++i) acc[i] = _mm512_fmadd_ps(_mm512_add_ps(part[i][0], part[i][1]), d, acc[i]);
  }
  for (int i = 0; i < r; ++i) _mm512_storeu_ps(out[i], acc[i]);
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (no AVX-512): the same tiles, each 64-byte load as two 32-byte halves of 8 rows. A
// half's accumulators are r x (2 chains + 1) registers of the 16, so the halves run one after
// the other over the tile (its bytes are in L1 by the second).
template <int r>
void avx2_q4_1_f32(const Work& wk, const uint8_t* tile, int64_t i0, float (*out)[kTile]) {
  const int64_t nb = wk.k / kBlock;
  const __m256i nibble = _mm256_set1_epi32(15);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[r];
    for (int i = 0; i < r; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = tile + b * 320;
      if (i0 == 0) prefetch_ahead<320>(p);  // later row passes find the tile in cache
      const __m256 d = load_f16x8(p + 16 * h), m = load_f16x8(p + 32 + 16 * h);
      __m256 part[r][2];
      for (int i = 0; i < r; ++i) part[i][0] = part[i][1] = _mm256_setzero_ps();
      for (int L = 0; L < 4; ++L) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 + 64 * L + 32 * h));
        for (int u = 0; u < 4; ++u) {
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * u), nibble));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * u + 4), nibble));
          for (int i = 0; i < r; ++i) {
            const float* xb = wk.x + (i0 + i) * wk.k + b * kBlock;
            part[i][0] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xb[4 * L + u]), part[i][0]);
            part[i][1] = _mm256_fmadd_ps(hi, _mm256_set1_ps(xb[16 + 4 * L + u]), part[i][1]);
          }
        }
      }
      for (int i = 0; i < r; ++i) {
        acc[i] = _mm256_fmadd_ps(_mm256_add_ps(part[i][0], part[i][1]), d, acc[i]);
        acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(wk.xsum[(i0 + i) * nb + b]), acc[i]);
      }
    }
    for (int i = 0; i < r; ++i) _mm256_storeu_ps(out[i] + 8 * h, acc[i]);
  }
}

template <int r>
void avx2_q8_0_f32(const Work& wk, const uint8_t* tile, int64_t i0, float (*out)[kTile]) {
  const int64_t nb = wk.k / kBlock;
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (int h = 0; h < 2; ++h) {
    __m256 acc[r];
    for (int i = 0; i < r; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = tile + b * 544;
      if (i0 == 0) prefetch_ahead<544>(p);  // later row passes find the tile in cache
      const __m256 d = load_f16x8(p + 16 * h);
      __m256 part[r][2];
      for (int i = 0; i < r; ++i) part[i][0] = part[i][1] = _mm256_setzero_ps();
      for (int L = 0; L < 8; ++L) {
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 32 + 64 * L + 32 * h)), flip);
        for (int u = 0; u < 4; ++u) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * u), 24));
          for (int i = 0; i < r; ++i) {
            const float* xb = wk.x + (i0 + i) * wk.k + b * kBlock;
            part[i][u & 1] = _mm256_fmadd_ps(q, _mm256_set1_ps(xb[4 * L + u]), part[i][u & 1]);
          }
        }
      }
      for (int i = 0; i < r; ++i) acc[i] = _mm256_fmadd_ps(_mm256_add_ps(part[i][0], part[i][1]), d, acc[i]);
    }
    for (int i = 0; i < r; ++i) _mm256_storeu_ps(out[i] + 8 * h, acc[i]);
  }
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) && defined(__AVX2__) && \
    defined(__FMA__) && defined(__F16C__)
// int8 activations on AVX2 (llama.cpp's way there): vpmaddubsw multiplies the unsigned bytes
// by the signed ones and adds pairs into int16 (saturating), vpmaddwd by ones adds those
// pairs into int32. Neither saturates here: q4_1's nibbles are <= 15, so an int16 lane sums
// 16 products of at most 15 * 127 (30480) over a whole block; q8_0's signed q goes in as |q|
// with its sign moved onto x (vpsignb), so one pair is at most 2 * 128 * 127 (32512) and each
// load's pairs go to int32 at once.
inline __m256i bcast4_256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int r>
void avx2_q4_1_i8(const Work& wk, const uint8_t* tile, int64_t i0, float (*out)[kTile]) {
  const int64_t nb = wk.k / kBlock;
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[r];
    for (int i = 0; i < r; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = tile + b * 320;
      if (i0 == 0) prefetch_ahead<320>(p);  // later row passes find the tile in cache
      const __m256 d = load_f16x8(p + 16 * h), m = load_f16x8(p + 32 + 16 * h);
      __m256i dot[r];
      for (int i = 0; i < r; ++i) dot[i] = _mm256_setzero_si256();
      for (int L = 0; L < 4; ++L) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 + 64 * L + 32 * h));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int i = 0; i < r; ++i) {
          const int8_t* xb = wk.xq + (i0 + i) * wk.k + b * kBlock;
          dot[i] = _mm256_add_epi16(dot[i], _mm256_maddubs_epi16(lo, bcast4_256(xb + 4 * L)));
          dot[i] = _mm256_add_epi16(dot[i], _mm256_maddubs_epi16(hi, bcast4_256(xb + 16 + 4 * L)));
        }
      }
      for (int i = 0; i < r; ++i) {
        const int64_t at = (i0 + i) * nb + b;
        const float dx = wk.xd[at];
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[i], ones));
        acc[i] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[i]);
        acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx * float(wk.xqs[at])), acc[i]);
      }
    }
    for (int i = 0; i < r; ++i) _mm256_storeu_ps(out[i] + 8 * h, acc[i]);
  }
}

template <int r>
void avx2_q8_0_i8(const Work& wk, const uint8_t* tile, int64_t i0, float (*out)[kTile]) {
  const int64_t nb = wk.k / kBlock;
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[r];
    for (int i = 0; i < r; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = tile + b * 544;
      if (i0 == 0) prefetch_ahead<544>(p);  // later row passes find the tile in cache
      const __m256 d = load_f16x8(p + 16 * h);
      __m256i dot[r];
      for (int i = 0; i < r; ++i) dot[i] = _mm256_setzero_si256();
      for (int L = 0; L < 8; ++L) {
        const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 32 + 64 * L + 32 * h)), flip);
        const __m256i aq = _mm256_abs_epi8(q);  // |q|, unsigned (-128 -> 128)
        for (int i = 0; i < r; ++i) {
          const int8_t* xb = wk.xq + (i0 + i) * wk.k + b * kBlock;
          const __m256i sx = _mm256_sign_epi8(bcast4_256(xb + 4 * L), q);  // x * sign(q)
          dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), ones));
        }
      }
      for (int i = 0; i < r; ++i) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(wk.xd[(i0 + i) * nb + b]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), scale, acc[i]);
      }
    }
    for (int i = 0; i < r; ++i) _mm256_storeu_ps(out[i] + 8 * h, acc[i]);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int r>
void avx_q4_1_i8(const Work& wk, const uint8_t* tile, int64_t i0, float (*out)[kTile]) {
  const int64_t nb = wk.k / kBlock;
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 acc[r];
  for (int i = 0; i < r; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = tile + b * 320;
    if (i0 == 0) prefetch_ahead<320>(p);  // later row passes find the tile in cache
    const __m512 d = load_f16x16(p), m = load_f16x16(p + 32);
    __m512i dot[r];
    for (int i = 0; i < r; ++i) dot[i] = _mm512_setzero_si512();
    for (int L = 0; L < 4; ++L) {
      const __m512i v = _mm512_loadu_si512(p + 64 + 64 * L);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      for (int i = 0; i < r; ++i) {
        const int8_t* xb = wk.xq + (i0 + i) * wk.k + b * kBlock;
        dot[i] = _mm512_dpbusd_epi32(dot[i], lo, bcast4(xb + 4 * L));
        dot[i] = _mm512_dpbusd_epi32(dot[i], hi, bcast4(xb + 16 + 4 * L));
      }
    }
    for (int i = 0; i < r; ++i) {
      const int64_t at = (i0 + i) * nb + b;
      const float dx = wk.xd[at];
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx * float(wk.xqs[at])), acc[i]);
    }
  }
  for (int i = 0; i < r; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

template <int r>
void avx_q8_0_i8(const Work& wk, const uint8_t* tile, int64_t i0, float (*out)[kTile]) {
  const int64_t nb = wk.k / kBlock;
  __m512 acc[r];
  for (int i = 0; i < r; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = tile + b * 544;
    if (i0 == 0) prefetch_ahead<544>(p);  // later row passes find the tile in cache
    const __m512 d = load_f16x16(p);
    __m512i dot[r];
    for (int i = 0; i < r; ++i) dot[i] = _mm512_setzero_si512();
    for (int L = 0; L < 8; ++L) {
      const __m512i v = _mm512_loadu_si512(p + 32 + 64 * L);  // q + 128, unsigned
      for (int i = 0; i < r; ++i) {
        const int8_t* xb = wk.xq + (i0 + i) * wk.k + b * kBlock;
        dot[i] = _mm512_dpbusd_epi32(dot[i], v, bcast4(xb + 4 * L));
      }
    }
    for (int i = 0; i < r; ++i) {
      const int64_t at = (i0 + i) * nb + b;
      // sum((q + 128) * xq) - 128 * sum(xq) = sum(q * xq), exactly.
      const __m512i sum = _mm512_sub_epi32(dot[i], _mm512_set1_epi32(128 * wk.xqs[at]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(wk.xd[at])), acc[i]);
    }
  }
  for (int i = 0; i < r; ++i) _mm512_storeu_ps(out[i], acc[i]);
}
#endif

// The kernel of each (format, activations): the AVX-512 (or AVX2) loops where this build has them,
// with r (the rows of x) a template argument so that their accumulators stay in registers.
#define PJ_TILE_DOT(format, acts, fn, available)                                                     \
  template <>                                                                                       \
  void tile_dot<format, acts>(const Work& wk, const uint8_t* tile, int64_t, int64_t i0, int r,       \
                              float (*out)[kTile]) {                                                \
    if (!(available)) return tile_dot_portable<format, acts>(wk, tile, i0, r, out);                 \
    switch (r) {                                                                                    \
      case 1: return fn<1>(wk, tile, i0, out);                                                      \
      case 2: return fn<2>(wk, tile, i0, out);                                                      \
      case 3: return fn<3>(wk, tile, i0, out);                                                      \
      case 4: return fn<4>(wk, tile, i0, out);                                                      \
      case 5: return fn<5>(wk, tile, i0, out);                                                      \
      case 6: return fn<6>(wk, tile, i0, out);                                                      \
      case 7: return fn<7>(wk, tile, i0, out);                                                      \
      default: return fn<8>(wk, tile, i0, out);                                                     \
    }                                                                                               \
  }

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kHasF32Simd = true;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kHasF32Simd = true;  // the AVX2 loops stand in (same tiles, half a tile per register)
template <int r> void avx_q4_1_f32(const Work& wk, const uint8_t* t, int64_t i0, float (*o)[kTile]) {
  avx2_q4_1_f32<r>(wk, t, i0, o);
}
template <int r> void avx_q8_0_f32(const Work& wk, const uint8_t* t, int64_t i0, float (*o)[kTile]) {
  avx2_q8_0_f32<r>(wk, t, i0, o);
}
#else
constexpr bool kHasF32Simd = false;
template <int r> void avx_q4_1_f32(const Work&, const uint8_t*, int64_t, float (*)[kTile]) {}
template <int r> void avx_q8_0_f32(const Work&, const uint8_t*, int64_t, float (*)[kTile]) {}
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kHasI8Simd = true;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kHasI8Simd = true;  // vpmaddubsw + vpmaddwd stand in for vpdpbusd
template <int r> void avx_q4_1_i8(const Work& wk, const uint8_t* t, int64_t i0, float (*o)[kTile]) {
  avx2_q4_1_i8<r>(wk, t, i0, o);
}
template <int r> void avx_q8_0_i8(const Work& wk, const uint8_t* t, int64_t i0, float (*o)[kTile]) {
  avx2_q8_0_i8<r>(wk, t, i0, o);
}
#else
constexpr bool kHasI8Simd = false;
template <int r> void avx_q4_1_i8(const Work&, const uint8_t*, int64_t, float (*)[kTile]) {}
template <int r> void avx_q8_0_i8(const Work&, const uint8_t*, int64_t, float (*)[kTile]) {}
#endif

PJ_TILE_DOT(kQ4_1, kF32, avx_q4_1_f32, kHasF32Simd)
PJ_TILE_DOT(kQ8_0, kF32, avx_q8_0_f32, kHasF32Simd)
PJ_TILE_DOT(kQ4_1, kI8, avx_q4_1_i8, kHasI8Simd)
PJ_TILE_DOT(kQ8_0, kI8, avx_q8_0_i8, kHasI8Simd)

// bf16 rows (not tiled): out[i][l] for the `rows` rows from `tile` of the row-major weight.
template <>
void tile_dot<kBF16, kF32>(const Work& wk, const uint8_t* tile, int64_t rows, int64_t i0, int r,
                           float (*out)[kTile]) {
  for (int64_t l = 0; l < rows; ++l) {
    const uint16_t* wb = reinterpret_cast<const uint16_t*>(tile) + l * wk.k;
#if defined(__AVX512F__)
    __m512 acc[kMaxRowsF32];
    for (int i = 0; i < kMaxRowsF32; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < wk.k; j += 16) {
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(wb + j)));
      const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
      for (int i = 0; i < r; ++i) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(wk.x + (i0 + i) * wk.k + j), wv, acc[i]);
    }
    for (int i = 0; i < r; ++i) out[i][l] = _mm512_reduce_add_ps(acc[i]);
#else
    for (int i = 0; i < r; ++i) {
      float t = 0.0f;
      for (int64_t j = 0; j < wk.k; ++j) {
        uint32_t bits = uint32_t(wb[j]) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        t += wk.x[(i0 + i) * wk.k + j] * f;
      }
      out[i][l] = t;
    }
#endif
  }
}

constexpr int64_t tile_bytes(int format, int64_t k) {
  return format == kBF16 ? kTile * k * 2 : k / kBlock * tile_block_bytes(format);
}

// Takes chunks of wk until none is left; true for the thread that finished its last chunk
// (which then sees every other thread's results: the done counter's acquire-release).
template <int kFormat, int kActs>
bool run_chunks(Work& wk, bool from_back = false) {
  bool last = false;
  const int64_t stride = tile_bytes(kFormat, wk.k);
  float out[kMaxRows][kTile];
  for (int64_t c; (c = take_chunk(wk, from_back)) >= 0;) {
    int p = 0;
    while (p + 1 < wk.num_parts && wk.parts[p + 1].first_chunk <= c) ++p;
    const Part& part = wk.parts[p];
    const int64_t t0 = (c - part.first_chunk) * wk.chunk_tiles;
    const int64_t t1 = std::min(part.num_tiles, t0 + wk.chunk_tiles);
    constexpr int64_t max_rows = kActs == kI8 ? kMaxRows : kMaxRowsF32;
    for (int64_t i0 = 0; i0 < wk.m; i0 += max_rows) {
      const int r = int(std::min<int64_t>(max_rows, wk.m - i0));
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t lanes = std::min<int64_t>(kTile, part.n - t * kTile);
        tile_dot<kFormat, kActs>(wk, part.w + t * stride, lanes, i0, r, out);
        for (int i = 0; i < r; ++i)
          std::memcpy(part.y + (i0 + i) * part.n + t * kTile, out[i], lanes * sizeof(float));
      }
    }
    last = wk.done.fetch_add(1, std::memory_order_acq_rel) + 1 == wk.num_chunks;
  }
  return last;
}

// Bytes of x's side inputs for m rows of k (each array 64-byte aligned).
constexpr int64_t side_bytes(int64_t m, int64_t k) {
  return (m * k + 63) / 64 * 64 + 3 * ((m * (k / kBlock) * 4 + 63) / 64 * 64);
}

// Points wk's side inputs into mem (side_bytes(wk.m, wk.k) bytes, 64-byte aligned), which the
// caller keeps for the Work's life: decoder_layer.cc's layers reuse their scratch, where a
// layer's four matmuls allocating theirs cost a malloc and a free each in the serial work.
inline void attach_side(Work& wk, char* mem) {
  const int64_t blocks = wk.m * (wk.k / kBlock), arr = (blocks * 4 + 63) / 64 * 64;
  wk.xq = reinterpret_cast<int8_t*>(mem);
  mem += (wk.m * wk.k + 63) / 64 * 64;
  wk.xd = reinterpret_cast<float*>(mem);
  wk.xqs = reinterpret_cast<int32_t*>(mem + arr);
  wk.xsum = reinterpret_cast<float*>(mem + 2 * arr);
}

// x's per-block side inputs: block sums (f32 activations) or its int8 quantization.
template <int kActs>
void prepare_x(Work& wk) {
  const int64_t nb = wk.k / kBlock, blocks = wk.m * nb;
  if (wk.xq == nullptr) {
    wk.side.reset(static_cast<char*>(std::aligned_alloc(64, side_bytes(wk.m, wk.k))));
    attach_side(wk, wk.side.get());
  }
  if (kActs == kF32) {
    for (int64_t a = 0; a < blocks; ++a) {
      float s = 0.0f;
      for (int j = 0; j < kBlock; ++j) s += wk.x[a * kBlock + j];
      wk.xsum[a] = s;
    }
    return;
  }
  for (int64_t a = 0; a < blocks; ++a) {
    const float* xb = wk.x + a * kBlock;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // The loop below in registers (the compiler vectorizes neither the max nor the rounding):
    // the same float operations, so the same bytes for finite x.
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.0f;
    const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&wk.xq[a * kBlock]), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&wk.xq[a * kBlock + 16]), _mm512_cvtepi32_epi8(qhi));
    wk.xd[a] = d;
    wk.xqs[a] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#elif defined(__AVX2__)
    // The same in 256-bit registers (the portable loop's nearbyint is a scalar round a value).
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(xb + 8 * j);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                    _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];  // rounded half to even (MXCSR's default mode), |q| <= 127
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
    // int32 -> int8: the packs interleave 128-bit lanes, the permute puts the 4-byte groups back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&wk.xq[a * kBlock]),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    wk.xd[a] = d;
    wk.xqs[a] = _mm_cvtsi128_si32(s4);
#else
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int32_t q = int32_t(std::nearbyint(xb[j] * id));  // half to even (the default mode)
      wk.xq[a * kBlock + j] = int8_t(q);
      s += q;
    }
    wk.xd[a] = d;
    wk.xqs[a] = s;
#endif
  }
}

}  // namespace

#endif  // PAGED_JAX_QUANT_MATMUL_H_
