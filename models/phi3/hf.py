"""HF Phi-3 checkpoint directory (config.json + safetensors) -> Phi3ForCausalLM.

Phi-3 stores Llama's weights with two fusions: `self_attn.qkv_proj.weight` [(N + 2K) H, D]
(q rows, then k, then v) and `mlp.gate_up_proj.weight` [2F, D] (gate rows, then up). They are
split into Llama's names as Llama's tensor map (models.llama.hf.model_from_hf_tensors) asks
for them, so the layouts, placement and shape checks are Llama's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from models.hf_checkpoint import hf_tensor_reader, read_hf_config, tensor_files
from models.llama import hf as llama_hf
from models.llama.hf import require_tensors
from models.phi3.config import Phi3Config
from models.phi3.model import Phi3ForCausalLM

__all__ = ["load_hf_checkpoint", "model_from_hf_tensors", "split_fused"]


def split_fused(config: Phi3Config, get_tensor: Callable[[str], Any]) -> Callable[[str], Any]:
    """get_tensor over Llama's names: q/k/v_proj from qkv_proj, gate/up_proj from gate_up_proj
    (each fused tensor read once per part asked for), every other name as it is."""
    q_rows, kv_rows, f = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    fused_rows = {"qkv_proj": q_rows + 2 * kv_rows, "gate_up_proj": 2 * f}
    parts = {"q_proj": ("qkv_proj", 0, q_rows), "k_proj": ("qkv_proj", q_rows, q_rows + kv_rows),
             "v_proj": ("qkv_proj", q_rows + kv_rows, q_rows + 2 * kv_rows),
             "gate_proj": ("gate_up_proj", 0, f), "up_proj": ("gate_up_proj", f, 2 * f)}

    def get(name: str):
        prefix, _, proj = name.removesuffix(".weight").rpartition(".")
        if proj not in parts or not name.startswith("model.layers."):
            return get_tensor(name)
        fused, start, stop = parts[proj]
        fused_name = f"{prefix}.{fused}.weight"
        tensor = get_tensor(fused_name)
        if tensor.shape[0] != fused_rows[fused]:
            raise ValueError(f"tensor {fused_name} has {tensor.shape[0]} rows, expected {fused_rows[fused]} "
                             "for this config")
        return tensor[start:stop]

    return get


def model_from_hf_tensors(config: Phi3Config, get_tensor: Callable[[str], Any], place=None) -> Phi3ForCausalLM:
    """A Phi3ForCausalLM from HF-named tensors (fused qkv_proj / gate_up_proj, as Phi-3 stores them).

    Args, Returns: as models.llama.hf.model_from_hf_tensors.
    Raises:
      ValueError naming the tensor when one is missing or has the wrong shape.
    """
    get_tensor = split_fused(config, require_tensors(get_tensor, f"a {config.num_layers}-layer Phi-3"))
    return llama_hf.model_from_hf_tensors(config, get_tensor, place, model_class=Phi3ForCausalLM)


def load_hf_checkpoint(path: str, dtype=None, param_dtype=None, place=None,
                       long_context: bool = False) -> Phi3ForCausalLM:
    """Load a HF Phi-3 directory (config.json + model.safetensors or a shard index).

    Args:
      path: the checkpoint directory.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the weights; defaults to the checkpoint's dtype.
      place: where each tensor goes (models.llama.hf.model_from_hf_tensors).
      long_context: LongRoPE checkpoints: serve max_position_embeddings with long_factor
        instead of original_max_position_embeddings with short_factor (models/phi3/config.py).
    Raises:
      ValueError naming the field or tensor for a config this model cannot serve (a bad
      window, an unsupported rope type), a missing tensor or a tensor of the wrong shape.
    """
    config = Phi3Config.from_hf_config(read_hf_config(path), dtype=dtype, param_dtype=param_dtype,
                                       long_context=long_context)
    with hf_tensor_reader(tensor_files(path)) as get_tensor:
        return model_from_hf_tensors(config, get_tensor, place)
