"""GGUF (llama.cpp) Llama checkpoints -> LlamaConfig and LlamaForCausalLM.

The Llama family's GGUF map: the metadata keys (`llama.*`) its config is read from, and the
GGUF tensor names (`blk.{i}.attn_q.weight`, ...) of its HF tensors. Every GGUF tensor is
turned into the HF tensor of the same weight and handed to
models.llama.hf.model_from_hf_tensors, so the two formats share one name -> parameter layout.
The file itself is read by models/gguf.py (shared by every family and by the tokenizer).

Two things differ from a HF directory:
- llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) interleaves the two
  rotary halves of every attn_q / attn_k head for its RoPE kernel; load undoes it.
- weight_dtype "auto" keeps Q8_0 / Q4_1 / Q4_0 / BF16 matrices in their own blocks
  (models/packed_weight.py) and dequantizes any other type to float32; "float32" dequantizes
  every tensor (param_dtype defaults to "float32"); "bfloat16" / "int8" repack it.
"""

from __future__ import annotations

import math

import numpy as np

from models.config import Llama3RopeScaling
from models.gguf import PackedRows, dequantize, get_float, get_metadata, open_gguf, packed_rows, require_metadata
from models.llama.config import LlamaConfig
from models.llama.hf import model_from_hf_tensors
from models.llama.model import LlamaForCausalLM
from models.packed_weight import pack_model

__all__ = ["BLOCK_TENSORS", "GGUF_ARCHITECTURES", "GLOBAL_TENSORS", "load_gguf_checkpoint", "read_gguf_config"]

GGUF_ARCHITECTURES = ("llama",)  # general.architecture values this map reads

# GGUF tensor name -> HF tensor name (blocks: blk.{i}.<key>.weight -> model.layers.{i}.<value>.weight);
# the families whose GGUFs llama.cpp writes with Llama's names read them too (models/qwen2/gguf.py).
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                  "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
BLOCK_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
                 "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# llama.cpp's encoding of llama3 RoPE scaling: per-frequency divisors, read into the config.
_ROPE_FREQS = "rope_freqs.weight"


def _llama3_factors(scaling: Llama3RopeScaling, rope_theta: float, head_dim: int) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter writes for `scaling` (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    old = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(scaling.factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.asarray(factors, np.float32)


def _rope_scaling(reader, name: str, rope_theta: float, head_dim: int) -> Llama3RopeScaling | None:
    # llama.cpp spells llama3 scaling as a rope_freqs tensor; other scalings as rope.scaling.* keys.
    kind = get_metadata(reader, "llama.rope.scaling.type", "none")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if kind not in ("none", "llama3"):
        raise ValueError(f"{name}: llama.rope.scaling.type={kind!r} is not supported; only llama3 "
                         "scaling (or none) is implemented")
    if kind == "none" and freqs is None:
        return None
    scaling = Llama3RopeScaling(
        # rope_freqs holds 1 for short wavelengths and the factor itself for long ones.
        factor=get_float(reader, "llama.rope.scaling.factor", 0) or (float(freqs.data.max()) if freqs is not None else 0),
        low_freq_factor=get_float(reader, "llama.rope.scaling.low_freq_factor", 1.0),
        high_freq_factor=get_float(reader, "llama.rope.scaling.high_freq_factor", 4.0),
        original_max_position_embeddings=int(get_metadata(reader, "llama.rope.scaling.original_context_length",
                                                          8192)))
    if freqs is not None and not np.allclose(np.asarray(freqs.data, np.float32),
                                             _llama3_factors(scaling, rope_theta, head_dim), rtol=1e-4):
        raise ValueError(f"{name}: {_ROPE_FREQS} is not llama3 scaling with {scaling}; other per-frequency "
                         "RoPE factors are not supported")
    return scaling


def read_gguf_config(reader_or_path, dtype=None, param_dtype=None) -> LlamaConfig:
    """The LlamaConfig a llama GGUF's metadata describes.

    Args:
      reader_or_path: a .gguf path or an open gguf.GGUFReader.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the weights; defaults to "float32" (what GGUF quantized
        weights dequantize to).
    Returns:
      The config; tie_word_embeddings is True when the file has no output.weight.
    Raises:
      ValueError naming the key for a non-llama architecture, missing metadata or an
      unsupported RoPE scaling.
    """
    reader, name = open_gguf(reader_or_path)
    arch = get_metadata(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{name}: general.architecture={arch!r} is not supported; only 'llama' GGUF files load")
    hidden = int(require_metadata(reader, "llama.embedding_length", name))
    num_heads = int(require_metadata(reader, "llama.attention.head_count", name))
    head_dim = get_metadata(reader, "llama.attention.key_length")
    rope_dim = get_metadata(reader, "llama.rope.dimension_count")
    head_dim = int(head_dim or rope_dim or hidden // num_heads)
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"{name}: llama.rope.dimension_count={rope_dim} differs from head_dim={head_dim}; "
                         "partial rotary embeddings are not supported")
    tensors = {t.name: t for t in reader.tensors}
    vocab = get_metadata(reader, "llama.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embd = tensors.get("token_embd.weight")
        vocab = len(tokens.data) if tokens is not None else int(embd.shape[-1]) if embd is not None else None
    if vocab is None:
        raise ValueError(f"{name} has neither llama.vocab_size, tokenizer.ggml.tokens nor token_embd.weight; "
                         "the vocabulary size is unknown")
    rope_theta = get_float(reader, "llama.rope.freq_base", 10000.0)
    eos = get_metadata(reader, "tokenizer.ggml.eos_token_id")
    param_dtype = param_dtype if param_dtype is not None else "float32"
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(require_metadata(reader, "llama.feed_forward_length", name)),
        num_layers=int(require_metadata(reader, "llama.block_count", name)),
        num_heads=num_heads,
        num_kv_heads=int(get_metadata(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=get_float(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, name, rope_theta, head_dim),
        max_position_embeddings=int(get_metadata(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=get_metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        param_dtype=param_dtype,
        dtype=dtype if dtype is not None else param_dtype,
    )


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK_TENSORS \
            and parts[3] == "weight":
        return f"model.layers.{int(parts[1])}.{BLOCK_TENSORS[parts[2]]}.weight"
    return None


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's LlamaModel.permute: rows of each head from (H/2, 2) back to (2, H/2).

    The converter maps HF's rotate_half layout (first half / second half of every head) to
    interleaved pairs with reshape(N, 2, H/2, D).swapaxes(1, 2); swapping back restores it.
    """
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_checkpoint(path, dtype=None, param_dtype=None, place=None, weight_dtype: str = "auto") -> LlamaForCausalLM:
    """Load a llama GGUF file (any tensor type gguf.quants can dequantize) as a LlamaForCausalLM.

    Args:
      path: the .gguf file.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the float weights; defaults to "float32".
      place: where each tensor goes (models.llama.hf.model_from_hf_tensors); default the default device.
      weight_dtype: models.packed_weight.WEIGHT_DTYPES: "auto" keeps the file's Q8_0 / Q4_1 /
        Q4_0 / BF16 matrices packed as they are (unless param_dtype asks for float weights);
        "float32" dequantizes all.
    Returns:
      The model; its config is `model.config` (see read_gguf_config).
    Raises:
      ValueError naming the file and the problem for a truncated or corrupt file, a
      non-llama architecture, a missing or unexpected tensor, a tensor type gguf.quants
      cannot dequantize, or a tensor of the wrong shape.
    """
    reader, name = open_gguf(path)
    config = read_gguf_config(reader, dtype=dtype, param_dtype=param_dtype)
    by_hf = {}
    for tensor in reader.tensors:
        hf = _hf_name(tensor.name)
        if hf is None and tensor.name != _ROPE_FREQS:
            raise ValueError(f"{name}: tensor {tensor.name} has no place in a Llama model (bias? another "
                             "architecture?); only llama GGUF files load")
        if hf is not None:
            by_hf[hf] = tensor
    num_layers = config.num_layers
    missing = [f"blk.{i}.{part}.weight" for i in range(num_layers) for part in BLOCK_TENSORS
               if f"model.layers.{i}.{BLOCK_TENSORS[part]}.weight" not in by_hf]
    missing += [g for g, hf in GLOBAL_TENSORS.items() if hf not in by_hf and g != "output.weight"]
    if missing:
        raise ValueError(f"{name} is missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                         f"for a {num_layers}-layer llama")

    if weight_dtype == "auto" and place is not None:
        raise ValueError("a tensor-parallel mesh splits float weights only: load the GGUF with "
                         "weight_dtype='float32'")
    keep_packed = weight_dtype == "auto" and param_dtype is None  # an explicit param_dtype asks for floats

    def get_tensor(hf_name: str) -> np.ndarray | PackedRows:
        w = packed_rows(by_hf[hf_name]) if keep_packed else None
        if w is not None:
            if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_heads if hf_name.endswith("q_proj.weight") else config.num_kv_heads
                w = w._replace(rows=_unpermute_rope_rows(w.rows, heads))
            return w
        w = dequantize(by_hf[hf_name], name)
        if hf_name.endswith("q_proj.weight"):
            w = _unpermute_rope_rows(w, config.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = _unpermute_rope_rows(w, config.num_kv_heads)
        return w

    return pack_model(model_from_hf_tensors(config, get_tensor, place), weight_dtype)
