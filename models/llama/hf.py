"""HF Llama checkpoint directory (config.json + safetensors) <-> LlamaForCausalLM.

The directory is read with models/hf_checkpoint.py (one tensor at a time, into an
nnx.eval_shape skeleton). HF stores linear weights [out, in]; this model keeps einsum layouts
([D, N, H], [D, F], ...), so every tensor goes through the one transform listed for it in
`_hf_layout`, the Llama HF tensor map. The GGUF loader (models/llama/gguf.py) hands its
tensors to model_from_hf_tensors under the same HF names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.flax import save_file

from models.hf_checkpoint import SINGLE_FILE, hf_tensor_reader, read_hf_config, set_param, tensor_files
from models.llama.config import LlamaConfig
from models.gguf import PackedRows
from models.llama.model import LlamaForCausalLM
from models.packed_weight import PackedWeight, packed_from_rows

__all__ = ["load_hf_checkpoint", "model_from_hf_tensors", "save_hf_checkpoint"]


def _hf_layout(c: LlamaConfig) -> dict[str, tuple[tuple[int, ...], Callable, Callable, Callable]]:
    """HF tensor name -> (HF shape, model param getter, from_hf transform, to_hf transform)."""
    d, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    n, k, h = c.num_heads, c.num_kv_heads, c.head_dim
    same = lambda w: w  # noqa: E731
    t = lambda w: w.T  # noqa: E731

    def heads_in(num):  # [num*H, D] -> [D, num, H]
        return lambda w: w.reshape(num, h, d).transpose(2, 0, 1)

    def heads_out(w):  # [D, num, H] -> [num*H, D]
        return w.transpose(1, 2, 0).reshape(-1, d)

    layout = {"model.embed_tokens.weight": ((v, d), lambda m: m.embed_tokens, same, same),
              "model.norm.weight": ((d,), lambda m: m.norm.weight, same, same)}
    if not c.tie_word_embeddings:
        layout["lm_head.weight"] = ((v, d), lambda m: m.lm_head, same, same)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        layer = lambda m, i=i: m.layers[i]  # noqa: E731
        layout |= {
            p + "input_layernorm.weight": ((d,), lambda m, g=layer: g(m).input_layernorm.weight, same, same),
            p + "post_attention_layernorm.weight":
                ((d,), lambda m, g=layer: g(m).post_attention_layernorm.weight, same, same),
            p + "self_attn.q_proj.weight": ((n * h, d), lambda m, g=layer: g(m).self_attn.q_proj,
                                            heads_in(n), heads_out),
            p + "self_attn.k_proj.weight": ((k * h, d), lambda m, g=layer: g(m).self_attn.k_proj,
                                            heads_in(k), heads_out),
            p + "self_attn.v_proj.weight": ((k * h, d), lambda m, g=layer: g(m).self_attn.v_proj,
                                            heads_in(k), heads_out),
            # [D, N*H] -> [N, H, D]
            p + "self_attn.o_proj.weight": ((d, n * h), lambda m, g=layer: g(m).self_attn.o_proj,
                                            lambda w: w.reshape(d, n, h).transpose(1, 2, 0),
                                            lambda w: w.transpose(2, 0, 1).reshape(d, n * h)),
            p + "mlp.gate_proj.weight": ((f, d), lambda m, g=layer: g(m).mlp.gate_proj, t, t),
            p + "mlp.up_proj.weight": ((f, d), lambda m, g=layer: g(m).mlp.up_proj, t, t),
            p + "mlp.down_proj.weight": ((d, f), lambda m, g=layer: g(m).mlp.down_proj, t, t),
        }
    return layout


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

    layout = _hf_layout(config)
    files = tensor_files(path)
    missing = sorted(set(layout) - set(files))
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor(s) {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} for a {config.num_layers}-layer Llama")

    with hf_tensor_reader(files) as get_tensor:
        return model_from_hf_tensors(config, get_tensor, place)


def model_from_hf_tensors(config: LlamaConfig, get_tensor: Callable[[str], Any], place=None) -> LlamaForCausalLM:
    """Build a model of `config` whose every parameter is the HF-named tensor get_tensor returns.

    The one place HF names meet model parameters, shared by every checkpoint format (a HF
    directory, a GGUF file): a format only has to produce HF-layout tensors by name.

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
        so no device ever holds the whole checkpoint. The name is the model attribute
        ("q_proj", "embed_tokens", "lm_head", "norm"...), the key of the family's rules.
    Returns:
      The model, weights cast to config.param_dtype.
    Raises:
      ValueError naming the tensor when one has the wrong shape.
    """
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    for name, (shape, param_of, from_hf, _) in _hf_layout(config).items():
        tensor = get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {shape} for this config")
        param = param_of(model)
        if isinstance(tensor, PackedRows):  # a GGUF's blocks: rows are HF's [out, in] rows
            set_param(param, packed_from_rows(tensor.rows, tensor.format, name.rsplit(".", 2)[-2], param.shape))
            continue
        if place is None:
            value = jnp.asarray(from_hf(tensor)).astype(config.param_dtype)
        else:
            value = place(name.rsplit(".", 2)[-2], np.asarray(from_hf(tensor)).astype(jnp.dtype(config.param_dtype)))
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

    tensors = {name: jnp.asarray(to_hf(value(param_of(model))))
               for name, (_, param_of, _, to_hf) in _hf_layout(model.config).items()}
    save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(model.config.to_hf_config(), fh, indent=2)
