#!/usr/bin/env python3
"""Record reference token ids for Peregrine's tokenizer parity tests (crates/peregrine-engine/tests/tokenizer.rs).

Writes tests/data/tokenizer/*.json, each with the strings below (plus 450 seeded random strings) and:
  - smollm2_llamacpp.json, gemma3_llamacpp.json: llama.cpp's ids (llama-cpp-python, vocab_only,
    parse_special=True) without and with add_special, llama.cpp's own detokenization
    (llama_detokenize, remove_special=False, unparse_special=True), and its end-of-generation ids;
  - hf_fixture_llama.json: HF `tokenizers` ids for tests/fixtures/llama/hf/tokenizer.json.

Usage: .venv-ref/bin/python scripts/record_tokenizer_parity.py
  (after scripts/setup-ref-venv.sh and scripts/fetch-models.sh; models are looked up in
  ${PEREGRINE_MODELS:-$HOME/.cache/peregrine/models})
"""
import ctypes
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "tokenizer"
MODELS = Path(os.environ.get("PEREGRINE_MODELS", Path.home() / ".cache" / "peregrine" / "models"))
GGUF = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}
HF_FIXTURE = ROOT / "tests" / "fixtures" / "llama" / "hf" / "tokenizer.json"

STRINGS = [
    "",
    "a",
    "Hello, world!",
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple    internal     spaces",
    " ",
    "   ",
    "      indented code line",
    "\t",
    "tab\tseparated\tvalues",
    "\n",
    "trailing newline\n",
    "line one\nline two",
    "\n\n\ndouble newlines\n\nhere",
    "\r\nwindows line\r\n",
    "mixed \t \n whitespace \n\t ",
    "1234567890",
    "3.14159265358979",
    "The year 2024 had 366 days.",
    "12345678901234567890123456789012345678901234567890",
    "-42 +7 1e-9 0x1F 1,000,000",
    "Grüße aus München",
    "café naïve résumé",
    "¡Hola! ¿Qué tal?",
    "日本語のテキストです。",
    "中文分词测试，包括标点符号。",
    "한국어 문장입니다",
    "Привет, мир!",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "ภาษาไทย",
    "emoji 🙂😀🎉",
    "👨‍👩‍👧‍👦 family",
    "🇫🇷🇯🇵",
    "math: ∑ x² ≤ ∞, α β γ",
    "Ⅻ Ⅷ ½ ²³ ١٢٣ ४२",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ",
    "zero\u200bwidth\u00a0nbsp",
    "control\u0001chars\u007f",
    "x\u0301 combining e\u0308",
    "def main():\n    print('hello world')\n    return 0\n",
    "fn main() { let x: Vec<u32> = vec![1, 2, 3]; }",
    "if (a && b || !c) { x += 1; } // comment",
    "<html><body><p>Hi</p></body></html>",
    "SELECT * FROM users WHERE id = 42;",
    '{"key": "value", "n": [1, 2, 3]}',
    "user@example.org and /usr/local/bin",
    "I'm sure you've seen they'll do it, won't they? I'd say we're fine.",
    "DON'T SHOUT",
    "CamelCaseIdentifier snake_case_identifier kebab-case-identifier",
    "...!!!???",
    "a" * 120,
    "ha" * 40,
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_end|><|im_start|>",
    "text<|im_end|>",
    "<|endoftext|>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>hello",
    "<s> and </s> literal",
    "<unk>",
    "<|im_start|> spaced <|im_end|> ",
]

RANDOM_ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    "     \t\n\n.,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`"
    "éèüößñçÅØ日本語中文한국어абвгдеαβγδ🙂🎉∑∞½²١"
)
# Fragments that stress special-token splitting, whitespace runs and merges across boundaries.
PIECES = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<unused12>",
    "<0x41>", "\u2581", "  ", "   ", "\n\n", "\n", "\t", "<s>", "</s>", "<table>", "<bos>", "<eos>",
    "<|im_", "end|>", "<pad>", "[multimodal]", " ", "'s", "'ll", "ing", "the", "12", "345", "日本",
    "語", "🙂", "é", "e\u0301",
]
N_RANDOM = 150


def random_strings():
    """Seeded random strings: characters from a mixed alphabet, fragments from PIECES, and code
    points from the BMP and beyond (no surrogates)."""
    rng = random.Random(20261129)
    out = []
    for _ in range(N_RANDOM):
        out.append("".join(rng.choice(RANDOM_ALPHABET) for _ in range(rng.randint(1, 40))))
    for _ in range(N_RANDOM):
        out.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))))
    for _ in range(N_RANDOM):
        cps, n = [], rng.randint(1, 30)
        while len(cps) < n:
            r = rng.random()
            c = rng.randint(0x20, 0x7E) if r < 0.5 else rng.randint(0xA0, 0x2FFF) if r < 0.8 else rng.randint(0x3000, 0x1FAFF)
            if not 0xD800 <= c <= 0xDFFF:
                cps.append(chr(c))
        out.append("".join(cps))
    return out


def record_gguf(name, path, texts):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def detokenize(ids):
        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        size = 256 + 64 * len(ids)
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, True)
        if n < 0:
            sys.exit(f"{name}: detokenize buffer too small ({-n} needed)")
        return buf.raw[:n].decode("utf-8", errors="replace")

    cases = []
    mismatched = 0
    for text in texts:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        with_special = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        detok = detokenize(ids)
        mismatched += detok != text
        cases.append({"text": text, "ids": ids, "ids_add_special": with_special, "detok": detok})
    eog = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    print(f"{name}: {len(cases)} strings, {mismatched} do not round-trip in llama.cpp", file=sys.stderr)
    return {
        "generator": "scripts/record_tokenizer_parity.py",
        "reference": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}: tokenize(parse_special=True), llama_detokenize(remove_special=False, unparse_special=True)",
        "model_file": path.name,
        "vocab_size": n_vocab,
        "bos_id": llama_cpp.llama_vocab_bos(vocab),
        "eos_id": llama_cpp.llama_vocab_eos(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "eog_ids": eog,
        "cases": cases,
    }


def record_hf(path, texts):
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(path))
    cases = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        with_special = tok.encode(text, add_special_tokens=True).ids
        detok = tok.decode(ids, skip_special_tokens=False)
        cases.append({"text": text, "ids": ids, "ids_add_special": with_special, "detok": detok})
    return {
        "generator": "scripts/record_tokenizer_parity.py",
        "reference": f"HF tokenizers (Python) {tokenizers.__version__}: encode(add_special_tokens=False/True), decode(skip_special_tokens=False)",
        "tokenizer_dir": str(path.parent.relative_to(ROOT)),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "cases": cases,
    }


def write(name, data):
    OUT.mkdir(parents=True, exist_ok=True)
    target = OUT / f"{name}.json"
    with open(target, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {target.relative_to(ROOT)} ({target.stat().st_size} bytes)", file=sys.stderr)


def main():
    texts = STRINGS + random_strings()
    for name, file in GGUF.items():
        path = MODELS / file
        if not path.exists():
            sys.exit(f"{path} is missing: run scripts/fetch-models.sh first")
        write(f"{name}_llamacpp", record_gguf(name, path, texts))
    if not HF_FIXTURE.exists():
        sys.exit(f"{HF_FIXTURE} is missing: generate the fixtures first")
    write("hf_fixture_llama", record_hf(HF_FIXTURE, texts))


if __name__ == "__main__":
    main()
