"""The tokenizer wrapper and the embedded byte-level BPE of the "tiny" model."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from paged_jax.core.tokenizer import IncrementalDetokenizer, Tokenizer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    return Tokenizer.from_model("tiny")


def test_embedded_vocab_and_special_ids(tiny):
    assert tiny.vocab_size == 512
    assert (tiny.bos_token_id, tiny.eos_token_id) == (510, 511)
    assert tiny.eos_token_ids == (511,)


def test_encode_starts_with_one_bos(tiny):
    ids = tiny.encode("Hello world")
    assert ids[0] == 510 and 510 not in ids[1:]
    assert tiny.encode("") == [510]
    assert all(0 <= i < 510 for i in ids[1:])


@pytest.mark.parametrize(
    "text",
    ["The capital of France is Paris.", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n",
     "naïve café, 日本語, emoji 🙂", "x = [i * i for i in range(16)]", ""],
)
def test_round_trip(tiny, text):
    assert tiny.decode(tiny.encode(text)) == text


@given(st.text(max_size=200))
def test_round_trip_any_text(text):
    tok = Tokenizer.from_model("tiny")
    assert tok.decode(tok.encode(text)) == text


def test_merges_compress_common_text(tiny):
    # The corpus-trained merges must do real work: common English is far below 1 token/byte.
    text = "The quick brown fox jumps over the lazy dog. What is the capital of France?"
    assert len(tiny.encode(text)) - 1 < len(text.encode()) / 2.5


def test_decode_skips_special_tokens_unless_asked(tiny):
    ids = tiny.encode("hi") + [tiny.eos_token_id]
    assert tiny.decode(ids) == "hi"
    assert tiny.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>hi<|end_of_text|>"


def test_asset_is_reproducible_from_the_script():
    spec = importlib.util.spec_from_file_location("build_tokenizer", REPO / "scripts" / "build_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = module.build().to_str(pretty=True) + "\n"
    committed = (REPO / "paged_jax" / "core" / "assets" / "tokenizer.json").read_text(encoding="utf-8")
    assert fresh == committed, "run scripts/build_tokenizer.py and commit the asset"


def _plain_bpe_dir(tmp_path, config, generation_config=None):
    # A Llama-2-style tokenizer: no post-processor, so BOS comes from tokenizer_config.json.
    hf = HFTokenizer(models.BPE(vocab={"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}, merges=[("a", "b")]))
    hf.add_special_tokens(["<s>", "</s>"])
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.decoder = decoders.BPEDecoder()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def test_model_dir_adds_bos_from_config(tmp_path):
    d = _plain_bpe_dir(tmp_path, {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True},
                       {"eos_token_id": [1, 3]})
    tok = Tokenizer.from_model(d)
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (0, 1, (1, 3))
    assert tok.encode("ab a b") == [0, 4, 2, 3]
    assert tok.vocab_size == 5


@pytest.mark.parametrize("config, bos", [
    ({"bos_token": "<s>"}, False),  # no flag, no post-processor: transformers 5 adds none either
    ({"bos_token": "<s>", "tokenizer_class": "LlamaTokenizerFast"}, False),
    ({"bos_token": "<s>", "add_bos_token": False}, False),
    ({"bos_token": "<s>", "add_bos_token": True}, True),
])
def test_model_dir_adds_bos_only_when_config_says_so(tmp_path, config, bos):
    tok = Tokenizer.from_model(_plain_bpe_dir(tmp_path, config))
    assert tok.encode("ab b") == ([0] if bos else []) + [4, 3]


def test_model_dir_without_bos(tmp_path):
    tok = Tokenizer.from_model(_plain_bpe_dir(tmp_path, {"add_bos_token": False}))
    assert tok.encode("ab b") == [4, 3]


def test_missing_tokenizer_json_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_model(tmp_path)


def test_tokenizer_module_imports_no_jax():
    code = "import sys, paged_jax.core.tokenizer; assert 'jax' not in sys.modules, 'tokenizer imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


@given(st.text(max_size=120), st.integers(1, 4))
def test_incremental_detokenizer_equals_whole_decode(text, chunk):
    """Streaming the ids in chunks yields exactly the text of decoding them all at once,
    multi-byte characters included (they are held back until complete)."""
    tok = Tokenizer.from_model("tiny")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk))
    assert streamed + detok.finish() == tok.decode(ids)
    # Any ids, not only valid text: a sequence may end inside a multi-byte character.
    cut = ids[:-1] if len(ids) > 2 else ids
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([t]) for t in cut) + detok.finish() == tok.decode(cut)


def test_incremental_detokenizer_holds_back_a_split_character(tiny):
    ids = tiny.encode("é🙂")[1:]  # byte-level: each character spans several ids
    detok = IncrementalDetokenizer(tiny)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == "é🙂" and "\ufffd" not in "".join(pieces)
    assert pieces.count("") >= 1, "a partial character must wait for its last byte"
