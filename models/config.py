"""What every family's config shares: dtype names, field checks, and the llama3 RoPE scaling.

A family's config (models/<family>/config.py) is a frozen, hashable dataclass (nnx keeps it
in the graphdef, which jit hashes) validated in __post_init__ with these helpers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# Names a dtype may be given by; stored as the canonical name so the config stays hashable
# (nnx keeps it in the graphdef, which jit hashes).
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "f32": "float32", "bf16": "bfloat16", "f16": "float16", "fp32": "float32",
                "fp16": "float16", "half": "float16", "float": "float32"}


def check_positive_ints(config, names) -> None:
    """In a config's __post_init__: ValueError naming the first of `names` that is not a
    positive int (bools excluded)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")


def normalize_token_ids_and_dtypes(config) -> None:
    """In a frozen config's __post_init__: eos_token_ids as a tuple of ints, BOS/EOS ids checked
    against vocab_size (ValueError naming the field), dtype and param_dtype as canonical names."""
    if isinstance(config.eos_token_ids, (int, np.integer)):
        object.__setattr__(config, "eos_token_ids", (int(config.eos_token_ids),))
    object.__setattr__(config, "eos_token_ids", tuple(int(t) for t in config.eos_token_ids))
    for name, ids in (("bos_token_id", () if config.bos_token_id is None else (config.bos_token_id,)),
                      ("eos_token_ids", config.eos_token_ids)):
        bad = [t for t in ids if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"{name} {bad} outside the vocabulary [0, {config.vocab_size}); "
                             "fix the token id or vocab_size")
    object.__setattr__(config, "param_dtype", canonical_dtype(config.param_dtype, "param_dtype"))
    object.__setattr__(config, "dtype", canonical_dtype(config.dtype, "dtype"))


def canonical_dtype(dtype: Any, field: str) -> str:
    """'bfloat16' / jnp.bfloat16 / np.dtype('float32') -> 'bfloat16' / 'float32'; ValueError otherwise."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    if name not in _DTYPE_NAMES:
        raise ValueError(f"{field}={dtype!r} is not supported; use 'float32', 'bfloat16' or 'float16'")
    return _DTYPE_NAMES[name]


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 RoPE frequency scaling (HF rope_type "llama3"; a rope type any family's config
    may name, so it lives here rather than with LlamaConfig).

    Wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by
    factor, shorter than original_max_position_embeddings / high_freq_factor are kept, and the
    band between is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"rope_scaling factor={self.factor} must be > 0 (Llama-3.1 uses 8.0)")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor=} {self.high_freq_factor=} (Llama-3.1 uses 1.0 and 4.0)")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"rope_scaling original_max_position_embeddings={self.original_max_position_embeddings} "
                "must be > 0 (Llama-3.1 uses 8192)")

    @classmethod
    def from_dict(cls, d: dict) -> Llama3RopeScaling:
        rope_type = d.get("rope_type", d.get("type", "llama3"))
        if rope_type != "llama3":
            raise ValueError(f"rope_scaling rope_type={rope_type!r} is not supported; only 'llama3' "
                             "scaling (or no scaling) is implemented")
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings") if k not in d]
        if missing:
            raise ValueError(f"rope_scaling is missing {missing}; a llama3 scaling dict needs factor, "
                             "low_freq_factor, high_freq_factor and original_max_position_embeddings")
        return cls(float(d["factor"]), float(d["low_freq_factor"]), float(d["high_freq_factor"]),
                   int(d["original_max_position_embeddings"]))
