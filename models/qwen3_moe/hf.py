"""HF Qwen3-MoE checkpoint directory (config.json + safetensors) -> Qwen3MoeForCausalLM.

The attention, norms, embeddings and dense layers' MLPs are Qwen3's HF tensor map
(models.qwen3.hf.hf_layout: Llama's plus the q/k norms), less the dense-MLP names of the MoE
layers, plus each MoE layer's router (`mlp.gate.weight` [E, D]), all read by Llama's
model_from_hf_tensors into a Qwen3MoeForCausalLM; the experts are read after. They come per
expert (`mlp.experts.{e}.gate_proj.weight`, what save_pretrained and the published checkpoints
write) or fused (`mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj` [E, D, F],
transformers' in-memory layout); both load into [D, E, F] (gate, up) and [E, F, D] (down).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from models.hf_checkpoint import hf_tensor_reader, read_hf_config, tensor_files
from models.llama import hf as llama_hf
from models.llama.hf import HfTensor, put_tensor, require_tensors
from models.qwen3 import hf as qwen3_hf
from models.qwen3_moe.config import Qwen3MoeConfig
from models.qwen3_moe.model import Qwen3MoeForCausalLM

__all__ = ["hf_layout", "load_hf_checkpoint", "model_from_hf_tensors"]


def _is_dense_mlp_of_moe_layer(config: Qwen3MoeConfig, hf_name: str) -> bool:
    parts = hf_name.split(".")
    return len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[3] == "mlp" \
        and config.is_moe_layer(int(parts[2]))


def hf_layout(config: Qwen3MoeConfig) -> dict[str, HfTensor]:
    """Qwen3's HF tensor map without the MoE layers' dense MLPs, with their routers; no experts."""
    c = config
    layout = {name: entry for name, entry in qwen3_hf.hf_layout(c).items() if not _is_dense_mlp_of_moe_layer(c, name)}
    for i in range(c.num_layers):
        if c.is_moe_layer(i):
            layout[f"model.layers.{i}.mlp.gate.weight"] = HfTensor(  # [E, D] -> [D, E]
                (c.num_experts, c.hidden_size), lambda m, i=i: m.layers[i].mlp.gate, lambda w: w.T, lambda w: w.T,
                "gate")
    return layout


def model_from_hf_tensors(config: Qwen3MoeConfig, get_tensor: Callable[[str], Any], place=None) -> Qwen3MoeForCausalLM:
    """A Qwen3MoeForCausalLM whose every parameter is the HF-named tensor get_tensor returns.

    Args:
      get_tensor: HF tensor name -> array in HF layout; KeyError for a name the checkpoint lacks
        (the fused expert names are tried first, then the per-expert ones).
      place: as models.llama.hf.model_from_hf_tensors takes it.
    Raises:
      ValueError naming the tensor when one is missing or has the wrong shape.
    """
    c = config
    read = require_tensors(get_tensor, f"a {c.num_layers}-layer Qwen3-MoE")
    model = llama_hf.model_from_hf_tensors(c, read, place, model_class=Qwen3MoeForCausalLM, layout=hf_layout(c))
    for i, layer in enumerate(model.layers):
        if c.is_moe_layer(i):
            _put_experts(layer.mlp, f"model.layers.{i}.mlp.", get_tensor, read, c, place)
    return model


def _put_experts(moe, prefix: str, get_tensor, read, config: Qwen3MoeConfig, place) -> None:
    def put(param, value, hf_name, param_name):
        put_tensor(param, value, hf_name, param_name, config.param_dtype, place)

    try:
        gate_up = jnp.asarray(get_tensor(prefix + "experts.gate_up_proj"))  # fused [E, 2F, D]
    except KeyError:
        gate_up = None
    if gate_up is not None:
        gate, up = jnp.split(gate_up, 2, axis=1)  # [E, F, D] each
        put(moe.experts_gate, gate.transpose(2, 0, 1), prefix + "experts.gate_up_proj", "experts_gate")
        put(moe.experts_up, up.transpose(2, 0, 1), prefix + "experts.gate_up_proj", "experts_up")
        down = jnp.asarray(read(prefix + "experts.down_proj"))  # [E, D, F]
        put(moe.experts_down, down.transpose(0, 2, 1), prefix + "experts.down_proj", "experts_down")
        return
    for param, proj, axis in ((moe.experts_gate, "gate_proj", 1), (moe.experts_up, "up_proj", 1),
                              (moe.experts_down, "down_proj", 0)):
        stacked = jnp.stack([jnp.asarray(read(f"{prefix}experts.{e}.{proj}.weight")).T
                             for e in range(config.num_experts)], axis=axis)
        put(param, stacked, f"{prefix}experts.*.{proj}.weight", f"experts_{proj.removesuffix('_proj')}")


def load_hf_checkpoint(path: str, dtype=None, param_dtype=None, place=None) -> Qwen3MoeForCausalLM:
    """Load a HF Qwen3-MoE directory (config.json + model.safetensors or a shard index).

    Args:
      path: the checkpoint directory.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the weights; defaults to the checkpoint's dtype.
      place: where each tensor goes (model_from_hf_tensors); default the default device.
    Raises:
      ValueError naming the field or tensor for a config this model cannot serve, a missing
      tensor or a tensor of the wrong shape.
    """
    config = Qwen3MoeConfig.from_hf_config(read_hf_config(path), dtype=dtype, param_dtype=param_dtype)
    with hf_tensor_reader(tensor_files(path)) as get_tensor:
        return model_from_hf_tensors(config, get_tensor, place)
