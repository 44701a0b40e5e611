#!/usr/bin/env python3
"""Image input on a GPU build, end to end: serves each VLM fixture (tests/fixtures/vlm/*) with
`peregrine serve --device DEVICE`, asks about its photo through the chat API (a base64 `data:`
URL), and compares the first answer token's log-probability with transformers' f32 logits over
the tokenizer's ids. On the GPU the model runs in bf16, so the tolerance is 0.15 (as
scripts/cuda/parity.py states for logits); on the CPU the same check holds to 1e-3
(crates/peregrine-server/tests/vision.rs).

`gemma3-gguf` serves the Gemma 3 fixture as llama.cpp's files (gguf/model-bf16.gguf with
`--mmproj gguf/mmproj-f32.gguf`), whose logits are llama.cpp's Gemma 3 rather than transformers'
(every sixth layer global): it is compared with the same files served on the CPU instead.

usage: vlm_check.py PEREGRINE [--device cuda] [--families gemma3,smolvlm,qwen2_5_vl,gemma3-gguf]
(needs numpy, safetensors)
"""
import argparse, base64, json, os, re, subprocess, sys, urllib.request

import numpy as np
from safetensors.numpy import load_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TOLERANCE = 0.15


def serve(binary, model, device, extra=()):
    proc = subprocess.Popen([binary, "serve", "--model", model, "--device", device, "--port", "0",
                             "--alias", "tiny", "--exit-on-stdin-eof", *extra],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if m := re.search(r"listening on (http://\S+)", line):
            return proc, m.group(1)
    raise RuntimeError(f"{model}: the server exited")


def ask(url, png):
    body = {"model": "tiny", "temperature": 0, "max_tokens": 1, "logprobs": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
                {"type": "text", "text": "Describe this image in one sentence."}]}]}
    for _ in range(600):  # the model loads after the port opens
        req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            if e.code != 503:
                raise RuntimeError(e.read().decode())
        import time
        time.sleep(0.2)
    raise RuntimeError("the model did not load")


def vocab_size(hf):
    tok = json.load(open(os.path.join(hf, "tokenizer.json")))
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok["added_tokens"]]
    return max(ids) + 1


def first_logprob(binary, model, device, png, extra=()):
    """The first answer token's log-probability and the prompt's length, served on `device`."""
    proc, url = serve(binary, model, device, extra)
    try:
        body = ask(url, png)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    return body["choices"][0]["logprobs"]["content"][0]["logprob"], body["usage"]["prompt_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--families", default="gemma3,smolvlm,qwen2_5_vl,gemma3-gguf")
    a = ap.parse_args()
    failed = 0
    for family in a.families.split(","):
        d = os.path.join(ROOT, "tests", "fixtures", "vlm", family.removesuffix("-gguf"))
        hf = os.path.join(d, "hf")
        ref = load_file(os.path.join(hf, "reference.safetensors"))
        png = open(os.path.join(d, "image.png"), "rb").read()
        n = len(ref["input_ids"])
        if family.endswith("-gguf"):
            model = os.path.join(d, "gguf", "model-bf16.gguf")
            extra = ["--mmproj", os.path.join(d, "gguf", "mmproj-f32.gguf")]
            want, _ = first_logprob(a.binary, model, "cpu", png, extra)
            got, tokens = first_logprob(a.binary, model, a.device, png, extra)
        else:
            got, tokens = first_logprob(a.binary, hf, a.device, png)
            last = ref["logits"][n - 1][: vocab_size(hf)].astype(np.float64)
            logp = last - (np.log(np.exp(last - last.max()).sum()) + last.max())
            want = logp[int(ref["greedy_ids"][0])]
        ok = abs(got - want) <= TOLERANCE and tokens == n
        failed += not ok
        print(f"{family} [{a.device}]: logprob {got:.4f} vs {want:.4f} (diff {abs(got - want):.2e}), "
              f"prompt {tokens}/{n} tokens: {'ok' if ok else 'FAIL'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
