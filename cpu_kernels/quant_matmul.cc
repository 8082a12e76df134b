// The XLA FFI handler of quant_matmul.h's kernel (that header says what it computes).

#include "quant_matmul.h"
#include "thread_team.h"

namespace {

// y_p[M, n_p] = x[M, K] @ W_p^T for each weight p of the call (x, then the weights, then the
// results, in the same order).
template <int kFormat, int kActs>
ffi::Error quant_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                        ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be 2-D");
  if (ws.size() != ys.size() || ws.size() < 1 || ws.size() > size_t(kMaxParts))
    return ffi::Error::InvalidArgument("give 1 to 4 weights and as many results");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->m = xd[0];
  work->k = xd[1];
  if (work->k % kBlock) return ffi::Error::InvalidArgument("x's inner dimension must be a multiple of 32");
  work->num_parts = int(ws.size());
  work->chunk_tiles = chunk_tiles(work->m);
  int64_t num_chunks = 0;
  for (size_t p = 0; p < ws.size(); ++p) {
    auto w = ws.get<ffi::Buffer<ffi::U8>>(p);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(p);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("weights must be u8, results f32");
    auto wd = w->dimensions();
    auto yd = (*y)->dimensions();
    if (wd.size() != 2 || yd.size() != 2) return ffi::Error::InvalidArgument("w and y must be 2-D");
    const int64_t n = yd[1];
    const int64_t num_tiles = kFormat == kBF16 ? (n + kTile - 1) / kTile : wd[0];
    if (yd[0] != work->m || n > num_tiles * kTile || n <= (num_tiles - 1) * kTile)
      return ffi::Error::InvalidArgument("x, w and y's shapes do not fit one another");
    if (kFormat == kBF16 ? (wd[0] != n || wd[1] != 2 * work->k) : wd[1] != tile_bytes(kFormat, work->k))
      return ffi::Error::InvalidArgument("w's bytes do not match x's inner dimension for this format");
    work->parts[p] = Part{w->typed_data(), (*y)->typed_data(), n, num_tiles, num_chunks};
    num_chunks += (num_tiles + work->chunk_tiles - 1) / work->chunk_tiles;
  }
  work->num_chunks = num_chunks;
  if (kFormat != kBF16) prepare_x<kActs>(*work);
  // The team's helpers while one is awake (a decode step's head after its one-call layers),
  // else XLA's pool (thread_team.h says why).
  auto& team = paged_jax::thread_team();
  auto job = [work] { run_chunks<kFormat, kActs>(*work); };
  if (team.has_awake_helper()) {
    team.post(job, std::min<int64_t>(team.num_helpers(), num_chunks - 1), paged_jax::ThreadTeam::kLinger);
  } else {
    const int64_t helpers = paged_jax::pool_helpers(pool.num_threads(), num_chunks - 1);
    for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { run_chunks<kFormat, kActs>(*work); });
  }
  run_chunks<kFormat, kActs>(*work);
  // A helper that starts late finds no chunk left and only drops its reference to work.
  while (work->done.load(std::memory_order_acquire) < num_chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

#define PJ_DEFINE(name, format, acts)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (quant_matmul<format, acts>),               \
                                ffi::Ffi::Bind()                                  \
                                    .Ctx<ffi::ThreadPool>()                       \
                                    .Arg<ffi::Buffer<ffi::F32>>()                 \
                                    .RemainingArgs()                              \
                                    .RemainingRets());

PJ_DEFINE(pj_quant_matmul_q8_0, kQ8_0, kF32)
PJ_DEFINE(pj_quant_matmul_q4_1, kQ4_1, kF32)
PJ_DEFINE(pj_quant_matmul_bf16, kBF16, kF32)
PJ_DEFINE(pj_quant_matmul_q8_0_i8, kQ8_0, kI8)
PJ_DEFINE(pj_quant_matmul_q4_1_i8, kQ4_1, kI8)
