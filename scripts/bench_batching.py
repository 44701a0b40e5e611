#!/usr/bin/env python3
"""Continuous batching, Peregrine against llama.cpp's server, on one GGUF file in one run.

Usage: scripts/bench_batching.py --model FILE [--llama-server PATH] [--streams 1,2,4,8,16]
           [--prompt-tokens 64] [--gen-tokens 64] [--threads 2] [--device cpu|cuda]

For each N in --streams, starts `peregrine serve --parallel N` and `llama-server -np N` (continuous
batching on, f16 KV as ours, the same threads and context per slot), sends N streamed
/v1/completions requests at once (each its own prompt of about --prompt-tokens, greedy,
end-of-sequence ignored, --gen-tokens each) and reads the token arrival times. Per stream:
decode tok/s = (tokens - 1) / (last - first arrival); aggregate = all streams' tokens after
their first over the span from the earliest first token to the latest last (and, apart, the
sum of the per-stream rates, which overstates it where streams do not overlap); concurrent =
the tokens that arrive while all N streams decode (from the last first token to the first last
one) over that window, the rate without the ramps at either end. Prints one JSON
line per server and N, with times to first token (p50, max). Standard library only; loopback.
"""
import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

WORDS = ["river", "stone", "market", "violin", "winter", "lantern", "orbit", "garden", "copper",
         "meadow", "harbor", "pencil", "thunder", "velvet", "canyon", "maple"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(i, words):
    # About 1.3 tokens per word in both tokenizers; what it says does not matter.
    return f"Story {i}: " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))


def wait_ready(port, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit("server did not become ready")


def model_id(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/v1/models")
    return json.loads(c.getresponse().read())["data"][0]["id"]


def stream(port, model, text, gen_tokens, out):
    body = json.dumps({"model": model, "prompt": text, "max_tokens": gen_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    start = time.time()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    arrivals = []
    if r.status != 200:
        print(f"HTTP {r.status}: {r.read()[:300]!r}", file=sys.stderr)
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            arrivals.append(time.time())
    out.append((start, arrivals))


def measure(port, n, words, gen_tokens):
    results, threads, model = [], [], model_id(port)
    for i in range(n):
        t = threading.Thread(target=stream, args=(port, model, prompt(i, words), gen_tokens, results))
        threads.append(t)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    decode, ttft = [], []
    # Wall throughput: every token after each stream's first over the span from the first
    # stream's first token to the last one's last (a sum of per-stream rates would overstate
    # it where streams do not overlap).
    spans = [a for _, a in results if len(a) >= 2]
    wall = (sum(len(a) - 1 for a in spans) / (max(a[-1] for a in spans) - min(a[0] for a in spans))
            if spans else 0)
    # Concurrent decode throughput: the tokens that arrive while every stream decodes (from the
    # last stream's first token to the first stream's last), over that window.
    lo = max((a[0] for a in spans), default=0)
    hi = min((a[-1] for a in spans), default=0)
    inside = sum(1 for a in spans for t in a if lo < t <= hi)
    concurrent = inside / (hi - lo) if len(spans) == n and hi > lo else None
    for start, arrivals in results:
        if len(arrivals) >= 2:
            decode.append((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))
        if arrivals:
            ttft.append((arrivals[0] - start) * 1e3)
    return {"streams": n, "aggregate_decode_tps": round(wall, 1),
            "concurrent_decode_tps": round(concurrent, 1) if concurrent else None,
            "sum_of_stream_tps": round(sum(decode), 1),
            "per_stream_decode_tps": round(statistics.median(decode), 1) if decode else 0,
            "ttft_ms_p50": round(statistics.median(ttft), 1) if ttft else None,
            "ttft_ms_max": round(max(ttft), 1) if ttft else None,
            "tokens": sum(len(a) for _, a in results)}


def gaps(arrivals, lo, hi):
    """Inter-token gaps (ms) of `arrivals` between times lo and hi."""
    return [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:]) if lo <= a and b <= hi]


def decode_streams(port, streams, words, gen_tokens, long_words=None):
    """`streams` decode; after a second a prompt of `long_words` arrives (if given). Returns
    each stream's token arrival times (by stream), the arrival and the first token time of
    the long prompt."""
    slots, model = [[] for _ in range(streams)], model_id(port)
    threads = [threading.Thread(target=stream, args=(port, model, prompt(i, words), gen_tokens, slots[i]))
               for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    arrived, long_result = time.time(), []
    if long_words:
        threads.append(threading.Thread(target=stream,
                                        args=(port, model, prompt(99, long_words), 2, long_result)))
        threads[-1].start()
    for t in threads:
        t.join()
    first = long_result[0][1][0] if long_result and long_result[0][1] else time.time()
    return [slot[0][1] for slot in slots], arrived, first


def interference(port, streams, words, gen_tokens, long_words):
    """The streams' inter-token gaps while a long prompt is prefilled (from its arrival to its
    first token: median, p90, max), against the same streams' gaps at the same token
    positions in a run without it (their contexts grow, and so does their unloaded gap), and
    their gap before it arrives."""
    base, _, _ = decode_streams(port, streams, words, gen_tokens)
    loaded, arrived, first = decode_streams(port, streams, words, gen_tokens, long_words)
    ms = lambda a, i: (a[i + 1] - a[i]) * 1e3
    before, during, unloaded = [], [], []
    for a, b in zip(loaded, base):
        for i in range(len(a) - 1):
            if a[i + 1] <= arrived:
                before.append(ms(a, i))
            elif a[i] >= arrived and a[i + 1] <= first and i + 1 < len(b):
                during.append(ms(a, i))
                unloaded.append(ms(b, i))
    p90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]
    row = {"streams": streams, "gap_ms_before": round(statistics.median(before), 1),
           "long_prompt_ttft_ms": round((first - arrived) * 1e3, 1)}
    if during:
        row.update({"gap_ms_during": round(statistics.median(during), 1),
                    "gap_ms_during_p90": round(p90(during), 1),
                    "gap_ms_during_max": round(max(during), 1),
                    "gap_ms_unloaded_same_positions": round(statistics.median(unloaded), 1),
                    "gap_ms_unloaded_same_positions_p90": round(p90(unloaded), 1)})
        row["ratio_median"] = round(row["gap_ms_during"] / row["gap_ms_unloaded_same_positions"], 2)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-server", help="llama.cpp's llama-server (omit: Peregrine only)")
    ap.add_argument("--peregrine", default="target/release/peregrine")
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peregrine-args", default="",
                    help="more `peregrine serve` flags for the batched runs (e.g. --batch-tokens 512)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: Peregrine on the GPU, llama-server with every layer there "
                         "(-ngl 99) and its flash attention (ours is a fused kernel there too)")
    ap.add_argument("--interfere", type=int, metavar="TOKENS",
                    help="instead: 4 streams decode and a prompt of TOKENS arrives (Peregrine)")
    ap.add_argument("--decode-stretch", type=float, default=1.5,
                    help="Peregrine's --decode-stretch for the paced --interfere run (the other: 1, "
                         "unpaced)")
    ap.add_argument("--interfere-gen-tokens", type=int, default=400,
                    help="tokens each of the 4 --interfere streams generates")
    a = ap.parse_args()
    if a.interfere:
        for stretch in (1.0, a.decode_stretch):
            port = free_port()
            cmd = [a.peregrine, "--threads", str(a.threads), "serve", "--model", a.model, "--port",
                   str(port), "--parallel", "5", "--prompt-cache-entries", "0",
                   "--decode-stretch", str(stretch)]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_ready(port, proc)
                row = interference(port, 4, 48, a.interfere_gen_tokens, a.interfere * 3 // 4)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            row["decode_stretch"] = stretch
            print(json.dumps(row), flush=True)
        return
    words = max(1, a.prompt_tokens * 3 // 4)
    # A byte-level BPE takes at most a token per byte (the random checkpoints' tokenizer, without
    # merges, takes exactly that), so a slot's context bounds the longest prompt in bytes.
    longest = max(len(prompt(i, words).encode()) for i in range(max(int(x) for x in a.streams.split(","))))
    per_slot = max(a.prompt_tokens, longest + 1) + a.gen_tokens + 64
    for n in [int(x) for x in a.streams.split(",")]:
        for name in ("peregrine", "llama.cpp") if a.llama_server else ("peregrine",):
            port = free_port()
            if name == "peregrine":
                cmd = [a.peregrine, "--threads", str(a.threads), "serve", "--model", a.model,
                       "--port", str(port), "--parallel", str(n), "--prompt-cache-entries", "0", "--device", a.device]
                cmd += a.peregrine_args.split()
            else:
                # llama-server splits --ctx-size over its slots.
                cmd = [a.llama_server, "-m", a.model, "--port", str(port), "-np", str(n),
                       "-t", str(a.threads), "-c", str(per_slot * n), "-cb", "-ctk", "f16",
                       "-ctv", "f16", "--cache-reuse", "0"]
                cmd += ["-ngl", "99", "-fa", "on"] if a.device == "cuda" else ["-fa", "off"]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_ready(port, proc)
                measure(port, 1, words, 4)  # warm-up
                row = measure(port, n, words, a.gen_tokens)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            row["server"] = name
            load = open("/proc/loadavg").read().split()[0]
            row["load"] = float(load)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
