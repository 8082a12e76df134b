"""HF Mistral checkpoint directory (config.json + safetensors) -> LlamaForCausalLM.

Mistral's tensors are Llama's, names and layouts: the config is read as MistralConfig (which
with its sliding window, if any) and the tensors by Llama's map (models.llama.hf.model_from_hf_tensors).
llama.cpp writes Mistral GGUFs as general.architecture "llama", so the Llama family reads those.
"""

from __future__ import annotations

from models.hf_checkpoint import hf_tensor_reader, read_hf_config, tensor_files
from models.llama.hf import model_from_hf_tensors, require_tensors
from models.llama.model import LlamaForCausalLM
from models.mistral.config import MistralConfig

__all__ = ["load_hf_checkpoint"]


def load_hf_checkpoint(path: str, dtype=None, param_dtype=None, place=None) -> LlamaForCausalLM:
    """Load a HF Mistral directory (config.json + model.safetensors or a shard index).

    Args:
      path: the checkpoint directory.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the weights; defaults to the checkpoint's dtype.
      place: where each tensor goes (models.llama.hf.model_from_hf_tensors).
    Returns:
      A LlamaForCausalLM whose config is a MistralConfig.
    Raises:
      ValueError naming the field or tensor for a config this model cannot serve (a window
      that is not a positive int), a missing tensor or a tensor of the wrong shape.
    """
    config = MistralConfig.from_hf_config(read_hf_config(path), dtype=dtype, param_dtype=param_dtype)
    with hf_tensor_reader(tensor_files(path)) as get_tensor:
        return model_from_hf_tensors(config, require_tensors(get_tensor, f"a {config.num_layers}-layer Mistral"),
                                     place)
