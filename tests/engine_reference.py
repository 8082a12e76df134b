"""What the engine tests compare against, and the engines they share.

- dense_greedy: the dense reference generation loop. Every step recomputes the whole
  sequence with model.dense_forward (full causal attention, no cache, no paging, no
  scheduler) and takes the argmax at the last real position. Rows are right-padded to a
  fixed length: causal masking keeps the padding out of every real position's logits, so
  one jitted shape serves all prompts and steps.
- Engines cost a few seconds of compilation per bucket on CPU, so each configuration is
  built once per test process (functools.cache) and shared across test files; every
  test leaves its engine idle (no unfinished requests) for the next one.

Not a test module (no test_ prefix); imported by tests/test_engine*.py and test_runner.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import LLM, SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig

MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
SYSTEM_PROMPT_LEN = 40  # two full blocks shared by half of the prompts
BATCH_PAD = 8  # dense batches are padded to a multiple of this (few compiled shapes)

# Engine shapes (each bucket compiles once at warm-up, a few seconds on a busy CPU).
ENGINE_CONFIGS = {
    # (a) and (c, on): a pool with room for every sequence; the LLM API front end.
    "big": dict(max_num_seqs=8, max_num_batched_tokens=64),
    # (c, off)
    "no_cache": dict(max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False),
    # (b): 11 usable blocks = 176 slots < max_model_len, so 8 running requests must preempt.
    "small_pool": dict(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=12),
    # (d) and the compile-nothing run: token buckets [16, 32], sequence buckets [8, 16].
    "chunked": dict(max_num_seqs=16, max_num_batched_tokens=32),
}


@functools.cache
def big_llm() -> LLM:
    """LLM(model="tiny") through the public constructor; its weights serve every engine."""
    return LLM("tiny", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, warm_up="full", **ENGINE_CONFIGS["big"])


@functools.cache
def get_engine(name: str) -> LLMEngine:
    if name == "big":
        return big_llm().engine
    base = big_llm().engine
    config = EngineConfig(model="tiny", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, warm_up="full",
                          **ENGINE_CONFIGS[name])
    return LLMEngine(config, model=base.model, tokenizer=base.tokenizer)


def model():
    return big_llm().engine.model


@functools.cache
def _dense_step_fn(graphdef):
    @jax.jit
    def step(state, token_ids, last):  # i32[B, L], i32[B] -> f32[B, V] log-probs at `last`
        logits = nnx.merge(graphdef, state).dense_forward(token_ids)  # [B, L, V]
        rows = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        return jax.nn.log_softmax(rows, axis=-1)

    return step


def dense_greedy(prompts, max_tokens, max_model_len: int = MAX_MODEL_LEN):
    """Greedy continuations by full recomputation, with the engine's stop rules for
    ignore_eos=True: stop after max_tokens outputs or once the sequence (prompt + outputs)
    reaches max_model_len (checked after each token, as vLLM does).

    Returns:
      (token ids per prompt, log-probabilities of those tokens per prompt).
    """
    graphdef, state = nnx.split(model())
    step = _dense_step_fn(graphdef)
    n = len(prompts)
    b = -(-n // BATCH_PAD) * BATCH_PAD
    tokens = np.zeros((b, max_model_len), np.int32)
    lens = np.ones(b, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        lens[i] = len(p)
    outs, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
    while True:
        # The stop check follows each new token, so even a prompt of max_model_len gets one.
        active = [i for i in range(n) if len(outs[i]) < max_tokens[i] and (not outs[i] or lens[i] < max_model_len)]
        if not active:
            return outs, logprobs
        logp = np.asarray(step(state, jnp.asarray(tokens), jnp.asarray(lens - 1)))
        for i in active:
            t = int(np.argmax(logp[i]))
            outs[i].append(t)
            logprobs[i].append(float(logp[i, t]))
            if lens[i] < max_model_len:  # a token past max_model_len is never fed back
                tokens[i, lens[i]] = t
            lens[i] += 1


def make_prompts(seed: int, num: int = 36, vocab: int = 512):
    """Mixed lengths (1 token, around block boundaries, up to 140) and varied
    max_tokens; every other prompt starts with one shared system prompt. Every request
    fits in the small pool (prompt + max_tokens <= 11 blocks of 16)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, SYSTEM_PROMPT_LEN).tolist()
    # Even indices are bare (1, 16, 32, 15, 17, 33 tokens); odd ones get the system prompt
    # in front (42, 48, 64, 80, 100, 140 tokens).
    lengths = [1, 2, 16, 8, 32, 24, 15, 40, 17, 60, 33, 100]
    lengths += rng.integers(1, 141, num - len(lengths)).tolist()
    prompts, max_tokens = [], []
    for i, n in enumerate(lengths):
        suffix = rng.integers(0, vocab, int(n)).tolist()
        prompts.append((system + suffix)[:140] if i % 2 else suffix)
        max_tokens.append(int(rng.integers(1, 25)))
    return prompts, max_tokens


def greedy_params(max_tokens: int, logprobs: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Steps until idle; returns {request_id: final RequestOutput} of requests finished meanwhile."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError(f"engine still busy after {max_steps} steps: the scheduler makes no progress")


def runs_of_tokens(engine: LLMEngine, prompts, params) -> list[list[list[int]]]:
    """Runs each prompt (with its SamplingParams) to completion; per request, the tokens each
    of its steps emitted (one, or with speculative decoding the accepted run and one more)."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    runs = {f"r{i}": [] for i in range(len(prompts))}
    seen = dict.fromkeys(runs, 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
            runs[out.request_id].append(tokens[seen[out.request_id]:])
            seen[out.request_id] = len(tokens)
    return [runs[f"r{i}"] for i in range(len(prompts))]


def assert_no_leak(engine: LLMEngine) -> None:
    """Idle engine: every block but the null block is back in the free queue."""
    kv = engine.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert not kv.has_requests(), f"blocks still held by {sorted(kv.coordinator.managers[0].req_to_blocks)}"
    assert kv.get_num_free_blocks() == kv.config.num_usable_blocks
    kv.check_invariants()
