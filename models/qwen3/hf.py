"""HF Qwen3 checkpoint directory (config.json + safetensors) -> Qwen3ForCausalLM.

Qwen3's tensors are Llama's plus `self_attn.{q,k}_norm.weight`, so its map (hf_layout) is
Llama's (models.llama.hf.hf_layout) plus the norms, read by Llama's model_from_hf_tensors.
The GGUF loader (models/qwen3/gguf.py) hands its tensors over by the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from models.hf_checkpoint import hf_tensor_reader, read_hf_config, tensor_files
from models.llama import hf as llama_hf
from models.llama.hf import HfTensor, require_tensors, same
from models.qwen3.config import Qwen3Config
from models.qwen3.model import Qwen3ForCausalLM

__all__ = ["hf_layout", "load_hf_checkpoint", "model_from_hf_tensors"]


def hf_layout(config: Qwen3Config) -> dict[str, HfTensor]:
    """Llama's HF tensor map plus every layer's q_norm and k_norm weights ([head_dim] each)."""
    layout = llama_hf.hf_layout(config)
    for i in range(config.num_layers):
        for norm in ("q_norm", "k_norm"):
            layout[f"model.layers.{i}.self_attn.{norm}.weight"] = HfTensor(
                (config.head_dim,), lambda m, i=i, norm=norm: getattr(m.layers[i].self_attn, norm).weight,
                same, same, norm)
    return layout


def model_from_hf_tensors(config: Qwen3Config, get_tensor: Callable[[str], Any], place=None) -> Qwen3ForCausalLM:
    """A Qwen3ForCausalLM whose every parameter is the HF-named tensor get_tensor returns.

    Args, Returns: as models.llama.hf.model_from_hf_tensors, plus
      "model.layers.{i}.self_attn.{q,k}_norm.weight" ([head_dim] each).
    Raises:
      ValueError naming the tensor when one is missing or has the wrong shape.
    """
    return llama_hf.model_from_hf_tensors(config, require_tensors(get_tensor, f"a {config.num_layers}-layer Qwen3"),
                                          place, model_class=Qwen3ForCausalLM, layout=hf_layout(config))


def load_hf_checkpoint(path: str, dtype=None, param_dtype=None, place=None) -> Qwen3ForCausalLM:
    """Load a HF Qwen3 directory (config.json + model.safetensors or a shard index).

    Args:
      path: the checkpoint directory.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the weights; defaults to the checkpoint's dtype.
      place: where each tensor goes (model_from_hf_tensors); default the default device.
    Raises:
      ValueError naming the field or tensor for a config this model cannot serve, a missing
      tensor or a tensor of the wrong shape.
    """
    config = Qwen3Config.from_hf_config(read_hf_config(path), dtype=dtype, param_dtype=param_dtype)
    with hf_tensor_reader(tensor_files(path)) as get_tensor:
        return model_from_hf_tensors(config, get_tensor, place)
