"""HF Llama checkpoint directory (config.json + safetensors) <-> LlamaForCausalLM.

The directory is read with models/hf_checkpoint.py (one tensor at a time, into an
nnx.eval_shape skeleton). HF stores linear weights [out, in]; this model keeps einsum layouts
([D, N, H], [D, F], ...), so every tensor goes through the one transform its entry in
`hf_layout` (the Llama HF tensor map: name -> HfTensor) lists. The GGUF loader
(models/llama/gguf.py) hands its tensors to model_from_hf_tensors under the same HF names. A
family built on Llama's model extends the map with its own tensors and passes its model class
(models/qwen2/hf.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.flax import save_file

from models.hf_checkpoint import SINGLE_FILE, hf_tensor_reader, read_hf_config, set_param, tensor_files
from models.llama.config import LlamaConfig
from models.gguf import PackedRows
from models.llama.model import LlamaForCausalLM
from models.packed_weight import PackedWeight, packed_from_rows

__all__ = ["HfTensor", "hf_layout", "load_hf_checkpoint", "model_from_hf_tensors", "put_tensor", "require_tensors",
           "same", "save_hf_checkpoint"]


def same(w):
    """The identity layout transform: the parameter is laid out as HF stores it."""
    return w


class HfTensor(NamedTuple):
    """How one HF tensor fills one parameter of the model.

    Attributes:
      shape: the HF tensor's shape.
      param_of: model -> the nnx.Param the tensor fills.
      from_hf: HF layout -> the parameter's layout (numpy or jax arrays).
      to_hf: the parameter's layout -> HF layout.
      param_name: the parameter's name, the key of the family's param_partition_rules (what
        place is called with) and of models.packed_weight's input axes: "q_proj", "q_bias".
    """

    shape: tuple[int, ...]
    param_of: Callable[[Any], nnx.Param]
    from_hf: Callable
    to_hf: Callable
    param_name: str


def hf_layout(config: LlamaConfig) -> dict[str, HfTensor]:
    """HF tensor name -> its HfTensor, for every tensor of a Llama checkpoint of `config`.

    A family on Llama's model adds its own names to the dict (models/qwen2/hf.py: the biases)
    or leaves some out (models/qwen3_moe/hf.py: the dense MLPs of its MoE layers).
    """
    c = config
    d, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    n, k, h = c.num_heads, c.num_kv_heads, c.head_dim
    t = lambda w: w.T  # noqa: E731

    def heads_in(num):  # [num*H, D] -> [D, num, H]
        return lambda w: w.reshape(num, h, d).transpose(2, 0, 1)

    def heads_out(w):  # [D, num, H] -> [num*H, D]
        return w.transpose(1, 2, 0).reshape(-1, d)

    layout = {"model.embed_tokens.weight": HfTensor((v, d), lambda m: m.embed_tokens, same, same, "embed_tokens"),
              "model.norm.weight": HfTensor((d,), lambda m: m.norm.weight, same, same, "norm")}
    if not c.tie_word_embeddings:
        layout["lm_head.weight"] = HfTensor((v, d), lambda m: m.lm_head, same, same, "lm_head")
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        layer = lambda m, i=i: m.layers[i]  # noqa: E731
        layout |= {
            p + "input_layernorm.weight": HfTensor(
                (d,), lambda m, g=layer: g(m).input_layernorm.weight, same, same, "input_layernorm"),
            p + "post_attention_layernorm.weight": HfTensor(
                (d,), lambda m, g=layer: g(m).post_attention_layernorm.weight, same, same, "post_attention_layernorm"),
            p + "self_attn.q_proj.weight": HfTensor(
                (n * h, d), lambda m, g=layer: g(m).self_attn.q_proj, heads_in(n), heads_out, "q_proj"),
            p + "self_attn.k_proj.weight": HfTensor(
                (k * h, d), lambda m, g=layer: g(m).self_attn.k_proj, heads_in(k), heads_out, "k_proj"),
            p + "self_attn.v_proj.weight": HfTensor(
                (k * h, d), lambda m, g=layer: g(m).self_attn.v_proj, heads_in(k), heads_out, "v_proj"),
            # [D, N*H] -> [N, H, D]
            p + "self_attn.o_proj.weight": HfTensor(
                (d, n * h), lambda m, g=layer: g(m).self_attn.o_proj, lambda w: w.reshape(d, n, h).transpose(1, 2, 0),
                lambda w: w.transpose(2, 0, 1).reshape(d, n * h), "o_proj"),
            p + "mlp.gate_proj.weight": HfTensor((f, d), lambda m, g=layer: g(m).mlp.gate_proj, t, t, "gate_proj"),
            p + "mlp.up_proj.weight": HfTensor((f, d), lambda m, g=layer: g(m).mlp.up_proj, t, t, "up_proj"),
            p + "mlp.down_proj.weight": HfTensor((d, f), lambda m, g=layer: g(m).mlp.down_proj, t, t, "down_proj"),
        }
    return layout


def require_tensors(get_tensor: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """get_tensor, raising a ValueError naming the tensor (and `what` wanted it) for a missing one."""

    def get(name: str):
        try:
            return get_tensor(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name} for {what}") from None

    return get


def put_tensor(param, tensor, hf_name: str, param_name: str, param_dtype: str, place=None) -> None:
    """Fill a skeleton's parameter with a float tensor already in the parameter's layout.

    place: as model_from_hf_tensors takes it, called with param_name (the key of the family's
    tensor-parallel rules). Raises ValueError naming hf_name when the shapes differ.
    """
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"tensor {hf_name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)} "
                         "for this config")
    if place is None:
        set_param(param, jnp.asarray(tensor).astype(param_dtype))
    else:
        set_param(param, place(param_name, np.asarray(tensor).astype(jnp.dtype(param_dtype))))


def load_hf_checkpoint(path: str, dtype=None, param_dtype=None, place=None) -> LlamaForCausalLM:
    """Load a HF Llama directory (config.json + model.safetensors or a shard index).

    Args:
      path: the checkpoint directory.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the weights; defaults to the checkpoint's dtype.
      place: where each tensor goes (model_from_hf_tensors); default the default device.
    Returns:
      The model; its config is `model.config`.
    Raises:
      ValueError naming the field or tensor for a non-Llama config, a missing tensor or a
      tensor of the wrong shape.
    """
    config = LlamaConfig.from_hf_config(read_hf_config(path), dtype=dtype, param_dtype=param_dtype)

    layout = hf_layout(config)
    files = tensor_files(path)
    missing = sorted(set(layout) - set(files))
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor(s) {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} for a {config.num_layers}-layer Llama")

    with hf_tensor_reader(files) as get_tensor:
        return model_from_hf_tensors(config, get_tensor, place)


def model_from_hf_tensors(config: LlamaConfig, get_tensor: Callable[[str], Any], place=None, *,
                          model_class: type[LlamaForCausalLM] = LlamaForCausalLM,
                          layout: dict[str, HfTensor] | None = None) -> LlamaForCausalLM:
    """Build a model of `config` whose every parameter is the HF-named tensor get_tensor returns.

    The one place HF names meet model parameters, shared by every checkpoint format (a HF
    directory, a GGUF file) and by the families built on Llama's model: a format only has to
    produce HF-layout tensors by name, a family its model class and its layout.

    Args:
      config: the model's shapes; decides which names are asked for (no lm_head.weight when
        tie_word_embeddings).
      get_tensor: HF tensor name -> array in HF layout (numpy or jax, any float dtype), e.g.
        "model.layers.0.self_attn.q_proj.weight" -> [num_heads * head_dim, hidden_size], or
        models.gguf.PackedRows of that shape (kept packed). Called once per name, so it may
        read lazily.
      place: optional (parameter name, host array in the model's layout and param_dtype) ->
        device array, e.g. paged_jax.sharding.param_placer(mesh)(PARAM_PARTITION_RULES) (what
        models.registry.load_model passes): each tensor goes straight to its devices, split,
        so no device ever holds the whole checkpoint. The name is the HfTensor's param_name
        ("q_proj", "embed_tokens", "lm_head", "norm"...), the key of the family's rules.
      model_class: the model built (as model_class(config, rngs=...)): a family's subclass of
        LlamaForCausalLM.
      layout: HF name -> HfTensor of every tensor to read; default hf_layout(config).
    Returns:
      The model, weights cast to config.param_dtype.
    Raises:
      ValueError naming the tensor when one has the wrong shape.
    """
    model = nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0)))
    for name, entry in (hf_layout(config) if layout is None else layout).items():
        tensor = get_tensor(name)
        if tuple(tensor.shape) != entry.shape:
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {entry.shape} for this config")
        param = entry.param_of(model)
        if isinstance(tensor, PackedRows):  # a GGUF's blocks: rows are HF's [out, in] rows
            set_param(param, packed_from_rows(tensor.rows, tensor.format, entry.param_name, param.shape))
            continue
        if place is None:
            value = jnp.asarray(entry.from_hf(tensor)).astype(config.param_dtype)
        else:
            value = place(entry.param_name, np.asarray(entry.from_hf(tensor)).astype(jnp.dtype(config.param_dtype)))
        assert value.shape == param.shape, f"layout transform of {name} gives {value.shape}"
        set_param(param, value)
    return model


def save_hf_checkpoint(model: LlamaForCausalLM, path: str) -> None:
    """Write `model` as a HF Llama directory (config.json + model.safetensors) in its param dtype.

    The inverse of load_hf_checkpoint; transformers' LlamaForCausalLM.from_pretrained reads it.
    Packed weights (a GGUF's blocks, LLM(weight_dtype=...)) are written dequantized, in f32.
    """
    os.makedirs(path, exist_ok=True)

    def value(param):
        v = param.get_value()
        return v.dense() if isinstance(v, PackedWeight) else v

    tensors = {name: jnp.asarray(entry.to_hf(value(entry.param_of(model))))
               for name, entry in hf_layout(model.config).items()}
    save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(model.config.to_hf_config(), fh, indent=2)
