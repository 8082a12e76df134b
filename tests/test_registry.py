"""The model registry: every family row provides every part."""

import importlib
import os
import subprocess
import sys

import pytest
from flax import nnx

from models.layers import CausalLM
from models.registry import FAMILIES, build_preset, family_for_architectures, family_for_gguf_architecture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILY_IDS = [f.name for f in FAMILIES]


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


def test_architectures_and_presets_pick_one_family():
    architectures = [a for f in FAMILIES for a in f.architectures]
    presets = [p for f in FAMILIES for p in f.presets]
    assert len(architectures) == len(set(architectures)) and len(presets) == len(set(presets))
    assert family_for_architectures(["DeepseekV2ForCausalLM"]).name == "deepseek_v2"
    assert family_for_gguf_architecture("llama").name == "llama"
    with pytest.raises(ValueError, match=r"general.architecture='gemma3' is not supported; known GGUF "
                                         r"architectures: \['llama'\]"):
        family_for_gguf_architecture("gemma3")
    with pytest.raises(ValueError, match="architectures=\\['GPT2LMHeadModel'\\] is not supported"):
        family_for_architectures(["GPT2LMHeadModel"])
    assert type(build_preset("tiny-mla")).__name__ == "DeepseekV2ForCausalLM"


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
