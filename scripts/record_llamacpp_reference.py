"""Record llama.cpp reference tokens/logits for the real test models (run once, commit the JSON).

usage: .venv-ref/bin/python scripts/record_llamacpp_reference.py [--models DIR] [--out tests/data/llamacpp]
                                                                  [--threads 2] [smollm2] [gemma3]
Models come from scripts/fetch-models.sh (default dir ${PEREGRINE_MODELS:-~/.cache/peregrine/models}).

For each prompt (exact text below):
  prompt_ids        llama.cpp tokenization: llama_tokenize(text, add_special=True, parse_special=True);
                    add_special only adds BOS when the GGUF says tokenizer.ggml.add_bos_token (recorded)
  continuation_ids  greedy (argmax of llama.cpp's logits, i.e. temperature 0), 64 tokens, no EOS stop,
                    n_ctx 2048, seed 0; the prompt is evaluated in one batch, then one token per eval
  top1[i], top5[i]  argmax and top-5 [id, logit] of the logits after token i of prompt_ids+continuation_ids
                    (logits_all=True, taken from that same run), i = 0 .. len(prompt)+64-1, so
                    top1[len(prompt)-1+k] == continuation_ids[k]
"""
import argparse, hashlib, json, os, platform, sys
from pathlib import Path
import numpy as np
import llama_cpp
from llama_cpp import Llama

N_GEN = 64
N_CTX = 2048
SEED = 0

def chatml(user, system=None):
    s = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return s + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"

MODELS = {
    "smollm2": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "prompts": [
            chatml("Which city is the capital of France?"),
            chatml("Write a short poem about the sea.", system="You are a helpful assistant."),
            chatml("List three primary colors and explain why they are called primary."),
            chatml("How do I reverse a list in Python?"),
            chatml("Explain photosynthesis to a ten-year-old."),
            chatml("What are the health benefits of drinking water?", system="You are a concise assistant."),
            chatml("Translate 'good morning' into Spanish and French."),
            chatml("Give me three tips for a job interview."),
        ],
    },
    "gemma3": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "prompts": [
            "The capital city of Japan is",
            "Once upon a time, in a small village by the sea,",
            "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
            "The three primary colors are",
            "Water boils at 100 degrees Celsius because",
            "In 1969, the first humans landed on the Moon. The mission",
            "A good breakfast should include",
            "The most important rule of writing clear code is",
        ],
    },
}

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

def as_bool(v):
    # llama-cpp-python returns GGUF metadata as strings; None = key absent from the file
    return None if v is None else str(v).lower() == "true"

def run_case(llm, prompt):
    ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
    llm.reset()
    llm.eval(ids)
    cont = []
    for _ in range(N_GEN):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        cont.append(tok)
        llm.eval([tok])
    n = llm.n_tokens
    assert n == len(ids) + N_GEN
    scores = np.asarray(llm.scores[:n], dtype=np.float32)
    top1 = [int(x) for x in scores.argmax(-1)]
    top5 = []
    for row in scores:
        idx = np.argsort(-row, kind="stable")[:5]
        top5.append([[int(i), round(float(row[i]), 4)] for i in idx])
    for k, t in enumerate(cont):
        assert top1[len(ids) - 1 + k] == t
    text = llm.detokenize(cont).decode("utf-8", errors="replace")
    return {"prompt": prompt, "prompt_ids": ids, "continuation_ids": cont, "continuation_text": text,
            "top1": top1, "top5": top5}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.environ.get("PEREGRINE_MODELS",
                                                       str(Path.home() / ".cache/peregrine/models")))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/data/llamacpp"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("which", nargs="*", default=list(MODELS))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for name in a.which:
        spec = MODELS[name]
        path = Path(a.models) / spec["file"]
        if not path.exists():
            sys.exit(f"{path} missing: run scripts/fetch-models.sh first")
        llm = Llama(model_path=str(path), n_ctx=N_CTX, n_threads=a.threads, n_threads_batch=a.threads,
                    seed=SEED, logits_all=True, verbose=False)
        md = llm.metadata
        out = {
            "model": spec["file"],
            "sha256": sha256(path),
            "llama_cpp_python": llama_cpp.__version__,
            "n_threads": a.threads,
            "n_ctx": N_CTX,
            "n_batch": llm.n_batch,
            "seed": SEED,
            "n_gen": N_GEN,
            "machine": platform.machine(),
            "tokenize": {"add_special": True, "parse_special": True,
                         "gguf_add_bos_token": as_bool(md.get("tokenizer.ggml.add_bos_token")),
                         "gguf_add_eos_token": as_bool(md.get("tokenizer.ggml.add_eos_token")),
                         "bos_id": llm.token_bos(), "eos_id": llm.token_eos()},
            "sampling": "greedy argmax of llama.cpp logits, no EOS stop",
            "top_positions": "top1[i]/top5[i] = logits after token i of prompt_ids+continuation_ids",
            "cases": [],
        }
        for p in spec["prompts"]:
            c = run_case(llm, p)
            print(f"{name}: {len(c['prompt_ids'])} prompt tokens -> {c['continuation_text']!r}", flush=True)
            out["cases"].append(c)
        dst = Path(a.out) / f"{name}.json"
        with open(dst, "w") as f:
            # one case field per line keeps diffs readable and the file small
            json.dump(out, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {dst} ({dst.stat().st_size} bytes)")
        del llm

if __name__ == "__main__":
    main()
