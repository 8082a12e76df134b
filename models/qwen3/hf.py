"""HF Qwen3 checkpoint directory (config.json + safetensors) -> Qwen3ForCausalLM.

Qwen3's tensors are Llama's plus `self_attn.{q,k}_norm.weight`, so Llama's tensor map
(models.llama.hf.model_from_hf_tensors) fills every weight the two share and this module
adds the norms. The GGUF loader (models/qwen3/gguf.py) hands its tensors over by the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from models.hf_checkpoint import hf_tensor_reader, read_hf_config, tensor_files
from models.llama import hf as llama_hf
from models.qwen2.hf import put_tensor, require_tensors
from models.qwen3.config import Qwen3Config
from models.qwen3.model import Qwen3ForCausalLM

__all__ = ["load_hf_checkpoint", "model_from_hf_tensors", "put_qk_norms"]


def put_qk_norms(model, get_tensor: Callable[[str], Any], place=None) -> None:
    """Fill every layer's q_norm / k_norm weight of a skeleton from its HF tensor."""
    for i, layer in enumerate(model.layers):
        for norm in ("q_norm", "k_norm"):
            name = f"model.layers.{i}.self_attn.{norm}.weight"
            put_tensor(getattr(layer.self_attn, norm).weight, get_tensor(name), name, norm,
                       model.config.param_dtype, place)


def model_from_hf_tensors(config: Qwen3Config, get_tensor: Callable[[str], Any], place=None) -> Qwen3ForCausalLM:
    """A Qwen3ForCausalLM whose every parameter is the HF-named tensor get_tensor returns.

    Args, Returns: as models.llama.hf.model_from_hf_tensors, plus
      "model.layers.{i}.self_attn.{q,k}_norm.weight" ([head_dim] each).
    Raises:
      ValueError naming the tensor when one is missing or has the wrong shape.
    """
    get_tensor = require_tensors(get_tensor, f"a {config.num_layers}-layer Qwen3")
    shared = nnx.state(llama_hf.model_from_hf_tensors(config, get_tensor, place))
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)))
    nnx.update(model, shared)
    put_qk_norms(model, get_tensor, place)
    return model


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
