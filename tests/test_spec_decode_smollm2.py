"""Speculative decoding (prompt lookup, and a draft model) on SmolLM2-135M-Instruct, the real model.

"Rewrite this passage with one change" over passages of Python's docs: the answers copy the
passage, so proposals are long and mostly accepted, and they bring tokens the output has not
had yet. Greedy outputs with speculation are the plain engine's, token for token (the same
loaded model); a stop token that falls inside an accepted run (a step that accepted
proposals past it) ends the request exactly where plain decoding ends it (EOS takes the same
per-token check: tests/test_spec_decode.py). With SmolLM2 as its own draft model (no smaller
model of its tokenizer ships offline) the greedy outputs are the plain engine's too, and the
draft's KV, written into the target's blocks, keeps it agreeing with the target.
"""

import numpy as np
import pytest

from engine_reference import assert_no_leak, runs_of_tokens
from paged_jax import LLM, SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SETTINGS = dict(model=MODEL, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128, num_blocks=256,
                warm_up="none")
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def engines():
    plain = LLM(**SETTINGS).engine
    spec = LLMEngine(EngineConfig(**SETTINGS, speculative_config=SPEC), model=plain.model, tokenizer=plain.tokenizer)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def test_smollm2_as_its_own_draft_model_gives_the_plain_greedy_outputs(engines):
    plain, _ = engines
    draft = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3}
    engine = LLMEngine(EngineConfig(**SETTINGS, speculative_config=draft), model=plain.model,
                       tokenizer=plain.tokenizer, draft_model=plain.model)
    prompts = rewrite_prompts(plain)[:2]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = [sum(r, []) for r in runs_of_tokens(plain, prompts, [greedy] * len(prompts))]
    assert [sum(r, []) for r in runs_of_tokens(engine, prompts, [greedy] * len(prompts))] == reference
    assert engine.get_stats()["spec_acceptance_rate"] > 0.9, engine.get_stats()
    assert_no_leak(engine)
    engine.shutdown()


def rewrite_prompts(engine) -> list[list[int]]:
    from pydoc_data.topics import topics

    rng = np.random.default_rng(0)
    texts = [" ".join(t.split()) for t in topics.values() if len(t.split()) >= 60]
    prompts = []
    for i in rng.choice(len(texts), 4, replace=False):
        passage = " ".join(texts[i].split()[:70])
        ask = f"Rewrite this passage with one change: replace the first 'the' with 'a'.\n\n{passage}"
        prompts.append(engine.chat_prompt([{"role": "user", "content": ask}])[0])
    return prompts


def test_greedy_rewrites_equal_plain_decoding_and_stops_inside_runs_land_where_they_should(engines):
    plain, spec = engines
    prompts = rewrite_prompts(plain)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = [sum(r, []) for r in runs_of_tokens(plain, prompts, [greedy] * len(prompts))]
    runs = runs_of_tokens(spec, prompts, [greedy] * len(prompts))
    assert [sum(r, []) for r in runs] == reference
    stats = spec.get_stats()
    assert stats["spec_acceptance_rate"] > 0.5 and stats["spec_mean_accepted_length"] > 2.0, stats
    # A token inside an accepted run that the output has not had before: stopping on it must
    # drop the rest of its run.
    cases = []
    for i, request_runs in enumerate(runs):
        start = 0
        for run in request_runs:
            inside = [start + j for j in range(len(run) - 1) if reference[i][start + j] not in reference[i][:start + j]]
            if inside:
                cases.append((i, inside[0]))
                break
            start += len(run)
    assert len(cases) >= 2, "no run brought a new token: the test would prove nothing"
    picked = [prompts[i] for i, _ in cases]
    expected = [reference[i][: at + 1] for i, at in cases]
    stop_params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                  stop_token_ids=(reference[i][at],)) for i, at in cases]
    for engine in (plain, spec):
        got = [sum(r, []) for r in runs_of_tokens(engine, picked, stop_params)]
        assert got == expected
    assert_no_leak(spec)
    assert_no_leak(plain)
