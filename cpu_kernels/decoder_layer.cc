// One Llama decoder layer of a small batch of tokens as one native call on the CPU
// (cpu_kernels/decoder_layer.py is the entry and holds the jnp reference):
//
//   n1  = rmsnorm(x) * w_in
//   q, k, v = n1 @ Wq, n1 @ Wk, n1 @ Wv; q, k rotated by RoPE (cos, sin given per token)
//   k, v written into the paged cache at slot_mapping
//   a   = attention of every token as a decode row of its own (paged_attention.h: its keys
//         through its table, seq_lens[t] of them, over the cache just written)
//   h   = x + a @ Wo
//   n2  = rmsnorm(h) * w_post
//   out = h + (silu(n2 @ Wg) * (n2 @ Wu)) @ Wd
//
// The matmuls are quant_matmul.h's (weights in q8_0 / q4_1 tiles or bf16 rows, activations
// f32 or quantized to int8 per block), the attention paged_attention.h's (f32 or bf16 caches).
//
// Why one call: as XLA thunks a decode layer is ~20 small fused ops plus five native calls
// (q/k/v, attention, o, gate/up, down), each of which hands its work to a helper thread and
// waits at its end for the last chunk. Here the helper is handed the layer once and stays in
// it: each phase (the four matmuls and the attention) is a list of chunks taken from an atomic
// counter, the thread that finishes a phase's last chunk does the small serial work that
// follows (norm, RoPE and the KV write, SwiGLU, preparing the next matmul's x) and opens the
// next phase, and a helper with nothing to do waits for it spinning, only inside the call. The
// calling thread can do every phase alone, so a helper that starts late, or never, costs only
// time. A thread that waits (for the last chunk, or for the serial work) asks for the weights it
// will read first in the next phase (work below). docs/BENCHMARKS.md section 18 measures it.

#include "paged_attention.h"
#include "quant_matmul.h"
#include "thread_team.h"

#include <cstdlib>

namespace {

enum Phase { kQKV = 0, kAttend = 1, kOut = 2, kGateUp = 3, kDown = 4, kDone = 5 };

// One matmul of the layer (a Work of quant_matmul.h, and the loops of its weights' format).
struct Matmul {
  Work work;
  int64_t stride = 0;  // a tile's bytes
  bool (*run)(Work&, bool from_back) = nullptr;
  void (*prepare)(Work&) = nullptr;  // x's side inputs (none for bf16 rows)
};

template <int kFormat, int kActs>
bool run_matmul(Work& wk, bool from_back) {
  return run_chunks<kFormat, kActs>(wk, from_back);
}
template <int kActs>
void prepare_matmul(Work& wk) {
  prepare_x<kActs>(wk);
}

struct WeightArg {
  const uint8_t* data;
  int64_t rows, bytes;  // the u8 array's shape
  float* y;             // where its outputs go, [m, n]
  int64_t n;            // its outputs
};

// Sets mm up for x [m, k] times the weights of one format; false when a weight's bytes do not
// fit its n and k.
bool set_up(Matmul& mm, int format, int acts, const float* x, int64_t m, int64_t k, const WeightArg* ws, int num) {
  if (format == kBF16) acts = kF32;
  switch (format * 2 + acts) {
    case kQ8_0 * 2 + kF32: mm.run = run_matmul<kQ8_0, kF32>; break;
    case kQ8_0 * 2 + kI8: mm.run = run_matmul<kQ8_0, kI8>; break;
    case kQ4_1 * 2 + kF32: mm.run = run_matmul<kQ4_1, kF32>; break;
    case kQ4_1 * 2 + kI8: mm.run = run_matmul<kQ4_1, kI8>; break;
    case kBF16 * 2 + kF32: mm.run = run_matmul<kBF16, kF32>; break;
    default: return false;
  }
  mm.prepare = format == kBF16 ? nullptr : acts == kI8 ? prepare_matmul<kI8> : prepare_matmul<kF32>;
  mm.stride = tile_bytes(format, k);
  Work& wk = mm.work;
  wk.x = x;
  wk.m = m;
  wk.k = k;
  wk.num_parts = num;
  wk.chunk_tiles = chunk_tiles(m);
  int64_t chunks = 0;
  for (int p = 0; p < num; ++p) {
    const WeightArg& w = ws[p];
    const int64_t num_tiles = format == kBF16 ? (w.n + kTile - 1) / kTile : w.rows;
    if (format == kBF16 ? (w.rows != w.n || w.bytes != 2 * k)
                        : (w.bytes != tile_bytes(format, k) || num_tiles != (w.n + kTile - 1) / kTile))
      return false;
    wk.parts[p] = Part{w.data, w.y, w.n, num_tiles, chunks};
    chunks += (num_tiles + wk.chunk_tiles - 1) / wk.chunk_tiles;
  }
  wk.num_chunks = chunks;
  return true;
}

inline float bf16_round(float f) {  // f32 -> bf16 -> f32, round half to even (XLA's convert)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u) return f;  // inf / nan pass
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline void store(float* dst, float v) { *dst = v; }
inline void store(uint16_t* dst, float v) {
  const float r = bf16_round(v);
  uint32_t bits;
  std::memcpy(&bits, &r, 4);
  *dst = uint16_t(bits >> 16);
}

// out[i] = x[i] / rms(x) * w[i] over d elements (the mean square accumulated in f32).
inline void rms_norm(const float* x, const float* w, float eps, int64_t d, float* out) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / float(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = (x[i] * r) * w[i];
}

// act[i] = silu(g[i]) * u[i] over n elements: silu(g) = g * sigmoid(g), the sigmoid from
// e = exp(-|g|) <= 1 (never overflows). 8 lanes on every AVX2 build: the compiler leaves the
// portable loop scalar, ~0.3 ms of a ~12 ms SmolLM2 decode step on a Zen 1 (one thread), where
// the 8 lanes take ~0.06 ms.
inline void silu_mul(const float* g, const float* u, int64_t n, float* act) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp_nonpositive8(_mm256_or_ps(x, sign));  // exp(-|x|)
    const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, x), _mm256_add_ps(one, e));  // x < 0: e / (1 + e)
    _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float e = exp_nonpositive(-std::fabs(g[i]));
    const float sig = g[i] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    act[i] = g[i] * sig * u[i];
  }
}

// The calling thread's scratch for one layer call, reused by its next (allocating a layer's
// ten buffers took ~2 us of its ~110). Helpers touch it only inside the call: a phase opens
// after its inputs are written, and a helper that comes late finds no chunk left.
float* scratch_for(int64_t n) {
  struct Aligned { void operator()(float* p) const { std::free(p); } };
  thread_local std::unique_ptr<float, Aligned> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < n) {
    buffer.reset(static_cast<float*>(std::aligned_alloc(64, n * sizeof(float))));
    capacity = n;
  }
  return buffer.get();
}

// A lone sequence's (row, KV head) tasks split its keys in up to kMaxSplits ranges of at
// least kSplitKeys (decoder_layer below).
constexpr int64_t kSplitKeys = 128, kMaxSplits = 8;

template <typename KV>
struct Layer {
  // inputs (XLA's buffers; the caches are the aliased results)
  const float *x, *cos, *sin, *w_in, *w_post;
  const int32_t* slots;
  KV *k_cache, *v_cache;
  float* out;
  int64_t t, d, hq, hkv, dim, f;
  float eps;
  int64_t threads;  // the caller and its helpers
  // the phases' work
  Matmul qkv, o, gate_up, down;
  Matmul next_qkv;          // the next layer's q/k/v (only asked for: work below); run == nullptr: none
  Job<KV> attend;
  int64_t num_tasks = 0;
  int64_t splits = 1;          // key ranges per (row, KV head); > 1 only with one-row tiles
  // Scratch in the calling thread's buffer (scratch_for): norms, projections, ..., and
  // `partial` [task][group][dim + 2], attend_keys' o, then m and l (splits > 1).
  float *n, *q, *k, *v, *a, *h, *g, *u, *act, *dn, *partial;
  std::atomic<int> phase{-1};
};

// rope on the heads of one token: x1 = head[:H/2], x2 = head[H/2:] (rotate_half layout).
inline void rope(float* heads, int64_t num_heads, int64_t dim, const float* c, const float* s) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < num_heads; ++j) {
    float* x = heads + j * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[half + i];
      x[i] = x1 * c[i] - x2 * s[i];
      x[half + i] = x2 * c[i] + x1 * s[i];
    }
  }
}

template <typename KV>
void open(Layer<KV>& L, int p);

// The attention of each (row, KV head) from its splits' partial results (attend_keys).
template <typename KV>
void merge_splits(Layer<KV>& L) {
  const Job<KV>& job = L.attend;
  const int64_t g_num = job.group, dim = job.dim, stride = g_num * (dim + 2), hq = job.hkv * g_num;
  for (size_t r = 0; r < job.seqs.size(); ++r)
    for (int64_t h = 0; h < job.hkv; ++h) {
      const float* part = L.partial + (int64_t(r) * job.hkv + h) * L.splits * stride;
      float* out = L.a + (job.qsl[job.seqs[r]] * hq + h * g_num) * dim;
      for (int64_t g = 0; g < g_num; ++g) {
        float mx = -INFINITY;
        for (int64_t sp = 0; sp < L.splits; ++sp) mx = std::max(mx, part[sp * stride + g_num * dim + g]);
        float sum = 0.0f;
        float* og = out + g * dim;
        std::fill(og, og + dim, 0.0f);
        for (int64_t sp = 0; sp < L.splits; ++sp) {
          const float* ps = part + sp * stride;
          if (ps[g_num * dim + g] == -INFINITY) continue;  // an empty range: its o was never written
          const float w = std::exp(ps[g_num * dim + g] - mx);
          sum += w * ps[g_num * dim + g_num + g];
          for (int64_t d = 0; d < dim; ++d) og[d] += w * ps[g * dim + d];
        }
        for (int64_t d = 0; d < dim; ++d) og[d] /= sum;
      }
    }
}

// The serial work after phase p (done by the thread that finished p's last chunk), then p + 1.
template <typename KV>
void finish(Layer<KV>& L, int p) {
  const int64_t t_num = L.t, d = L.d, dim = L.dim, half = dim / 2;
  constexpr bool kBF16Cache = std::is_same_v<KV, uint16_t>;
  switch (p) {
    case kQKV: {
      const int64_t kv_width = L.hkv * dim;
      for (int64_t t = 0; t < t_num; ++t) {
        rope(&L.q[t * L.hq * dim], L.hq, dim, L.cos + t * half, L.sin + t * half);
        rope(&L.k[t * kv_width], L.hkv, dim, L.cos + t * half, L.sin + t * half);
        const int64_t slot = L.slots[t];
        for (int64_t i = 0; i < kv_width; ++i) {
          store(L.k_cache + slot * kv_width + i, L.k[t * kv_width + i]);
          store(L.v_cache + slot * kv_width + i, L.v[t * kv_width + i]);
        }
        if (kBF16Cache)  // the XLA path casts q to the cache dtype before attending
          for (int64_t i = 0; i < L.hq * dim; ++i) L.q[t * L.hq * dim + i] = bf16_round(L.q[t * L.hq * dim + i]);
      }
      break;
    }
    case kAttend:
      if (L.splits > 1) merge_splits(L);
      if (kBF16Cache)  // ... and its output comes back in that dtype
        for (int64_t i = 0; i < t_num * L.hq * dim; ++i) L.a[i] = bf16_round(L.a[i]);
      if (L.o.prepare) L.o.prepare(L.o.work);
      break;
    case kOut:
      for (int64_t t = 0; t < t_num; ++t) {
        for (int64_t i = 0; i < d; ++i) L.h[t * d + i] = L.x[t * d + i] + L.h[t * d + i];  // h held a @ Wo
        rms_norm(&L.h[t * d], L.w_post, L.eps, d, &L.n[t * d]);
      }
      if (L.gate_up.prepare) L.gate_up.prepare(L.gate_up.work);
      break;
    case kGateUp:
      silu_mul(L.g, L.u, t_num * L.f, L.act);
      if (L.down.prepare) L.down.prepare(L.down.work);
      break;
    case kDown:
      for (int64_t i = 0; i < t_num * d; ++i) L.out[i] = L.h[i] + L.dn[i];
      break;
  }
  open(L, p + 1);
}

// Makes phase p the current one (one with no work is finished at once).
template <typename KV>
void open(Layer<KV>& L, int p) {
  if (p == kAttend && L.num_tasks == 0) return finish(L, p);
  L.phase.store(p, std::memory_order_release);
}

// The first matmul phase after phase `seen`, and its Matmul (after the last one, the next
// layer's q/k/v where the call was given them; nullptr: none is left).
template <typename KV>
std::pair<int, Matmul*> next_matmul(Layer<KV>& L, int seen) {
  if (seen < kQKV) return {kQKV, &L.qkv};
  if (seen < kOut) return {kOut, &L.o};
  if (seen < kGateUp) return {kGateUp, &L.gate_up};
  if (seen < kDown) return {kDown, &L.down};
  return {kDone, L.next_qkv.run ? &L.next_qkv : nullptr};
}

// What a waiting thread has asked for of the next matmul phase's weights (work below).
struct IdlePrefetch {
  int phase = -1;
  int64_t chunks = 0;  // its chunks asked for, counted from this thread's end (take_chunk)
  int64_t offset = 0;  // bytes of the next one asked for
  int64_t bytes = 0;
};

// At most this much of a phase's weights is asked for ahead by each waiting thread (its share of
// the phase, at most: prefetch_next).
#ifndef PJ_IDLE_PREFETCH_BYTES
#define PJ_IDLE_PREFETCH_BYTES (512 * 1024)
#endif
constexpr int64_t kIdlePrefetchBytes = PJ_IDLE_PREFETCH_BYTES, kIdlePrefetchStep = 4096;

// Asks for the next kIdlePrefetchStep bytes (into L2) of the weights this thread will read first
// in the first matmul phase after `seen`: the chunks it would take from its end, up to its share
// of them and kIdlePrefetchBytes. False when there is nothing (more) to ask for.
template <typename KV>
bool prefetch_next(Layer<KV>& L, int seen, bool from_back, IdlePrefetch& pf) {
  const auto [p, mm] = next_matmul(L, seen);
  if (mm == nullptr) return false;
  if (pf.phase != p) pf = IdlePrefetch{p};
  const Work& wk = mm->work;
  if (pf.chunks >= (wk.num_chunks + L.threads - 1) / L.threads || pf.bytes >= kIdlePrefetchBytes) return false;
  const int64_t c = from_back ? wk.num_chunks - 1 - pf.chunks : pf.chunks;
  int part = 0;
  while (part + 1 < wk.num_parts && wk.parts[part + 1].first_chunk <= c) ++part;
  const Part& pt = wk.parts[part];
  const int64_t t0 = (c - pt.first_chunk) * wk.chunk_tiles, t1 = std::min(pt.num_tiles, t0 + wk.chunk_tiles);
  const int64_t size = (t1 - t0) * mm->stride, n = std::min(kIdlePrefetchStep, size - pf.offset);
  const char* begin = reinterpret_cast<const char*>(pt.w + t0 * mm->stride + pf.offset);
  for (int64_t j = 0; j < n; j += 64) _mm_prefetch(begin + j, _MM_HINT_T1);
  pf.bytes += n;
  pf.offset += n;
  if (pf.offset == size) ++pf.chunks, pf.offset = 0;
  return true;
}

// This thread's share of phase p; true when it finished the phase's last chunk.
template <typename KV>
bool run_phase(Layer<KV>& L, int p, bool from_back) {
  switch (p) {
    case kQKV: return L.qkv.run(L.qkv.work, from_back);
    case kOut: return L.o.run(L.o.work, from_back);
    case kGateUp: return L.gate_up.run(L.gate_up.work, from_back);
    case kDown: return L.down.run(L.down.work, from_back);
    case kAttend: {
      Job<KV>& job = L.attend;
      thread_local std::vector<float> scores;  // grown once per thread, not per layer
      bool last = false;
      for (int64_t i; (i = job.next.fetch_add(1)) < L.num_tasks;) {
        if (L.splits == 1) {
          run_tile(job, i / job.hkv, i % job.hkv, scores);
        } else {  // task i: row r, KV head h, key range sp of the row's keys
          const int64_t sp = i % L.splits, rh = i / L.splits, seq = job.seqs[rh / job.hkv];
          const int64_t end = job.seq_lens[seq], first = first_key(job, end), n = end - first;
          const int64_t k0 = first + n * sp / L.splits, k1 = first + n * (sp + 1) / L.splits;
          float* part = L.partial + i * job.group * (job.dim + 2);
          float* m = part + job.group * job.dim;
          if (k0 == k1) {  // an empty range weighs nothing
            std::fill(m, m + job.group, -INFINITY);
            std::fill(m + job.group, m + 2 * job.group, 0.0f);
          } else {
            attend_keys_any(job, seq, rh % job.hkv, k0, k1, scores, m, m + job.group, part);
          }
        }
        last = job.done.fetch_add(1, std::memory_order_acq_rel) + 1 == L.num_tasks;
      }
      return last;
    }
  }
  return false;
}

// A thread's part of the layer: the calling thread takes the matmuls' chunks from the front,
// helpers from the back. A thread waiting for the next phase (the others finish theirs, or
// one does the serial work) asks for the weights it will read first in the next matmul phase,
// or at the last one's end the next layer's q/k/v: those waits are time in which nobody reads
// the weights from memory. It asks only while it waits inside the call: a helper that went on
// asking after the call ended, while the calling thread set the next call up, made a layer
// stack slower (docs/BENCHMARKS.md section 18, eighth pass).
template <typename KV>
void work(Layer<KV>& L, bool helper) {
  int seen = -1;  // the latest phase this thread took part in
  IdlePrefetch pf;
  for (;;) {
    const int p = L.phase.load(std::memory_order_acquire);
    if (p == kDone) return;
    if (p <= seen) {
      if (!prefetch_next(L, seen, helper, pf)) _mm_pause();
      continue;
    }
    seen = p;
    if (run_phase(L, p, helper)) finish(L, p);
  }
}

int64_t rows_of(const ffi::AnyBuffer& b) { return b.dimensions().size() == 2 ? b.dimensions()[0] : -1; }
int64_t bytes_of(const ffi::AnyBuffer& b) { return b.dimensions().size() == 2 ? b.dimensions()[1] : -1; }
const uint8_t* data_of(const ffi::AnyBuffer& b) { return reinterpret_cast<const uint8_t*>(b.untyped_data()); }

template <ffi::DataType kKV>
ffi::Error decoder_layer(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos,
                         ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::F32> w_in, ffi::Buffer<ffi::F32> w_post,
                         ffi::AnyBuffer wq, ffi::AnyBuffer wk, ffi::AnyBuffer wv, ffi::AnyBuffer wo,
                         ffi::AnyBuffer wg, ffi::AnyBuffer wu, ffi::AnyBuffer wd, ffi::AnyBuffer next_wq,
                         ffi::AnyBuffer next_wk, ffi::AnyBuffer next_wv, ffi::Buffer<kKV>,
                         ffi::Buffer<kKV>, ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::S32> block_tables,
                         ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                         ffi::Buffer<ffi::S32> num_rows, float eps, float sm_scale, int32_t sliding_window,
                         int32_t num_heads, int32_t intermediate_size, int32_t format_qkv, int32_t format_o,
                         int32_t format_gate_up, int32_t format_down, int32_t format_next_qkv, int32_t activations,
                         ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<kKV> k_out, ffi::ResultBuffer<kKV> v_out) {
  using KV = std::conditional_t<kKV == ffi::DataType::F32, float, uint16_t>;
  auto xd = x.dimensions();
  auto kd = k_out->dimensions();
  auto td = block_tables.dimensions();
  if (xd.size() != 2 || kd.size() != 4 || td.size() != 2 || td[0] != xd[0] || num_heads % kd[2] ||
      cos.dimensions().size() != 2 || cos.dimensions()[0] != xd[0] || 2 * cos.dimensions()[1] != kd[3] ||
      w_in.element_count() != xd[1] || w_post.element_count() != xd[1] || slot_mapping.element_count() != xd[0])
    return ffi::Error::InvalidArgument(
        "x [T, D], cos / sin [T, H/2], norms [D], caches [blocks, block_size, Hkv, H], token rows [T, W] expected");
  auto L = std::make_shared<Layer<KV>>();
  const int64_t t = xd[0], d = xd[1], hkv = kd[2], dim = kd[3], hq = num_heads, f = intermediate_size;
  L->x = x.typed_data();
  L->cos = cos.typed_data();
  L->sin = sin.typed_data();
  L->w_in = w_in.typed_data();
  L->w_post = w_post.typed_data();
  L->slots = slot_mapping.typed_data();
  L->k_cache = reinterpret_cast<KV*>(k_out->untyped_data());
  L->v_cache = reinterpret_cast<KV*>(v_out->untyped_data());
  L->out = out->typed_data();
  L->t = t, L->d = d, L->hq = hq, L->hkv = hkv, L->dim = dim, L->f = f, L->eps = eps;
  auto& team = paged_jax::thread_team();
  L->threads = team.num_helpers() + 1;
  // The scratch: a is zero where no row attends (prefill rows, padding).
  const int64_t sizes[] = {t * d, t * hq * dim, t * hkv * dim, t * hkv * dim, t * hq * dim, t * d, t * f, t * f,
                           t * f, t * d, t * hq * kMaxSplits * (dim + 2)};
  float** slices[] = {&L->n, &L->q, &L->k, &L->v, &L->a, &L->h, &L->g, &L->u, &L->act, &L->dn, &L->partial};
  // ... then the four matmuls' side inputs of x (quant_matmul.h attach_side)
  const int64_t sides[] = {side_bytes(t, d) / 4, side_bytes(t, hq * dim) / 4, side_bytes(t, d) / 4,
                           side_bytes(t, f) / 4};
  int64_t total = 0;
  for (int64_t size : sizes) total += (size + 15) / 16 * 16;  // 64-byte aligned slices
  for (int64_t size : sides) total += size;
  float* next = scratch_for(total);
  for (int i = 0; i < 11; ++i) *slices[i] = next, next += (sizes[i] + 15) / 16 * 16;
  float* side = next;
  std::fill(L->a, L->a + t * hq * dim, 0.0f);
  const WeightArg qkv[3] = {{data_of(wq), rows_of(wq), bytes_of(wq), L->q, hq * dim},
                            {data_of(wk), rows_of(wk), bytes_of(wk), L->k, hkv * dim},
                            {data_of(wv), rows_of(wv), bytes_of(wv), L->v, hkv * dim}};
  const WeightArg o[1] = {{data_of(wo), rows_of(wo), bytes_of(wo), L->h, d}};
  const WeightArg gate_up[2] = {{data_of(wg), rows_of(wg), bytes_of(wg), L->g, f},
                                {data_of(wu), rows_of(wu), bytes_of(wu), L->u, f}};
  const WeightArg down[1] = {{data_of(wd), rows_of(wd), bytes_of(wd), L->dn, d}};
  if (!set_up(L->qkv, format_qkv, activations, L->n, t, d, qkv, 3) ||
      !set_up(L->o, format_o, activations, L->a, t, hq * dim, o, 1) ||
      !set_up(L->gate_up, format_gate_up, activations, L->n, t, d, gate_up, 2) ||
      !set_up(L->down, format_down, activations, L->act, t, f, down, 1))
    return ffi::Error::InvalidArgument("a weight's bytes do not fit its format and the layer's sizes");
  Matmul* matmuls[] = {&L->qkv, &L->o, &L->gate_up, &L->down};
  for (int i = 0; i < 4; ++i) attach_side(matmuls[i]->work, reinterpret_cast<char*>(side)), side += sides[i];
  const WeightArg next_qkv[3] = {{data_of(next_wq), rows_of(next_wq), bytes_of(next_wq), nullptr, hq * dim},
                                 {data_of(next_wk), rows_of(next_wk), bytes_of(next_wk), nullptr, hkv * dim},
                                 {data_of(next_wv), rows_of(next_wv), bytes_of(next_wv), nullptr, hkv * dim}};
  if (format_next_qkv >= 0 && !set_up(L->next_qkv, format_next_qkv, activations, nullptr, t, d, next_qkv, 3))
    return ffi::Error::InvalidArgument("the next layer's q / k / v bytes do not fit its format and this layer's sizes");
  if (d % kBlock || (hq * dim) % kBlock || f % kBlock)
    return ffi::Error::InvalidArgument("the layer's matmul inputs must be multiples of 32");
  // The helpers start once the matmuls are set up (all a thread reads before a phase opens), so
  // they fetch their q/k/v while this thread sets the attention up and normalizes x; what they
  // read after a phase opens is ordered after these writes by `phase`'s release / acquire.
  team.post([L] { work(*L, true); }, team.num_helpers(), paged_jax::ThreadTeam::kLinger);
  Job<KV>& job = L->attend;
  job.q = L->q;
  job.k = L->k_cache;
  job.v = L->v_cache;
  job.tables = block_tables.typed_data();
  job.seq_lens = seq_lens.typed_data();
  job.qsl = query_start_loc.typed_data();
  job.out = L->a;
  job.width = td[1];
  job.block_size = kd[1];
  job.hkv = hkv;
  job.group = hq / hkv;
  job.dim = dim;
  job.scale = sm_scale;
  job.window = std::max<int32_t>(sliding_window, 0);
  const int64_t rows = std::min<int64_t>(num_rows.typed_data()[0], t);
  for (int64_t s = 0; s < rows; ++s)
    if (job.qsl[s + 1] - job.qsl[s] == 1 && job.qsl[s] < t && job.seq_lens[s] > 0) job.seqs.push_back(s);
  // Fewer (row, KV head) pairs than a few per thread (one sequence decoding): split each
  // one's keys in ranges of at least kSplitKeys, a task a (row, KV head, range). Else a task
  // is a (tile, KV head).
  const int64_t pairs = int64_t(job.seqs.size()) * hkv;
  int64_t longest = 0;
  for (int64_t seq : job.seqs) longest = std::max<int64_t>(longest, job.seq_lens[seq]);
  if (pairs > 0 && pairs < 4 * (team.num_helpers() + 1))
    L->splits = std::clamp<int64_t>(longest / kSplitKeys, 1, kMaxSplits);
  job.make_tiles(L->splits == 1 ? kTileRows : 1);
  L->num_tasks = job.num_tiles() * hkv * L->splits;
  for (int64_t i = 0; i < t; ++i) rms_norm(L->x + i * d, L->w_in, eps, d, &L->n[i * d]);
  if (L->qkv.prepare) L->qkv.prepare(L->qkv.work);
  open(*L, kQKV);
  work(*L, false);
  return ffi::Error::Success();
}

}  // namespace

#define PJ_DEFINE_LAYER(name, kv)                                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, decoder_layer<kv>,                          \
                                ffi::Ffi::Bind()                                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()   /* x */       \
                                    .Arg<ffi::Buffer<ffi::F32>>()   /* cos */     \
                                    .Arg<ffi::Buffer<ffi::F32>>()   /* sin */     \
                                    .Arg<ffi::Buffer<ffi::F32>>()   /* w_in */    \
                                    .Arg<ffi::Buffer<ffi::F32>>()   /* w_post */  \
                                    .Arg<ffi::AnyBuffer>()          /* wq */      \
                                    .Arg<ffi::AnyBuffer>()          /* wk */      \
                                    .Arg<ffi::AnyBuffer>()          /* wv */      \
                                    .Arg<ffi::AnyBuffer>()          /* wo */      \
                                    .Arg<ffi::AnyBuffer>()          /* wg */      \
                                    .Arg<ffi::AnyBuffer>()          /* wu */      \
                                    .Arg<ffi::AnyBuffer>()          /* wd */      \
                                    .Arg<ffi::AnyBuffer>()          /* next_wq */ \
                                    .Arg<ffi::AnyBuffer>()          /* next_wk */ \
                                    .Arg<ffi::AnyBuffer>()          /* next_wv */ \
                                    .Arg<ffi::Buffer<kv>>()         /* k_cache */ \
                                    .Arg<ffi::Buffer<kv>>()         /* v_cache */ \
                                    .Arg<ffi::Buffer<ffi::S32>>()   /* slots */   \
                                    .Arg<ffi::Buffer<ffi::S32>>()   /* tables */  \
                                    .Arg<ffi::Buffer<ffi::S32>>()   /* lens */    \
                                    .Arg<ffi::Buffer<ffi::S32>>()   /* qsl */     \
                                    .Arg<ffi::Buffer<ffi::S32>>()   /* num_rows */\
                                    .Attr<float>("eps")                           \
                                    .Attr<float>("sm_scale")                      \
                                    .Attr<int32_t>("sliding_window")              \
                                    .Attr<int32_t>("num_heads")                   \
                                    .Attr<int32_t>("intermediate_size")           \
                                    .Attr<int32_t>("format_qkv")                  \
                                    .Attr<int32_t>("format_o")                    \
                                    .Attr<int32_t>("format_gate_up")              \
                                    .Attr<int32_t>("format_down")                 \
                                    .Attr<int32_t>("format_next_qkv")             \
                                    .Attr<int32_t>("activations")                 \
                                    .Ret<ffi::Buffer<ffi::F32>>()                 \
                                    .Ret<ffi::Buffer<kv>>()                       \
                                    .Ret<ffi::Buffer<kv>>());

PJ_DEFINE_LAYER(pj_decoder_layer_f32, ffi::DataType::F32)
PJ_DEFINE_LAYER(pj_decoder_layer_bf16, ffi::DataType::BF16)
