"""GGUF (llama.cpp) Gemma 3 checkpoints -> Gemma3Config and Gemma3ForCausalLM.

What llama.cpp's converter writes for Gemma3ForCausalLM (Gemma3Model): `gemma3.*` metadata with
llama's meanings (head_dim as gemma3.attention.key_length, the full layers' RoPE base as
gemma3.rope.freq_base, the window as gemma3.attention.sliding_window); the layer pattern and
the local RoPE base are llama.cpp's built-ins (every sixth layer full, base 10000) unless the
file says otherwise (gemma3.attention.sliding_window_pattern, gemma3.rope.freq_base_swa); the
softmax scale is head_dim ** -0.5 (llama.cpp's, and transformers' default query_pre_attn_scalar
256 for every Gemma 3 but 27B). Tensors: Qwen3's names, with ffn_norm the pre-feedforward norm
and post_attention_norm / post_ffw_norm the two norms after attention and MLP; rows are not
permuted (NEOX RoPE). Every norm weight is stored as 1 + weight (the converter adds the 1, as
transformers' GGUF loader knows): the loader subtracts it. weight_dtype as
models/llama/gguf.py: "auto" keeps the Q8_0 / Q4_1 / Q4_0 / BF16 matrices packed (Gemma 3 270M
Q4_K_M: the embedding and half the attn_v), the rest (Q4_K, Q5_0, Q6_K) float32.
"""

from __future__ import annotations

from models.gemma3.config import Gemma3Config, default_layer_types
from models.gemma3.hf import model_from_hf_tensors
from models.gemma3.model import Gemma3ForCausalLM
from models.gguf import get_float, get_metadata, open_gguf, require_metadata
from models.packed_weight import pack_model
from models.qwen2.gguf import check_weight_dtype, gguf_config_fields, read_gguf_tensors, tensor_getter
from models.qwen3.gguf import QWEN3_BLOCKS

__all__ = ["GGUF_ARCHITECTURES", "load_gguf_checkpoint", "read_gguf_config"]

GGUF_ARCHITECTURES = ("gemma3",)
GEMMA3_BLOCKS = {**QWEN3_BLOCKS, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}


def read_gguf_config(reader_or_path, dtype=None, param_dtype=None) -> Gemma3Config:
    """The Gemma3Config a gemma3 GGUF's metadata describes (param_dtype defaults to "float32").

    Raises:
      ValueError naming the key for another architecture (general.architecture), missing
      metadata (gemma3.attention.sliding_window among it), RoPE scaling, or a window that is
      not positive (sliding_window).
    """
    reader, name = open_gguf(reader_or_path)
    arch = get_metadata(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{name}: general.architecture={arch!r} is not a Gemma 3 GGUF ({list(GGUF_ARCHITECTURES)})")
    fields = gguf_config_fields(reader, name, arch, dtype=dtype, param_dtype=param_dtype, sliding_window_ok=True)
    pattern = get_metadata(reader, f"{arch}.attention.sliding_window_pattern")
    if pattern is not None and not isinstance(pattern, int):
        raise ValueError(f"{name}: {arch}.attention.sliding_window_pattern={pattern!r} is not supported; only an "
                         "int (every n-th layer full) is")
    window = int(require_metadata(reader, f"{arch}.attention.sliding_window", name))
    return Gemma3Config(**fields, sliding_window=window,
                        layer_types=default_layer_types(fields["num_layers"], pattern or 6),
                        rope_local_base_freq=get_float(reader, f"{arch}.rope.freq_base_swa", 10000.0),
                        query_pre_attn_scalar=float(fields["head_dim"]))


def load_gguf_checkpoint(path, dtype=None, param_dtype=None, place=None,
                         weight_dtype: str = "auto") -> Gemma3ForCausalLM:
    """A gemma3 GGUF file as a Gemma3ForCausalLM (Args and Raises as models.qwen3.load_gguf_checkpoint),
    each norm weight the file's less 1."""
    reader, name = open_gguf(path)
    config = read_gguf_config(reader, dtype=dtype, param_dtype=param_dtype)
    check_weight_dtype(weight_dtype, place)
    stored = tensor_getter(read_gguf_tensors(reader, name, GEMMA3_BLOCKS, "Gemma 3"), name,
                           keep_packed=weight_dtype == "auto" and param_dtype is None)

    def get_tensor(hf_name: str):
        tensor = stored(hf_name)
        return tensor - 1.0 if hf_name.endswith("norm.weight") else tensor  # the file's 1 + weight

    return pack_model(model_from_hf_tensors(config, get_tensor, place), weight_dtype)
