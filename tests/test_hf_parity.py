"""Parity with transformers' LlamaForCausalLM, the model's own reference.

Random tiny GQA models are built with transformers on CPU torch, saved with save_pretrained
(safetensors), loaded with load_hf_checkpoint, and both our dense forward and our paged
forward (prefill chunks + decode steps) must give transformers' float32 logits within 1e-4
relative. torch and transformers are test-time references only (pyproject extra [hf]).
"""

import copy
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="HF parity needs torch (pip install -e '.[hf]', the CPU build)")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers (pip install -e '.[hf]')")

from models.kv_cache_spec import init_kv_caches  # noqa: E402
from paged_jax.attention import make_attention_backend  # noqa: E402
from models.llama import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from hand_step_inputs import hand_step_inputs  # noqa: E402
from hf_reference import assert_close_rel, hf_logits  # noqa: E402

pytestmark = pytest.mark.hf

REL_TOL = 1e-4
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}  # short, so scaling bites at tiny head_dim


def hf_model(*, rope_scaling=None, tied=False, rope_theta=10000.0, seed=0):
    """A random tiny GQA LlamaForCausalLM, weights scaled so logits are O(1) and norms are not all ones."""
    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=tied, attn_implementation="eager")
    if int(transformers.__version__.split(".")[0]) >= 5:
        rope_type = "llama3" if rope_scaling else "default"
        kwargs["rope_parameters"] = {"rope_type": rope_type, "rope_theta": rope_theta, **(rope_scaling or {})}
    else:
        kwargs |= dict(rope_theta=rope_theta,
                       rope_scaling={"rope_type": "llama3", **rope_scaling} if rope_scaling else None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:  # linear [out, in]
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model
def paged_logits(model, ids, chunk_ends, block_size=8, num_blocks=24, seed=0):
    """Run the rows of ids [B, L] as B sequences of one paged batch, in the given chunks.

    Returns f32[len(chunk_ends), B, V]: each sequence's logits at the end of each chunk.
    """
    rng = np.random.default_rng(seed)
    blocks_per_seq = -(-ids.shape[1] // block_size)
    perm = rng.permutation(np.arange(1, num_blocks)).tolist()
    block_ids = [perm[b * blocks_per_seq:(b + 1) * blocks_per_seq] for b in range(ids.shape[0])]
    assert len(block_ids[-1]) == blocks_per_seq, "num_blocks too small for the test sequences"
    specs = model.kv_cache_specs()
    attention = make_attention_backend(specs[0], "xla")
    step = jax.jit(lambda inputs, kv: model(inputs.model, kv, inputs.attention.for_group(0), attention))
    kv_caches = init_kv_caches(specs, num_blocks, block_size)
    rows, start = [], 0
    for end in chunk_ends:
        chunks = [(row, blocks, start, end) for row, blocks in zip(ids, block_ids)]
        inputs = hand_step_inputs(chunks, block_size, width=blocks_per_seq + 1,
                                   token_bucket=-(-len(ids) * (end - start) // 16) * 16, seq_bucket=4)
        logits, kv_caches = step(inputs, kv_caches)
        rows.append(np.asarray(logits)[:len(ids)])
        start = end
    return np.stack(rows)


def check_parity(tmp_path, ref, *, seq_len=40, **load_kwargs):
    model = load_hf_checkpoint(str(tmp_path), **load_kwargs)
    ids = np.random.default_rng(1).integers(0, 256, size=(2, seq_len))
    expected = hf_logits(ref, ids)
    assert_close_rel(model.dense_forward(jnp.asarray(ids, jnp.int32)), expected, "dense forward")
    # Two prefill chunks, then decode steps, both rows batched together.
    chunk_ends = [17, seq_len - 6] + list(range(seq_len - 5, seq_len + 1))
    got = paged_logits(model, ids, chunk_ends)
    assert_close_rel(got, expected[:, np.array(chunk_ends) - 1].transpose(1, 0, 2), "paged forward")
    return model


def test_gqa_untied(tmp_path):
    ref = hf_model(seed=0)
    ref.save_pretrained(tmp_path)
    model = check_parity(tmp_path, ref)
    assert model.config.rope_scaling is None and not model.config.tie_word_embeddings


def test_llama3_rope_scaling_sharded(tmp_path):
    ref = hf_model(rope_scaling=LLAMA3_SCALING, rope_theta=500000.0, seed=1)
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = check_parity(tmp_path, ref, seq_len=72)
    assert model.config.rope_scaling.factor == 8.0


def test_transformers_4x_config_keys(tmp_path):
    """Published checkpoints carry rope_theta + rope_scaling + torch_dtype: same model, same logits."""
    ref = hf_model(rope_scaling=LLAMA3_SCALING, rope_theta=500000.0, seed=2)
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {**config.pop("rope_scaling"), "rope_theta": config["rope_theta"]}
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype", None) or config.get("torch_dtype", "float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_parity(tmp_path, ref, seq_len=72)


def test_tied_embeddings(tmp_path):
    ref = hf_model(tied=True, seed=3)
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    ref.save_pretrained(tmp_path)
    model = check_parity(tmp_path, ref)
    assert model.config.tie_word_embeddings and model.lm_head is None


def test_bf16_checkpoint(tmp_path):
    ref = hf_model(seed=4)
    with torch.no_grad():  # round the weights to bf16, keep them (and rope's inv_freq buffer) in f32
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    # .to(bfloat16) would also round the inv_freq buffer, so the bf16 model is saved from a copy.
    copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    model = load_hf_checkpoint(str(tmp_path))
    assert model.config.param_dtype == "bfloat16" and model.embed_tokens[...].dtype == jnp.bfloat16
    # The bf16 weights upcast exactly, so in f32 they match transformers on the same weights.
    check_parity(tmp_path, ref, param_dtype="float32", dtype="float32")
    # Computing in bf16 stays near the f32 reference.
    ids = np.random.default_rng(5).integers(0, 256, size=(1, 24))
    got = np.asarray(model.dense_forward(jnp.asarray(ids, jnp.int32)))
    expected = hf_logits(ref, ids)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 0.05


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    """save_hf_checkpoint writes what transformers reads: the inverse of the loader."""
    ours = load_hf_checkpoint(str(_saved(tmp_path / "src", hf_model(rope_scaling=LLAMA3_SCALING, seed=6))))
    save_hf_checkpoint(ours, str(tmp_path / "dst"))
    ref = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "dst")).float().eval()
    ids = np.random.default_rng(7).integers(0, 256, size=(1, 48))
    assert_close_rel(ours.dense_forward(jnp.asarray(ids, jnp.int32)), hf_logits(ref, ids), "reloaded in transformers")


def _saved(path, model):
    model.save_pretrained(path)
    return path
