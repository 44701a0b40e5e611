"""Behaviour that needs a `peregrine serve` of its own, started with particular flags: SSE
keep-alive comments during a silent stretch, and /health answering 503 while the model loads.

scripts/test-openai-client.sh sets PEREGRINE_BIN and PEREGRINE_MODEL_PATH.
"""
import json
import os
import queue
import re
import subprocess
import threading
import time

import pytest

try:  # the `openai` client brings httpx (as `httpx2` in the 3.x line)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx


class Server:
    """A `peregrine serve` on a free loopback port; it exits when its stdin closes."""

    def __init__(self, *flags, model=None, alias="smollm2"):
        model = model or os.environ["PEREGRINE_MODEL_PATH"]
        cmd = [os.environ["PEREGRINE_BIN"], "serve", "--model", model]
        cmd += ["--port", "0", "--alias", alias, "--exit-on-stdin-eof", *flags]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = "http://" + self.wait_for_line(r"listening on http://(\S+)").group(1)

    def _pump(self):
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for_line(self, pattern, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                assert self.proc.poll() is None, "the server exited"
                continue
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r} in {timeout} s")

    def wait_ready(self, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                return
            time.sleep(0.05)
        raise AssertionError("the model did not load")

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server_with(request):
    servers = []

    def start(*flags):
        servers.append(Server(*flags))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_stream_sends_keepalive_comments_while_silent(server_with):
    """With one slot taken by a long answer, a second streamed request waits in the queue after
    its first chunk (the role): that silence is filled with `: keep-alive` comments."""
    server = server_with("--parallel", "1", "--keepalive-secs", "0.05")
    server.wait_ready()
    # Long enough to still hold the slot when the second request arrives, however fast decode is.
    long = {"model": "smollm2", "prompt": "Once upon a time", "temperature": 0, "max_tokens": 400,
            "ignore_eos": True}
    blocker = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", json=long, timeout=600))
    blocker.start()
    time.sleep(0.2)  # let the blocker take the slot
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
            "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        text = r.read().decode()
    blocker.join()
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], text
    comments = [i for i, e in enumerate(events) if e.startswith(":")]
    assert comments, f"no keep-alive comment in {text!r}"
    assert all(events[i] == ": keep-alive" for i in comments)
    data = [i for i, e in enumerate(events[:-2]) if not e.startswith(":")]
    assert all(events[i].startswith("data: ") for i in data)
    assert json.loads(events[data[0]][6:])["choices"][0]["delta"]["role"] == "assistant"
    # The comments came in the silence between the role chunk and the first text.
    assert data[0] < comments[0] < data[-1]


def test_keepalive_must_be_positive():
    cmd = [os.environ["PEREGRINE_BIN"], "serve", "--model", "unused", "--keepalive-secs", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "keepalive-secs" in r.stderr


def test_health_is_503_while_loading(server_with):
    server = server_with("--test-load-delay-ms", "1500")
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == "the model is loading"
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=10).status_code == 503
    server.wait_for_line(r"model `smollm2` ready")
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=600).status_code == 200
