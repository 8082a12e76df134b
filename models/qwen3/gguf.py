"""GGUF (llama.cpp) Qwen3 checkpoints -> Qwen3Config and Qwen3ForCausalLM.

What llama.cpp's converter writes for Qwen3ForCausalLM (Qwen3Model): `qwen3.*` metadata with
llama's meanings (head_dim as qwen3.attention.key_length) and Llama's tensor names plus
`blk.{i}.attn_q_norm.weight` / `attn_k_norm.weight`; rows are not permuted. The reader is
Qwen2's (models/qwen2/gguf.py) with Qwen3's names.
"""

from __future__ import annotations

from models.gguf import get_metadata, open_gguf
from models.packed_weight import pack_model
from models.qwen2.gguf import LLAMA_BLOCKS, check_weight_dtype, gguf_config_fields, read_gguf_tensors, tensor_getter
from models.qwen3.config import Qwen3Config
from models.qwen3.hf import model_from_hf_tensors
from models.qwen3.model import Qwen3ForCausalLM

__all__ = ["GGUF_ARCHITECTURES", "load_gguf_checkpoint", "read_gguf_config"]

GGUF_ARCHITECTURES = ("qwen3",)
QWEN3_BLOCKS = {**LLAMA_BLOCKS, "attn_q_norm.weight": "self_attn.q_norm.weight",
                "attn_k_norm.weight": "self_attn.k_norm.weight"}


def read_gguf_config(reader_or_path, dtype=None, param_dtype=None) -> Qwen3Config:
    """The Qwen3Config a qwen3 GGUF's metadata describes (param_dtype defaults to "float32").

    Raises:
      ValueError naming the key for another architecture, missing metadata, RoPE scaling or
      a sliding window.
    """
    reader, name = open_gguf(reader_or_path)
    arch = get_metadata(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{name}: general.architecture={arch!r} is not a Qwen3 GGUF ({list(GGUF_ARCHITECTURES)})")
    return Qwen3Config(**gguf_config_fields(reader, name, arch, dtype=dtype, param_dtype=param_dtype))


def load_gguf_checkpoint(path, dtype=None, param_dtype=None, place=None,
                         weight_dtype: str = "auto") -> Qwen3ForCausalLM:
    """Load a qwen3 GGUF file as a Qwen3ForCausalLM (Args as models.llama.load_gguf_checkpoint).

    Raises:
      ValueError naming the file and the problem: a non-qwen3 architecture, a missing or
      unexpected tensor, a type gguf.quants cannot dequantize, a tensor of the wrong shape.
    """
    reader, name = open_gguf(path)
    config = read_gguf_config(reader, dtype=dtype, param_dtype=param_dtype)
    check_weight_dtype(weight_dtype, place)
    by_hf = read_gguf_tensors(reader, name, QWEN3_BLOCKS, "Qwen3")
    get_tensor = tensor_getter(by_hf, name, keep_packed=weight_dtype == "auto" and param_dtype is None)
    return pack_model(model_from_hf_tensors(config, get_tensor, place), weight_dtype)
