"""Record llama.cpp's greedy chat answers (its own chat-template handling) for SmolLM2 Q4_1.
usage: .venv-ref/bin/python scripts/record_llamacpp_chat.py   (writes tests/data/llamacpp/smollm2_chat.json)"""
import hashlib, json, os, sys
from llama_cpp import Llama, __version__

MODELS = os.environ.get("PEREGRINE_MODELS", os.path.expanduser("~/.cache/peregrine/models"))
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["Which city is the capital of France?", "What is 2 + 2?", "Name a color of the sky."]

def main():
    path = os.path.join(MODELS, FILE)
    llm = Llama(path, n_ctx=2048, n_threads=2, seed=0, verbose=False)
    cases = []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        r = llm.create_chat_completion(messages=messages, max_tokens=32, temperature=0.0)
        cases.append({"messages": messages, "max_tokens": 32, "text": r["choices"][0]["message"]["content"],
                      "finish_reason": r["choices"][0]["finish_reason"], "usage": r["usage"]})
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    out = {"model": FILE, "sha256": sha, "llama_cpp_python": __version__,
           "how": "Llama.create_chat_completion (template from GGUF tokenizer.chat_template), temperature 0",
           "cases": cases}
    dest = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "llamacpp", "smollm2_chat.json")
    json.dump(out, open(dest, "w"), indent=1, ensure_ascii=False)
    print(json.dumps(cases, indent=1, ensure_ascii=False))

if __name__ == "__main__":
    sys.exit(main())
