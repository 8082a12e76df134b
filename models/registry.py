"""Model registry: which model family serves a `model=` argument, and how it is loaded.

A family is an architecture (HF `architectures` names) with its model class, its config
class (presets + HF config reader) and its checkpoint loaders. `load_model` is the one
place the engine turns `model=` into weights:

- an embedded preset name ("tiny"): random weights, seeded;
- a HF model directory (config.json + safetensors): its `architectures` picks the family.

A new family (DeepSeek-V2 / MLA) or checkpoint format (GGUF) is a new entry or loader here;
the engine and runner only use the model's interface: `config`, `kv_cache_specs(dtype)`,
`__call__(inputs, kv_caches, attn_metadata, attention)` and `dense_forward`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping

from flax import nnx

from models.config import PRESETS as LLAMA_PRESETS
from models.llama import LlamaForCausalLM
from models.loader import load_hf_checkpoint
from paged_jax.core.tokenizer import EMBEDDED_MODELS


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One architecture and how to build it.

    Attributes:
      name: the family's short name ("llama").
      architectures: HF `architectures` entries it serves.
      model_class: the NNX module, built as model_class(config, rngs=...).
      presets: named configs (random-weight models for tests and benchmarks).
      load_hf_checkpoint: (directory, dtype) -> model.
    """

    name: str
    architectures: tuple[str, ...]
    model_class: type
    presets: Mapping[str, object]
    load_hf_checkpoint: Callable


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("LlamaForCausalLM",), LlamaForCausalLM, LLAMA_PRESETS,
                lambda path, dtype: load_hf_checkpoint(path, dtype=dtype)),
)


def family_for_architectures(architectures) -> ModelFamily:
    """The family whose architectures include every one listed (ValueError naming them if none)."""
    for family in FAMILIES:
        if architectures and all(a in family.architectures for a in architectures):
            return family
    known = sorted(a for family in FAMILIES for a in family.architectures)
    raise ValueError(f"architectures={list(architectures or [])} is not supported; known: {known}")


def build_preset(name: str, *, dtype: str | None = None, seed: int = 0):
    """A random-weight model of a named preset (any family's); dtype sets compute and storage."""
    for family in FAMILIES:
        if name in family.presets:
            config = family.presets[name]
            if dtype is not None:
                config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
            return family.model_class(config, rngs=nnx.Rngs(seed))
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(p for f in FAMILIES for p in f.presets)}")


def load_model(model: str, *, dtype: str | None = None, seed: int = 0):
    """The model `model=` names: an embedded preset (random weights, seeded) or a HF directory.

    Args:
      model: "tiny" (the embedded preset whose tokenizer ships in the package) or a model
        directory with config.json and safetensors.
      dtype: compute dtype (None: the checkpoint's; tiny: float32).
      seed: weights of embedded presets.
    Raises:
      ValueError naming what is wrong: unknown name, missing config.json, unsupported architecture.
    """
    if model in EMBEDDED_MODELS:
        return build_preset(model, dtype=dtype, seed=seed)
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model={model!r} is neither an embedded model {EMBEDDED_MODELS} nor a directory with "
                         "config.json; pass a HF checkpoint directory")
    with open(config_path) as fh:
        hf_config = json.load(fh)
    architectures = hf_config.get("architectures") or (["LlamaForCausalLM"] if hf_config.get("model_type") == "llama"
                                                       else [])
    return family_for_architectures(architectures).load_hf_checkpoint(model, dtype)


__all__ = ["FAMILIES", "ModelFamily", "build_preset", "family_for_architectures", "load_model"]
