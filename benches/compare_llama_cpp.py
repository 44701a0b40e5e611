"""Compare `peregrine bench` with llama.cpp (llama-cpp-python) on the same GGUF file, in one run.

usage: .venv-ref/bin/python benches/compare_llama_cpp.py --model FILE --prompt-tokens N --gen-tokens M
           --threads T --repeat R [--cache-type f16|f32|q8_0|q4_0] [--peregrine PATH] [--skip-peregrine]
           [--warmup W]

Both systems keep their KV cache in the same type, `--cache-type` (default f16, both defaults).
q8_0 / q4_0: llama.cpp's 32-value blocks (with flash attention, which its quantized V cache needs)
against Peregrine's `--kv-bits 8|4 --kv-group-size 32` (32-value groups with a scale and a bias).

peregrine half: runs `PATH bench --model FILE --prompt-tokens N --gen-tokens M --repeat R --threads T
--cache-type C --json` and reads one JSON object from its stdout (prefill_tps, decode_tps, ttft_ms, peak_rss_bytes,
kv_bytes). PATH defaults to target/release/peregrine in this repo; the script stops with an error when
the binary is missing (use --skip-peregrine to time llama.cpp alone).

llama.cpp half: the prompt is SYNTHETIC_TEXT below tokenized by llama.cpp (no BOS, no specials),
repeated and truncated to N ids. Per repeat: fresh KV cache; prefill = wall time of one eval over the
N prompt ids (n_batch = n_ubatch = 512, llama.cpp's defaults); then M greedy tokens (argmax, no EOS
stop), one eval each; decode tok/s = M / their wall time; ttft_ms = prefill time (time until the first
generated token's logits exist). Median over R repeats, after W unrecorded warm-up repeats.
Prints one JSON object:
  {"model", "threads", "prompt_tokens", "gen_tokens", "repeat", "peregrine": {...}, "llama_cpp": {...},
   "ratio": {"prefill": peregrine/llama_cpp, "decode": peregrine/llama_cpp}}
"""
import argparse, json, os, resource, statistics, subprocess, sys, time
from pathlib import Path

SYNTHETIC_TEXT = ("The quick brown fox jumps over the lazy dog. Peregrine falcons are the fastest birds "
                  "on Earth, diving at more than three hundred kilometres per hour. ")
ROOT = Path(__file__).resolve().parent.parent

def die(msg, code=2):
    print(f"compare_llama_cpp: error: {msg}", file=sys.stderr)
    sys.exit(code)

def run_peregrine(binary, a):
    kv = {"q8_0": ["--kv-bits", "8", "--kv-group-size", "32"],
          "q4_0": ["--kv-bits", "4", "--kv-group-size", "32"]}.get(a.cache_type, ["--cache-type", a.cache_type])
    cmd = [str(binary), "--threads", str(a.threads), "bench", "--model", a.model,
           "--prompt-tokens", str(a.prompt_tokens), "--gen-tokens", str(a.gen_tokens),
           "--repeat", str(a.repeat), *kv, "--json"]
    print("compare_llama_cpp: running " + " ".join(cmd), file=sys.stderr)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    if p.returncode != 0:
        die(f"peregrine bench exited with {p.returncode}")
    lines = [l for l in p.stdout.strip().splitlines() if l.strip()]
    try:
        obj = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        obj = None
    if obj is None:
        try:
            obj = json.loads(p.stdout)
        except json.JSONDecodeError:
            die(f"peregrine bench did not print a JSON object on stdout; got: {p.stdout[:500]!r}")
    missing = [k for k in ("prefill_tps", "decode_tps") if k not in obj]
    if missing:
        die(f"peregrine bench JSON lacks {missing}: {obj}")
    return obj

def synthetic_ids(llm, n):
    base = llm.tokenize(SYNTHETIC_TEXT.encode("utf-8"), add_bos=False, special=False)
    reps = n // len(base) + 1
    return (base * reps)[:n]

def run_llama_cpp(a):
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama
    n_ctx = a.prompt_tokens + a.gen_tokens + 16
    t0 = time.perf_counter()
    # llama-cpp-python sizes its logits buffer by n_batch: make it hold every position (the
    # compute still runs in n_ubatch=512 micro-batches, llama.cpp's default).
    n_batch = max(512, n_ctx)
    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32,
               "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}[a.cache_type]
    quantized = a.cache_type in ("q8_0", "q4_0")
    llm = Llama(model_path=a.model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=512, n_threads=a.threads,
                n_threads_batch=a.threads, seed=0, logits_all=False, verbose=False,
                type_k=kv_type, type_v=kv_type, flash_attn=quantized)
    load_s = time.perf_counter() - t0
    ids = synthetic_ids(llm, a.prompt_tokens)
    runs = []
    for r in range(a.warmup + a.repeat):
        llm.reset()  # n_tokens = 0; the next eval drops the KV cells past it (kv_cache_seq_rm)
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        gen = []
        for _ in range(a.gen_tokens):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            gen.append(tok)
            llm.eval([tok])
        t2 = time.perf_counter()
        if r >= a.warmup:
            runs.append({"prefill_s": t1 - t0, "decode_s": t2 - t1})
    pre = statistics.median(x["prefill_s"] for x in runs)
    dec = statistics.median(x["decode_s"] for x in runs)
    return {
        "prefill_tps": a.prompt_tokens / pre,
        "decode_tps": a.gen_tokens / dec if a.gen_tokens else None,
        "ttft_ms": pre * 1000.0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_s": load_s,
        "prefill_s_runs": [round(x["prefill_s"], 5) for x in runs],
        "decode_s_runs": [round(x["decode_s"], 5) for x in runs],
        "n_batch": n_batch, "n_ubatch": 512, "n_ctx": n_ctx,
        "llama_cpp_python": llama_cpp.__version__,
    }

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, required=True)
    ap.add_argument("--gen-tokens", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cache-type", choices=["f16", "f32", "q8_0", "q4_0"], default="f16",
                    help="KV cache type of both systems (default f16, llama.cpp's default)")
    ap.add_argument("--peregrine", default=None, help="path to the peregrine binary (default target/release/peregrine)")
    ap.add_argument("--skip-peregrine", action="store_true", help="time llama.cpp only")
    a = ap.parse_args()
    if not os.path.isfile(a.model):
        die(f"model file not found: {a.model} (scripts/fetch-models.sh fetches the test models)")
    if a.prompt_tokens < 1 or a.gen_tokens < 0 or a.repeat < 1 or a.threads < 1:
        die("need --prompt-tokens >= 1, --gen-tokens >= 0, --repeat >= 1, --threads >= 1")
    binary = None
    if not a.skip_peregrine:
        binary = Path(a.peregrine) if a.peregrine else ROOT / "target" / "release" / "peregrine"
        if not binary.is_file() or not os.access(binary, os.X_OK):
            die(f"peregrine binary not found or not executable: {binary} "
                "(build it with `cargo build --release -p peregrine-server`, pass --peregrine PATH, "
                "or use --skip-peregrine to time llama.cpp alone)")
    per = run_peregrine(binary, a) if binary else None
    lcp = run_llama_cpp(a)
    def ratio(k):
        if not per or not lcp.get(k) or per.get(k) is None:
            return None
        return per[k] / lcp[k]
    out = {"model": os.path.basename(a.model), "threads": a.threads, "cache_type": a.cache_type,
           "prompt_tokens": a.prompt_tokens,
           "gen_tokens": a.gen_tokens, "repeat": a.repeat, "peregrine": per, "llama_cpp": lcp,
           "ratio": {"prefill": ratio("prefill_tps"), "decode": ratio("decode_tps")}}
    print(json.dumps(out))

if __name__ == "__main__":
    main()
