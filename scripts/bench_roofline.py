"""Roofline: this machine's read bandwidth and matmul rate, and single-stream decode of
SmolLM2-135M-Instruct (the real GGUF) beside them (issue 26).

    python scripts/bench_roofline.py [--quick] [--context 300] [--new-tokens 128] [--runs 3]
        [--activation-dtype int8]

1. Machine limits, each the median of --reps timed calls after a warm-up:
   - read bandwidth of a jitted jnp.sum and of np.add.reduce over the same f32 array
     (--bandwidth-mib; a few hundred MiB, far past the caches), bytes read / time;
   - a jitted f32 matvec over the model's [V, D] head matrix (jnp.dot(W, x)), and the same
     matvec through numpy's BLAS (np.dot; threadpoolctl's report of that BLAS is recorded
     when threadpoolctl is importable, with the OPENBLAS_* variables of the process);
   - the decode step's own matmul shapes: x[T, 576] @ 90 [576, 1536] f32 matrices in one
     jitted program (a step's worth of MLP-sized weights, each read once) for T = 1 and the
     engine's smallest token bucket (16: what one decoding sequence is padded to);
   - the f32 matmul rate: bench_compute.matmul_rate (jnp.dot, n x n, 2 n^3 FLOPs).
2. What one single-stream decode step must read and compute at a --context-token context:
   the weights as the engine holds them (the runner's layer and head parameter bytes; a tied
   embedding is read once, as the head, and its lookup reads one row), the GGUF's stored
   tensor bytes (GGUFReader, sum of n_bytes), the live KV (context x the pool's bytes per
   token), and the useful FLOPs (_bench_common.useful_flops). Each bandwidth gives a
   bandwidth-limited tok/s = bandwidth / bytes per step.
3. Measured decode: LLM(model, max_num_seqs=1), a --context-token prompt (random ids),
   --new-tokens greedy tokens with ignore_eos, stepped with engine.step(); the first step is
   the prefill, every later one a decode of one token. Per run: median decode step time;
   tok/s is 1 / the median of the runs' medians. Each beside its bandwidth limits as a fraction:
   the best measured read (the verdict), the XLA matvec, and the better reduction. The VM's
   bandwidth moves by up to 2x between minutes (a reduction over 512 MiB read 35-76 GB/s on
   one Zen 5 VM), so the four reads of section 1 are measured again (--probe-reps calls each)
   just before and just after every run, and each run's fraction is of the better of those
   two: the paired table, whose median over the --runs runs is the verdict.
4. Where a decode step's time goes: the same engine, its step taken apart (schedule, build,
   pack + put (device_put off the CPU), embed, each layer program, head, results to host, update), a
   block_until_ready after each program, medians over the decode steps; then jax's profiler
   over plain engine.step() decode steps: the device thunks' self time (a while loop's body
   thunks are not counted twice) by kind (matmuls, attention, the rest) and busiest first,
   each named from the compiled program's HLO (ms per step; the profiler slows the step, so
   read the shares). Synchronising after each program stops
   dispatch from overlapping execution; the sum of the parts is reported beside a plain step.
5. Two levers the step's remaining overhead suggests, on one decode step's own inputs
   (step_levers): its programs compiled as one, and its input building run on a second thread
   while the programs run (the overlap of vLLM's async scheduling), each beside the programs
   as runner.execute calls them.
6. What the padding costs: runner.execute of one synthetic decode (profile_step.decode_inputs)
   in the engine's decode bucket (16 tokens x 1 sequence) and in a second runner whose
   smallest token bucket is 1 (no library change: SchedulerConfig.min_token_bucket replaced).

--quick: 64 MiB arrays, matmul 2048, 32 new tokens, 1 run, 2 profiled steps; a smoke run
(~40 s here, most of it loading the GGUF).
Writes results/bench_roofline.json (results/bench_roofline_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import numpy as np

from _bench_common import command_line, machine_info, print_table, tree_nbytes, useful_flops, write_json

MODEL = "smollm2-135m-instruct"


def _median_s(fn, reps: int) -> float:
    fn()  # warm-up (compiles, touches pages)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def blas_info() -> dict:
    """What numpy's BLAS is and how it is set up: threadpoolctl's report when importable, and
    the OPENBLAS_* variables (set on some processors here; they can pick a slower kernel)."""
    info = {"env": {k: v for k, v in os.environ.items() if k.startswith(("OPENBLAS", "OMP_", "MKL_"))}}
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        info["threadpoolctl"] = None
    else:
        info["threadpoolctl"] = [{k: p.get(k) for k in ("internal_api", "version", "architecture", "num_threads",
                                                          "threading_layer", "filepath")} for p in threadpool_info()]
    return info


class ReadProbe:
    """The four read rates (GB/s): a jitted jnp.sum and np.add.reduce over one f32 array of
    bandwidth_bytes, a jitted jnp.dot and np.dot over an f32 [V, D] matrix (the model's head
    shape) and a vector; each the median of `reps` timed calls. Holds its arrays, so the same
    reads can be measured again around each decode run (the VM's bandwidth moves between
    minutes: section 3 of the module docstring)."""

    def __init__(self, bandwidth_bytes: int, matvec_shape: tuple[int, int]):
        import jax
        import jax.numpy as jnp

        self.bandwidth_bytes = bandwidth_bytes
        self.host = np.random.default_rng(0).standard_normal(bandwidth_bytes // 4, dtype=np.float32)
        self.dev = jax.device_put(self.host)
        v, d = matvec_shape
        self.w_host = np.random.default_rng(1).standard_normal((v, d), dtype=np.float32)
        self.x_host = np.random.default_rng(2).standard_normal(d, dtype=np.float32)
        self.w, self.x = jax.device_put(self.w_host), jax.device_put(self.x_host)
        self.matvec_bytes = v * d * 4
        self._sum, self._dot = jax.jit(jnp.sum), jax.jit(jnp.dot)

    def __call__(self, reps: int) -> dict:
        """{name}_gb_per_s and {name}_s for xla_sum, numpy_sum, xla_matvec and numpy_matvec."""
        reads = {"xla_sum": (lambda: self._sum(self.dev).block_until_ready(), self.bandwidth_bytes),
                 "numpy_sum": (lambda: np.add.reduce(self.host), self.bandwidth_bytes),
                 "xla_matvec": (lambda: self._dot(self.w, self.x).block_until_ready(), self.matvec_bytes),
                 "numpy_matvec": (lambda: np.dot(self.w_host, self.x_host), self.matvec_bytes)}
        out = {}
        for name, (fn, size) in reads.items():
            s = _median_s(fn, reps)
            out[f"{name}_gb_per_s"], out[f"{name}_s"] = size / s / 1e9, s
        return out


def machine_limits(probe: ReadProbe, *, layer_f: int, min_token_bucket: int, token_rows: tuple[int, ...],
                   matmul_n: int, reps: int) -> dict:
    """Read bandwidth (the probe's reductions and matvecs, and x @ 90 layer-sized matrices in
    one program) and the matmul rate."""
    import jax
    import jax.numpy as jnp

    from bench_compute import matmul_rate

    v, d = probe.w_host.shape
    # The decode step's own matmul shapes: x[T, D] @ 90 [D, F] matrices in one program (a
    # step's layers' gate/up/down-sized weights, read once each), for one token and for the
    # engine's smallest token bucket (what one decoding sequence is padded to).
    layer_mats = [jax.device_put(np.random.default_rng(3 + i).standard_normal((d, layer_f), dtype=np.float32))
                  for i in range(90)]
    many = jax.jit(lambda x, ws: [jnp.dot(x, w) for w in ws])
    layer_rows = {}
    for t in sorted({1, *token_rows, min_token_bucket}):
        xt = jax.device_put(np.ones((t, d), np.float32))
        layer_rows[t] = _median_s(lambda: jax.block_until_ready(many(xt, layer_mats)), reps)
    layer_bytes = 90 * d * layer_f * 4
    del layer_mats
    rate = matmul_rate(matmul_n, reps=reps)
    return {
        "bandwidth_bytes": probe.bandwidth_bytes, "matvec_shape": [v, d], "matvec_bytes": probe.matvec_bytes,
        "reps": reps, **probe(reps),
        "layer_matvec_shape": [90, d, layer_f], "layer_matvec_bytes": layer_bytes,
        "layer_matvec_gb_per_s": {str(t): layer_bytes / s / 1e9 for t, s in layer_rows.items()},
        "layer_matvec_s": {str(t): s for t, s in layer_rows.items()},
        "matmul_n": matmul_n, "matmul_flops_per_s": rate, "numpy_blas": blas_info(),
    }


def gguf_bytes(path: str) -> dict:
    """The GGUF's tensor bytes (what llama.cpp reads per decode token), total and per type."""
    import gguf

    reader = gguf.GGUFReader(path)
    by_type = collections.Counter()
    for tensor in reader.tensors:
        by_type[tensor.tensor_type.name] += int(tensor.n_bytes)
    return {"path": path, "file_bytes": os.path.getsize(path), "tensor_bytes": sum(by_type.values()),
            "tensor_bytes_by_type": dict(by_type), "num_tensors": len(reader.tensors)}


def decode_requirements(engine, context: int, gguf_path: str) -> dict:
    """Bytes one single-stream decode step at `context` keys must read, and its useful FLOPs."""
    from bench_compute import model_shape
    from models.kv_cache_spec import kv_cache_bytes_per_token

    runner, model = engine.runner, engine.model
    layers = sum(tree_nbytes(p) for p in runner.layer_params)
    head = tree_nbytes(runner.head_params)  # embedding, final norm, lm_head if untied
    embed_table = int(model.embed_tokens.get_value().nbytes)  # a float array or a PackedWeight
    tied = model.lm_head is None
    row = embed_table // model.config.vocab_size
    # Tied: the table is read whole by the head and one row by the lookup; untied: the lookup
    # reads one row of it and the head its own matrix.
    head_read = head - (0 if tied else embed_table) + row
    kv_per_token = kv_cache_bytes_per_token(runner.pool.specs)
    shape = model_shape(model.config)
    return {
        "context": context, "tied_embedding": tied,
        "weights_held": {"layers": layers, "head_and_embed_read": head_read, "total": layers + head_read,
                        "parameter_bytes_held": layers + head},
        "gguf": gguf_bytes(gguf_path),
        "kv_bytes_per_token": kv_per_token, "kv_live_bytes": kv_per_token * context,
        "flops": useful_flops(shape, 1, context, 1),
        "per_layer_program_bytes": layers // len(runner.layer_groups(1).tensors),  # a decode bucket's runs
    }


# measured decode
def make_llm(args):
    from paged_jax import LLM

    t0 = time.perf_counter()
    # warm_up="none", then the two buckets the runs use compiled here (the prefill's and the
    # decode's; or loaded from the persistent compilation cache). A bucket not compiled would
    # make the step run in a larger compiled one (CompileManager.choose_shape).
    llm = LLM(MODEL, max_num_seqs=1, max_model_len=args.max_model_len, warm_up="none",
              activation_dtype=args.activation_dtype, num_scheduler_steps=args.num_scheduler_steps)
    load_s = time.perf_counter() - t0
    runner, buckets = llm.engine.runner, llm.engine.scheduler_config.token_buckets
    for num_tokens in (buckets[0], next(b for b in buckets if b >= args.context)):
        runner.compiler.programs_for(runner.compiler.bucket_for(num_tokens, 1))
    return llm, load_s, time.perf_counter() - t0 - load_s


def decode_run(engine, prompt: list[int], new_tokens: int, step=None) -> list[float]:
    """One request to completion with engine.step (or `step`); seconds of each decoded token
    after the first (a step that decodes k tokens, num_scheduler_steps, counts k of its time / k)."""
    from paged_jax.core.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    assert engine.reset_prefix_cache(), "requests still hold blocks"  # every run prefills anew
    engine.add_request(f"roofline-{time.monotonic_ns()}", prompt, params)
    step = step or engine.step
    times = []
    done = 0  # the request's tokens so far (its RequestOutput's are cumulative)
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = step()
        seconds = time.perf_counter() - t0
        tokens = len(outputs[0].token_ids) - done if outputs else 0
        if done:
            times += [seconds / tokens] * tokens
        done += tokens
    assert len(times) == new_tokens - 1, f"expected {new_tokens - 1} decoded tokens, got {len(times)}"
    return times


class TimedStep:
    """engine.step() taken apart, with a timer (and a block_until_ready) around each piece.

    The same calls as LLMEngine.step and ModelRunner.execute (no offload tier, no mesh, the
    step's own bucket compiled); parts[name] collects seconds per step."""

    def __init__(self, engine):
        self.engine = engine
        self.parts = collections.defaultdict(list)
        self.programs = None

    def __call__(self):
        import jax

        from paged_jax.runner import pack_step_inputs

        e, r, parts = self.engine, self.engine.runner, collections.Counter()
        t = time.perf_counter()

        def lap(name):
            nonlocal t
            now = time.perf_counter()
            parts[name] += now - t
            t = now

        out = e.scheduler.schedule()
        lap("host: schedule")
        inputs = e.input_builder.build(out)
        copies = e.kv_cache_manager.take_step_copies()
        lap("host: build step inputs")
        assert copies is None and r.mesh is None, "TimedStep runs the plain single-device step only"
        shape = inputs.model.token_ids.shape[0], inputs.attention.seq_lens.shape[0]
        assert r.compiler.choose_shape(*shape) == shape, "the step's own bucket is not compiled"
        embed, layers, head, *_ = r._programs_for(shape)
        packed = jax.block_until_ready(r._put(pack_step_inputs(inputs)))  # the host array itself on a CPU
        lap("host: pack + put")
        x = embed(r._head_leaves, packed).block_until_ready()
        lap("embed")
        kv_caches, groups = r.pool.kv_caches, r.layer_groups(shape[0])
        k = groups.size
        for run, i in enumerate(range(0, len(kv_caches), k)):
            layer = layers[groups.kind_of[run]]
            x, kv_caches[i : i + k] = layer(groups.leaves[run], x, kv_caches[i : i + k], packed,
                                            groups.layer_inputs[run])
            jax.block_until_ready((x, kv_caches[i : i + k]))
            lap(f"layers {i}-{i + k - 1}")
        token_ids, logprobs = head(r._head_leaves, x, packed)
        jax.block_until_ready((token_ids, logprobs))
        lap("head (norm, logits, sample)")
        token_ids, logprobs = np.asarray(token_ids), np.asarray(logprobs)
        r.num_steps += 1
        lap("host: results to numpy")
        outputs = e._make_outputs(e.scheduler.update_from_output(out, token_ids, logprobs))
        lap("host: update + outputs")
        if inputs.model.token_ids.shape[0] and out.total_num_scheduled_tokens == 1:  # decode steps only
            for name, s in parts.items():
                self.parts[name].append(s)
        return outputs


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")


def hlo_ops(text: str) -> dict:
    """instruction name -> (opcode, shape, op_name) of a compiled program's HLO text; a
    fusion's op_name is its own or the first one inside the computation it calls."""
    instructions, computation_op_names, current = {}, collections.defaultdict(list), None
    for line in text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(1)
            continue
        if m := _INSTRUCTION.match(line):
            op_name = re.search(r'op_name="([^"]+)"', line)
            calls = re.search(r"calls=%?([\w.\-]+)", line)
            instructions[m.group(1)] = (m.group(3), m.group(2), op_name.group(1) if op_name else None,
                                        calls.group(1) if calls else None)
            if op_name and current:
                computation_op_names[current].append(op_name.group(1))
    described = {}
    for name, (opcode, shape, op_name, calls) in instructions.items():
        if op_name is None and calls:
            op_name = next(iter(computation_op_names.get(calls, [])), None)
        described[name] = (opcode, shape, op_name or "")
    return described


def _thunk_kind(op_name: str, opcode: str, name: str, shape: str = "") -> str:
    if (name.startswith("ffi_call") or opcode == "custom-call") and shape.startswith("(") and shape.count("[") >= 3:
        # (x, k_cache, v_cache): a layer as one native call
        return "whole layers (one native call each, cpu_kernels/decoder_layer)"
    if "attention" in op_name:
        return "attention (ragged_paged_attention_xla)"
    if "dot_general" in op_name or opcode == "dot" or name.startswith("dot"):
        return "matmuls (dot_general)"
    if name.startswith("ffi_call") or opcode == "custom-call":  # outside attention: the packed matmul
        return "matmuls (packed weights, cpu_kernels/quant_matmul)"
    return "everything else (norms, rope, silu, sampling, copies)"


def _self_times(events):
    """(event, its duration less the events nested in it on its thread): a while or
    conditional thunk's span holds its body's thunks, which are events of their own."""
    by_thread = collections.defaultdict(list)
    for event in events:
        by_thread[event["tid"]].append(event)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, nested = [], collections.Counter()
        for event in thread_events:
            while stack and event["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                nested[id(stack[-1])] += event["dur"]
            stack.append(event)
        for event in thread_events:
            yield event, event["dur"] - nested[id(event)]


def trace_thunks(run) -> list[tuple[dict, float]]:
    """jax's profiler over run(): each device thunk's trace event and its self time in us."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            run()
        (path,) = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as fh:
            events = json.load(fh)["traceEvents"]
    return list(_self_times(e for e in events if e.get("ph") == "X" and "hlo_module" in e.get("args", {})))


def profile_thunks(engine, prompt: list[int], steps: int) -> dict:
    """jax's profiler over `steps` plain decode steps: device thunks by (program, name), ms
    per step, each named by its HLO op (opcode, shape, the jax op it came from). The traced
    step's time is the steps' own under the profiler (not its start, stop and export)."""
    from paged_jax.core.request import SamplingParams

    assert engine.reset_prefix_cache(), "requests still hold blocks"
    engine.add_request(f"roofline-profile-{time.monotonic_ns()}", prompt,
                       SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill, outside the trace
    traced_s = 0.0

    def decode():
        nonlocal traced_s
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        traced_s = time.perf_counter() - t0

    total, calls = collections.Counter(), collections.Counter()
    for event, self_us in trace_thunks(decode):
        key = (event["args"]["hlo_module"], event["args"].get("hlo_op", event["name"]))
        total[key] += self_us
        calls[key] += 1
    # The decode bucket's programs, to name each thunk by what it computes.
    shape = engine.runner.compiler.shapes[0]
    embed, layers, head, *_ = engine.runner._programs_for(shape)
    texts = {"jit_embed_fn": embed.as_text(), "jit_head_fn": head.as_text(), "jit_layer_fn": layers[0].as_text()}
    steps_program = engine.runner._programs_for(shape).steps
    if steps_program is not None:  # num_scheduler_steps > 1: the decode runs as one program of k steps
        texts["jit_steps_fn"] = steps_program[0].as_text()
    ops = {module: hlo_ops(text) for module, text in texts.items()}
    top, kinds, per_module = [], collections.Counter(), collections.Counter()
    for (module, name), us in total.most_common():
        opcode, op_shape, op_name = ops.get(module, {}).get(name, ("", "", ""))
        ms = us / steps / 1e3
        kinds[_thunk_kind(op_name, opcode, name, op_shape)] += ms
        per_module[module] += ms
        top.append({"program": module, "thunk": name, "ms_per_step": ms, "calls_per_step": calls[(module, name)] // steps,
                    "opcode": opcode, "shape": op_shape, "op_name": op_name})
    return {"steps": steps, "bucket": list(shape), "traced_ms_per_step": 1e3 * traced_s / steps,
            "thunk_ms_per_step": sum(per_module.values()), "by_program_ms_per_step": dict(per_module),
            "by_kind_ms_per_step": dict(kinds), "top": top[:40]}


def measure(args) -> dict:
    import jax

    from models.named_models import resolve_named_model
    from paged_jax.core.config import MIN_TOKEN_BUCKET

    quick = args.quick
    # SmolLM2's shapes (vocab 49152, hidden 576, intermediate 1536), before the model loads.
    probe = ReadProbe(args.bandwidth_mib * 2**20, (49152, 576))
    limits = machine_limits(probe, layer_f=1536, min_token_bucket=MIN_TOKEN_BUCKET,
                            token_rows=() if quick else (2, 4, 8),
                            matmul_n=2048 if quick else 4096, reps=args.reps)
    llm, load_s, compile_s = make_llm(args)
    engine = llm.engine
    gguf_path = str(resolve_named_model(MODEL))
    need = decode_requirements(engine, args.context, gguf_path)
    vocab = engine.model.config.vocab_size
    prompt = np.random.default_rng(args.seed).integers(3, vocab, args.context).tolist()
    t0 = time.perf_counter()
    decode_run(engine, prompt, 4)  # untimed: the prefill and decode buckets' first runs
    first_run_s = time.perf_counter() - t0

    runs = []
    for _ in range(args.runs):  # each run between two measurements of the reads (the limits)
        before = probe(args.probe_reps)
        times = decode_run(engine, prompt, args.new_tokens)
        runs.append({"median_step_s": statistics.median(times), "mean_step_s": statistics.fmean(times),
                     "p90_step_s": float(np.percentile(times, 90)), "steps": len(times),
                     "reads_before": before, "reads_after": probe(args.probe_reps)})
    del probe
    step_s = statistics.median(r["median_step_s"] for r in runs)

    timed = TimedStep(engine)
    decode_run(engine, prompt, args.breakdown_tokens, step=timed)
    parts = {name: statistics.median(s) for name, s in timed.parts.items()}
    profile = profile_thunks(engine, prompt, args.profile_steps) if args.profile_steps else None
    levers = step_levers(engine, prompt, rounds=2 if args.quick else 6, calls=20 if args.quick else 50)
    what_if = bucket_what_if(engine, args.context, args.runs * 8)

    return {"limits": limits, "requirements": need, "decode": {
        "runs": runs, "median_step_s": step_s, "tok_per_s": 1 / step_s, "new_tokens": args.new_tokens,
        "context": args.context, "engine_load_s": load_s, "compile_s": compile_s,
        "first_run_s": first_run_s,
        "layers_per_program": engine.runner.layer_groups(1).size, "num_layers": engine.model.config.num_layers,
        "max_model_len": engine.max_model_len, "num_blocks": engine.cache_config.num_blocks,
        "block_size": engine.cache_config.block_size, "attention_impl": engine.runner.attention_impl,
        "dtype": str(engine.model.config.dtype)},
        "breakdown": {"steps": len(next(iter(timed.parts.values()))), "median_s": parts,
                      "sum_of_parts_s": sum(parts.values())},
        "profile": profile, "levers_s": levers, "decode_bucket_execute_s": what_if,
        "jax_backend": jax.default_backend()}


def step_levers(engine, prompt: list[int], rounds: int, calls: int) -> dict:
    """Two levers on one real decode step's inputs (a decode of `prompt` that allocates no
    block, so its input building can be repeated unchanged), in ms, medians over `rounds`
    rounds of `calls` calls of each way, the ways taking turns:

    - programs: the step's compiled programs back to back as runner.execute calls them
      (embed, each layer program, head), results to numpy;
    - one program: the same computation compiled as one program (the runner's steps program
      of one step, ModelRunner.compile_steps; the caches donated), the "fewer compiled
      programs per step" lever;
    - build: the step's input building alone (StepInputsBuilder.build + pack_step_inputs, the
      largest piece of a step's host work);
    - build, then programs: as engine.step runs them;
    - build overlapped: the build on a second thread, started as the layer programs start, the
      programs on this one (vLLM's async scheduling builds step N + 1 while step N runs).

    The engine's request is then finished normally."""
    import threading

    from paged_jax.core.request import SamplingParams
    from paged_jax.runner import pack_step_inputs

    e, r = engine, engine.runner
    assert e.reset_prefix_cache(), "requests still hold blocks"
    e.add_request(f"levers-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=64, temperature=0.0,
                                                                        ignore_eos=True))
    e.step()  # the prefill
    while True:  # a decode step that allocates no block: building it twice changes nothing
        out = e.scheduler.schedule()
        inputs = e.input_builder.build(out)
        if not any(ids for per_request in out.new_block_ids for ids in per_request):
            break
        token_ids, logprobs = r.execute(inputs)
        e.scheduler.update_from_output(out, token_ids, logprobs)
    assert out.total_num_scheduled_tokens == 1 and r.mesh is None, "one decoding token, one device"
    shape = inputs.model.token_ids.shape[0], inputs.attention.seq_lens.shape[0]
    assert r.compiler.choose_shape(*shape) == shape, "the step's own bucket is not compiled"
    embed, layers, head, *_ = r._programs_for(shape)
    groups = r.layer_groups(shape[0])
    packed = r._put(pack_step_inputs(inputs))
    layers_started = threading.Event()

    def programs():
        x = embed(r._head_leaves, packed)
        caches = r.pool.kv_caches
        layers_started.set()
        for run, tensors in enumerate(groups.tensors):
            x, new = layers[groups.kind_of[run]](groups.leaves[run], x, [caches[t] for t in tensors], packed,
                                                 groups.layer_inputs[run])
            for t, cache in zip(tensors, new):
                caches[t] = cache
        return tuple(np.asarray(a) for a in head(r._head_leaves, x, packed))

    one, used = r.compile_steps(*shape, 1)  # embed, layers and head of one step: the steps program, k = 1
    slots = e.input_builder.step_slot_mappings(inputs, 1)

    def one_program():
        caches = r.pool.kv_caches
        token_ids, logprobs, new = one(r._head_leaves, groups.leaves, [caches[t] for t in used], packed,
                                       groups.layer_inputs, slots)
        for t, cache in zip(used, new):
            caches[t] = cache
        return np.asarray(token_ids)[:, 0], np.asarray(logprobs)[:, 0]

    def build():
        return pack_step_inputs(e.input_builder.build(out))

    go, built, stop = threading.Event(), threading.Event(), []

    def builder():  # the second thread: one build per go
        while go.wait() and not stop:
            go.clear()
            layers_started.wait()
            build()
            built.set()

    thread = threading.Thread(target=builder, daemon=True)
    thread.start()

    def overlapped():
        layers_started.clear()
        go.set()
        result = programs()
        built.wait()
        built.clear()
        return result

    ways = {"programs": programs, "one program": one_program, "build": build,
            "build, then programs": lambda: (build(), programs()), "build overlapped": overlapped}
    reference = programs()
    assert np.array_equal(one_program()[0], reference[0]), "the one program sampled another token"
    times = collections.defaultdict(list)
    for i in range(rounds):
        for name, fn in (ways.items() if i % 2 == 0 else reversed(ways.items())):
            for _ in range(3):
                fn()
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    stop.append(True)
    go.set()
    thread.join()
    token_ids, logprobs = programs()
    e.scheduler.update_from_output(out, token_ids, logprobs)
    while e.has_unfinished_requests():
        e.step()
    return {name: statistics.median(ts) for name, ts in times.items()}


def bucket_what_if(engine, context: int, repeats: int) -> dict:
    """runner.execute of one synthetic decode at `context` keys (profile_step.decode_inputs)
    in the engine's decode bucket, and in a second runner on the same weights whose smallest
    token bucket is 1 (SchedulerConfig.min_token_bucket; no engine knob sets it): what padding
    one decoding sequence to the smallest bucket costs. Writes the engine's free pages: run last."""
    from profile_step import decode_inputs, median_ms

    from paged_jax.engine_config import ResolvedConfig
    from paged_jax.runner import ModelRunner

    rc = engine.resolved_config
    out = {}
    for min_bucket in (rc.scheduler.min_token_bucket, 1):
        if min_bucket == rc.scheduler.min_token_bucket:
            runner = engine.runner
        else:
            runner = ModelRunner(engine.model, ResolvedConfig(
                rc.engine, rc.cache, dataclasses.replace(rc.scheduler, min_token_bucket=min_bucket)))
        inputs = decode_inputs(runner, 1, (context, context + 1), np.random.default_rng(0))
        bucket = (len(inputs.model.token_ids), len(inputs.attention.seq_lens))
        out[f"{bucket[0]}x{bucket[1]}"] = median_ms(runner, inputs, repeats) / 1e3
    return out


# tables
def _gb(x): return f"{x / 1e9:.1f}"  # noqa: E704
def _mb(x): return f"{x / 1e6:.1f}"  # noqa: E704


def limit_rows(lim: dict) -> list[list]:
    mib = lim["bandwidth_bytes"] / 2**20
    v, d = lim["matvec_shape"]
    return [
        [f"read: jnp.sum over {mib:.0f} MiB f32 (jit)", f"{lim['xla_sum_gb_per_s']:.1f} GB/s", f"{1e3 * lim['xla_sum_s']:.2f} ms"],
        [f"read: np.add.reduce over {mib:.0f} MiB f32", f"{lim['numpy_sum_gb_per_s']:.1f} GB/s", f"{1e3 * lim['numpy_sum_s']:.2f} ms"],
        [f"read: jnp.dot [{v}, {d}] f32 @ [{d}] (jit)", f"{lim['xla_matvec_gb_per_s']:.1f} GB/s", f"{1e3 * lim['xla_matvec_s']:.2f} ms"],
        [f"read: np.dot [{v}, {d}] f32 @ [{d}] (BLAS)", f"{lim['numpy_matvec_gb_per_s']:.1f} GB/s", f"{1e3 * lim['numpy_matvec_s']:.2f} ms"],
        *[[f"read: jnp.dot [{t}, {d}] @ {n} x [{d}, {f}] f32 (jit, one program)", f"{gbps:.1f} GB/s",
            f"{1e3 * lim['layer_matvec_s'][t]:.2f} ms"]
          for (n, d, f) in [lim["layer_matvec_shape"]] for t, gbps in lim["layer_matvec_gb_per_s"].items()],
        [f"compute: jnp.dot {lim['matmul_n']}^2 f32 (jit)", f"{lim['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s",
         f"{2e3 * lim['matmul_n'] ** 3 / lim['matmul_flops_per_s']:.1f} ms"],
    ]


def bandwidths(lim: dict) -> dict:
    """The read bandwidths a step's bytes are set against: the best measured (the verdict's),
    the XLA matvec (the op a decode step's matmuls are), and the better of the two reductions
    (the measure issue 26 names; on some machines a matvec reads faster than a long sum)."""
    best = max(lim["xla_sum_gb_per_s"], lim["numpy_sum_gb_per_s"], lim["xla_matvec_gb_per_s"],
               lim["numpy_matvec_gb_per_s"], *lim.get("layer_matvec_gb_per_s", {}).values())
    reduction = max(lim["xla_sum_gb_per_s"], lim["numpy_sum_gb_per_s"])
    return {"best measured read": best * 1e9, "XLA matvec": lim["xla_matvec_gb_per_s"] * 1e9,
            "best reduction": reduction * 1e9}


def step_bytes(need: dict) -> int:
    """What a decode step reads: the weights as the engine holds them and the live KV."""
    return need["weights_held"]["total"] + need["kv_live_bytes"]


def thunk_read(result: dict) -> tuple[float, float]:
    """(bytes/s, fraction of the best read) at which the profiled thunks alone would read a
    step's bytes (step_bytes): the kernels' rate without the step's overheads."""
    rate = step_bytes(result["requirements"]) / (result["profile"]["thunk_ms_per_step"] / 1e3)
    return rate, rate / bandwidths(result["limits"])["best measured read"]


def roofline_rows(result: dict) -> list[list]:
    need, dec, lim = result["requirements"], result["decode"], result["limits"]
    tok_s = dec["tok_per_s"]
    kv = need["kv_live_bytes"]
    rows = []
    for label, weights in (("weights as the engine holds them", need["weights_held"]["total"]),
                           (f"GGUF stored bytes ({'+'.join(need['gguf']['tensor_bytes_by_type'])})",
                            need["gguf"]["tensor_bytes"])):
        step_bytes = weights + kv
        for bw_name, bw in bandwidths(lim).items():
            limit = bw / step_bytes
            rows.append([label, f"{_mb(weights)} + KV {_mb(kv)}", f"{bw_name} {_gb(bw)} GB/s",
                         f"{limit:.0f}", f"{tok_s:.1f}", f"{100 * tok_s / limit:.0f}%"])
    flops = need["flops"]
    limit = lim["matmul_flops_per_s"] / flops
    rows.append([f"FLOPs ({flops / 1e6:.0f} MFLOP a token)", "", f"matmul {lim['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s",
                 f"{limit:.0f}", f"{tok_s:.1f}", f"{100 * tok_s / limit:.1f}%"])
    return rows


def paired_runs(result: dict) -> list[dict]:
    """Each decode run beside the reads measured just before and after it (ReadProbe: each
    read's better rate of the two), the step's bytes (weights held + live KV) over its median
    step time as a fraction of them: "best read" and "reduction" as in bandwidths."""
    read = step_bytes(result["requirements"])
    out = []
    for run in result["decode"]["runs"]:
        before, after = run["reads_before"], run["reads_after"]
        reads = {k: max(before[k], after[k]) for k in before if k.endswith("_gb_per_s")}
        bw = bandwidths(reads)
        rate = read / run["median_step_s"]
        out.append({"tok_per_s": 1 / run["median_step_s"], "read_bytes_per_s": rate,
                    "best_read": bw["best measured read"], "of_best_read": rate / bw["best measured read"],
                    "reduction": bw["best reduction"], "of_reduction": rate / bw["best reduction"]})
    return out


def paired_rows(paired: list[dict]) -> list[list]:
    rows = [[str(i + 1), f"{p['tok_per_s']:.1f}", _gb(p["read_bytes_per_s"]), _gb(p["best_read"]),
             f"{100 * p['of_best_read']:.0f}%", _gb(p["reduction"]), f"{100 * p['of_reduction']:.0f}%"]
            for i, p in enumerate(paired)]
    rows.append(["median", f"{statistics.median(p['tok_per_s'] for p in paired):.1f}", "", "",
                 f"{100 * statistics.median(p['of_best_read'] for p in paired):.0f}%", "",
                 f"{100 * statistics.median(p['of_reduction'] for p in paired):.0f}%"])
    return rows


def breakdown_rows(result: dict) -> list[list]:
    parts, need, lim = result["breakdown"]["median_s"], result["requirements"], result["limits"]
    total = result["breakdown"]["sum_of_parts_s"]
    bw = bandwidths(lim)["XLA matvec"]
    kv_layer = need["kv_bytes_per_token"] * need["context"] // result["decode"]["num_layers"]
    k = result["decode"]["layers_per_program"]
    rows = []
    for name, s in parts.items():
        must = None
        if name.startswith("layers"):
            must = need["per_layer_program_bytes"] + k * kv_layer
        elif name.startswith("head"):
            must = need["weights_held"]["head_and_embed_read"]
        row = [name, f"{1e3 * s:.2f}", f"{100 * s / total:.1f}%"]
        if must:
            row += [_mb(must), f"{must / s / 1e9:.1f}", f"{1e3 * must / bw:.2f}", f"{100 * must / bw / s:.0f}%"]
        else:
            row += ["", "", "", ""]
        rows.append(row)
    plain = result["decode"]["median_step_s"]
    rows.append(["sum of the parts (synchronised)", f"{1e3 * total:.2f}", "100%", _mb(step_bytes(need)),
                 f"{step_bytes(need) / total / 1e9:.1f}", "", ""])
    rows.append(["plain engine.step() (the decode runs' median)", f"{1e3 * plain:.2f}", "", "", "", "", ""])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small arrays, 32 tokens, 1 run (a smoke run)")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens (the decode context)")
    parser.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per run (default 128; quick 32)")
    parser.add_argument("--runs", type=int, default=None, help="timed decode runs (default 7; quick 1)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per machine limit (default 7; quick 3)")
    parser.add_argument("--probe-reps", type=int, default=3, help="timed calls of each read before and after each "
                        "decode run")
    parser.add_argument("--bandwidth-mib", type=int, default=None, help="array size of the read bandwidth "
                        "(default 512; quick 64)")
    parser.add_argument("--profile-steps", type=int, default=None, help="decode steps under jax's profiler "
                        "(default 8; quick 2; 0: none)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--activation-dtype", default="float32", choices=("float32", "int8"),
                        help="the packed matmuls' activations (LLM(activation_dtype=...))")
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps an engine step runs "
                        "(LLM(num_scheduler_steps=...)); the decode runs' figures are per token")
    parser.add_argument("--out", default=None, help="default: results/bench_roofline[_quick].json")
    args = parser.parse_args(argv)
    q = args.quick
    args.new_tokens = args.new_tokens or (32 if q else 128)
    args.runs = args.runs or (1 if q else 7)
    args.reps = args.reps or (3 if q else 7)
    args.bandwidth_mib = args.bandwidth_mib or (64 if q else 512)
    args.profile_steps = (2 if q else 8) if args.profile_steps is None else args.profile_steps
    args.breakdown_tokens = 16 if q else 64
    args.out = args.out or f"results/bench_roofline{'_quick' if q else ''}.json"

    result = measure(args)
    result.update(machine=machine_info(), command=command_line(), args=vars(args))
    dec = result["decode"]
    print_table("this machine's limits (medians)", ["what", "rate", "per call"], limit_rows(result["limits"]))
    print_table(f"single-stream decode, {MODEL}, context {args.context}: {dec['tok_per_s']:.1f} tok/s "
                f"({1e3 * dec['median_step_s']:.1f} ms a token, median of {args.runs} runs of {args.new_tokens} tokens)",
                ["bytes a step reads", "MB", "limit", "limit tok/s", "measured tok/s", "of limit"],
                roofline_rows(result))
    paired = result["paired_runs"] = paired_runs(result)
    print_table("each decode run beside the reads measured just before and after it (the better of the two; "
                "the VM's bandwidth moves between minutes)",
                ["run", "tok/s", "step's bytes, GB/s", "best read GB/s", "of best read", "best reduction GB/s",
                 "of reduction"], paired_rows(paired))
    print_table(f"where a decode step's time goes ({result['breakdown']['steps']} steps, medians, "
                "block_until_ready after each program)",
                ["part", "ms per step", "share", "MB it must read", "GB/s achieved", "ms at XLA matvec BW", "of limit"],
                breakdown_rows(result))
    if result["profile"]:
        p = result["profile"]
        rate, of_best = thunk_read(result)
        title = (f"device thunks under jax's profiler ({p['steps']} decode steps, bucket {tuple(p['bucket'])}; "
                 f"thunks {p['thunk_ms_per_step']:.2f} ms a step: the step's bytes at {rate / 1e9:.1f} GB/s, "
                 f"{100 * of_best:.0f}% of the best read; the traced step {p['traced_ms_per_step']:.1f} ms)")
        print_table(title, ["kind", "ms per step", "share of thunk time"],
                    [[k, f"{ms:.2f}", f"{100 * ms / p['thunk_ms_per_step']:.0f}%"]
                     for k, ms in sorted(p["by_kind_ms_per_step"].items(), key=lambda kv: -kv[1])])
        print_table("busiest thunks", ["program", "thunk", "ms per step", "calls", "shape", "from"],
                    [[t["program"], t["thunk"], f"{t['ms_per_step']:.2f}", t["calls_per_step"], t["shape"][:40],
                      t["op_name"].replace("jit(layer_fn)/", "").replace("jit(head_fn)/", "")[-60:]]
                     for t in p["top"][:15]])
    lv = result["levers_s"]
    serial, overlapped = (1e3 * (lv[name] - lv["programs"]) for name in ("build, then programs", "build overlapped"))
    print_table(f"two levers on one decode step's inputs (medians): the input building adds {serial:.3f} ms to the "
                f"programs run after it, {overlapped:.3f} ms run beside them on a second thread",
                ["how the step runs", "ms", "vs the programs"],
                [[name, f"{1e3 * s:.3f}", f"{s / lv['programs']:.3f}"] for name, s in lv.items()])
    wi = result["decode_bucket_execute_s"]
    print_table("one synthetic decode, runner.execute alone (median), by the token bucket it is padded to",
                ["bucket (tokens x seqs)", "ms", "tok/s"], [[b, f"{1e3 * s:.1f}", f"{1 / s:.1f}"] for b, s in wi.items()])
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
