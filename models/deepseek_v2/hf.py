"""HF DeepSeek-V2 checkpoint directory (config.json + safetensors) -> DeepseekV2ForCausalLM.

Tensors are read one at a time by models/hf_checkpoint.py (framework="flax", so bf16 reads),
into a skeleton built with nnx.eval_shape. HF stores linear weights [out, in]; this model keeps
einsum layouts, so each parameter names its HF tensor(s) and the one transform between.
Routed experts come per expert (`mlp.experts.{e}.gate_proj.weight`, what save_pretrained and
the published checkpoints write) or fused (`mlp.experts.gate_up_proj`, transformers' in-memory
layout); both load into [D, E, F] (gate, up) and [E, F, D] (down) stacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from models.deepseek_v2.config import DeepseekV2Config
from models.deepseek_v2.model import DeepseekV2ForCausalLM
from models.hf_checkpoint import hf_tensor_reader, read_hf_config, set_param, tensor_files

__all__ = ["load_hf_checkpoint", "model_from_hf_tensors"]


def _set(param, value, name: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"tensor {name} gives shape {tuple(value.shape)}, expected {tuple(param.shape)} for this "
                         "config (check config.json against the checkpoint)")
    set_param(param, jnp.asarray(value).astype(param.dtype))


def model_from_hf_tensors(config: DeepseekV2Config, get_tensor: Callable[[str], Any]) -> DeepseekV2ForCausalLM:
    """Build a model of `config` from HF-named tensors (get_tensor: name -> array in HF layout).

    Raises:
      ValueError naming the tensor when one is missing or has the wrong shape.
    """
    c = config
    n, h, p, v = c.num_heads, c.qk_head_dim, c.qk_nope_head_dim, c.v_head_dim
    model = nnx.eval_shape(lambda: DeepseekV2ForCausalLM(c, rngs=nnx.Rngs(0)))

    def read(name):
        try:
            return jnp.asarray(get_tensor(name))
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name} for this {c.num_layers}-layer DeepSeek-V2 "
                             "config") from None

    def put(param, name, transform=lambda w: w):
        _set(param, transform(read(name)), name)

    def heads_in(num, width):  # [num*width, in] -> [in, num, width]
        return lambda w: w.reshape(num, width, -1).transpose(2, 0, 1)

    put(model.embed_tokens, "model.embed_tokens.weight")
    put(model.norm.weight, "model.norm.weight")
    if model.lm_head is not None:
        put(model.lm_head, "lm_head.weight")
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        put(layer.input_layernorm.weight, pre + "input_layernorm.weight")
        put(layer.post_attention_layernorm.weight, pre + "post_attention_layernorm.weight")
        attn = layer.self_attn
        if c.q_lora_rank is None:
            put(attn.q_proj, pre + "self_attn.q_proj.weight", heads_in(n, h))
        else:
            put(attn.q_a_proj, pre + "self_attn.q_a_proj.weight", lambda w: w.T)
            put(attn.q_a_layernorm.weight, pre + "self_attn.q_a_layernorm.weight")
            put(attn.q_b_proj, pre + "self_attn.q_b_proj.weight", heads_in(n, h))
        put(attn.kv_a_proj_with_mqa, pre + "self_attn.kv_a_proj_with_mqa.weight", lambda w: w.T)
        put(attn.kv_a_layernorm.weight, pre + "self_attn.kv_a_layernorm.weight")
        put(attn.kv_b_proj, pre + "self_attn.kv_b_proj.weight", heads_in(n, p + v))
        put(attn.o_proj, pre + "self_attn.o_proj.weight", lambda w: w.reshape(w.shape[0], n, v).transpose(1, 2, 0))
        mlp = layer.mlp
        dense_mlps = [(mlp, pre + "mlp.")]
        if c.is_moe_layer(i):
            dense_mlps = [(mlp.shared_experts, pre + "mlp.shared_experts.")] if mlp.shared_experts is not None else []
            put(mlp.gate, pre + "mlp.gate.weight", lambda w: w.T)
            _load_experts(mlp, pre + "mlp.experts.", read, get_tensor, c.n_routed_experts)
        for module, prefix in dense_mlps:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                put(getattr(module, proj), f"{prefix}{proj}.weight", lambda w: w.T)
    return model


def _load_experts(moe, prefix: str, read, get_tensor, num_experts: int) -> None:
    try:
        gate_up = jnp.asarray(get_tensor(prefix + "gate_up_proj"))  # fused [E, 2F, D]
    except KeyError:
        gate_up = None
    if gate_up is not None:
        gate, up = jnp.split(gate_up, 2, axis=1)  # [E, F, D] each
        _set(moe.experts_gate, gate.transpose(2, 0, 1), prefix + "gate_up_proj")
        _set(moe.experts_up, up.transpose(2, 0, 1), prefix + "gate_up_proj")
        _set(moe.experts_down, read(prefix + "down_proj").transpose(0, 2, 1), prefix + "down_proj")  # [E, D, F]
        return
    for param, proj, axis in ((moe.experts_gate, "gate_proj", 1), (moe.experts_up, "up_proj", 1),
                              (moe.experts_down, "down_proj", 0)):
        _set(param, jnp.stack([read(f"{prefix}{e}.{proj}.weight").T for e in range(num_experts)], axis=axis),
             f"{prefix}*.{proj}.weight")


def load_hf_checkpoint(path: str, dtype=None, param_dtype=None) -> DeepseekV2ForCausalLM:
    """Load a HF DeepSeek-V2 directory (config.json + model.safetensors or a shard index).

    Args:
      path: the checkpoint directory.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the weights; defaults to the checkpoint's dtype.
    Raises:
      ValueError naming the config field this model cannot serve, or a missing / misshapen tensor.
    """
    config = DeepseekV2Config.from_hf_config(read_hf_config(path), dtype=dtype, param_dtype=param_dtype)
    with hf_tensor_reader(tensor_files(path)) as get_tensor:
        return model_from_hf_tensors(config, get_tensor)
