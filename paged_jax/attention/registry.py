"""The attention backend table: (cache spec type, implementation name) -> backend class.

Implementation names say what runs:
- "xla": gather-based attention in plain XLA (xla.py, mla_xla.py), the fast CPU path;
- "triton": the Pallas kernels of pallas_kernels/, lowered through JAX's Triton backend
  (compiler_params=pallas.triton.CompilerParams); interpret=True runs them on CPU.
"pallas", the old name of "triton", is still accepted (ATTENTION_IMPL_ALIASES).

A new cache kind (a sliding-window spec, a draft model's cache) adds its spec in
models/kv_cache_spec.py and one backend class per implementation; a new implementation
(mosaic_gpu, JAX's successor to the Triton backend) adds its name to
CANONICAL_ATTENTION_IMPLS and one class per spec type it serves. Each class registers itself
with `@register_backend(SpecType, "impl")`; make_attention_backend does not change.

A backend class is a frozen dataclass with a `spec` field, a class attribute `name` (its
canonical implementation name), a classmethod `create(spec, *, interpret, pallas_config)` that
checks the options it takes (NoKernelOptions, KernelOptions) and the call the model makes.
"""

from __future__ import annotations

CANONICAL_ATTENTION_IMPLS = ("xla", "triton")
ATTENTION_IMPL_ALIASES = {"pallas": "triton"}  # old name -> canonical name
# Every name attention_impl accepts: canonical ones first, then the aliases.
ATTENTION_IMPLS = CANONICAL_ATTENTION_IMPLS + tuple(ATTENTION_IMPL_ALIASES)

# (spec type, canonical impl) -> backend class; filled by @register_backend when
# paged_jax.attention is imported (backend.py, mla.py). Lookup is by exact spec type.
ATTENTION_BACKENDS: dict[tuple[type, str], type] = {}


def register_backend(spec_type: type, impl: str):
    """Class decorator: make `cls` the backend of (spec_type, impl) in ATTENTION_BACKENDS."""
    assert impl in CANONICAL_ATTENTION_IMPLS, f"{impl!r}: add the name to CANONICAL_ATTENTION_IMPLS first"

    def register(cls):
        key = (spec_type, impl)
        assert key not in ATTENTION_BACKENDS, f"{spec_type.__name__} x {impl!r} registered twice"
        assert cls.name == impl, f"{cls.__name__}.name={cls.name!r} must be its implementation name {impl!r}"
        ATTENTION_BACKENDS[key] = cls
        return cls

    return register


def default_attention_impl() -> str:
    """"triton" on GPUs (the Pallas kernels), "xla" elsewhere (the gather path is the fast CPU one)."""
    import jax

    return "triton" if jax.default_backend() == "gpu" else "xla"


def canonical_attention_impl(impl: str | None) -> str:
    """The canonical implementation name of `impl` (an alias resolved; None: default_attention_impl())."""
    if impl is None:
        return default_attention_impl()
    if impl not in ATTENTION_IMPLS:
        aliases = "; ".join(f"{old!r} is an alias of {new!r}" for old, new in ATTENTION_IMPL_ALIASES.items())
        raise ValueError(f"attention_impl={impl!r} must be one of {ATTENTION_IMPLS} ({aliases}) or None "
                         "(triton on GPU, xla elsewhere)")
    return ATTENTION_IMPL_ALIASES.get(impl, impl)


def get_backend_class(spec_type: type, impl: str) -> type:
    """The registered backend class of (spec_type, canonical impl), or a ValueError naming what exists."""
    cls = ATTENTION_BACKENDS.get((spec_type, impl))
    if cls is not None:
        return cls
    available = [name for (t, name) in ATTENTION_BACKENDS if t is spec_type]
    if not available:
        known = ", ".join(dict.fromkeys(t.__name__ for t, _ in ATTENTION_BACKENDS))
        raise ValueError(f"no attention backend for a {spec_type.__name__}; this build knows {known} (a new "
                         "cache spec registers its backends with @register_backend in paged_jax/attention/)")
    raise ValueError(f"no {impl!r} attention backend for {spec_type.__name__}; available: {', '.join(available)} "
                     "(choose one as attention_impl)")


def make_attention_backend(spec, impl: str | None = None, *, interpret: bool = False, pallas_config=None):
    """The backend for a cache spec: the one place an implementation is chosen and checked.

    Args:
      spec: the model's per-layer cache spec (models.kv_cache_spec); its exact type picks the row.
      impl: one of ATTENTION_IMPLS ("xla", "triton", or "pallas", an alias of "triton"), or None
        (default_attention_impl()).
      interpret: run the Pallas kernel in interpret mode (CPU tests of the kernel path); kernel
        implementations only.
      pallas_config: launch parameters of the kernel (PallasConfig; MLA: MlaPallasConfig);
        kernel implementations only.
    Returns:
      a frozen, hashable backend whose `name` is the canonical implementation name.
    """
    cls = get_backend_class(type(spec), canonical_attention_impl(impl))
    return cls.create(spec, interpret=interpret, pallas_config=pallas_config)


class NoKernelOptions:
    """create() of a backend that runs no Pallas kernel (the XLA paths): it takes the spec only."""

    @classmethod
    def create(cls, spec, *, interpret: bool = False, pallas_config=None):
        if interpret or pallas_config is not None:
            raise ValueError(f"interpret and pallas_config apply to attention_impl='triton' only, not "
                             f"{cls.name!r}: drop them or choose attention_impl='triton'")
        return cls(spec)


class KernelOptions:
    """create() of a Pallas kernel backend: interpret mode and a launch config of the type of its
    `config` field's default (PallasConfig; the MLA kernel's MlaPallasConfig)."""

    @classmethod
    def create(cls, spec, *, interpret: bool = False, pallas_config=None):
        config_type = type(cls.config)  # the dataclass field's default
        if pallas_config is None:
            pallas_config = config_type()
        elif type(pallas_config) is not config_type:
            raise ValueError(f"pallas_config must be a {config_type.__name__} for {cls.__name__} "
                             f"({type(spec).__name__}), not a {type(pallas_config).__name__}")
        return cls(spec, interpret=interpret, config=pallas_config)
