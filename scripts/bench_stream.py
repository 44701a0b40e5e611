"""Decode speed and peak memory of a MoE checkpoint with its experts resident and streamed from
disk (--stream-experts), with a cold or warm page cache, with and without prefetch; and
llama.cpp's llama-bench on the same GGUF (mmap) cold and warm. Prints one JSON line per run.

usage: python3 scripts/bench_stream.py --model FILE.gguf|DIR [--llama-bench BIN] [--peregrine BIN]
       [--prompt-tokens 32] [--gen-tokens 32] [--threads 2] [--runs resident,cold,warm,...]

"Cold" drops the checkpoint's pages from the page cache first (posix_fadvise DONTNEED on every
file of it: no root needed, other files untouched); "warm" reads it whole first. Peak RSS is the
child's maximum resident set (getrusage), which counts mapped file pages a process touched.
Runs: resident (experts loaded; warm), cold, warm (streamed, default queue depth), cold-noprefetch,
warm-noprefetch (--stream-queue-depth 0), cold-guess, warm-guess (--stream-speculate: each
layer's experts also read on a guess a layer early), cold-nomap, warm-nomap (--expert-map-mb 0:
experts multiplied from the file's mapping are mapped in and out on every use), llama-cold,
llama-warm.

--memory-limit-gb G runs every command in a memory cgroup (v1, /sys/fs/cgroup/memory; needs root)
capped at G GiB, page cache included: a model larger than memory on a machine where it is not.
llama-bench then runs with `--repack 0 -lm mmap` (its repacked copy would not fit).
"""
import argparse, json, os, re, resource, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def files_of(model):
    if os.path.isdir(model):
        return [os.path.join(model, f) for f in sorted(os.listdir(model)) if f.endswith(".safetensors")]
    return [model]


def drop_cache(model):
    for path in files_of(model):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(model):
    for path in files_of(model):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


CGROUP = "/sys/fs/cgroup/memory/peregrine-bench"
LIMITED = False


def limit_memory(gib):
    global LIMITED
    os.makedirs(CGROUP, exist_ok=True)
    with open(os.path.join(CGROUP, "memory.limit_in_bytes"), "w") as f:
        f.write(str(int(gib * (1 << 30))))
    LIMITED = True


def enter_cgroup():
    with open(os.path.join(CGROUP, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def run(cmd):
    """Runs cmd (in the memory cgroup when limited); returns (stdout, stderr, peak RSS bytes of the
    child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    p = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=enter_cgroup if LIMITED else None)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the largest of any child so far: valid when it grew.
    return p.stdout, p.stderr, peak * 1024 if peak > before else None


def peregrine(a, stream, depth=None, guess=False, nomap=False):
    cmd = [a.peregrine, "--threads", str(a.threads), "bench", "--model", a.model,
           "--prompt-tokens", str(a.prompt_tokens), "--gen-tokens", str(a.gen_tokens),
           "--repeat", "1", "--json"]
    if stream:
        cmd.append("--stream-experts")
    if depth is not None:
        cmd += ["--stream-queue-depth", str(depth)]
    if guess:
        cmd.append("--stream-speculate")
    if nomap:
        cmd += ["--expert-map-mb", "0"]
    out, _, _ = run(cmd)
    r = json.loads(out.strip().splitlines()[-1])
    keep = {k: r.get(k) for k in ("prefill_tps", "decode_tps", "peak_rss_bytes", "weight_bytes")}
    if "expert_streaming" in r:
        keep["expert_streaming"] = r["expert_streaming"]
    return keep


def llama(a):
    mapped = ["--repack", "0", "-lm", "mmap"] if LIMITED else []
    out, _, peak = run([a.llama_bench, "-m", a.model, "-t", str(a.threads), "-p", str(a.prompt_tokens),
                        "-n", str(a.gen_tokens), "-r", "1", "-o", "json"] + mapped)
    rows = json.loads(out)
    tps = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    return {"prefill_tps": tps.get("prefill"), "decode_tps": tps.get("decode"), "peak_rss_bytes": peak}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--peregrine", default=os.path.join(ROOT, "target", "release", "peregrine"))
    ap.add_argument("--llama-bench")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", default="resident,cold,warm,cold-noprefetch,warm-noprefetch,llama-cold,llama-warm")
    ap.add_argument("--memory-limit-gb", type=float)
    a = ap.parse_args()
    if a.memory_limit_gb:
        limit_memory(a.memory_limit_gb)
    for name in a.runs.split(","):
        if name.startswith("llama") and not a.llama_bench:
            continue
        cold = name.endswith("cold") or "cold-" in name
        (drop_cache if cold else warm_cache)(a.model)
        start = time.time()
        if name == "resident":
            r = peregrine(a, stream=False)
        elif name.startswith("llama"):
            r = llama(a)
        else:
            r = peregrine(a, stream=True, depth=0 if "noprefetch" in name else None,
                          guess="guess" in name, nomap="nomap" in name)
        r.update(run=name, model=a.model, seconds=round(time.time() - start, 1),
                 memory_limit_gb=a.memory_limit_gb)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
