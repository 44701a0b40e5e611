"""scripts/loadtest.py at a small scale against a `peregrine serve` of its own: a 2 s header
timeout and a 1 MiB body limit, so slow-loris connections and oversized bodies are answered
quickly; a small queue, so some requests get 503. The script fails on a hung request, a dropped
connection, an unexpected answer, a slow-loris connection left open, a panic in the server's log
or RSS growth after warm-up.

scripts/test-openai-client.sh sets PEREGRINE_BIN and PEREGRINE_MODEL_PATH.
"""
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "loadtest.py"
DURATION, DEADLINE = 20, 60
SERVER_FLAGS = ["--parallel", "2", "--queue-size", "8", "--header-timeout", "2",
                "--max-body-mb", "1"]


def start_server(log, *flags):
    """A `peregrine serve` on a free loopback port, its stderr to log; it exits when its stdin
    closes (as in test_server_process.py)."""
    cmd = [os.environ["PEREGRINE_BIN"], "serve", "--model", os.environ["PEREGRINE_MODEL_PATH"]]
    cmd += ["--port", "0", "--alias", "smollm2", "--exit-on-stdin-eof", *flags]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log)


def stop_server(proc):
    proc.stdin.close()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until(what, check, proc, log_path, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        assert proc.poll() is None, f"the server exited:\n{log_path.read_text(errors='replace')}"
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout} s:\n{log_path.read_text(errors='replace')}")


def healthy(addr):
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=10) as r:
            return r.status == 200
    except OSError:  # refused, or 503 while the model loads
        return False


def test_loadtest_small_scale(tmp_path):
    log_path, summary_path = tmp_path / "server.log", tmp_path / "summary.json"
    with open(log_path, "w") as log:
        server = start_server(log, *SERVER_FLAGS)
    try:
        def listening():
            return re.search(r"listening on http://(\S+)", log_path.read_text(errors="replace"))

        addr = wait_until("no `listening on`", listening, server, log_path).group(1)
        wait_until("no /health 200", lambda: healthy(addr), server, log_path)
        cmd = [sys.executable, str(SCRIPT), "--url", f"http://{addr}", "--model", "smollm2",
               "--clients", "6", "--duration", str(DURATION), "--slowloris", "12",
               "--header-timeout", "2", "--max-body-bytes", str(1 << 20),
               "--request-deadline", str(DEADLINE), "--pid", str(server.pid),
               "--server-log", str(log_path), "--max-tokens", "16", "--json-out", str(summary_path)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=DURATION + DEADLINE + 60)
        try:
            summary = json.loads(r.stdout)
            rss = {**(summary["rss_mb"] or {}), "samples": "..."}
            shown = json.dumps({**summary, "rss_mb": rss}, indent=1)
        except (ValueError, TypeError, KeyError):
            summary, shown = None, r.stdout
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        report = f"summary:\n{shown}\nstderr:\n{r.stderr}\nserver log (tail):\n{tail}"
        assert r.returncode == 0, report
        assert summary["pass"] and summary["requests"] > 0, report
        assert summary["slowloris"]["closed_by_server"] > 0, report
        assert server.poll() is None, report
    finally:
        stop_server(server)
