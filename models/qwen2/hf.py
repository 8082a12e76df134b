"""HF Qwen2 checkpoint directory (config.json + safetensors) -> Qwen2ForCausalLM.

Qwen2's tensors are Llama's plus `self_attn.{q,k,v}_proj.bias`, so its map (hf_layout) is
Llama's (models.llama.hf.hf_layout) plus the biases, read by Llama's model_from_hf_tensors
(layouts, packed GGUF blocks, placement on a mesh) into a Qwen2ForCausalLM. The GGUF loader
(models/qwen2/gguf.py) hands its tensors to model_from_hf_tensors under the same HF names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from models.hf_checkpoint import hf_tensor_reader, read_hf_config, tensor_files
from models.llama import hf as llama_hf
from models.llama.hf import HfTensor, require_tensors, same
from models.qwen2.config import Qwen2Config
from models.qwen2.model import Qwen2ForCausalLM

__all__ = ["hf_layout", "load_hf_checkpoint", "model_from_hf_tensors"]


def hf_layout(config: Qwen2Config) -> dict[str, HfTensor]:
    """Llama's HF tensor map plus every layer's q, k and v biases ([N * H], [K * H], kept flat)."""
    c = config
    layout = llama_hf.hf_layout(c)
    for i in range(c.num_layers):
        for proj, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
            layout[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = HfTensor(
                (heads * c.head_dim,), lambda m, i=i, proj=proj: getattr(m.layers[i].self_attn, f"{proj}_bias"),
                same, same, f"{proj}_bias")
    return layout


def model_from_hf_tensors(config: Qwen2Config, get_tensor: Callable[[str], Any], place=None) -> Qwen2ForCausalLM:
    """A Qwen2ForCausalLM whose every parameter is the HF-named tensor get_tensor returns.

    Args, Returns: as models.llama.hf.model_from_hf_tensors (HF names, HF layouts, PackedRows
      kept packed, place per tensor), plus "model.layers.{i}.self_attn.{q,k,v}_proj.bias".
    Raises:
      ValueError naming the tensor when one is missing or has the wrong shape.
    """
    return llama_hf.model_from_hf_tensors(config, require_tensors(get_tensor, f"a {config.num_layers}-layer Qwen2"),
                                          place, model_class=Qwen2ForCausalLM, layout=hf_layout(config))


def load_hf_checkpoint(path: str, dtype=None, param_dtype=None, place=None) -> Qwen2ForCausalLM:
    """Load a HF Qwen2 / Qwen2.5 directory (config.json + model.safetensors or a shard index).

    Args:
      path: the checkpoint directory.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the weights; defaults to the checkpoint's dtype.
      place: where each tensor goes (model_from_hf_tensors); default the default device.
    Raises:
      ValueError naming the field or tensor for a config this model cannot serve (another
      architecture, a sliding window), a missing tensor or a tensor of the wrong shape.
    """
    config = Qwen2Config.from_hf_config(read_hf_config(path), dtype=dtype, param_dtype=param_dtype)
    with hf_tensor_reader(tensor_files(path)) as get_tensor:
        return model_from_hf_tensors(config, get_tensor, place)
