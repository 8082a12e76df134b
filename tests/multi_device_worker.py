"""Runs in a subprocess with 8 host CPU devices (tests/test_tensor_parallel.py starts it).

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before jax is imported, so
the multi-device checks cannot run in the pytest process. Prints one JSON object: greedy
tokens per configuration, the dense reference, shardings, per-device cache bytes, routing.

Not a test module (no test_ prefix).
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from importlib import resources  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from models.llama import save_hf_checkpoint  # noqa: E402
from paged_jax import LLM, SamplingParams  # noqa: E402
from paged_jax.sharding import TP_AXIS  # noqa: E402

MAX_MODEL_LEN = 128
SYSTEM_PROMPT_LEN = 40
ENGINE = dict(max_model_len=MAX_MODEL_LEN, block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
              warm_up="none", compile_cache_dir=None, hash_seed=0)
# 11 usable blocks (176 slots) for 4 running sequences of up to 90 tokens: preemption.
SMALL_POOL = 12


def make_prompts():
    """Half share a 40-token system prompt (prefix caching); lengths 1..60 (mixed batches)."""
    rng = np.random.default_rng(7)
    system = rng.integers(3, 512, SYSTEM_PROMPT_LEN).tolist()
    prompts = []
    for i, n in enumerate([1, 20, 33, 5, 16, 50, 9, 28]):
        suffix = rng.integers(3, 512, n).tolist()
        prompts.append(system + suffix if i % 2 else suffix)
    return prompts


MAX_TOKENS = [12, 30, 7, 25, 18, 30, 3, 22]


def dense_greedy(model, prompts, max_tokens):
    """Greedy by full recomputation with model.dense_forward (no cache, no paging)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, tokens, last):
        logits = nnx.merge(graphdef, state).dense_forward(tokens)
        return jnp.argmax(jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], axis=-1)

    tokens = np.zeros((len(prompts), MAX_MODEL_LEN), np.int32)
    lens = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    outs = [[] for _ in prompts]
    for _ in range(max(max_tokens)):
        ids = np.asarray(next_token(state, tokens, lens - 1))
        for i, t in enumerate(ids):
            if len(outs[i]) < max_tokens[i]:
                outs[i].append(int(t))
                tokens[i, lens[i]] = t
                lens[i] += 1
    return outs


def run(prompts, model="tiny", **engine_args):
    llm = LLM(model, **ENGINE, **engine_args)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS[: len(prompts)]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.token_ids for o in outs]


def sharding_report(llm):
    engine = llm.engine
    runner = engine.runner
    layer = runner.layer_params[0]
    k_cache = runner.kv_caches[0][0]
    layer_memory = runner.compiled_memory(*sorted(runner.compiler._programs)[0])["layer"]
    return {
        # The layer program's donated caches, per device: aliased, not copied.
        "layer_alias_bytes": int(layer_memory.alias_size_in_bytes),
        "layer_cache_bytes_per_device": sum(int(a.addressable_shards[0].data.nbytes) for a in runner.kv_caches[0]),
        "layers_per_program": runner.layers_per_program,
        "mesh_devices": int(runner.mesh.shape[TP_AXIS]),
        "q_proj": str(layer["self_attn"]["q_proj"][...].sharding.spec),
        "k_proj": str(layer["self_attn"]["k_proj"][...].sharding.spec),
        "o_proj": str(layer["self_attn"]["o_proj"][...].sharding.spec),
        "gate_proj": str(layer["mlp"]["gate_proj"][...].sharding.spec),
        "down_proj": str(layer["mlp"]["down_proj"][...].sharding.spec),
        "embed_tokens": str(runner.head_params["embed_tokens"][...].sharding.spec),
        "k_cache": str(k_cache.sharding.spec),
        "k_cache_shape": list(k_cache.shape),
        "k_cache_shard_shapes": [list(s.data.shape) for s in k_cache.addressable_shards],
        "k_cache_devices": len({s.device for s in k_cache.addressable_shards}),
        "q_proj_shard_bytes": [int(s.data.nbytes) for s in layer["self_attn"]["q_proj"][...].addressable_shards],
        "stats": {key: engine.get_stats()[key] for key in (
            "kv_cache_bytes", "kv_cache_bytes_per_device", "tensor_parallel_size", "kv_head_replicas",
            "num_preemptions", "prefix_cache_hit_rate")},
    }


def main():
    what = sys.argv[1:] or ["tp", "dp"]
    prompts = make_prompts()
    result = {"num_devices": jax.device_count()}
    if "tp" in what:
        llm1, result["tp1"] = run(prompts, num_blocks=SMALL_POOL)
        result["tp1_stats"] = {k: llm1.stats()[k] for k in ("num_preemptions", "prefix_cache_hit_rate",
                                                             "kv_cache_bytes")}
        result["dense"] = dense_greedy(llm1.engine.model, prompts, MAX_TOKENS)
        for tp in (2, 4):
            llm, result[f"tp{tp}"] = run(prompts, num_blocks=SMALL_POOL, tensor_parallel_size=tp)
            result[f"tp{tp}_shardings"] = sharding_report(llm)
        # A checkpoint directory: its tensors go to their devices, split, as they are read.
        with tempfile.TemporaryDirectory() as path:
            save_hf_checkpoint(llm1.engine.model, path)
            shutil.copy(resources.files("paged_jax.core").joinpath("assets", "tokenizer.json"), path)
            llm, result["hf_tp2"] = run(prompts, path, num_blocks=SMALL_POOL, tensor_parallel_size=2)
            attn = llm.engine.model.layers[0].self_attn
            result["hf_tp2_loaded"] = {"q_proj": str(attn.q_proj[...].sharding.spec),
                                       "embed_tokens": str(llm.engine.model.embed_tokens[...].sharding.spec)}
        # The Pallas kernel per shard (interpret mode), KV heads replicated (tp 4 > 2 KV heads).
        llm, result["tp4_pallas"] = run(prompts[:4], num_blocks=SMALL_POOL, tensor_parallel_size=4,
                                        attention_impl="pallas", interpret=True)
        try:
            LLM("tiny", **ENGINE, tensor_parallel_size=8)
        except ValueError as error:
            result["tp8_error"] = str(error)
    if "dp" in what:
        # A pool with room for everything, so the hit rates compare routing only.
        llm1, result["dp1"] = run(prompts)
        result["dp1_hit_rate"] = llm1.stats()["prefix_cache_hit_rate"]
        llm2 = LLM("tiny", **ENGINE, data_parallel_size=2)
        engine = llm2.engine
        routes = {}
        # Two system-prompt requests first: alternating replicas would split them.
        for i in (1, 3, 0, 2, 5, 4, 7, 6):
            engine.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0,
                                                                   ignore_eos=True))
            routes[i] = engine.replica_of(f"r{i}")
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.token_ids
        result["dp2"] = [finished[f"r{i}"] for i in range(len(prompts))]
        result["dp2_routes"] = routes
        stats = engine.get_stats()
        result["dp2_hit_rate"] = stats["prefix_cache_hit_rate"]
        result["dp2_requests_per_replica"] = [r["num_finished"] for r in stats["replicas"]]
        result["dp2_devices"] = [str(e.runner.kv_caches[0][0].sharding.device_set) for e in engine.replicas]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
