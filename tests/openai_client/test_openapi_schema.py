"""Raw responses and stream chunks of `peregrine serve` validate against OpenAI's published
OpenAPI schema for chat completions and completions.

The schemas are tests/data/openapi/openai-completions-subset.json: a verbatim subset of the
openai/openai-openapi repository's `openapi.yaml` (see the README beside it). The spec is
OpenAPI 3.0, so `to_json_schema` turns its schemas into JSON Schema first:
  * `$ref: '#/components/schemas/X'` is replaced by X, converted (the subset has no cycles);
    like OpenAPI 3.0, keys beside a `$ref` are ignored;
  * `nullable: true` adds null to what the schema accepts: `"null"` joins `type`, `None` joins
    `enum` (an enum without it would still reject null), and a schema with no `type` becomes
    `anyOf: [schema, {"type": "null"}]`. Without `nullable`, null is rejected, as OpenAPI 3.0
    says: a required-but-nullable field (`logprobs`, `message.content`, `finish_reason` of a
    chunk) must be present, and may be null only where the spec says so.
Other OpenAPI keywords (`example`, `deprecated`, `x-…`) are annotations that the validator
ignores. Requests go over raw HTTP, so no client-side parsing hides a missing or null field.
"""
import copy
import json
import pathlib

import jsonschema
import pytest

try:  # the `openai` client brings httpx (as `httpx2` in the 3.x line)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

SUBSET = pathlib.Path(__file__).resolve().parents[1] / "data" / "openapi" / "openai-completions-subset.json"
REF = "#/components/schemas/"
CHAT = "CreateChatCompletionResponse"
CHUNK = "CreateChatCompletionStreamResponse"
COMPLETION = "CreateCompletionResponse"  # both whole answers and stream chunks, per the spec
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def to_json_schema(node, schemas):
    """One OpenAPI 3.0 schema object as JSON Schema (see the module docstring)."""
    if isinstance(node, list):
        return [to_json_schema(v, schemas) for v in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith(REF), ref
        return to_json_schema(schemas[ref[len(REF):]], schemas)
    out = {}
    for key, value in node.items():
        if key == "nullable":
            continue
        if key in ("properties", "patternProperties"):  # maps of name -> schema
            out[key] = {k: to_json_schema(v, schemas) for k, v in value.items()}
        elif key in ("required", "enum", "type"):  # values, not schemas
            out[key] = copy.deepcopy(value)
        else:
            out[key] = to_json_schema(value, schemas)
    if node.get("nullable") is True:
        if "type" in out:
            out["type"] = [out["type"], "null"]
            if "enum" in out and None not in out["enum"]:
                out["enum"] = out["enum"] + [None]
        else:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


def load_validators():
    schemas = json.loads(SUBSET.read_text())["components"]["schemas"]
    validators = {}
    for name in (CHAT, CHUNK, COMPLETION):
        schema = to_json_schema(schemas[name], schemas)
        jsonschema.Draft202012Validator.check_schema(schema)
        validators[name] = jsonschema.Draft202012Validator(schema)
    return validators


VALIDATORS = load_validators()


def errors(name, instance):
    return sorted(VALIDATORS[name].iter_errors(instance), key=lambda e: list(e.absolute_path))


def describe(errs):
    return "\n".join(f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errs)


def assert_valid(name, instance):
    errs = errors(name, instance)
    assert not errs, f"{name} rejects {json.dumps(instance)}:\n{describe(errs)}"


def completion_chunk_errors(chunk):
    """A completions stream chunk's errors, less `finish_reason: null` on a choice that has not
    finished. The spec gives streamed and whole completions one schema, whose `finish_reason` is
    a required, non-nullable string, yet a chunk before a choice's last cannot have a reason, and
    OpenAI's own stream sends null there. That one deviation is allowed; nothing else is."""
    rest = []
    for e in errors(COMPLETION, chunk):
        path = list(e.absolute_path)
        unfinished = len(path) == 3 and path[0] == "choices" and path[2] == "finish_reason"
        if not (unfinished and e.instance is None and e.validator in ("type", "enum")):
            rest.append(e)
    return rest


def post(base_url, path, body):
    r = httpx.post(base_url + path, json=body, timeout=600)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.json()


def post_stream(base_url, path, body):
    """The JSON chunks of a streamed answer, after checking the SSE framing."""
    with httpx.stream("POST", base_url + path, json={**body, "stream": True}, timeout=600) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], text[-200:]
    chunks = []
    for event in events[:-2]:
        if event.startswith(":"):  # keep-alive comment
            continue
        assert event.startswith("data: "), event
        chunks.append(json.loads(event.removeprefix("data: ")))
    assert chunks
    return chunks


def chat_body(model, **kw):
    return {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 8, **kw}


def completion_body(model, **kw):
    return {"model": model, "prompt": "The quick brown fox", "temperature": 0, "max_tokens": 8, **kw}


CHAT_CASES = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 3},
    "n2": {"n": 2},
    "stop": {"stop": [" ", "\n"], "max_tokens": 16},  # any answer has a space: finish "stop"
    "length": {"max_tokens": 2, "ignore_eos": True},
}


@pytest.mark.parametrize("case", CHAT_CASES)
def test_chat_completion(base_url, model, case):
    r = post(base_url, "/chat/completions", chat_body(model, **CHAT_CASES[case]))
    assert_valid(CHAT, r)
    assert len(r["choices"]) == (2 if case == "n2" else 1)
    if case == "logprobs":
        content = r["choices"][0]["logprobs"]["content"]
        assert content and all(len(t["top_logprobs"]) == 3 for t in content)
    if case in ("stop", "length"):
        assert r["choices"][0]["finish_reason"] == case


@pytest.mark.parametrize(
    "case,include_usage",
    [("plain", True), ("plain", False), ("logprobs", True), ("n2", True), ("stop", True), ("length", True)],
)
def test_chat_stream_chunks(base_url, model, case, include_usage):
    body = chat_body(model, **CHAT_CASES[case], stream_options={"include_usage": include_usage})
    chunks = post_stream(base_url, "/chat/completions", body)
    for chunk in chunks:
        assert_valid(CHUNK, chunk)
    if include_usage:
        last = chunks[-1]
        assert last["choices"] == [] and set(last["usage"]) >= {"prompt_tokens", "completion_tokens"}
        chunks = chunks[:-1]
    assert all(c.get("usage") is None for c in chunks)
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert len(finishes) == (2 if case == "n2" else 1)
    if case in ("stop", "length"):
        assert finishes == [case]
    if case == "logprobs":
        assert any(ch["logprobs"] for c in chunks for ch in c["choices"])


COMPLETION_CASES = {
    "plain": {},
    "logprobs": {"logprobs": 2},
    "echo": {"echo": True},
    "n2": {"n": 2},
    "token-prompts": {"prompt": [[504, 2365, 6354], [504, 2365]]},
    "length": {"max_tokens": 2, "ignore_eos": True},
}


@pytest.mark.parametrize("case", COMPLETION_CASES)
def test_completion(base_url, model, case):
    r = post(base_url, "/completions", completion_body(model, **COMPLETION_CASES[case]))
    assert_valid(COMPLETION, r)
    if case == "logprobs":
        lp = r["choices"][0]["logprobs"]
        assert lp["tokens"] and all(len(t) >= 1 for t in lp["top_logprobs"])


@pytest.mark.parametrize("case", ["plain", "logprobs", "n2", "echo"])
def test_completion_stream_chunks(base_url, model, case):
    body = completion_body(model, **COMPLETION_CASES[case], stream_options={"include_usage": True})
    chunks = post_stream(base_url, "/completions", body)
    for chunk in chunks:
        errs = completion_chunk_errors(chunk)
        assert not errs, f"{json.dumps(chunk)}:\n{describe(errs)}"
    usage = chunks[-1]
    assert_valid(COMPLETION, usage)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] > 0
    finished = [ch for c in chunks[:-1] for ch in c["choices"] if ch["finish_reason"] is not None]
    assert len(finished) == (2 if case == "n2" else 1)
    for c in chunks[:-1]:
        if all(ch["finish_reason"] is not None for ch in c["choices"]):
            assert_valid(COMPLETION, c)  # a choice's last chunk meets the schema in full


def test_the_validator_rejects_broken_copies(base_url, model):
    """The check can fail: broken copies of real answers are rejected, and only they."""
    chat = post(base_url, "/chat/completions", chat_body(model, logprobs=True, top_logprobs=2))
    assert_valid(CHAT, chat)
    chunks = post_stream(base_url, "/chat/completions", chat_body(model, stream_options={"include_usage": True}))
    completion = post(base_url, "/completions", completion_body(model, logprobs=1))
    assert_valid(COMPLETION, completion)

    def broken(doc, edit):
        doc = copy.deepcopy(doc)
        edit(doc)
        return doc

    bad_chats = {
        "no created": lambda d: d.pop("created"),
        "created as text": lambda d: d.update(created=str(d["created"])),
        "wrong object": lambda d: d.update(object="chat.completion.chunk"),
        "no logprobs (required, nullable)": lambda d: d["choices"][0].pop("logprobs"),
        "no message.refusal": lambda d: d["choices"][0]["message"].pop("refusal"),
        "null finish_reason": lambda d: d["choices"][0].update(finish_reason=None),
        "unknown finish_reason": lambda d: d["choices"][0].update(finish_reason="eos"),
        "null system_fingerprint": lambda d: d.update(system_fingerprint=None),
        "token bytes as text": lambda d: d["choices"][0]["logprobs"]["content"][0].update(bytes="ab"),
        "no usage.total_tokens": lambda d: d["usage"].pop("total_tokens"),
    }
    for what, edit in bad_chats.items():
        assert errors(CHAT, broken(chat, edit)), f"{what}: accepted"
    bad_chunks = {
        "no created": (chunks[0], lambda d: d.pop("created")),
        "null usage (not nullable in the spec)": (chunks[0], lambda d: d.update(usage=None)),
        "no finish_reason (required, nullable)": (chunks[0], lambda d: d["choices"][0].pop("finish_reason")),
        "role not a role": (chunks[0], lambda d: d["choices"][0]["delta"].update(role="wizard")),
        "usage without prompt_tokens": (chunks[-1], lambda d: d["usage"].pop("prompt_tokens")),
    }
    for what, (chunk, edit) in bad_chunks.items():
        assert errors(CHUNK, broken(chunk, edit)), f"{what}: accepted"
    bad_completions = {
        "no created": lambda d: d.pop("created"),
        "no text": lambda d: d["choices"][0].pop("text"),
        "top_logprobs as a list of lists": lambda d: d["choices"][0]["logprobs"].update(top_logprobs=[[1.0]]),
    }
    for what, edit in bad_completions.items():
        assert errors(COMPLETION, broken(completion, edit)), f"{what}: accepted"
        assert completion_chunk_errors(broken(completion, edit)), f"{what}: accepted in a chunk"
    # Where the spec says nullable, null is accepted.
    assert not errors(CHAT, broken(chat, lambda d: d["choices"][0].update(logprobs=None)))
    assert not errors(CHAT, broken(chat, lambda d: d["choices"][0]["message"].update(content=None)))
    assert not errors(CHUNK, broken(chunks[0], lambda d: d["choices"][0].update(finish_reason=None)))


def test_nullable_conversion():
    schemas = {"S": {"type": "string", "enum": ["a"], "nullable": True}}
    assert to_json_schema({"$ref": REF + "S"}, schemas) == {"type": ["string", "null"], "enum": ["a", None]}
    assert to_json_schema({"oneOf": [{"type": "integer"}], "nullable": True}, {}) == {
        "anyOf": [{"oneOf": [{"type": "integer"}]}, {"type": "null"}]
    }
    assert to_json_schema({"type": "object", "properties": {"nullable": {"type": "string"}}}, {}) == {
        "type": "object",
        "properties": {"nullable": {"type": "string"}},
    }
