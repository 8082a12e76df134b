"""Builds paged_jax/core/assets/tokenizer.json, the tokenizer of the embedded "tiny" model.

A byte-level BPE (GPT-2/Llama-3 style: every byte is a token, so any text round-trips)
trained locally with HF `tokenizers` on the small corpus below: no downloads, and the same
corpus gives the same file, so the asset can be rebuilt and diffed:

    python scripts/build_tokenizer.py            # rewrite the asset
    python scripts/build_tokenizer.py --check    # exit 1 if the committed asset differs

Vocabulary: 256 byte tokens + 254 merges + 2 special tokens = 512, the tiny preset's vocab.
The special tokens take the last ids (510, 511) as in Llama 3, and a post-processor puts
<|begin_of_text|> in front of every encoding, as Llama 3's tokenizer.json does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
ASSET = Path(__file__).resolve().parent.parent / "paged_jax" / "core" / "assets" / "tokenizer.json"

# Written for this file (plain English about the system plus everyday sentences), so the
# merges cover common words and the engine's demo prompts tokenize into short sequences.
CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs
into the forest. A cat watches them from the window of a small house on the hill.
Once upon a time there was a little girl who lived in a village near the sea. Every
morning she walked to the harbour to see the boats come in with the fish of the night.
The weather today is sunny with a light wind from the west; tomorrow it will rain.
What is the capital of France? The capital of France is Paris. What is the capital of
Italy? The capital of Italy is Rome. The capital of Japan is Tokyo.
Hello, my name is Ada and I like to write programs. Hello world! How are you today?
I am fine, thank you. Please tell me a story about a dragon who was afraid of the dark.
The future of artificial intelligence is open, and the people who build it should share
what they learn. Language models read a prompt and write the next token, one at a time.
A paged attention kernel reads the keys and values of every sequence from fixed-size
blocks. The block manager decides where every token's key and value live in memory.
Blocks are taken from a free queue; a block that is freed goes back to the queue, and a
block with a hash can be found again by the prefix cache when another request shares the
same system prompt. When the pool runs out of blocks, the scheduler preempts the request
that was admitted last and computes it again later. The engine runs one step at a time:
schedule, run, update. Each step has a budget of tokens, and long prompts are split into
chunks so that decoding requests keep their speed. The sampler picks the next token with
a temperature, top-k and top-p, or greedily when the temperature is zero.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 100 128 256 512 1000 1024 2048 4096.
def main(): return sum(range(10))  # code: x = [i * i for i in range(16)]
She said that the river was cold, but he did not listen and jumped in anyway. They
laughed, and then they went home for dinner with their friends and their family.
Science is the study of the natural world through observation and experiment. The
history of the world is the story of people, their cities, their wars and their ideas.
"""


def build() -> Tokenizer:
    """Trains the BPE and returns the tokenizer (deterministic for a fixed corpus)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 2,  # the two special tokens are appended after training
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE - 2:
        raise SystemExit(
            f"the corpus yields {tokenizer.get_vocab_size()} tokens before the specials, "
            f"want {VOCAB_SIZE - 2}: add text to CORPUS"
        )
    tokenizer.add_special_tokens([BOS, EOS])
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, "special tokens did not land in the vocab"
    assert (bos_id, tokenizer.token_to_id(EOS)) == (VOCAB_SIZE - 2, VOCAB_SIZE - 1), "specials moved"
    return tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed asset")
    args = parser.parse_args()
    text = build().to_str(pretty=True) + "\n"
    if args.check:
        same = ASSET.exists() and ASSET.read_text(encoding="utf-8") == text
        print(f"{ASSET}: {'up to date' if same else 'DIFFERS from a fresh build'}")
        return 0 if same else 1
    ASSET.parent.mkdir(parents=True, exist_ok=True)
    ASSET.write_text(text, encoding="utf-8")
    print(f"wrote {ASSET} ({len(text)} bytes, vocab {VOCAB_SIZE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
