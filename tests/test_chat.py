"""LLM.chat and the chat CLI: the template's rendering, its end-of-turn stop, and the prefix
cache carrying a conversation from one turn to the next."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine_reference import big_llm
from paged_jax.core.request import SamplingParams

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_renders_the_template_and_generates_like_generate():
    llm = big_llm()
    messages = [{"role": "user", "content": "Hello there"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.chat(messages, params, chat_template=CHATML, use_tqdm=False)[0]
    text = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert out.token_ids == llm.generate([out.prompt_token_ids], params, use_tqdm=False)[0].token_ids
    # one conversation or a list of them
    both = llm.chat([messages, messages], params, chat_template=CHATML, use_tqdm=False)
    assert [o.token_ids for o in both] == [out.token_ids] * 2


def test_chat_errors_name_the_problem():
    llm = big_llm()
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)  # tiny ships none
    with pytest.raises(ValueError, match=r"conversation 0: messages\[0\] has no 'content'"):
        llm.chat([{"role": "user"}], chat_template=CHATML, use_tqdm=False)


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.slow
def test_second_turn_hits_the_prefix_cache_for_the_whole_first_turn():
    """SmolLM2 (the real model, its own ChatML template): turn 2's prompt extends turn 1's
    prompt and reply token for token, and every full block of them comes from the cache."""
    from paged_jax import LLM

    llm = LLM("smollm2-135m-instruct", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
              warm_up=False)
    params = SamplingParams(temperature=0, max_tokens=48)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = llm.chat(messages, params, use_tqdm=False)[0]
    assert first.text == "The capital of France is Paris." and first.finish_reason == "stop"
    assert first.token_ids[-1] == llm.tokenizer.end_of_turn_token_id()  # stopped at <|im_end|>
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    second = llm.chat(messages, params, use_tqdm=False)[0]
    turn_one = first.prompt_token_ids + first.token_ids
    assert common_prefix(turn_one, second.prompt_token_ids) == len(turn_one)
    block_size = llm.engine.cache_config.block_size
    assert second.metrics.num_cached_tokens == len(turn_one) // block_size * block_size
    assert "Rome" in second.text


def test_chat_cli_streams_turns_and_reuses_the_first_turn(tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "200"}
    args = [sys.executable, "-m", "paged_jax", "chat", "--chat-template", str(template), "--max-tokens", "40",
            "--ignore-eos", "--max-model-len", "256", "--max-num-batched-tokens", "64"]
    run = subprocess.run(args, input="Hello there, how are you today?\nAnd tomorrow?\n/exit\n", capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    stats = [line for line in run.stdout.splitlines() if "prefix cache hit" in line]
    assert len(stats) == 2, run.stdout
    assert "40 tokens" in stats[0] and "prefix cache hit 0/" in stats[0]
    hit, prompt = stats[1].split("prefix cache hit ")[1].split(" prompt tokens")[0].split("/")
    # turn 1 = ~20 prompt + 40 reply tokens: its full 16-token blocks come back from the cache
    assert int(hit) >= 48 and int(hit) < int(prompt), stats[1]


def test_chat_cli_refuses_a_model_without_a_template_before_the_first_turn():
    """The embedded tiny model ships no template (as gemma-3-270m, a base model): chat says so
    and what to use instead, with exit status 2 and no traceback, without reading a turn."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "200"}
    run = subprocess.run([sys.executable, "-m", "paged_jax", "chat", "--max-model-len", "64", "--warm-up", "none"],
                         input="Hello?\n", capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 2, run.stderr
    assert "--model tiny has no chat template" in run.stderr and "generate" in run.stderr
    assert "Traceback" not in run.stderr and "assistant>" not in run.stdout


def test_generate_chat_cli_prints_the_question_and_llm_chat_tokens(tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "paged_jax", "generate", "--chat", "--chat-template", str(template),
                          "--prompt", "Hello there", "--max-tokens", "6", "--ignore-eos", "--max-model-len", "256",
                          "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    line = json.loads(run.stdout.splitlines()[0])
    ref = big_llm().chat([{"role": "user", "content": "Hello there"}],
                         SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), chat_template=CHATML,
                         use_tqdm=False)[0]
    assert line["prompt"] == "Hello there" and line["token_ids"] == ref.token_ids
