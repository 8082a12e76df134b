"""`paged-jax chat`: a conversation at the terminal, each reply streamed as it is generated.

Line editing and history come from readline on a terminal; Ctrl-C stops the reply that is
streaming (between engine steps, the request aborted, the reply so far kept), and Ctrl-C or
Ctrl-D at the prompt leaves.
"""

from __future__ import annotations

import itertools
import signal
import sys
import time

from rich.console import Console

from paged_jax.cli import _make_llm, _progress, _read_chat_template


class _CtrlC:
    """Ctrl-C as a flag while a reply streams: the chat loop looks between steps and aborts the
    request, so a step is never cut halfway (a KeyboardInterrupt raised inside LLMEngine.step
    could leave the scheduler and the KV pool disagreeing, and the next turn broken)."""

    def __enter__(self):
        self.pressed = False
        self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, signum, frame) -> None:
        self.pressed = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def read_turn(prompt: str) -> str:
    """A line of the user's (EOFError at Ctrl-D or the input's end); input() edits it with
    readline once that is imported (chat does, on a terminal)."""
    return input(prompt)


def chat(args, params, console: Console) -> int:
    """Reads user turns until Ctrl-D, Ctrl-C or /exit; streams each reply as it is generated
    (Ctrl-C stops the reply, which stays in the conversation as far as it got)."""
    from paged_jax.core.tokenizer import IncrementalDetokenizer

    chat_template = _read_chat_template(args)
    with _progress(console) as progress:
        llm = _make_llm(args, progress)  # background warm-up: a person waits for one bucket, not all
    engine = llm.engine
    if chat_template is None and engine.tokenizer.chat_template is None:
        # Refused before the first turn is typed: a base model (gemma-3-270m) has no chat format.
        llm.shutdown()
        raise ValueError(f"--model {args.model} has no chat template (a base model, not an instruction-tuned "
                         "one): continue text with `generate`, or give one with --chat-template FILE")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (input() then edits the line: arrow keys, history)
        except ImportError:  # not on every platform; input() still reads lines
            pass
    try:
        for turn in itertools.count():
            try:
                line = read_turn("you> " if interactive else "")
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave
                if interactive:
                    console.print()
                return 0
            if line.strip() == "/exit":
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            with _CtrlC() as ctrl_c:
                ids, turn_params = engine.chat_prompt(messages, sampling_params=params,  # stops at the turn's end
                                                      chat_template=chat_template)
                request_id = f"chat-{turn}"
                engine.add_request(request_id, ids, turn_params)
                detok, start, output = IncrementalDetokenizer(engine.tokenizer), time.perf_counter(), None
                console.print("[bold]assistant>[/bold] ", end="")
                while engine.has_unfinished_requests():
                    if ctrl_c.pressed:
                        engine.abort_request(request_id)  # frees its blocks; the turn's KV stays cached
                        break
                    for out in engine.step():
                        if out.request_id == request_id:
                            output = out
                            console.print(detok.push(out.token_ids[len(detok.token_ids):]), end="", markup=False,
                                          highlight=False, soft_wrap=True)
                console.print(detok.finish(), markup=False, highlight=False, soft_wrap=True)
            elapsed = time.perf_counter() - start
            messages.append({"role": "assistant", "content": engine.tokenizer.decode(detok.token_ids)})
            n = len(detok.token_ids)
            if ctrl_c.pressed:
                console.print(f"[dim]\\[stopped by Ctrl-C after {n} tokens; the reply so far stays in the "
                              "conversation][/dim]", highlight=False)  # \\[: a bracket, not a markup tag
                continue
            ttft = output.metrics.time_to_first_token
            console.print(f"[dim][{n} tokens, {n / elapsed:.1f} tok/s, TTFT {1e3 * ttft:.0f} ms, prefix cache hit "
                          f"{output.metrics.num_cached_tokens}/{len(ids)} prompt tokens, "
                          f"{output.finish_reason}][/dim]", highlight=False)
    finally:
        llm.shutdown()
    return 0
