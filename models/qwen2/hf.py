"""HF Qwen2 checkpoint directory (config.json + safetensors) -> Qwen2ForCausalLM.

Qwen2's tensors are Llama's plus `self_attn.{q,k,v}_proj.bias`, so Llama's tensor map
(models.llama.hf.model_from_hf_tensors: layouts, packed GGUF blocks, placement on a mesh)
fills every weight the two share, and this module adds the biases. The GGUF loader
(models/qwen2/gguf.py) hands its tensors to model_from_hf_tensors under the same HF names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.hf_checkpoint import hf_tensor_reader, read_hf_config, set_param, tensor_files
from models.llama import hf as llama_hf
from models.qwen2.config import Qwen2Config
from models.qwen2.model import Qwen2ForCausalLM

__all__ = ["load_hf_checkpoint", "model_from_hf_tensors", "put_tensor", "require_tensors"]


def require_tensors(get_tensor: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """get_tensor, raising a ValueError naming the tensor (and `what` wanted it) for a missing one."""

    def get(name: str):
        try:
            return get_tensor(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name} for {what}") from None

    return get


def put_tensor(param, tensor, hf_name: str, param_name: str, param_dtype: str, place=None) -> None:
    """Fill a skeleton's parameter with an HF tensor already in the parameter's layout.

    place: as models.llama.hf.model_from_hf_tensors takes it, called with param_name (the key
    of the family's tensor-parallel rules)."""
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"tensor {hf_name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)} "
                         "for this config")
    if place is None:
        set_param(param, jnp.asarray(tensor).astype(param_dtype))
    else:
        set_param(param, place(param_name, np.asarray(tensor).astype(jnp.dtype(param_dtype))))


def model_from_hf_tensors(config: Qwen2Config, get_tensor: Callable[[str], Any], place=None) -> Qwen2ForCausalLM:
    """A Qwen2ForCausalLM whose every parameter is the HF-named tensor get_tensor returns.

    Args, Returns: as models.llama.hf.model_from_hf_tensors (HF names, HF layouts, PackedRows
      kept packed, place per tensor), plus "model.layers.{i}.self_attn.{q,k,v}_proj.bias".
    Raises:
      ValueError naming the tensor when one is missing or has the wrong shape.
    """
    get_tensor = require_tensors(get_tensor, f"a {config.num_layers}-layer Qwen2")
    shared = nnx.state(llama_hf.model_from_hf_tensors(config, get_tensor, place))
    model = nnx.eval_shape(lambda: Qwen2ForCausalLM(config, rngs=nnx.Rngs(0)))
    nnx.update(model, shared)
    for i, layer in enumerate(model.layers):
        for proj in ("q", "k", "v"):
            name = f"model.layers.{i}.self_attn.{proj}_proj.bias"
            put_tensor(getattr(layer.self_attn, f"{proj}_bias"), get_tensor(name), name, f"{proj}_bias",
                       config.param_dtype, place)
    return model


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
