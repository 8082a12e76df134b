"""HF checkpoint loading: config.json parsing (transformers 4.x and 5.x), safetensors layouts, errors.

Parity of the loaded weights with transformers itself is in test_hf_parity.py; here the
checkpoints are written with safetensors directly, so these tests need no torch.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from models.llama import LlamaConfig, LlamaForCausalLM, load_hf_checkpoint, save_hf_checkpoint

# meta-llama/Llama-3.2-1B's config.json as published (transformers 4.x keys).
LLAMA_3_2_1B_V4 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def v5_config(v4: dict) -> dict:
    """The same config as transformers 5.x writes it: rope_parameters + dtype."""
    v5 = {k: v for k, v in v4.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    rope = dict(v4.get("rope_scaling") or {"rope_type": "default"})
    v5["rope_parameters"] = {**rope, "rope_theta": v4["rope_theta"]}
    v5["dtype"] = v4["torch_dtype"]
    return v5


def test_hf_config_v4_and_v5_give_the_preset():
    preset = LlamaConfig.from_preset("llama-3.2-1b")
    assert LlamaConfig.from_hf_config(LLAMA_3_2_1B_V4) == preset
    assert LlamaConfig.from_hf_config(v5_config(LLAMA_3_2_1B_V4)) == preset


def test_hf_config_default_rope_list_eos_and_dtype_overrides():
    hf = dict(LLAMA_3_2_1B_V4, rope_scaling=None, eos_token_id=[128001, 128009], head_dim=None)
    c = LlamaConfig.from_hf_config(hf, param_dtype="float32")
    assert c.rope_scaling is None and c.rope_theta == 500000.0
    assert c.eos_token_ids == (128001, 128009)
    assert c.head_dim == 2048 // 32
    assert (c.param_dtype, c.dtype) == ("float32", "float32")
    c5 = LlamaConfig.from_hf_config(v5_config(hf), dtype="bfloat16")
    assert c5.rope_scaling is None and (c5.param_dtype, c5.dtype) == ("bfloat16", "bfloat16")


@pytest.mark.parametrize("change, field", [
    (dict(model_type="mistral"), "model_type"),
    (dict(architectures=["LlamaForSequenceClassification"]), "architectures"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    (dict(torch_dtype="int8"), "param_dtype"),
])
def test_unsupported_hf_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        LlamaConfig.from_hf_config(dict(LLAMA_3_2_1B_V4, **change))


def test_missing_hf_field_is_named():
    hf = dict(LLAMA_3_2_1B_V4)
    del hf["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        LlamaConfig.from_hf_config(hf)


# ---------------------------------------------------------------- checkpoints on disk


def tiny_model(seed=0, **overrides):
    return LlamaForCausalLM(LlamaConfig.from_preset("tiny", **overrides), rngs=nnx.Rngs(seed))


def assert_same_params(a, b):
    sa, sb = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    assert [p for p, _ in sa] == [p for p, _ in sb]
    for (path, va), (_, vb) in zip(sa, sb):
        assert va[...].dtype == vb[...].dtype, path
        np.testing.assert_array_equal(np.asarray(va[...], np.float32), np.asarray(vb[...], np.float32),
                                      err_msg=str(path))


@pytest.mark.parametrize("tied", [False, True])
def test_save_then_load_round_trips(tmp_path, tied):
    model = tiny_model(tie_word_embeddings=tied)
    save_hf_checkpoint(model, str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), framework="flax") as fh:
        names = set(fh.keys())
        # HF layout on disk: [out, in]
        assert tuple(fh.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape()) == (64, 64)
        assert tuple(fh.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape()) == (32, 64)
        assert tuple(fh.get_slice("model.layers.1.mlp.down_proj.weight").get_shape()) == (64, 128)
    assert ("lm_head.weight" in names) == (not tied)
    loaded = load_hf_checkpoint(str(tmp_path))
    assert loaded.config == model.config
    assert_same_params(model, loaded)


def test_bf16_checkpoint_loads_as_bf16_or_upcast(tmp_path):
    model = tiny_model(param_dtype="bfloat16", dtype="bfloat16")
    save_hf_checkpoint(model, str(tmp_path))
    loaded = load_hf_checkpoint(str(tmp_path))
    assert loaded.config.param_dtype == "bfloat16" and loaded.embed_tokens[...].dtype == jnp.bfloat16
    assert_same_params(model, loaded)
    up = load_hf_checkpoint(str(tmp_path), dtype="float32", param_dtype="float32")
    assert up.layers[1].mlp.up_proj[...].dtype == jnp.float32 and up.config.dtype == "float32"
    np.testing.assert_array_equal(np.asarray(up.layers[1].mlp.up_proj[...]),
                                  np.asarray(model.layers[1].mlp.up_proj[...], np.float32))


def read_tensors(path):
    with safe_open(str(path / "model.safetensors"), framework="flax") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}


def test_sharded_checkpoint_loads(tmp_path):
    model = tiny_model(seed=4)
    save_hf_checkpoint(model, str(tmp_path))
    tensors = read_tensors(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard), metadata={"format": "pt"})
        weight_map |= {n: shard for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_same_params(model, load_hf_checkpoint(str(tmp_path)))


def test_missing_tensor_is_named(tmp_path):
    save_hf_checkpoint(tiny_model(), str(tmp_path))
    tensors = read_tensors(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(str(tmp_path))


def test_untied_config_without_lm_head_is_a_missing_tensor(tmp_path):
    save_hf_checkpoint(tiny_model(tie_word_embeddings=True), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=False)))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_hf_checkpoint(str(tmp_path))


def test_wrong_shape_is_named(tmp_path):
    save_hf_checkpoint(tiny_model(), str(tmp_path))
    tensors = read_tensors(tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name].T  # [in, out] instead of HF's [out, in]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}.*\(64, 32\).*\(32, 64\)"):
        load_hf_checkpoint(str(tmp_path))


def test_non_llama_checkpoint_is_rejected(tmp_path):
    save_hf_checkpoint(tiny_model(), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="gpt2", architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        load_hf_checkpoint(str(tmp_path))


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_hf_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig.from_preset("tiny").to_hf_config()))
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_checkpoint(str(tmp_path))
