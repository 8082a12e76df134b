"""HF Gemma 3 text checkpoint directory (Gemma3ForCausalLM: config.json + safetensors) -> Gemma3ForCausalLM.

Gemma 3's tensors are Qwen3's (Llama's plus `self_attn.{q,k}_norm.weight`) plus each layer's
`pre_feedforward_layernorm.weight` and `post_feedforward_layernorm.weight`; every norm weight
is HF's own (the model adds the 1). Read by Llama's model_from_hf_tensors; the GGUF loader
(models/gemma3/gguf.py) hands its tensors over by the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from models.gemma3.config import Gemma3Config
from models.gemma3.model import Gemma3ForCausalLM
from models.hf_checkpoint import hf_tensor_reader, read_hf_config, tensor_files
from models.llama import hf as llama_hf
from models.llama.hf import HfTensor, require_tensors, same
from models.qwen3 import hf as qwen3_hf

__all__ = ["hf_layout", "load_hf_checkpoint", "model_from_hf_tensors"]


def hf_layout(config: Gemma3Config) -> dict[str, HfTensor]:
    """Qwen3's HF tensor map plus every layer's pre- and post-feedforward norms ([hidden_size] each)."""
    layout = qwen3_hf.hf_layout(config)
    for i in range(config.num_layers):
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            layout[f"model.layers.{i}.{norm}.weight"] = HfTensor(
                (config.hidden_size,), lambda m, i=i, norm=norm: getattr(m.layers[i], norm).weight, same, same, norm)
    return layout


def model_from_hf_tensors(config: Gemma3Config, get_tensor: Callable[[str], Any], place=None) -> Gemma3ForCausalLM:
    """models.llama.hf.model_from_hf_tensors over hf_layout(config), building a Gemma3ForCausalLM
    (ValueError naming a missing tensor or one of the wrong shape)."""
    return llama_hf.model_from_hf_tensors(config, require_tensors(get_tensor, f"a {config.num_layers}-layer Gemma 3"),
                                          place, model_class=Gemma3ForCausalLM, layout=hf_layout(config))


def load_hf_checkpoint(path: str, dtype=None, param_dtype=None, place=None) -> Gemma3ForCausalLM:
    """Load a HF Gemma3ForCausalLM directory (Args as models.llama.load_hf_checkpoint).

    Raises ValueError naming the field or tensor: a config this model cannot serve (another
    architecture, a window that is not positive, soft-capping...), a missing or misshapen tensor.
    """
    config = Gemma3Config.from_hf_config(read_hf_config(path), dtype=dtype, param_dtype=param_dtype)
    with hf_tensor_reader(tensor_files(path)) as get_tensor:
        return model_from_hf_tensors(config, get_tensor, place)
