"""A server that never sits broken: `python -m paged_jax serve` when things go wrong.

- The engine process dies (SIGKILL, as the out-of-memory killer sends it): every open request
  fails with the reason (a stream ends with an SSE error event, a plain request gets a 500),
  then serve exits non-zero; with --restart-engine it starts a new engine process instead,
  answers 503 while that warms up, and serves again.
- A bad or busy --port exits 2 before any warm-up, with a message naming --port.
- With stdout not a terminal (a log), the warm-up prints plain progress lines.
- chat: the penalty flags reach SamplingParams; Ctrl-C stops a streaming reply and leaves the
  conversation usable, and at the prompt it leaves with status 0.

Each serve runs in a subprocess on 127.0.0.1 (--port 0: a free port, read off its banner)
with the tiny model, and is killed in a finally; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

SERVE = [sys.executable, "-m", "paged_jax", "serve", "--model", "tiny", "--host", "127.0.0.1", "--port", "0",
         "--max-model-len", "2048", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--reserved-cpus", "0"]
START_TIMEOUT = 300.0
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Serve:
    """A `serve` subprocess; stdout and stderr collected line by line as they come."""

    def __init__(self, *extra: str):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "100"}
        self.process = subprocess.Popen([*SERVE, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=env)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._collect, args=(pipe, lines), daemon=True)
                         for pipe, lines in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr))]
        for reader in self._readers:
            reader.start()
        self.url = None

    @staticmethod
    def _collect(pipe, lines: list[str]) -> None:
        for line in pipe:
            lines.append(line)

    def output(self) -> str:
        return "".join(self.stdout) + "\n--- stderr ---\n" + "".join(self.stderr)

    def wait_serving(self) -> str:
        """The base URL once the banner is out and /health answers 200."""
        deadline = time.time() + START_TIMEOUT
        while self.url is None:
            banner = [m for line in self.stdout if (m := re.search(r"serving tiny at (http://[\d.:]+)/v1", line))]
            if banner:
                self.url = banner[0].group(1)
                break
            assert self.process.poll() is None and time.time() < deadline, f"serve did not start:\n{self.output()}"
            time.sleep(0.2)
        wait_for(lambda: http_status(f"{self.url}/health") == 200, deadline - time.time(), self.output)
        return self.url

    def wait_exit(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve did not exit within {timeout} s:\n{self.output()}") from None
        for reader in self._readers:
            reader.join(10)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


@contextlib.contextmanager
def serving(*extra: str):
    server = Serve(*extra)
    try:
        yield server
    finally:
        server.kill()


def wait_for(condition, timeout: float, output=lambda: "") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out after {timeout:.0f} s:\n{output()}"
        time.sleep(0.2)


def http(url, payload: dict | None = None, timeout: float = 60) -> tuple[int, str]:
    """(status, body) of a GET (no payload) or a JSON POST, 4xx/5xx included."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def http_status(url) -> int | None:
    """The status of a GET, or None while nothing answers."""
    try:
        return http(url, timeout=10)[0]
    except OSError:
        return None


def open_stream(url: str, prompt: str):
    """A long streaming completion (2000 tokens, EOS ignored), once its first event is in.
    Returns (response, the events so far)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=60)
    events = []
    while not events:
        line = response.readline().decode()
        assert line, "the stream ended before its first event"
        if line.startswith("data: "):
            events.append(line[len("data: "):].strip())
    return response, events


def read_to_end(response, events: list[str]) -> list[str]:
    """The stream's events up to its end (the server closes it; the read timeout bounds it)."""
    for raw in response:
        line = raw.decode()
        if line.startswith("data: "):
            events.append(line[len("data: "):].strip())
    return events


def metrics(url: str) -> dict[str, float]:
    """The samples of /metrics, by name without labels (the first series of each name)."""
    samples = {}
    for line in http(f"{url}/metrics")[1].splitlines():
        if line and not line.startswith("#"):
            samples.setdefault(re.split(r"[{ ]", line, maxsplit=1)[0], float(line.rsplit(" ", 1)[1]))
    return samples


def engine_pid(pid: int) -> int:
    """The engine process `pid` spawned with multiprocessing (Linux /proc; its resource tracker aside)."""
    spawned = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                    if b"spawn_main" in cmdline.read():
                        spawned.append(child)
    (child,) = spawned
    return child


def assert_error_event(events: list[str], pid: int) -> dict:
    """The stream's last event is the server's error naming the dead engine process."""
    assert events and events[-1] != "[DONE]", f"the stream did not end with an error: {events[-3:]}"
    error = json.loads(events[-1])["error"]
    assert error["type"] == "server_error" and error["code"] == 500
    assert f"the engine process (pid {pid}) was killed by SIGKILL" in error["message"]
    return error


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="finds the engine process through Linux /proc")
def test_engine_death_fails_every_open_request_and_serve_exits_1():
    with serving() as server:
        url = server.wait_serving()
        pid = engine_pid(server.process.pid)
        stream, events = open_stream(url, "a long one")
        plain: list = []
        body = {"model": "tiny", "prompt": "another", "max_tokens": 2000, "ignore_eos": True}
        waiter = threading.Thread(target=lambda: plain.append(http(f"{url}/v1/completions", body)), daemon=True)
        waiter.start()
        wait_for(lambda: metrics(url)["vllm:num_requests_running"] == 2, 60, server.output)

        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        assert_error_event(read_to_end(stream, events), pid)
        waiter.join(30)
        status, text = plain[0]
        assert status == 500 and json.loads(text)["error"]["type"] == "server_error", text
        code = server.wait_exit(15)
        assert code == 1 and time.time() - killed < 15
        message = [line for line in server.stderr if line.startswith("paged-jax: error:")]
        assert len(message) == 1 and f"the engine process (pid {pid}) was killed by SIGKILL" in message[0], \
            server.output()
        assert "--restart-engine" in message[0] and "Traceback" not in server.output()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="finds the engine process through Linux /proc")
def test_restart_engine_serves_again_after_the_engine_process_dies():
    """--restart-engine: the open stream fails, /health is 503 while a new engine process warms
    up (from the compile cache the first one filled), then a completion succeeds and /metrics
    counts the restart. The log (stdout, not a terminal) shows both warm-ups as plain lines."""
    with serving("--restart-engine") as server:
        url = server.wait_serving()
        pid = engine_pid(server.process.pid)
        assert metrics(url)["paged_jax:engine_restarts_total"] == 0
        stream, events = open_stream(url, "a long one")
        os.kill(pid, signal.SIGKILL)
        assert_error_event(read_to_end(stream, events), pid)
        assert http_status(f"{url}/health") == 503  # a fresh process is still importing jax
        status, text = http(f"{url}/v1/completions", {"model": "tiny", "prompt": "now", "max_tokens": 2})
        assert status == 503, text

        wait_for(lambda: http_status(f"{url}/health") == 200, START_TIMEOUT, server.output)
        assert engine_pid(server.process.pid) != pid
        status, text = http(f"{url}/v1/completions", {"model": "tiny", "prompt": "again", "max_tokens": 4,
                                                      "ignore_eos": True})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 4, text
        assert metrics(url)["paged_jax:engine_restarts_total"] == 1
        assert server.process.poll() is None
        assert any(f"pid {pid}) was killed by SIGKILL" in line and "starting a new engine process" in line
                   for line in server.stderr), server.output()
        # non-tty progress: the loading line, then "compiling buckets N/N (S s)", once per warm-up
        assert server.stdout[0].startswith("paged-jax: loading tiny"), server.output()
        finished = [line for line in server.stdout if re.fullmatch(r"paged-jax: compiling buckets (\d+)/\1 \(\d+ s\)\n",
                                                                    line)]
        assert len(finished) == 2, server.output()


def test_bad_port_exits_2_naming_the_flag():
    result = subprocess.run([*SERVE[:SERVE.index("--port")], "--port", "99999"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "argument --port: '99999' is not a port: give 1 to 65535" in result.stderr
    assert "Traceback" not in result.stderr


def test_port_in_use_exits_2_before_the_warm_up():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [*SERVE[:SERVE.index("--port")], "--port", str(port), *SERVE[SERVE.index("--port") + 2:]]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"paged-jax: error: --port {port}: 127.0.0.1:{port} is already in use" in result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr  # no warm-up began, no banner


# chat


def test_penalty_flags_reach_sampling_params_and_bad_values_exit_2():
    from paged_jax import cli

    for command in (["chat"], ["generate", "--prompt", "x"]):
        args = cli._parser().parse_args([*command, "--repetition-penalty", "1.3", "--presence-penalty", "0.5",
                                         "--frequency-penalty", "-0.25", "--temperature", "0.7", "--top-p", "0.9",
                                         "--top-k", "5", "--seed", "3", "--max-tokens", "9"])
        params = cli._sampling_params(args)
        assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.3, 0.5, -0.25)
        assert (params.temperature, params.top_p, params.top_k, params.seed, params.max_tokens) == (0.7, 0.9, 5, 3, 9)
    for flag, value, message in (("--repetition-penalty", "0", "repetition_penalty=0.0 must be a number > 0"),
                                 ("--presence-penalty", "3", "presence_penalty=3.0 must be a number in [-2, 2]")):
        result = subprocess.run([sys.executable, "-m", "paged_jax", "chat", flag, value], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr and "usage: paged-jax chat" in result.stderr
        assert "Traceback" not in result.stderr


def test_chat_ctrl_c_stops_the_reply_and_keeps_the_conversation(monkeypatch, tmp_path: Path):
    """Ctrl-C (SIGINT) while a reply streams aborts that request between steps; its text so far
    stays in the conversation, the next turn streams in full, and Ctrl-C at the prompt leaves
    with status 0."""
    from rich.console import Console

    from paged_jax import chat_repl, cli

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML, encoding="utf-8")
    args = cli._parser().parse_args(["chat", "--chat-template", str(template), "--max-tokens", "40", "--ignore-eos",
                                     "--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens",
                                     "64"])
    turns = iter(["hello", "and again"])
    seen = []  # (messages, request ids) per chat_prompt

    def read_turn(prompt):
        line = next(turns, None)
        if line is None:
            raise KeyboardInterrupt  # Ctrl-C at the prompt
        return line

    make_llm = cli._make_llm

    def make_llm_and_press_ctrl_c(args, progress):
        llm = make_llm(args, progress)
        engine, step, chat_prompt = llm.engine, llm.engine.step, llm.engine.chat_prompt
        steps = []

        def step_then_press():
            outputs = step()
            steps.append(len(outputs))
            if len(seen) == 1 and len(steps) == 3:  # the first reply, a few tokens in
                signal.raise_signal(signal.SIGINT)
            return outputs

        def record(messages, **kwargs):
            seen.append([dict(m) for m in messages])
            return chat_prompt(messages, **kwargs)

        monkeypatch.setattr(engine, "step", step_then_press)
        monkeypatch.setattr(engine, "chat_prompt", record)
        built.append(llm)
        return llm

    built = []
    monkeypatch.setattr(chat_repl, "_make_llm", make_llm_and_press_ctrl_c)
    monkeypatch.setattr(chat_repl, "read_turn", read_turn)
    out = io.StringIO()
    previous = signal.getsignal(signal.SIGINT)
    assert chat_repl.chat(args, cli._sampling_params(args), Console(file=out, width=200)) == 0
    assert signal.getsignal(signal.SIGINT) is previous  # restored after each reply
    text = out.getvalue()
    stopped = re.search(r"\[stopped by Ctrl-C after (\d+) tokens", text)
    assert stopped and 1 <= int(stopped.group(1)) < 40, text
    assert "[40 tokens," in text, text  # the second reply ran to --max-tokens
    first, second = seen
    assert [m["role"] for m in second] == ["user", "assistant", "user"] and second[0] == first[0]
    assert second[1]["content"] and second[2]["content"] == "and again"
    assert not built[0].engine.has_unfinished_requests()


# the core swap, in-process (a fake core: no engine, no subprocess)


class FakeCore:
    """A core whose death the test decides: accepts every add, reports nothing else."""

    def __init__(self, name: str):
        self.name, self.stats, self.alive, self.commands = name, {"num_running_reqs": 0}, False, []

    def start(self, report, on_exit) -> None:
        self.report, self.on_exit, self.alive = report, on_exit, True

    def submit(self, command) -> None:
        self.commands.append(command)
        if command[0] == "add":
            from paged_jax.server.engine_loop import Report

            self.report(Report((command[1],), (), (), self.stats))

    def is_alive(self) -> bool:
        return self.alive

    def describe_exit(self) -> str:
        return f"{self.name} died"

    def die(self) -> None:
        self.alive = False
        self.on_exit()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.alive:
            self.die()


def test_a_dead_core_fails_its_requests_and_a_replaced_core_serves():
    import asyncio

    from paged_jax.core.request import SamplingParams
    from paged_jax.server.engine_loop import AsyncEngine, QueueFullError

    exits = []
    first, second = FakeCore("first"), FakeCore("second")
    engine = AsyncEngine(first, on_core_exit=lambda core, message: exits.append((core.name, message)))
    engine.start()

    async def scenario():
        deltas = await engine.add_request("a", [1, 2], SamplingParams(max_tokens=4))
        first.die()
        (delta,) = [d async for d in deltas]  # the one final delta: the error
        assert delta.error == "first died" and delta.final
        assert exits == [("first", "first died")] and not engine.is_alive()
        with pytest.raises(QueueFullError, match="the engine is not running"):
            await engine.add_request("b", [1], SamplingParams(max_tokens=4))
        assert engine.replace_core(second) and engine.core is second and engine.is_alive()
        await engine.add_request("c", [3], SamplingParams(max_tokens=4))
        assert [c[1] for c in second.commands] == ["c"] and engine.num_unfinished == 1
        engine.shutdown()  # a shutdown is no death: no on_core_exit, the open request fails
        assert exits == [("first", "first died")] and engine.num_unfinished == 0
        assert not engine.replace_core(FakeCore("third"))  # shutting down: refused

    asyncio.run(scenario())
