"""The model registry: every family row provides every part, and one family's tensor-parallel
rules never reach another family's weights."""

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from models.layers import CausalLM
from models.llama import LlamaForCausalLM, save_hf_checkpoint
from models.registry import (FAMILIES, build_preset, family_for_architectures, family_for_gguf_architecture,
                             load_model)
from paged_jax.sharding import TP_AXIS, param_shardings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILY_IDS = [f.name for f in FAMILIES]


def param_shapes(family) -> dict[str, set[int]]:
    """Parameter name (last key of its state path, what the rules are keyed by) -> the ranks it
    has in the family's first preset."""
    config = next(iter(family.presets.values()))
    state = nnx.state(nnx.eval_shape(lambda: family.model_class(config, rngs=nnx.Rngs(0))))
    names: dict[str, set[int]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        names.setdefault(str(keys[-1]), set()).add(len(leaf.shape))
    return names


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_every_family_provides_every_part(family):
    assert importlib.import_module(f"models.{family.name}")  # the family is one package
    assert family.architectures and family.presets
    assert callable(family.config_class.from_hf_config)
    for name, config in family.presets.items():
        assert isinstance(config, family.config_class), name
    model = nnx.eval_shape(lambda: family.model_class(next(iter(family.presets.values())), rngs=nnx.Rngs(0)))
    assert isinstance(model, CausalLM)
    assert len(model.kv_cache_specs()) == model.config.num_layers
    assert callable(family.load_hf_checkpoint)
    # GGUF: a config reader and a loader together, or neither.
    has_gguf = bool(family.gguf_architectures)
    assert (family.read_gguf_config is not None) == (family.load_gguf_checkpoint is not None) == has_gguf
    # Rules: the row carries the model class's, each names a parameter of this family's model
    # and fits its rank, and splits over the mesh's one axis only.
    rules = family.param_partition_rules
    assert isinstance(rules, Mapping) and rules is family.model_class.param_partition_rules
    names = param_shapes(family)
    for name, spec in rules.items():
        assert name in names, f"{family.name}'s rule for {name!r} names no parameter of its model"
        assert isinstance(spec, P) and set(spec) <= {TP_AXIS, None}
        assert names[name] == {len(spec)}, f"rule {spec} of {name} does not fit ranks {names[name]}"


def test_rules_do_not_leak_across_families():
    by_name = {f.name: f for f in FAMILIES}
    llama, deepseek = by_name["llama"], by_name["deepseek_v2"]
    names = {f.name: set(param_shapes(f)) for f in FAMILIES}
    assert "kv_b_proj" in names["deepseek_v2"] and "kv_b_proj" not in llama.param_partition_rules
    for a in FAMILIES:
        for b in FAMILIES:
            only_b = names[b.name] - names[a.name]
            assert not set(a.param_partition_rules) & only_b, f"{a.name}'s rules name {b.name}-only parameters"

    # DeepSeek-V2 shares names with Llama (q_proj, o_proj, gate_proj, embed_tokens...), and under
    # its own (empty) rules every one of its weights stays whole; Llama's rules would split them.
    state = nnx.state(nnx.eval_shape(lambda: deepseek.model_class(deepseek.presets["tiny-mla"], rngs=nnx.Rngs(0))))
    mesh = AbstractMesh((2,), (TP_AXIS,))
    specs = [s.spec for s in jax.tree.leaves(param_shardings(state, mesh, deepseek.param_partition_rules))]
    assert specs and all(spec == P() for spec in specs)
    llama_specs = jax.tree.leaves(param_shardings(state, mesh, llama.param_partition_rules))
    assert any(s.spec != P() for s in llama_specs)


def test_architectures_and_presets_pick_one_family():
    architectures = [a for f in FAMILIES for a in f.architectures]
    presets = [p for f in FAMILIES for p in f.presets]
    assert len(architectures) == len(set(architectures)) and len(presets) == len(set(presets))
    assert family_for_architectures(["DeepseekV2ForCausalLM"]).name == "deepseek_v2"
    assert family_for_gguf_architecture("llama").name == "llama"
    assert family_for_gguf_architecture("gemma3").name == "gemma3"
    with pytest.raises(ValueError, match=r"general.architecture='mamba' is not supported; known GGUF "
                                         r"architectures: \['gemma3', 'llama', 'qwen2', 'qwen3'\]"):
        family_for_gguf_architecture("mamba")
    with pytest.raises(ValueError, match="architectures=\\['GPT2LMHeadModel'\\] is not supported"):
        family_for_architectures(["GPT2LMHeadModel"])
    assert type(build_preset("tiny-mla")).__name__ == "DeepseekV2ForCausalLM"


def test_load_model_binds_the_loaded_familys_rules(tmp_path):
    save_hf_checkpoint(build_preset("tiny"), str(tmp_path))
    bound, placed = [], []

    def placer(rules):  # stands in for paged_jax.sharding.param_placer(mesh)
        bound.append(rules)

        def place(name, value):
            placed.append(name)
            return jnp.asarray(value)

        return place

    model = load_model(str(tmp_path), place=placer)
    assert isinstance(model, LlamaForCausalLM)
    assert bound == [LlamaForCausalLM.param_partition_rules]
    assert {"q_proj", "embed_tokens", "down_proj"} <= set(placed)


def test_placing_a_family_without_rules_is_a_value_error(tmp_path):
    # The check comes before any tensor is read: a config.json is enough.
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV2ForCausalLM"]}))
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM has no tensor-parallel rules yet"):
        load_model(str(tmp_path), place=lambda rules: pytest.fail("bound rules it does not have"))


def test_tokenizer_loading_imports_no_jax():
    """The tokenizer side of the registry (models/tokenizer.py, the GGUF reader, named models)
    stays jax-free, so a process that only tokenizes does not load jax; the same probe sees
    jax arrive with the registry."""
    code = ("import sys\n"
            "from models.tokenizer import load_tokenizer\n"
            "assert load_tokenizer('tiny').encode('hello world')\n"
            "assert 'jax' not in sys.modules, 'models.tokenizer imported jax'\n"
            "import models.registry\n"
            "print('jax' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
