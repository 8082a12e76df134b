"""`python -m paged_jax generate` end to end, in a subprocess, with the embedded "tiny" model.

The JSON run's token ids are checked against the dense greedy reference (the CLI's tiny
model has the same seeded weights as the tests' LLM("tiny")). Bad flag values exit with
status 2, a message naming the fix and no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_reference import big_llm, dense_greedy

ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "256"]
PROMPTS = ["Hello world", "The paged cache keeps blocks"]


def _cli(*args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "paged_jax", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_prints_completions_and_the_table(tmp_path: Path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"\n{PROMPTS[1]}\n\n", encoding="utf-8")  # blank lines are skipped
    cache_dir = tmp_path / "xla-cache"
    result = _cli("generate", "--prompt", PROMPTS[0], "--prompts-file", str(prompts_file), "--max-tokens", "8",
                  "--ignore-eos", "--compile-cache-dir", str(cache_dir), *ENGINE_FLAGS)
    assert result.returncode == 0, result.stderr
    assert any(cache_dir.iterdir()), "the persistent compilation cache stayed empty: a rerun would compile again"
    assert "Traceback" not in result.stderr
    out = result.stdout
    for prompt in PROMPTS:
        assert f"{prompt!r} -> " in out and "(8 tokens, length)" in out
    assert "paged-jax generate (tiny, xla attention, cpu)" in out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    assert {"requests", "generated tok/s", "TTFT p50 (ms)", "peak KV usage", "prefix hit rate", "preemptions",
            "compilations"} <= set(rows), out
    assert rows["requests"] == "2" and rows["preemptions"] == "0"
    # background warm-up (the default): the first bucket before generating, at most all 7
    # ((1, 1), (2, 2), (4, 4), (8, 8), (16, 8), (32, 8), (64, 8) for 8 sequences and 64 tokens)
    assert 1 <= int(rows["compilations"]) <= 7
    assert float(rows["generated tok/s"]) > 0 and rows["peak KV usage"].endswith("%")
    assert max(map(len, out.splitlines())) <= 80  # readable in an 80-column terminal


def test_generate_json_matches_the_dense_reference():
    result = _cli("generate", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-tokens", "8", "--ignore-eos",
                  "--json", "--warm-up", "full", *ENGINE_FLAGS)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]  # every stdout line is JSON
    completions, summary = records[:-1], records[-1]["summary"]
    assert [c["prompt"] for c in completions] == PROMPTS
    tokenizer = big_llm().tokenizer
    ref, _ = dense_greedy([tokenizer.encode(p) for p in PROMPTS], [8, 8])
    assert [c["token_ids"] for c in completions] == ref
    assert [c["text"] for c in completions] == [tokenizer.decode(r) for r in ref]
    assert all(c["finish_reason"] == "length" and c["ttft_s"] > 0 for c in completions)
    assert summary["requests"] == 2 and summary["generated_tokens"] == 16
    assert summary["compilations"] == 7 and summary["preemptions"] == 0  # every bucket (warm-up full)


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "0"], "max_tokens=0 must be an int >= 1"),
    (["--temperature", "-1"], "temperature=-1.0 must be >= 0"),
    (["--top-p", "1.5"], "top_p=1.5 must be in (0, 1]"),
    (["--top-k", "-2"], "top_k=-2 must be an int >= 1, or -1 / 0 to disable"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file /nonexistent/prompts.txt: No such file"),
])
def test_bad_flag_values_exit_2_before_loading_anything(args, message):
    if "--prompts-file" not in args:
        args = ["--prompt", "hi", *args]
    result = _cli("generate", *args, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and "usage: paged-jax generate" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_no_prompts_and_unknown_flags_exit_2():
    result = _cli("generate", timeout=60)
    assert result.returncode == 2 and "no prompts: pass --prompt TEXT" in result.stderr
    result = _cli("generate", "--prompt", "hi", "--max-tokens", "many", timeout=60)
    assert result.returncode == 2 and "--max-tokens: invalid int value: 'many'" in result.stderr


def test_bad_engine_value_exits_2_with_the_fix():
    result = _cli("generate", "--prompt", "hi", "--block-size", "24", timeout=120)
    assert result.returncode == 2
    assert "block_size=24 must be a power of two" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("paged-jax")
    if not script.exists():
        pytest.skip(f"no {script}: the package is not installed with its scripts in this environment")
    result = subprocess.run([str(script), "generate", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--prompts-file" in result.stdout


def test_offload_flags_reach_the_engine_config():
    result = _cli("generate", "--prompt", "hi", "--preemption-mode", "swap", timeout=120)
    assert result.returncode == 2 and "need a host tier: set offload_host_bytes" in result.stderr
    result = _cli("generate", "--prompt", "hi", "--offload-host-mib", "1", "--offload-disk-dir", "/tmp/x", timeout=120)
    assert result.returncode == 2 and "offload_disk_dir needs a fixed hash_seed" in result.stderr


def test_serve_names_the_engine_cores_in_runs():
    from paged_jax.cli import _cpu_list

    assert _cpu_list((0, 1, 2, 5)) == "cores 0-2,5"
    assert _cpu_list((3,)) == "core 3"
    assert _cpu_list((0, 2, 4)) == "cores 0,2,4"
    assert _cpu_list(()) == "every core"  # no per-process affinity on this OS


def test_generate_runs_as_many_sequences_as_it_has_prompts(monkeypatch):
    """No step of a generate run holds more sequences than it has prompts, so --max-num-seqs
    defaults to their number (at most 64): fewer buckets, and on the CPU a pool for that many."""
    from paged_jax import cli

    class Built(Exception):
        pass

    def make_llm(args, progress):
        raise Built(args.max_num_seqs)

    monkeypatch.setattr(cli, "_make_llm", make_llm)
    for argv, expected in ((["--prompt", "a", "--prompt", "b"], 2), (["--prompt", "a", "--max-num-seqs", "8"], 8),
                           ([arg for i in range(70) for arg in ("--prompt", f"p{i}")], 64)):
        with pytest.raises(Built) as built:
            cli.main(["generate", *argv])
        assert built.value.args == (expected,)


def test_calibrate_kv_writes_what_the_api_computes_and_generate_reads_it(tmp_path: Path):
    """`calibrate-kv` cuts --text into passages and saves calibrate_key_offsets and (per_tensor)
    calibrate_kv_scales of them; generate takes the file with --kv-calibration, and refuses one
    whose scales are of another format, or no calibration at all."""
    import numpy as np

    from paged_jax.kv_calibration import calibrate_key_offsets, calibrate_kv_scales

    text = tmp_path / "text.txt"
    text.write_text("The paged cache keeps its blocks in a pool; prefix hits share them. " * 20, encoding="utf-8")
    out = tmp_path / "cal.npz"
    result = _cli("calibrate-kv", "--text", str(text), "--num-passages", "3", "--passage-tokens", "32",
                  "--kv-cache-dtype", "int8", "--kv-cache-scaling", "per_tensor", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "key offsets of 2 layers" in result.stdout and "--kv-calibration" in result.stdout
    llm = big_llm()
    ids = llm.tokenizer.encode(text.read_text(encoding="utf-8"))
    passages = [ids[i : i + 32] for i in range(0, 96, 32)]
    offsets = calibrate_key_offsets(llm.engine.model, passages)
    with np.load(out) as saved:
        np.testing.assert_allclose(saved["key_offsets"], offsets, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(saved["kv_scales"], calibrate_kv_scales(llm.engine.model, passages, "int8",
                                                                           key_offsets=offsets), rtol=1e-5)
        assert str(saved["kv_cache_dtype"]) == "int8"

    result = _cli("generate", "--prompt", "hi", "--max-tokens", "4", "--kv-cache-dtype", "int8", "--kv-cache-scaling",
                  "per_tensor", "--kv-calibration", str(out), "--json", *ENGINE_FLAGS)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout.splitlines()[0])["token_ids"]) == 4
    result = _cli("generate", "--prompt", "hi", "--kv-cache-dtype", "fp8", "--kv-cache-scaling", "per_tensor",
                  "--kv-calibration", str(out), timeout=120)
    assert result.returncode == 2 and "holds no per-tensor scales for fp8_e4m3 (it has int8)" in result.stderr
    result = _cli("generate", "--prompt", "hi", "--kv-calibration", str(text), "--kv-cache-dtype", "fp8", timeout=120)
    assert result.returncode == 2 and "not a readable .npz" in result.stderr
    assert "Traceback" not in result.stderr


def _sample_value(field, kind):
    """A value other than the field's default, as a flag would give it."""
    choices = field.metadata["choices"]
    if choices:
        return next(c for c in reversed(choices) if c != field.default)
    return {int: 7 if field.default != 7 else 8, float: 0.5, str: "a-dir"}[kind]


def test_every_engine_config_field_is_reachable_from_the_cli(tmp_path: Path):
    """Each EngineConfig field has a generated flag that sets it, or names (via=...) the flag
    that does and why it differs; both kinds are exercised here, through the real parser."""
    import argparse
    import dataclasses
    import typing

    import numpy as np

    from paged_jax import cli
    from paged_jax.core.kv_quant import save_kv_calibration
    from paged_jax.engine_args import _arg_type, _flag, _user_fields, add_engine_args, engine_config_kwargs
    from paged_jax.engine_config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    for command in ("generate", "chat", "serve"):
        parser = cli._parser()
        base = ["generate", "--prompt", "x"] if command == "generate" else [command]
        defaults = engine_config_kwargs(parser.parse_args(base))
        for field in _user_fields():
            if field.metadata["via"] is not None:
                continue
            kind = _arg_type(hints[field.name])
            if kind is bool:
                argv, expected = [_flag(field)], not field.default
            else:
                expected = _sample_value(field, kind)
                argv = [_flag(field), str(expected)]
            kwargs = engine_config_kwargs(parser.parse_args(base + argv))
            assert kwargs[field.name] == expected, f"{command} {' '.join(argv)} did not set {field.name}"
            assert {k: v for k, v in kwargs.items() if k != field.name} == \
                {k: v for k, v in defaults.items() if k != field.name}, f"{' '.join(argv)} set other fields"

    # The explicit exceptions: each names its flag, and the flag sets the field.
    assert [f.name for f in dataclasses.fields(EngineConfig) if not f.init] == [
        "offload_config", "kv_transfer_config", "spec_config"]  # resolved
    exceptions = {f.name: f.metadata["via"] for f in _user_fields() if f.metadata["via"]}
    assert sorted(exceptions) == ["kv_key_offsets", "kv_scales", "offload_host_bytes"]
    flags = argparse.ArgumentParser()
    add_engine_args(flags)
    for name, via in exceptions.items():
        assert f"{via.split()[0]} " in flags.format_help(), f"{name}: its flag {via.split()[0]} is missing"
    parser = cli._parser()
    args = parser.parse_args(["serve", "--offload-host-mib", "3"])
    assert engine_config_kwargs(args)["offload_host_bytes"] == 3 << 20
    offsets, scales = np.full((2, 2, 8), 0.25, np.float32), np.full((2, 2), 0.5, np.float32)
    save_kv_calibration(str(tmp_path / "cal.npz"), offsets, scales, "int8")
    args = parser.parse_args(["serve", "--kv-cache-dtype", "int8", "--kv-cache-scaling", "per_tensor",
                              "--kv-calibration", str(tmp_path / "cal.npz")])
    config = EngineConfig(**engine_config_kwargs(args))
    np.testing.assert_array_equal(np.asarray(config.kv_key_offsets), offsets)
    np.testing.assert_array_equal(np.asarray(config.kv_scales), scales)
    # --no-compile-cache turns the cache off; the subcommands' own defaults hold.
    assert engine_config_kwargs(parser.parse_args(["serve", "--no-compile-cache"]))["compile_cache_dir"] is None
    assert engine_config_kwargs(parser.parse_args(["serve"]))["warm_up"] == "full"
    assert engine_config_kwargs(parser.parse_args(["chat"]))["max_num_seqs"] == 4
    assert EngineConfig(**engine_config_kwargs(parser.parse_args(["chat"]))) == EngineConfig(max_num_seqs=4)


def test_progress_prints_plain_lines_when_stdout_is_not_a_terminal(capsys, monkeypatch):
    """rich draws nothing off a terminal: a log gets plain lines instead, one per tenth of the
    buckets (or every LOG_SECONDS), and the last; a restarted warm-up is timed afresh. --json
    keeps stdout for its records."""
    import io

    from rich.console import Console
    from rich.progress import Progress

    from paged_jax import cli

    log = Console(file=io.StringIO(), force_terminal=False)
    assert isinstance(cli._progress(log, show=False), Progress)  # generate --json: nothing printed
    assert isinstance(cli._progress(Console(file=io.StringIO(), force_terminal=True)), Progress)
    clock = iter(range(1000))
    monkeypatch.setattr(cli.time, "perf_counter", lambda: float(next(clock)) / 10)  # 0.1 s per call
    with cli._progress(log) as progress:
        compiled = cli._compile_progress(cli._parser().parse_args(["serve"]), progress)
        for done in range(1, 41):
            compiled(done, 40)
        compiled(1, 40)  # a new engine process warming up
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "paged-jax: loading tiny, compiling the first bucket"
    assert [line.split()[3] for line in lines[1:]] == [f"{n}/40" for n in range(4, 41, 4)] + ["1/40"]
    assert lines[-2] == "paged-jax: compiling buckets 40/40 (4 s)" and lines[-1].endswith("(0 s)")


def test_serve_port_is_checked_by_the_parser(capsys):
    from paged_jax import cli

    assert cli._parser().parse_args(["serve", "--port", "0"]).port == 0  # any free port, named in the banner
    for bad in ("65536", "-1", "http"):
        with pytest.raises(SystemExit) as exited:
            cli._parser().parse_args(["serve", "--port", bad])
        assert exited.value.code == 2
        assert f"argument --port: {bad!r} is not a port: give 1 to 65535" in capsys.readouterr().err
