"""HF Qwen3-MoE checkpoint directory (config.json + safetensors) -> Qwen3MoeForCausalLM.

The attention, norms, embeddings and dense layers' MLPs use Llama's HF tensor map
(models.llama.hf._hf_layout: each name's layout transform; its getters find the same
attributes here), the q/k norms Qwen3's; a MoE layer's dense-MLP names are skipped and its
router (`mlp.gate.weight` [E, D]) and experts read instead. Experts come per expert
(`mlp.experts.{e}.gate_proj.weight`, what save_pretrained and the published checkpoints
write) or fused (`mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj` [E, D, F],
transformers' in-memory layout); both load into [D, E, F] (gate, up) and [E, F, D] (down).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from models.hf_checkpoint import hf_tensor_reader, read_hf_config, tensor_files
from models.llama.hf import _hf_layout as llama_hf_layout
from models.qwen2.hf import put_tensor, require_tensors
from models.qwen3.hf import put_qk_norms
from models.qwen3_moe.config import Qwen3MoeConfig
from models.qwen3_moe.model import Qwen3MoeForCausalLM

__all__ = ["load_hf_checkpoint", "model_from_hf_tensors"]


def _is_dense_mlp_of_moe_layer(config: Qwen3MoeConfig, hf_name: str) -> bool:
    parts = hf_name.split(".")
    return len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[3] == "mlp" \
        and config.is_moe_layer(int(parts[2]))


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
    model = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(c, rngs=nnx.Rngs(0)))
    for name, (_, param_of, from_hf, _) in llama_hf_layout(c).items():
        if not _is_dense_mlp_of_moe_layer(c, name):
            put_tensor(param_of(model), from_hf(jnp.asarray(read(name))), name, name.rsplit(".", 2)[-2],
                       c.param_dtype, place)
    put_qk_norms(model, read, place)
    for i, layer in enumerate(model.layers):
        if c.is_moe_layer(i):
            _put_experts(layer.mlp, f"model.layers.{i}.mlp.", get_tensor, read, c, place)
    return model


def _put_experts(moe, prefix: str, get_tensor, read, config: Qwen3MoeConfig, place) -> None:
    def put(param, value, hf_name, param_name):
        put_tensor(param, value, hf_name, param_name, config.param_dtype, place)

    put(moe.gate, jnp.asarray(read(prefix + "gate.weight")).T, prefix + "gate.weight", "gate")  # [E, D] -> [D, E]
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
