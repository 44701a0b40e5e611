#!/usr/bin/env python3
"""Speculative decoding against llama.cpp's, on the same files and prompt, in the same run.

Runs, alternating, for --rounds rounds (greedy, --gen-tokens tokens after the prompt file's text):
  peregrine bench: plain, --draft-model DRAFT (adaptive), --draft-model DRAFT --draft-fixed,
                   --spec-ngram
  llama.cpp:       llama-completion (plain), llama-speculative-simple -md DRAFT, llama-lookup
with --num-draft-tokens / --spec-draft-n-max N on both sides, and prints one JSON line per run, then
the medians and each pair's ratio (ours / llama.cpp's decode tok/s).

usage: benches/compare_speculative.py --target T.gguf --draft D.gguf --prompt-file F
           --llama-bin DIR [--peregrine target/release/peregrine] [--gen-tokens 100]
           [--draft-max 8] [--threads 2] [--rounds 2]
The llama.cpp binaries: built natively from the llama-cpp-python sdist's vendor/llama.cpp
(cmake -DGGML_NATIVE=ON, targets llama-completion llama-speculative-simple llama-lookup).
"""
import argparse
import json
import re
import statistics
import subprocess
import sys


def peregrine(a, extra):
    cmd = [a.peregrine, "--threads", str(a.threads), "bench", "--model", a.target,
           "--prompt-file", a.prompt_file, "--gen-tokens", str(a.gen_tokens), "--repeat", "1",
           "--num-draft-tokens", str(a.draft_max)] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    spec = r.get("speculative", {})
    return {"decode_tps": r["decode_tps"], "acceptance": spec.get("acceptance_rate")}


def llama(a, tool, extra):
    cmd = [f"{a.llama_bin}/{tool}", "-m", a.target, "-f", a.prompt_file, "-n", str(a.gen_tokens),
           "-t", str(a.threads), "--temp", "0", "-c", "2048"] + extra
    run = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    log = run.stdout + run.stderr
    if tool == "llama-completion":
        m = re.search(r"eval time =.*?/\s*(\d+) runs.*?([\d.]+) tokens per second", log)
        if not m:
            sys.exit(f"{tool}: no eval timing in its output:\n{log[-2000:]}")
        return {"decode_tps": float(m.group(2)), "acceptance": None}
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    acc = re.search(r"accept\s+=\s+([\d.]+)%", log)
    if not m:
        sys.exit(f"{tool}: no decode timing in its output:\n{log[-2000:]}")
    return {"decode_tps": float(m.group(3)),
            "acceptance": float(acc.group(1)) / 100 if acc else None}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompt-file", required=True)
    p.add_argument("--llama-bin", required=True)
    p.add_argument("--peregrine", default="target/release/peregrine")
    p.add_argument("--gen-tokens", type=int, default=100)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    n = str(a.draft_max)
    runs = {
        "peregrine plain": lambda: peregrine(a, []),
        "peregrine draft model": lambda: peregrine(a, ["--draft-model", a.draft]),
        "peregrine draft model, fixed": lambda: peregrine(a, ["--draft-model", a.draft, "--draft-fixed"]),
        "peregrine prompt lookup": lambda: peregrine(a, ["--spec-ngram"]),
        "llama.cpp plain": lambda: llama(a, "llama-completion", ["-no-cnv"]),
        "llama.cpp draft model": lambda: llama(a, "llama-speculative-simple", ["-md", a.draft, "--spec-type", "draft-simple", "--spec-draft-n-max", n]),
        "llama.cpp prompt lookup": lambda: llama(a, "llama-lookup", ["--spec-draft-n-max", n]),
    }
    results = {k: [] for k in runs}
    for r in range(a.rounds):
        for name, run in runs.items():
            res = run()
            results[name].append(res)
            print(json.dumps({"round": r, "run": name, **res}), flush=True)
    med = {k: statistics.median(x["decode_tps"] for x in v) for k, v in results.items()}
    acc = {k: v[-1]["acceptance"] for k, v in results.items()}
    for k in runs:
        print(json.dumps({"median": k, "decode_tps": round(med[k], 1), "acceptance": acc[k]}))
    for ours, theirs in [("peregrine plain", "llama.cpp plain"),
                         ("peregrine draft model", "llama.cpp draft model"),
                         ("peregrine draft model, fixed", "llama.cpp draft model"),
                         ("peregrine prompt lookup", "llama.cpp prompt lookup")]:
        print(json.dumps({"ratio": f"{ours} / {theirs}", "value": round(med[ours] / med[theirs], 2)}))


if __name__ == "__main__":
    main()
