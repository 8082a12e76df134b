"""`paged-jax` / `python -m paged_jax`: generate, chat and serve from the command line.

- `generate`: runs prompts (or, with --chat, one-turn chats) through the engine and prints
  each completion, then a table: requests, generated tokens/s, time to first token p50,
  peak KV usage, prefix-cache hit rate, preemptions and compilations.
- `chat`: an interactive multi-turn conversation; tokens stream as they are generated, each
  turn reuses the earlier turns' KV through the prefix cache, and a stats line per turn
  shows the hit.
- `serve`: the OpenAI-compatible HTTP server (paged_jax/server/).
- `proxy`: prefill/decode disaggregation in front of `serve --kv-role` producers and
  consumers (paged_jax/server/proxy.py).
- `calibrate-kv`: a quantized pool's static inputs from a few passages of text (key offsets,
  and per-tensor scales with --kv-cache-scaling per_tensor), saved as an .npz that the other
  commands take with --kv-calibration.
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
import sys
import time

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from paged_jax.core.kv_quant import KV_CACHE_DTYPES, KV_CACHE_SCALINGS, UNQUANTIZED_KV_CACHE_DTYPES
from paged_jax.engine_args import add_engine_args, engine_config_kwargs
from paged_jax.engine_config import CACHE, DEVICES


def _add_engine_args(p: argparse.ArgumentParser, defaults: dict | None = None,
                     default_help: dict | None = None) -> None:
    """EngineConfig's flags (generated from its fields: paged_jax/engine_args.py), and the
    ones of this CLI: a chat template file and jax.distributed's process flags."""
    groups = add_engine_args(p, defaults, default_help)
    groups[CACHE].add_argument("--chat-template", default=None,
                               help="a Jinja chat template file for chat requests (default: the model's own)")
    d = groups[DEVICES]
    d.add_argument("--coordinator-address", default=None,
                   help="host:port of process 0: run one engine across processes (jax.distributed); every "
                        "process runs the same command with the same prompts and its own --process-id")
    d.add_argument("--num-processes", type=int, default=1)
    d.add_argument("--process-id", type=int, default=0)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=max_tokens)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0; above 1 makes tokens already in the prompt or reply less likely (1 = off)")
    s.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]; subtracted once from every token already generated (0 = off)")
    s.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]; subtracted once per time a token was generated (0 = off)")


def _port(text: str) -> int:
    """argparse type of --port: checked before anything loads, so a typo costs no warm-up."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give 1 to 65535 (0: any free port, "
                                         "printed once serving)")
    return port


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts")
    g.set_defaults(parser=g)  # flag-value errors found after parsing are reported by this subparser
    src = g.add_argument_group("prompts (one or more of)")
    src.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for several")
    src.add_argument("--prompts-file", help="a text file, one prompt per line (blank lines skipped)")
    src.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the model's chat template")
    _add_engine_args(g, {"max_num_seqs": None},  # generate() sizes it by its prompts
                     {"max_num_seqs": "the number of prompts, at most 64"})
    _add_sampling_args(g, max_tokens=64)
    o = g.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object per completion and the stats")
    o.add_argument("--quiet", action="store_true", help="print only the summary table")

    c = sub.add_parser("chat", help="an interactive multi-turn chat (Ctrl-D or /exit to leave)")
    c.set_defaults(parser=c)
    c.add_argument("--system", default=None, help="a system message opening the conversation")
    _add_engine_args(c, {"max_num_seqs": 4})
    _add_sampling_args(c, max_tokens=256)

    v = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    v.set_defaults(parser=v)
    _add_engine_args(v, {"warm_up": "full"})
    h = v.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=_port, default=8000)
    h.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    h.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    h.add_argument("--max-waiting-requests", type=int, default=256,
                   help="queued requests beyond which new ones get HTTP 503")
    h.add_argument("--reserved-cpus", type=int, default=None,
                   help="on the CPU backend, cores the engine process leaves to the HTTP process "
                        "(vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU; default: 1 on machines of 4 cores or "
                        "more, else 0). On few cores a small model whose engine makes thousands of "
                        "tokens/s serves more with 1 (docs/BENCHMARKS.md, section 11)")
    h.add_argument("--restart-engine", action="store_true",
                   help="when the engine process dies (e.g. the out-of-memory killer), fail its requests and "
                        "start a new one (HTTP 503 while it warms up) instead of exiting with an error")
    h.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                   help="request bodies larger than this get HTTP 413 (default: 8 MiB)")

    x = sub.add_parser("proxy", help="prefill on producer servers, decode on consumer servers, one OpenAI API")
    x.set_defaults(parser=x)
    x.add_argument("--host", default="127.0.0.1")
    x.add_argument("--port", type=_port, default=8000)
    x.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a producer's root URL (serve --kv-role producer); repeat for several, taken in turn")
    x.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a consumer's root URL (serve --kv-role consumer); repeat for several, taken in turn")
    x.add_argument("--timeout", type=float, default=600.0,
                   help="seconds an upstream call may wait to connect or for its next bytes (default: %(default)s)")

    k = sub.add_parser("calibrate-kv", help="key offsets (and per-tensor scales) of a quantized KV cache, from text")
    k.set_defaults(parser=k)
    k.add_argument("--model", default="tiny", help="as for generate")
    k.add_argument("--dtype", default=None, help="compute dtype (default: the model's)")
    k.add_argument("--kv-cache-dtype", default="fp8",
                   choices=[name for name in KV_CACHE_DTYPES if name not in UNQUANTIZED_KV_CACHE_DTYPES],
                   help="the format per-tensor scales are computed for (default: %(default)s)")
    k.add_argument("--kv-cache-scaling", default="per_token", choices=KV_CACHE_SCALINGS,
                   help="per_tensor also computes each layer's static K and V scales")
    k.add_argument("--text", default=None,
                   help="a text file of representative input, cut into passages (default: the last passages of "
                        "Python's own documentation, pydoc_data.topics)")
    k.add_argument("--num-passages", type=int, default=8)
    k.add_argument("--passage-tokens", type=int, default=256)
    k.add_argument("--out", required=True, help="the .npz to write (give it to --kv-calibration)")
    return parser


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as error:
            raise ValueError(f"--prompts-file {args.prompts_file}: {error.strerror or error}; "
                             "give a readable text file, one prompt per line") from error
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    return prompts


def _summary(outputs, stats: dict, elapsed: float) -> dict:
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    generated = sum(len(o.token_ids) for o in outputs)
    return {
        "requests": len(outputs),
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed if elapsed > 0 else float("nan"),
        "ttft_p50_ms": 1e3 * float(np.median(ttfts)) if ttfts else float("nan"),
        "peak_kv_usage": stats["peak_kv_cache_usage"],
        "prefix_hit_rate": stats["prefix_cache_hit_rate"],
        "preemptions": stats["num_preemptions"],
        "compilations": stats["num_compilations"],
        "wall_s": elapsed,
        **({"spec_acceptance_rate": stats["spec_acceptance_rate"],
            "spec_mean_accepted_length": stats["spec_mean_accepted_length"]} if "spec_num_drafts" in stats else {}),
    }


def _sampling_params(args):
    from paged_jax.core.request import SamplingParams  # host-only: no jax yet

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty)


def _read_chat_template(args) -> str | None:
    if not args.chat_template:
        return None
    try:
        with open(args.chat_template, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise ValueError(f"--chat-template {args.chat_template}: {error.strerror or error}; give a readable "
                         "Jinja file") from error


def _compile_progress(args, progress: Progress):
    """A progress task for loading and compiling, and the callable(done, total) that advances it."""
    task = progress.add_task(f"loading {args.model}, compiling the first bucket", total=None)

    def compiled(done: int, total: int) -> None:
        progress.update(task, description="compiling buckets", completed=done, total=total)

    return compiled


def _make_llm(args, progress: Progress | _LogProgress):
    """The LLM of the engine flags, its bucket compilation shown on `progress`."""
    from paged_jax import LLM  # jax loads here, after argument errors are out of the way

    if args.coordinator_address:
        from paged_jax.multiprocess import initialize

        initialize(args.coordinator_address, args.num_processes, args.process_id)
    return LLM(warm_up_progress=_compile_progress(args, progress), **engine_config_kwargs(args))


class _LogProgress:
    """rich's Progress (add_task, update) as plain lines on stdout, for a log: rich draws its
    bar only on a terminal, and a warm-up of many minutes would leave a log silent. A line
    every LOG_SECONDS or tenth of the total at most, and the last; a task counting up again
    from below (a restarted engine process warming up) says so and is timed afresh."""

    LOG_SECONDS = 5.0

    def __init__(self):
        self._tasks: list[dict] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: int | None = None) -> int:
        now = time.perf_counter()
        self._tasks.append({"description": description, "done": 0, "start": now, "said": now})
        print(f"paged-jax: {description}", flush=True)
        return len(self._tasks) - 1

    def update(self, task: int, *, description: str, completed: int, total: int) -> None:
        state, now = self._tasks[task], time.perf_counter()
        restarted = completed < state["done"]
        if restarted:
            state["start"] = now
        tenth = max(1, total // 10)
        if (restarted or completed == total or now - state["said"] >= self.LOG_SECONDS
                or completed // tenth > state["done"] // tenth):
            print(f"paged-jax: {description} {completed}/{total} ({now - state['start']:.0f} s)", flush=True)
            state["said"] = now
        state["done"] = completed


def _progress(console: Console, show: bool = True) -> Progress | _LogProgress:
    if show and not console.is_terminal:
        return _LogProgress()
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=not show)


def generate(args, params, prompts: list[str], console: Console) -> int:
    if args.max_num_seqs is None:
        # No step of this run holds more sequences than it has prompts: fewer sequence buckets
        # to compile, and on the CPU a pool for that many (one question's pool, not 64
        # full-length sequences').
        args.max_num_seqs = min(len(prompts), 64)
    # One bar over the buckets, from loading until generation ends: in background warm-up the
    # buckets keep compiling while the prompts run (generate's own bar would be a second
    # live display, which rich refuses, so it is off while this one shows).
    with _progress(console, show=not args.json) as progress:
        llm = _make_llm(args, progress)
        start = time.perf_counter()
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False,
                               chat_template=_read_chat_template(args))
            for o, p in zip(outputs, prompts):
                o.prompt = p  # show the question, not the rendered template
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    # The buckets this run did not need are left to the next one (their compilation would
    # only delay the exit); those compiled are in the persistent cache.
    llm.shutdown()
    summary = _summary(outputs, llm.stats(), elapsed)
    if args.json:
        for o in outputs:
            print(json.dumps({"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason,
                              "ttft_s": o.metrics.time_to_first_token,
                              "num_cached_tokens": o.metrics.num_cached_tokens}))
        print(json.dumps({"summary": summary}))
        return 0
    if not args.quiet:
        for o in outputs:
            console.print(f"[bold]{o.prompt!r}[/bold] -> {o.text!r} [dim]({len(o.token_ids)} tokens, "
                          f"{o.finish_reason})[/dim]", highlight=False)
    # One metric per row: seven columns side by side truncate their headers in 80 columns,
    # and a title above a narrow table would wrap, so it is a line of its own.
    stats = llm.stats()
    console.print(f"paged-jax generate ({args.model}, {stats['attention_impl']} attention, {stats['backend']})",
                  highlight=False, soft_wrap=True)
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in (("requests", str(summary["requests"])),
                        ("generated tok/s", f"{summary['tokens_per_s']:.1f}"),
                        ("TTFT p50 (ms)", f"{summary['ttft_p50_ms']:.1f}"),
                        ("peak KV usage", f"{summary['peak_kv_usage']:.1%}"),
                        ("prefix hit rate", f"{summary['prefix_hit_rate']:.1%}"),
                        ("preemptions", str(summary["preemptions"])),
                        ("compilations", str(summary["compilations"]))):
        table.add_row(name, value)
    if "spec_acceptance_rate" in summary:
        table.add_row("proposals accepted", f"{summary['spec_acceptance_rate']:.1%}")
        table.add_row("tokens per verify step", f"{summary['spec_mean_accepted_length']:.2f}")
    console.print(table)
    return 0


def _cpu_list(cpus) -> str:
    """(0, 1, 2, 5) -> 'cores 0-2,5'; () (no per-process affinity on this OS) -> 'every core'."""
    if not cpus:
        return "every core"
    runs, start = [], None
    for i, cpu in enumerate(cpus):
        start = cpu if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            runs.append(str(cpu) if cpu == start else f"{start}-{cpu}")
            start = None
    return f"core{'s' if len(cpus) > 1 else ''} {','.join(runs)}"


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the warm-up: a port in use fails now, not after
    minutes of compiling. It listens only once the engine is warm, so that until then a
    client's connection is refused rather than left waiting in the backlog."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use (another server?); pick another "
                             "--port, or stop what listens there") from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({error.strerror or error}); "
                         "give an address of this machine and a port it may use") from None
    return sock


def serve(args, console: Console) -> int:
    from paged_jax.engine_config import EngineConfig
    from paged_jax.server import EngineProcessError, make_server

    if args.data_parallel_size > 1 or args.coordinator_address:
        # The HTTP side feeds one engine in one process; replicas and multi-process engines
        # would need every process to see every request (paged_jax/multiprocess.py).
        raise ValueError("serve runs one engine in one process: use --tensor-parallel-size for several devices, "
                         "without --data-parallel-size or --coordinator-address")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes {args.max_request_bytes} must be >= 1 (bytes of a request body)")
    chat_template = _read_chat_template(args)
    config = EngineConfig(**engine_config_kwargs(args))  # --warm-up full by default: /health once all compiled
    with _bind(args.host, args.port) as sock:
        try:
            with _progress(console) as progress:
                # The engine runs in a process of its own (server/engine_core.py); this returns once it is warm.
                server = make_server(config, host=args.host, port=args.port,
                                     model_name=args.served_model_name or args.model, api_key=args.api_key,
                                     max_waiting_requests=args.max_waiting_requests, chat_template=chat_template,
                                     progress=_compile_progress(args, progress), reserved_cpus=args.reserved_cpus,
                                     restart_engine=args.restart_engine, max_body_bytes=args.max_request_bytes)
            sock.listen(2048)  # uvicorn's default backlog
            core, port = server.engine.core, sock.getsockname()[1]
            host = f"[{args.host}]" if ":" in args.host else args.host
            console.print(f"paged-jax: serving {args.served_model_name or args.model} at http://{host}:{port}/v1 "
                          f"(warm: {server.engine.stats['num_compilations']} buckets compiled; engine on "
                          f"{_cpu_list(core.cpus)}{f', {core.reserved} left to HTTP' if core.reserved else ''})",
                          highlight=False, soft_wrap=True)  # one line: a log greps it whole
            sys.stdout.flush()  # a log (stdout not a terminal) sees the banner now, not at exit
            server.run(sockets=[sock])
        except EngineProcessError as error:  # it failed to start, or died (without --restart-engine)
            print(f"paged-jax: error: {error}", file=sys.stderr, flush=True)
            return 1
    return 0


def proxy(args) -> int:
    from paged_jax.server.proxy import run_proxy  # fastapi loads only for the commands that serve

    with _bind(args.host, args.port) as sock:
        run_proxy(args.host, args.port, args.prefill, args.decode, args.timeout, sock=sock)
    return 0


def _calibration_passages(args, tokenizer) -> list[list[int]]:
    """--num-passages token lists of --passage-tokens each: consecutive cuts of --text, or the
    last documentation topics long enough (pydoc_data.topics, sorted by name)."""
    from paged_jax.kv_calibration import documentation_passages, text_passages

    n, length = args.num_passages, args.passage_tokens
    if n < 1 or length < 2:
        raise ValueError(f"--num-passages {n} and --passage-tokens {length} must be >= 1 and >= 2")
    if args.text:
        try:
            with open(args.text, encoding="utf-8") as f:
                passages = text_passages(tokenizer.encode(f.read()), n, length)
        except OSError as error:
            raise ValueError(f"--text {args.text}: {error.strerror or error}; give a readable text file") from error
    else:
        passages = documentation_passages(tokenizer, length, reverse=True)[:n]
    if len(passages) < n:
        raise ValueError(f"the text holds {len(passages)} passages of {length} tokens, not --num-passages {n}; "
                         "give more text or lower them")
    return passages


def calibrate_kv(args, console: Console) -> int:
    from models.registry import load_model, load_tokenizer  # jax loads here
    from paged_jax.core.kv_quant import save_kv_calibration
    from paged_jax.kv_calibration import calibrate_key_offsets, calibrate_kv_scales

    tokenizer = load_tokenizer(args.model)
    passages = _calibration_passages(args, tokenizer)
    model = load_model(args.model, dtype=args.dtype)
    offsets = calibrate_key_offsets(model, passages)
    scales = None
    if args.kv_cache_scaling == "per_tensor":
        scales = calibrate_kv_scales(model, passages, args.kv_cache_dtype, key_offsets=offsets)
    save_kv_calibration(args.out, offsets, scales, args.kv_cache_dtype)
    norms = np.linalg.norm(offsets, axis=-1)  # [layers, KV heads]
    console.print(f"paged-jax: {args.out}: key offsets of {offsets.shape[0]} layers x {offsets.shape[1]} KV heads "
                  f"(norm {norms.min():.3g}..{norms.max():.3g}) from {len(passages)} passages x "
                  f"{args.passage_tokens} tokens" + (f", per-tensor {args.kv_cache_dtype} scales" if scales else "")
                  + f"; use it with --kv-cache-dtype {args.kv_cache_dtype} --kv-calibration {args.out}",
                  highlight=False, soft_wrap=True)  # soft: the path stays whole for copying
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    # Flag values are checked before jax loads, and answered like argparse's own errors
    # (usage line, message, exit status 2).
    try:
        params = _sampling_params(args) if args.command in ("generate", "chat") else None
        prompts = _read_prompts(args) if args.command == "generate" else None
    except ValueError as error:
        args.parser.error(str(error))
    console = Console()
    try:
        if args.command == "chat":
            from paged_jax.chat_repl import chat

            return chat(args, params, console)
        if args.command == "serve":
            return serve(args, console)
        if args.command == "proxy":
            return proxy(args)
        if args.command == "calibrate-kv":
            return calibrate_kv(args, console)
        return generate(args, params, prompts, console)
    except ValueError as error:  # bad input found later (model dir, cache sizes): what to change, no traceback
        print(f"paged-jax: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading or compiling: the user's choice, not a crash
        return 130


if __name__ == "__main__":
    sys.exit(main())
