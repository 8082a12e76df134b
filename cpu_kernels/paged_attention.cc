// The XLA FFI handler of paged_attention.h's kernel (that header says what it computes).

#include "paged_attention.h"
#include "thread_team.h"

namespace {

template <ffi::DataType kKV>
ffi::Error decode_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<kKV> k_cache,
                            ffi::Buffer<kKV> v_cache, ffi::Buffer<ffi::S32> block_tables,
                            ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                            ffi::Buffer<ffi::S32> num_seqs, float sm_scale, int32_t sliding_window,
                            ffi::ResultBuffer<ffi::F32> out) {
  using KV = std::conditional_t<kKV == ffi::DataType::F32, float, uint16_t>;
  auto qd = q.dimensions();
  auto kd = k_cache.dimensions();
  auto td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || qd[2] != kd[3] || qd[1] % kd[2])
    return ffi::Error::InvalidArgument("q [T, Hq, D], caches [blocks, block_size, Hkv, D], tables [S, W] expected");
  const int64_t num_tokens = qd[0], hq = qd[1], dim = qd[2], hkv = kd[2];
  auto job = std::make_shared<Job<KV>>();
  job->q = q.typed_data();
  job->k = reinterpret_cast<const KV*>(k_cache.untyped_data());
  job->v = reinterpret_cast<const KV*>(v_cache.untyped_data());
  job->tables = block_tables.typed_data();
  job->seq_lens = seq_lens.typed_data();
  job->qsl = query_start_loc.typed_data();
  job->out = out->typed_data();
  job->width = td[1];
  job->block_size = kd[1];
  job->hkv = hkv;
  job->group = hq / hkv;
  job->dim = dim;
  job->scale = sm_scale;
  job->window = std::max<int32_t>(sliding_window, 0);
  std::fill(job->out, job->out + num_tokens * hq * dim, 0.0f);
  const int64_t n = std::min<int64_t>(num_seqs.typed_data()[0], td[0]);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t start = job->qsl[s];
    if (job->qsl[s + 1] - start == 1 && start < num_tokens && job->seq_lens[s] > 0) job->seqs.push_back(s);
  }
  job->make_tiles(kTileRows);
  const int64_t num_tasks = job->num_tiles() * hkv;
  // A task is a few microseconds per thousand keys: helpers only for more than a couple.
  // The team's helpers while one is awake, else XLA's pool (thread_team.h says why).
  auto& team = paged_jax::thread_team();
  if (team.has_awake_helper()) {
    team.post([job] { run_tasks(*job); }, std::min<int64_t>(team.num_helpers(), num_tasks / 2),
              paged_jax::ThreadTeam::kLinger);
  } else {
    const int64_t helpers = paged_jax::pool_helpers(pool.num_threads(), num_tasks / 2);
    for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { run_tasks(*job); });
  }
  run_tasks(*job);
  while (job->done.load(std::memory_order_acquire) < num_tasks) {
  }
  return ffi::Error::Success();
}

}  // namespace

#define PJ_DEFINE_ATTENTION(name, kv)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, decode_attention<kv>,                       \
                                ffi::Ffi::Bind()                                  \
                                    .Ctx<ffi::ThreadPool>()                       \
                                    .Arg<ffi::Buffer<ffi::F32>>()                 \
                                    .Arg<ffi::Buffer<kv>>()                       \
                                    .Arg<ffi::Buffer<kv>>()                       \
                                    .Arg<ffi::Buffer<ffi::S32>>()                 \
                                    .Arg<ffi::Buffer<ffi::S32>>()                 \
                                    .Arg<ffi::Buffer<ffi::S32>>()                 \
                                    .Arg<ffi::Buffer<ffi::S32>>()                 \
                                    .Attr<float>("sm_scale")                      \
                                    .Attr<int32_t>("sliding_window")              \
                                    .Ret<ffi::Buffer<ffi::F32>>());

PJ_DEFINE_ATTENTION(pj_paged_decode_attention_f32, ffi::DataType::F32)
PJ_DEFINE_ATTENTION(pj_paged_decode_attention_bf16, ffi::DataType::BF16)
