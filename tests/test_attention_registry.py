"""The attention backend table (paged_jax/attention/registry.py): one row per (cache spec type,
implementation), canonical names with "pallas" as an alias of "triton", and errors that name
what exists. Backends are only built here, never run (test_paged_attention.py, test_mla_attention.py
and test_kv_quant.py run them)."""

import dataclasses

import jax
import pytest

from models.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec, QuantizedAttentionSpec
from paged_jax.attention import (ATTENTION_BACKENDS, ATTENTION_IMPLS, CANONICAL_ATTENTION_IMPLS,
                                 MlaTritonAttention, MlaXlaAttention, QuantizedTritonAttention,
                                 QuantizedXlaAttention, TritonAttention, XlaAttention, canonical_attention_impl,
                                 default_attention_impl, make_attention_backend, register_backend)
from paged_jax.attention.registry import NoKernelOptions
from paged_jax.sharding import ShardedAttention
from pallas_kernels.mla_attention import MlaPallasConfig
from pallas_kernels.paged_attention import PallasConfig

SPECS = {
    FullAttentionSpec: FullAttentionSpec(num_kv_heads=2, head_dim=64, dtype="float32"),
    QuantizedAttentionSpec: QuantizedAttentionSpec(num_kv_heads=2, head_dim=64, dtype="float32",
                                                   kv_cache_dtype="int8"),
    MLAAttentionSpec: MLAAttentionSpec(kv_lora_rank=64, qk_rope_head_dim=16, dtype="float32"),
}
EXPECTED_TABLE = {
    (FullAttentionSpec, "xla"): XlaAttention,
    (FullAttentionSpec, "triton"): TritonAttention,
    (QuantizedAttentionSpec, "xla"): QuantizedXlaAttention,
    (QuantizedAttentionSpec, "triton"): QuantizedTritonAttention,
    (MLAAttentionSpec, "xla"): MlaXlaAttention,
    (MLAAttentionSpec, "triton"): MlaTritonAttention,
}


def test_table_has_a_row_for_every_spec_type_and_implementation():
    assert CANONICAL_ATTENTION_IMPLS == ("xla", "triton")
    assert ATTENTION_IMPLS == ("xla", "triton", "pallas")  # canonical first: the CLI lists them in this order
    assert ATTENTION_BACKENDS == EXPECTED_TABLE
    for (spec_type, impl), cls in EXPECTED_TABLE.items():
        backend = make_attention_backend(SPECS[spec_type], impl)
        assert type(backend) is cls and backend.name == impl and backend.spec == SPECS[spec_type]
        assert hash(backend) == hash(make_attention_backend(SPECS[spec_type], impl)), "static under jit"


@pytest.mark.parametrize("spec_type", list(SPECS), ids=lambda t: t.__name__)
def test_pallas_is_an_alias_of_triton(spec_type):
    spec = SPECS[spec_type]
    alias = make_attention_backend(spec, "pallas", interpret=True)
    assert alias == make_attention_backend(spec, "triton", interpret=True)
    assert type(alias) is EXPECTED_TABLE[spec_type, "triton"] and alias.name == "triton" and alias.interpret


def test_canonical_names():
    assert [canonical_attention_impl(name) for name in ATTENTION_IMPLS] == ["xla", "triton", "triton"]
    assert canonical_attention_impl(None) == default_attention_impl()
    assert default_attention_impl() == ("triton" if jax.default_backend() == "gpu" else "xla")
    spec = SPECS[FullAttentionSpec]
    assert make_attention_backend(spec).name == default_attention_impl()


def test_sharded_backend_reports_the_canonical_name():
    inner = make_attention_backend(SPECS[FullAttentionSpec], "pallas", interpret=True)
    sharded = ShardedAttention(inner, mesh=None)  # name and spec do not touch the mesh
    assert sharded.name == "triton" and sharded.spec is inner.spec


def test_unknown_impl_names_the_choices():
    with pytest.raises(ValueError, match=r"attention_impl='mosaic_gpu' must be one of \('xla', 'triton', "
                                         r"'pallas'\) \('pallas' is an alias of 'triton'\) or None"):
        make_attention_backend(SPECS[FullAttentionSpec], "mosaic_gpu")


def test_unknown_spec_type_names_the_known_ones():
    with pytest.raises(ValueError, match="no attention backend for a str; this build knows FullAttentionSpec, "
                                         "QuantizedAttentionSpec, MLAAttentionSpec"):
        make_attention_backend("a latent cache", "xla")


def test_lookup_is_by_exact_spec_type():
    """A subclass of a registered spec is not silently served by its parent's backend."""

    @dataclasses.dataclass(frozen=True)
    class WindowedSpec(FullAttentionSpec):
        window: int = 8

    with pytest.raises(ValueError, match="no attention backend for a WindowedSpec"):
        make_attention_backend(WindowedSpec(2, 64, "float32"), "xla")


@pytest.mark.parametrize("impl, options, match", [
    ("xla", dict(interpret=True), "interpret and pallas_config apply to attention_impl='triton' only, not 'xla'"),
    ("xla", dict(pallas_config=PallasConfig()), "apply to attention_impl='triton' only"),
])
@pytest.mark.parametrize("spec_type", list(SPECS), ids=lambda t: t.__name__)
def test_xla_rejects_kernel_options(spec_type, impl, options, match):
    with pytest.raises(ValueError, match=match):
        make_attention_backend(SPECS[spec_type], impl, **options)


def test_each_kernel_takes_its_own_launch_config():
    gqa = make_attention_backend(SPECS[FullAttentionSpec], "triton", pallas_config=PallasConfig(prefill_rows=16))
    assert gqa.config == PallasConfig(prefill_rows=16)
    mla = make_attention_backend(SPECS[MLAAttentionSpec], "triton", pallas_config=MlaPallasConfig(prefill_rows=16))
    assert mla.config == MlaPallasConfig(prefill_rows=16)
    assert make_attention_backend(SPECS[MLAAttentionSpec], "triton").config == MlaPallasConfig()
    with pytest.raises(ValueError, match="pallas_config must be a MlaPallasConfig for MlaTritonAttention "
                                         r"\(MLAAttentionSpec\), not a PallasConfig"):
        make_attention_backend(SPECS[MLAAttentionSpec], "triton", pallas_config=PallasConfig())
    with pytest.raises(ValueError, match="pallas_config must be a PallasConfig for TritonAttention"):
        make_attention_backend(SPECS[FullAttentionSpec], "triton", pallas_config=MlaPallasConfig())


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """A cache kind this build does not know (a draft model's cache, say)."""

    num_kv_heads: int


@dataclasses.dataclass(frozen=True)
class DraftXlaAttention(NoKernelOptions):
    spec: DraftSpec

    name = "xla"


@pytest.fixture
def draft_row():
    register_backend(DraftSpec, "xla")(DraftXlaAttention)
    yield
    del ATTENTION_BACKENDS[DraftSpec, "xla"]


def test_a_registered_spec_type_is_picked_up(draft_row):
    """One decorated class is all a new cache kind needs; make_attention_backend is unchanged."""
    spec = DraftSpec(num_kv_heads=1)
    assert make_attention_backend(spec, "xla") == DraftXlaAttention(spec)
    with pytest.raises(ValueError, match="no 'triton' attention backend for DraftSpec; available: xla"):
        make_attention_backend(spec, "pallas")  # the alias resolves first, then the missing pair is named
    with pytest.raises(ValueError, match="apply to attention_impl='triton' only"):
        make_attention_backend(spec, "xla", interpret=True)


def test_registration_mistakes_are_caught(draft_row):
    with pytest.raises(AssertionError, match="registered twice"):
        register_backend(DraftSpec, "xla")(DraftXlaAttention)
    with pytest.raises(AssertionError, match="add the name to CANONICAL_ATTENTION_IMPLS"):
        register_backend(DraftSpec, "mosaic_gpu")
    with pytest.raises(AssertionError, match="must be its implementation name 'triton'"):
        register_backend(DraftSpec, "triton")(DraftXlaAttention)
    assert ATTENTION_BACKENDS.keys() == EXPECTED_TABLE.keys() | {(DraftSpec, "xla")}, "no partial rows left"
