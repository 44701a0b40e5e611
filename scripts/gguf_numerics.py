"""Real-GGUF numerics: Peregrine and llama.cpp against transformers running the same GGUF's weights
dequantized to f32 (the exact reference of that file), on SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M
Q4_K_M, over 20-30 prompts each (prompt + the reference's own greedy continuation, teacher-forced: up
to 48 tokens, to the end of turn, cut where it starts repeating itself).

usage: .venv-fixtures/bin/python scripts/gguf_numerics.py [--models DIR] [--work /tmp/gguf-numerics]
                                                          [--peregrine target/release/peregrine]
                                                          [--record] [smollm2] [gemma3]
needs: .venv-fixtures (torch, transformers, gguf) and .venv-ref (llama-cpp-python, scripts/setup-ref-venv.sh);
       `cargo build --release -p peregrine-server`; models from scripts/fetch-models.sh.

Stages (each cached under --work by input, so a rerun after changing Peregrine only reruns Peregrine):
  tokenize   .venv-ref: llama.cpp's tokenization of each prompt (add_special, parse_special)
  reference  .venv-fixtures: transformers (f32, eager) on the dequantized GGUF tensors; greedy continuation
             (up to 48 tokens, end of turn included, stopped before a token that would repeat a 6-gram),
             then one forward over prompt + continuation: logits at every position
  llamacpp   .venv-ref: one eval of prompt + continuation, logits_all, KV cache f16 (its default) and f32
  peregrine  `peregrine logits` on the same ids, --cache-type f32 (our default) and f16
Metrics per model and run, over every position of every case: mean |logit - reference logit| over the
whole vocabulary ("err"), and top-1 agreement (argmax equal to the reference's argmax).

--record writes tests/data/numerics/<model>.json, the reference data `tests/integration/numerics.rs`
checks Peregrine against (no Python at test time): per position the reference's argmax and its logits at
a fixed random sample of vocabulary ids (an unbiased estimate of the whole-vocabulary mean), and
llama.cpp's error and agreement on exactly that data as the bar.
"""
import argparse, base64, hashlib, json, os, platform, subprocess, sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
N_GEN = 48
REPEAT = 6  # continuations stop before a token that would repeat a 6-gram of the sequence
SAMPLE = 32  # vocabulary ids per position in the recorded data (the same ids at every position)
SCALE = 256  # recorded logits are stored as round(logit * SCALE) in little-endian i16, base64
SEED = 0

def chatml(user, system=None):
    s = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return s + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"

MODELS = {
    "smollm2": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "stop_ids": [2],  # <|im_end|>
        "prompts": [
            # what `peregrine generate --chat` renders: SmolLM2's template adds its default system prompt
            chatml("Which city is the capital of France?",
                   system="You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
            chatml("Which city is the capital of France?"),
            chatml("Write a short poem about the sea.", system="You are a helpful assistant."),
            chatml("List three primary colors and explain why they are called primary."),
            chatml("How do I reverse a list in Python?"),
            chatml("Explain photosynthesis to a ten-year-old."),
            chatml("What are the health benefits of drinking water?", system="You are a concise assistant."),
            chatml("Translate 'good morning' into Spanish and French."),
            chatml("Give me three tips for a job interview."),
            chatml("Why is the sky blue?"),
            chatml("Write a haiku about autumn leaves."),
            chatml("What is the difference between a virus and a bacterium?", system="You are a biology tutor."),
            chatml("Summarize the plot of Romeo and Juliet in two sentences."),
            chatml("How many legs does a spider have, and how many does an insect have?"),
            chatml("Suggest a name for a small bakery that sells bread and cakes."),
            chatml("Explain what a prime number is and give two examples."),
            chatml("What should I pack for a weekend hiking trip?", system="You are a friendly travel guide."),
            chatml("Convert 5 kilometers to miles and show the calculation."),
            chatml("Write a SQL query that counts the rows of a table named orders."),
            chatml("What are the main causes of climate change?"),
        ],
    },
    "gemma3": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "stop_ids": [1, 106],  # <eos>, <end_of_turn>
        "prompts": [
            "The capital city of Japan is",
            "Once upon a time, in a small village by the sea,",
            "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
            "The three primary colors are",
            "Water boils at 100 degrees Celsius because",
            "In 1969, the first humans landed on the Moon. The mission",
            "A good breakfast should include",
            "The most important rule of writing clear code is",
            "The history of the printing press begins",
            "Photosynthesis is the process by which plants",
            "import numpy as np\n\ndef normalize(v):\n",
            "My favorite recipe for a quick dinner is",
            "The largest planet in our solar system",
            "Dear hiring manager, I am writing to apply for",
            "The rules of chess are simple: each player",
            "When the train finally arrived at the station,",
            "The French Revolution began in 1789 when",
            "To change a flat tire, first",
            "A black hole is a region of space where",
            "The best way to learn a new language is",
            "Volcanoes form when",
            "The recipe calls for two cups of flour,",
            "In a distant galaxy, a small robot",
            "The stock market fell sharply on Monday after",
            "Bees are important for agriculture because",
            "The Great Wall of China was built",
            "function add(a, b) {\n",
            "The museum's new exhibit features",
            "After years of research, scientists discovered that",
            "Winter in the mountains is",
        ],
    },
}

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

def key(*parts):
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

# ---------------------------------------------------------------- stage: tokenize (.venv-ref)

def stage_tokenize(model, prompts, out):
    from llama_cpp import Llama
    llm = Llama(model_path=model, n_ctx=512, vocab_only=True, verbose=False)
    ids = [llm.tokenize(p.encode("utf-8"), add_bos=True, special=True) for p in prompts]
    json.dump(ids, open(out, "w"))

# ---------------------------------------------------------------- stage: llamacpp (.venv-ref)

def stage_llamacpp(model, cases, kv, threads, out):
    import llama_cpp
    from llama_cpp import Llama
    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[kv]
    llm = Llama(model_path=model, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
                seed=SEED, logits_all=True, type_k=kv_type, type_v=kv_type, verbose=False)
    arrays = {}
    for i, ids in enumerate(cases):
        llm.reset()
        llm.eval(ids)
        arrays[f"case{i}"] = np.array(llm.scores[:len(ids)], dtype=np.float32)  # a copy: scores is a view
    np.savez(out, **arrays)

# ---------------------------------------------------------------- stage: reference (.venv-fixtures)

LLAMA_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}

def llama_reference(reader):
    import torch, transformers
    from gguf.quants import dequantize
    f = lambda k: reader.fields[k].contents()
    arch = f("general.architecture")
    kv = lambda k: f(f"{arch}.{k}")
    heads, kv_heads = kv("attention.head_count"), kv("attention.head_count_kv")
    sd = {}
    for t in reader.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        if t.name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            hf = "model.norm.weight"
        elif t.name == "output.weight":
            hf = "lm_head.weight"
        else:
            _, layer, module, kind = t.name.split(".")
            hf = f"model.layers.{layer}.{LLAMA_NAMES[module]}.{kind}"
            # llama.cpp's converter permutes q/k rows for GPT-J-style rotation: undo it for HF's
            # rotate_half (transformers' own GGUF loader does the same)
            n = {"attn_q": heads, "attn_k": kv_heads}.get(module)
            if n is not None:
                shape = a.shape
                a = a.reshape(n, shape[0] // n // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
        sd[hf] = torch.from_numpy(np.ascontiguousarray(a))
    tied = "lm_head.weight" not in sd
    config = transformers.LlamaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=kv("embedding_length"),
        intermediate_size=kv("feed_forward_length"), num_hidden_layers=kv("block_count"),
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        rms_norm_eps=kv("attention.layer_norm_rms_epsilon"), max_position_embeddings=kv("context_length"),
        rope_theta=kv("rope.freq_base"), tie_word_embeddings=tied, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert missing == (["lm_head.weight"] if tied else []) and not unexpected, (missing, unexpected)
    return model

def stage_reference(model_path, prompt_ids, stop_ids, outs):
    import torch
    from gguf import GGUFReader
    torch.manual_seed(SEED)
    torch.set_num_threads(int(os.environ.get("REF_THREADS", "2")))
    reader = GGUFReader(model_path)
    if reader.fields["general.architecture"].contents() == "gemma3":
        sys.path.insert(0, str(ROOT / "scripts"))
        from gemma3_gguf_vs_transformers import config, state_dict
        import transformers
        model = transformers.Gemma3ForCausalLM(config(reader)).float().eval()
        missing, unexpected = model.load_state_dict(state_dict(reader), strict=False)
        assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)
    else:
        model = llama_reference(reader)
    stops = set(stop_ids)
    with torch.no_grad():
        for ids, out in zip(prompt_ids, outs):
            # greedy continuation (the cached steps only choose the tokens): up to N_GEN tokens, the
            # end of turn included, cut before the first token that would complete a REPEAT-gram
            # already in the sequence (a model looping at temperature 0 repeats the same contexts,
            # so one near-tie would count once per repetition)
            seq, past = list(ids), None
            seen = {tuple(seq[j:j + REPEAT]) for j in range(len(seq) - REPEAT + 1)}
            for _ in range(N_GEN):
                o = model(torch.tensor([seq if past is None else seq[-1:]]), past_key_values=past,
                          use_cache=True)
                past = o.past_key_values
                token = int(o.logits[0, -1].argmax())
                gram = tuple(seq[len(seq) - REPEAT + 1:] + [token])
                if len(gram) == REPEAT and gram in seen:
                    break
                seen.add(gram)
                seq.append(token)
                if token in stops:
                    break
            # the teacher-forced logits: one forward over prompt + continuation
            logits = model(torch.tensor([seq]), use_cache=False).logits[0].float().numpy()
            np.savez(out, ids=np.array(seq, dtype=np.int64), logits=logits)
            print(f"  reference: {len(ids)} + {len(seq) - len(ids)} tokens", file=sys.stderr)

# ---------------------------------------------------------------- stage: peregrine

def stage_peregrine(binary, model, cases, kv, threads, work):
    arrays = {}
    from safetensors.numpy import load_file
    for i, ids in enumerate(cases):
        f = work / f"peregrine-{i}.safetensors"
        subprocess.run([binary, "--threads", str(threads), "logits", "--model", model,
                        "--cache-type", kv, "--input-ids", ",".join(map(str, ids)), "--out", str(f)],
                       check=True, stdout=subprocess.DEVNULL)
        t = load_file(str(f))
        assert list(t["input_ids"]) == list(ids)
        arrays[f"case{i}"] = t["logits"]
        f.unlink()
    return arrays

# ---------------------------------------------------------------- driver

def venv_python(name):
    p = ROOT / name / "bin/python"
    if not p.exists():
        sys.exit(f"{p} missing")
    return str(p)

def cached(path, make):
    if not path.exists():
        make(path)
    return path

def self_call(venv, *args):
    subprocess.run([venv_python(venv), __file__, *args], check=True)

def metrics(ref, got):
    """Per position: |err| summed over the vocabulary, and top-1 equality."""
    err = np.abs(got - ref).mean(-1)
    agree = got.argmax(-1) == ref.argmax(-1)
    return err, agree

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.environ.get("PEREGRINE_MODELS",
                                                       str(Path.home() / ".cache/peregrine/models")))
    ap.add_argument("--work", default="/tmp/gguf-numerics")
    ap.add_argument("--peregrine", action="append", metavar="[NAME=]BINARY",
                    help="Peregrine binaries to measure (repeatable; default target/release/peregrine)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--args", help=argparse.SUPPRESS)
    ap.add_argument("which", nargs="*", default=list(MODELS))
    a = ap.parse_args()
    if a.stage:
        s = json.loads(a.args)
        if a.stage == "tokenize":
            return stage_tokenize(s["model"], s["prompts"], s["out"])
        if a.stage == "llamacpp":
            return stage_llamacpp(s["model"], s["cases"], s["kv"], s["threads"], s["out"])
        if a.stage == "reference":
            return stage_reference(s["model"], s["prompt_ids"], s["stop_ids"], s["outs"])
        sys.exit(f"unknown stage {a.stage}")

    binaries = []
    for spec in a.peregrine or [str(ROOT / "target/release/peregrine")]:
        label, _, path = spec.rpartition("=")
        binaries.append((label or "peregrine", path))
        if not Path(path).exists():
            sys.exit(f"{path} missing: cargo build --release -p peregrine-server")
    for name in a.which:
        spec = MODELS[name]
        model = str(Path(a.models) / spec["file"])
        if not Path(model).exists():
            sys.exit(f"{model} missing: run scripts/fetch-models.sh first")
        work = Path(a.work) / name
        work.mkdir(parents=True, exist_ok=True)
        digest = sha256(model)
        tok = cached(work / f"ids-{key(digest, spec['prompts'])}.json", lambda p: self_call(
            ".venv-ref", "--stage", "tokenize",
            "--args", json.dumps({"model": model, "prompts": spec["prompts"], "out": str(p)})))
        prompt_ids = json.load(open(tok))
        print(f"{name}: reference (transformers f32 on the dequantized GGUF)", file=sys.stderr)
        ref_files = [work / f"ref-{key(digest, ids, N_GEN, REPEAT, spec['stop_ids'])}.npz"
                     for ids in prompt_ids]
        todo = [(ids, str(f)) for ids, f in zip(prompt_ids, ref_files) if not f.exists()]
        if todo:
            self_call(".venv-fixtures", "--stage", "reference", "--args", json.dumps(
                {"model": model, "prompt_ids": [t[0] for t in todo], "stop_ids": spec["stop_ids"],
                 "outs": [t[1] for t in todo]}))
        refz = [np.load(f) for f in ref_files]
        cases = [[int(t) for t in z["ids"]] for z in refz]
        refs = [z["logits"] for z in refz]
        runs = {}
        for kv in ("f16", "f32"):
            print(f"{name}: llama.cpp, KV {kv}", file=sys.stderr)
            p = cached(work / f"llamacpp-{kv}-{key(digest, cases, a.threads)}.npz", lambda p: self_call(
                ".venv-ref", "--stage", "llamacpp", "--args", json.dumps(
                    {"model": model, "cases": cases, "kv": kv, "threads": a.threads, "out": str(p)})))
            z = np.load(p)
            runs[f"llama.cpp kv {kv}"] = [z[f"case{i}"] for i in range(len(cases))]
        for label, binary in binaries:
            for kv in ("f32", "f16"):
                print(f"{name}: {label}, KV {kv}", file=sys.stderr)
                got = stage_peregrine(binary, model, cases, kv, a.threads, work)
                runs[f"{label} kv {kv}"] = [got[f"case{i}"] for i in range(len(cases))]

        positions = sum(len(c) for c in cases)
        print(f"\n{spec['file']}: {len(cases)} prompts, {positions} positions "
              f"(prompt + up to {N_GEN} reference-greedy tokens)")
        print(f"{'run':<24} {'mean |err|':>10} {'top-1':>8}   per case |err|")
        summary = {}
        for run, logits in runs.items():
            per = [metrics(r, g) for r, g in zip(refs, logits)]
            err = np.concatenate([e for e, _ in per])
            agree = np.concatenate([t for _, t in per])
            summary[run] = {"err": float(err.mean()), "top1": float(agree.mean()),
                            "agree": int(agree.sum())}
            print(f"{run:<24} {err.mean():>10.4f} {agree.mean():>8.4f}   "
                  + " ".join(f"{e.mean():.3f}" for e, _ in per))
        if a.record:
            record(name, spec, digest, cases, prompt_ids, refs, runs, summary)

def versions():
    from importlib.metadata import version
    llama = subprocess.run([venv_python(".venv-ref"), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           check=True, capture_output=True, text=True).stdout.strip()
    return {"llama_cpp_python": llama, "transformers": version("transformers"), "torch": version("torch"),
            "gguf": version("gguf")}

def record(name, spec, digest, cases, prompt_ids, refs, runs, summary):
    """tests/data/numerics/<name>.json: what tests/integration/numerics.rs needs, compactly."""
    rng = np.random.default_rng(SEED)
    vocab = refs[0].shape[1]
    sample = np.sort(rng.choice(vocab, SAMPLE, replace=False))
    out_cases, stored = [], []
    for ids, prompt, ref in zip(cases, prompt_ids, refs):
        fixed = np.round(ref[:, sample] * SCALE)
        assert np.abs(fixed).max() < 32767, "a sampled logit is out of the i16 range"
        fixed = fixed.astype("<i2")
        stored.append(fixed.astype(np.float32) / SCALE)
        out_cases.append({"prompt_tokens": len(prompt), "ids": ids,
                          "ref_top1": [int(t) for t in ref.argmax(-1)],
                          "ref_sample": base64.b64encode(fixed.tobytes()).decode()})
    def bar(run):
        logits = runs[run]
        err = np.concatenate([np.abs(g[:, sample] - r).mean(-1) for g, r in zip(logits, stored)])
        agree = np.concatenate([g.argmax(-1) == r.argmax(-1) for g, r in zip(logits, refs)])
        return {"sample_err": round(float(err.mean()), 5), "top1": round(float(agree.mean()), 5),
                "agree": int(agree.sum()), "vocab_err": round(summary[run]["err"], 5)}
    data = {
        "model": spec["file"], "sha256": digest,
        "reference": "transformers (f32, eager) on the GGUF's tensors dequantized to f32 by gguf-py; "
                     f"prompt + its own greedy continuation (up to {N_GEN} tokens, end of turn included, "
                     f"stopped before a token that would repeat a {REPEAT}-gram), one forward",
        "recorded_by": "scripts/gguf_numerics.py --record",
        "versions": versions(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "positions": sum(len(c) for c in cases),
        "sample_ids": [int(i) for i in sample], "scale": SCALE,
        "llama_cpp": {kv: bar(f"llama.cpp kv {kv}") for kv in ("f16", "f32")},
        "peregrine_when_recorded": {run.split(" kv ")[0] + " " + run.split(" kv ")[1]: bar(run)
                                    for run in runs if not run.startswith("llama.cpp")},
        "cases": out_cases,
    }
    path = ROOT / "tests/data/numerics" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB)")

if __name__ == "__main__":
    main()
