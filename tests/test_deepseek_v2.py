"""DeepSeek-V2 (MLA + MoE) against transformers' DeepseekV2ForCausalLM, its reference.

Random tiny models are built with transformers on CPU torch, saved with save_pretrained
and loaded through the registry (`load_model(<directory>)`); our dense forward and our paged
forward (prefill chunks, then decode steps, on the latent pool) must give transformers'
float32 logits within 1e-4 relative. Configs cover MLA with and without q_lora_rank, YaRN
with mscale != mscale_all_dim (so both of its factors bite), dense and MoE layers, both
routing methods, and tied embeddings. Configs this model cannot serve are ValueErrors that
name the field.
"""

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="HF parity needs torch (pip install -e '.[hf]', the CPU build)")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers (pip install -e '.[hf]')")

from models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM, MoE, model_from_hf_tensors  # noqa: E402
from models.kv_cache_spec import MLAAttentionSpec  # noqa: E402
from models.registry import load_model  # noqa: E402
from test_hf_parity import assert_close_rel, hf_logits, paged_logits  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB = 256
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.9, "mscale_all_dim": 0.6}


def hf_deepseek(*, q_lora_rank=24, yarn=True, first_k_dense_replace=1, topk_method="greedy", tied=False, num_layers=2,
                seed=0):
    """A random tiny DeepseekV2ForCausalLM whose weights give O(1) logits and decisive routing."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                  num_attention_heads=4, kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                  n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
                  first_k_dense_replace=first_k_dense_replace, routed_scaling_factor=1.5, topk_method=topk_method,
                  n_group=4 if topk_method == "group_limited_greedy" else None,
                  topk_group=2 if topk_method == "group_limited_greedy" else None,
                  max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                  rope_parameters={"rope_theta": 10000.0, **(YARN if yarn else {"rope_type": "default"})},
                  attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**kwargs)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            else:  # linear [out, in] and expert stacks [E, out, in]
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return model


def check_parity(tmp_path, ref, paged=True):
    """Dense forward and (if paged) the paged forward over 34 tokens (past YaRN's original 16 x 2)."""
    ref.save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    assert isinstance(model, DeepseekV2ForCausalLM)
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 34))
    expected = hf_logits(ref, ids)
    dense = nnx.jit(lambda model, ids: model.dense_forward(ids))  # one compile, not one per eager op
    assert_close_rel(dense(model, jnp.asarray(ids, jnp.int32)), expected, "dense forward")
    if paged:
        # Two prefill chunks (the second over a cached context), then two decode steps.
        chunk_ends = [16, 32, 33, 34]
        got = paged_logits(model, ids, chunk_ends)
        assert_close_rel(got, expected[:, np.array(chunk_ends) - 1].transpose(1, 0, 2), "paged forward")
    return model


def test_q_lora_yarn_dense_and_moe_layers(tmp_path):
    model = check_parity(tmp_path, hf_deepseek(seed=0))
    c = model.config
    assert c.q_lora_rank == 24 and c.rope_scaling.factor == 4.0 and c.first_k_dense_replace == 1
    assert isinstance(model.layers[1].mlp, MoE) and not isinstance(model.layers[0].mlp, MoE)
    assert model.kv_cache_specs() == (MLAAttentionSpec(32, 8, "float32"),) * 2


def test_no_q_lora_no_scaling_all_dense(tmp_path):
    model = check_parity(tmp_path, hf_deepseek(q_lora_rank=None, yarn=False, first_k_dense_replace=2, seed=1))
    assert model.config.q_lora_rank is None and model.config.num_moe_layers == 0


def test_all_moe_group_limited_routing_tied(tmp_path):
    model = check_parity(tmp_path, hf_deepseek(first_k_dense_replace=0, topk_method="group_limited_greedy",
                                               tied=True, seed=2), paged=False)
    assert model.config.topk_method == "group_limited_greedy" and model.lm_head is None
    # transformers' in-memory state dict fuses the experts (gate_up_proj [E, 2F, D]): same weights.
    ref = hf_deepseek(first_k_dense_replace=0, topk_method="group_limited_greedy", tied=True, seed=2)
    state = {name: t.detach().numpy() for name, t in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    fused = model_from_hf_tensors(model.config, state.__getitem__)
    for name in ("experts_gate", "experts_up", "experts_down"):
        np.testing.assert_array_equal(getattr(fused.layers[1].mlp, name)[...], getattr(model.layers[1].mlp, name)[...])


def test_grouped_and_dense_moe_agree():
    """The two MoE implementations compute the same experts (the dense one is the default)."""
    config = DeepseekV2Config(vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                              kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                              n_routed_experts=6, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=8)
    moe = MoE(config, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, 16)), jnp.float32)
    run = nnx.jit(lambda moe, x, impl: moe(x, impl=impl), static_argnums=2)
    np.testing.assert_allclose(np.asarray(run(moe, x, "grouped")), np.asarray(run(moe, x, "dense")), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("field, value, message", [
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "rope_type='dynamic'"),
    ("topk_method", "noaux_tc", "topk_method='noaux_tc'"),
    ("norm_topk_prob", True, "norm_topk_prob"),
    ("attention_bias", True, "attention_bias"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
])
def test_unservable_config_is_a_value_error_naming_the_field(tmp_path, field, value, message):
    ref = hf_deepseek(seed=3)
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_model(str(tmp_path))


@pytest.mark.parametrize("field, value", [("kv_lora_rank", 0), ("qk_rope_head_dim", -2), ("v_head_dim", True),
                                          ("num_layers", 1.0)])
def test_bad_size_names_the_field(field, value):
    from models.deepseek_v2 import PRESETS

    with pytest.raises(ValueError, match=f"{field}={value!r} must be a positive int"):
        dataclasses.replace(PRESETS["tiny-mla"], **{field: value})
