"""Tensor and data parallelism on 8 host CPU devices (in a subprocess: the device count is
fixed before jax is imported), and the sizing and validation that need no devices.

The subprocess (tests/multi_device_worker.py) runs the tiny model (4 query heads, 2 KV
heads) on a mixed batch with a shared system prompt (prefix caching) and a pool small
enough to preempt, at tp=1, 2, 4 (4 > 2 KV heads: replicated) with the XLA path, at tp=4
with the Pallas kernel (interpret mode), and at dp=1 / dp=2; and a dense greedy loop
(full recomputation, no cache) as the independent reference.
"""

import json
import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from flax import nnx

from models.deepseek_v2 import PRESETS as DEEPSEEK_PRESETS
from models.deepseek_v2 import DeepseekV2ForCausalLM
from models.llama import LlamaConfig, LlamaForCausalLM
from models.kv_cache_spec import FullAttentionSpec
from paged_jax.engine_config import EngineConfig
from paged_jax.kv_pool import num_blocks_for_budget
from paged_jax.sharding import TP_AXIS, check_tensor_parallel, kv_head_replicas, make_mesh, param_partition_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A hang's bound, not a speed check: the worker passed in minutes on a quiet CI machine and ran
# past 420 s in a clean-clone run that shared the 2 cores with other test runs (2026-12-06).
WORKER_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def multi_device():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "multi_device_worker.py")], env=env,
                          capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, f"worker failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_tp_greedy_outputs_equal_dense_reference(multi_device):
    r = multi_device
    assert r["num_devices"] == 8
    assert r["tp1"] == r["dense"], "the single-device engine disagrees with dense recomputation"
    assert r["tp2"] == r["tp1"]
    assert r["tp4"] == r["tp1"], "tp=4 > 2 KV heads (replicated KV heads) changed the outputs"
    assert r["tp4_pallas"] == r["tp1"][:4], "the Pallas kernel per shard changed the outputs"
    assert r["hf_tp2"] == r["tp1"], "the same weights loaded from a checkpoint directory at tp=2 differ"
    # The batch exercised what it claims to: preemption and prefix-cache hits, at every tp.
    for key in ("tp2_shardings", "tp4_shardings"):
        assert r[key]["stats"]["num_preemptions"] == r["tp1_stats"]["num_preemptions"] > 0
        assert r[key]["stats"]["prefix_cache_hit_rate"] == r["tp1_stats"]["prefix_cache_hit_rate"] > 0


@pytest.mark.slow
def test_tp_weights_and_caches_carry_declared_shardings(multi_device):
    tp2, tp4 = multi_device["tp2_shardings"], multi_device["tp4_shardings"]
    for report, tp in ((tp2, 2), (tp4, 4)):
        assert report["mesh_devices"] == tp
        assert report["q_proj"] == "P(None, 'tp', None)"
        assert report["o_proj"] == "P('tp', None, None)"
        assert report["gate_proj"] == "P(None, 'tp')" and report["down_proj"] == "P('tp', None)"
        assert report["embed_tokens"] == "P('tp', None)"
        assert report["k_cache"] == "P(None, None, 'tp', None)"
        assert report["k_cache_devices"] == tp
        # [num_blocks, block_size, heads, head_dim]: one device holds heads / tp of every page.
        blocks, block_size, heads, head_dim = report["k_cache_shape"]
        assert report["k_cache_shard_shapes"] == [[blocks, block_size, heads // tp, head_dim]] * tp
        stats = report["stats"]
        assert stats["kv_cache_bytes_per_device"] * tp == stats["kv_cache_bytes"]
        # Donation stays in place per shard: the layer program aliases each device's cache
        # shards to its outputs (tests/test_runner.py bounds the temporaries on a big pool).
        per_device = report["layer_cache_bytes_per_device"]
        assert report["layer_alias_bytes"] == report["layers_per_program"] * per_device
        # q_proj is [64, 4, 16] f32: 16 KiB split evenly.
        assert report["q_proj_shard_bytes"] == [64 * 4 * 16 * 4 // tp] * tp
    # tp=2 splits the 2 KV heads; tp=4 holds each twice (one per device) and keeps k_proj whole.
    assert tp2["k_proj"] == "P(None, 'tp', None)" and tp2["stats"]["kv_head_replicas"] == 1
    assert tp4["k_proj"] == "P()" and tp4["stats"]["kv_head_replicas"] == 2
    assert tp4["k_cache_shape"][2] == 4
    assert tp4["stats"]["kv_cache_bytes_per_device"] == tp2["stats"]["kv_cache_bytes_per_device"]
    # A checkpoint's tensors were placed split as the loader read them (the model holds no
    # single-device copy).
    assert multi_device["hf_tp2_loaded"] == {"q_proj": "P(None, 'tp', None)", "embed_tokens": "P('tp', None)"}


@pytest.mark.slow
def test_tp_past_the_query_heads_is_a_value_error(multi_device):
    assert "tensor_parallel_size=8 must divide the model's 4 query heads" in multi_device["tp8_error"]


@pytest.mark.slow
def test_dp_outputs_equal_dp1_and_shared_prefixes_share_a_replica(multi_device):
    r = multi_device
    assert r["dp2"] == r["dp1"] == r["tp1"]
    routes = {int(i): replica for i, replica in r["dp2_routes"].items()}
    # Odd prompts start with the system prompt: all on one replica, the rest spread.
    assert len({routes[i] for i in routes if i % 2}) == 1
    assert sorted(set(routes.values())) == [0, 1] and r["dp2_requests_per_replica"] == [4, 4]
    assert r["dp2_devices"] == ["{CpuDevice(id=0)}", "{CpuDevice(id=1)}"]
    assert r["dp2_hit_rate"] >= r["dp1_hit_rate"] - 0.02 and r["dp1_hit_rate"] > 0.25


# no devices needed
def test_check_tensor_parallel_names_the_fix():
    tiny = LlamaForCausalLM(LlamaConfig.from_preset("tiny"), rngs=nnx.Rngs(0))  # 4 query heads, 2 KV heads, MLP 128
    for tp in (1, 2, 4):
        check_tensor_parallel(tiny, tp)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's 4 query heads"):
        check_tensor_parallel(tiny, 3)
    odd = LlamaForCausalLM(LlamaConfig.from_preset("tiny", num_heads=6, num_kv_heads=3, intermediate_size=96),
                           rngs=nnx.Rngs(0))
    check_tensor_parallel(odd, 3)
    with pytest.raises(ValueError, match="divide the model's 3 KV heads or be a multiple"):
        check_tensor_parallel(odd, 2)
    # A family without rules (DeepSeek-V2: no sharded latent pool yet) is refused by name,
    # before its config (no num_kv_heads) is read.
    deepseek = DeepseekV2ForCausalLM(DEEPSEEK_PRESETS["tiny-mla"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM has no tensor-parallel rules"):
        check_tensor_parallel(deepseek, 2)
    assert [kv_head_replicas(2, tp) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]


def test_mesh_needs_the_devices():
    mesh = make_mesh(1)
    assert mesh.shape[TP_AXIS] == 1
    with pytest.raises(ValueError, match="tensor_parallel_size=64 needs that many devices"):
        make_mesh(64)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=0)


def test_pool_is_sized_per_device():
    """kv_cache_memory_bytes is per device: at tp=2 a block costs each device half as much
    (twice the blocks); past the KV heads (tp=4 > 2) the replicated heads cost the same per
    device as at tp=2."""
    specs = (FullAttentionSpec(2, 16, "float32"),) * 2  # 2 layers x (k, v) x 2 heads x 16 x 4 B = 512 B/token
    budget = 512 * 16 * 100  # 100 blocks of 16 tokens on one device
    blocks = {tp: num_blocks_for_budget(specs, 16, kv_cache_memory_bytes=budget, max_num_seqs=1, max_model_len=16,
                                        tensor_parallel_size=tp) for tp in (1, 2, 4)}
    assert blocks == {1: 100, 2: 200, 4: 200}


def test_param_rules_by_name():
    rules = LlamaForCausalLM.param_partition_rules
    assert param_partition_spec("q_proj", (64, 4, 16), 2, rules) == P(None, TP_AXIS, None)
    assert param_partition_spec("k_proj", (64, 2, 16), 2, rules) == P(None, TP_AXIS, None)
    assert param_partition_spec("k_proj", (64, 2, 16), 4, rules) == P()
    assert param_partition_spec("down_proj", (128, 64), 2, rules) == P(TP_AXIS, None)
    assert param_partition_spec("weight", (64,), 1, rules) == P()  # norms: replicated
    assert param_partition_spec("embed_tokens", (512, 64), 4, rules) == P(TP_AXIS, None)
    # A vocabulary tp does not divide stays whole.
    assert param_partition_spec("lm_head", (510, 64), 4, rules) == P()
    # The rules are the family's: the same name under another family's (empty) rules is whole.
    assert param_partition_spec("q_proj", (64, 4, 16), 2, {}) == P()


def test_parallel_sizes_need_the_devices():
    """One CPU device here: a second replica or a second shard has nowhere to go."""
    from paged_jax import LLM

    with pytest.raises(ValueError, match="data_parallel_size=2 x tensor_parallel_size=1 needs 2 devices"):
        LLM("tiny", data_parallel_size=2, warm_up="none", compile_cache_dir=None)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs that many devices"):
        LLM("tiny", tensor_parallel_size=2, warm_up="none", compile_cache_dir=None)
