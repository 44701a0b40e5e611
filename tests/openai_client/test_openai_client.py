"""The official `openai` Python client against `peregrine serve` with SmolLM2-135M-Instruct.

Generations are short (the model runs on CPU); temperature 0 makes them deterministic.
"""
import json
import urllib.request

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat(client, model, **kw):
    args = dict(model=model, messages=QUESTION, temperature=0, max_tokens=12)
    args.update(kw)
    return client.chat.completions.create(**args)


def complete(client, model, **kw):
    args = dict(model=model, prompt="The quick brown fox", temperature=0, max_tokens=12)
    args.update(kw)
    return client.completions.create(**args)


def raw_post(base_url, path, body):
    """POSTs JSON with the standard library (no client-side parsing) and returns the body text."""
    request = urllib.request.Request(
        base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        assert r.status == 200
        return r.read().decode()


def test_models(client, model):
    ids = [m.id for m in client.models.list()]
    assert ids == [model]
    assert client.models.retrieve(model).id == model


def test_chat_whole_and_streamed_agree(client, model):
    whole = chat(client, model)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(chat(client, model, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    # The same counts; the streamed request may take more of its prompt from the prompt
    # cache (the whole one ran it before), never its last token.
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.model_dump(exclude={"prompt_tokens_details"}) \
        == whole.usage.model_dump(exclude={"prompt_tokens_details"})
    cached = usage.prompt_tokens_details.cached_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens <= cached < usage.prompt_tokens


def test_completions_whole_and_streamed_agree(client, model):
    whole = complete(client, model)
    chunks = list(complete(client, model, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage == whole.usage


def test_usage_counts_tokens(client, model):
    ids = [504, 2365, 6354, 16438]  # token ids of a short prompt, used as given
    r = complete(client, model, prompt=ids, max_tokens=6, logprobs=1)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_length_exactly_at_max_tokens(client, model):
    r = complete(client, model, max_tokens=5, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    r = chat(client, model, max_completion_tokens=4, max_tokens=None)
    assert r.usage.completion_tokens <= 4


def test_stop_strings_are_honoured_and_not_leaked(client, model):
    full = complete(client, model, max_tokens=16).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    expected = full[: full.index(stop)]
    for value in (stop, ["\u0001never", stop]):
        r = complete(client, model, max_tokens=16, stop=value)
        assert r.choices[0].text == expected
        assert r.choices[0].finish_reason == "stop"
        streamed = "".join(c.choices[0].text for c in complete(client, model, max_tokens=16, stop=value, stream=True))
        assert streamed == expected


def test_same_seed_same_text(client, model):
    a = chat(client, model, temperature=1.0, seed=1234, max_tokens=8)
    b = chat(client, model, temperature=1.0, seed=1234, max_tokens=8)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_n_choices(client, model):
    r = chat(client, model, n=2, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # temperature 0


def test_logprobs_sorted(client, model):
    r = chat(client, model, logprobs=True, top_logprobs=3, max_tokens=6)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob <= 0.0


def test_responses_validate_against_the_client_types(base_url, model):
    body = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 4}
    ChatCompletion.model_validate_json(raw_post(base_url, "/chat/completions", body))
    events = raw_post(base_url, "/chat/completions", {**body, "stream": True}).split("\n\n")
    assert events[-2] == "data: [DONE]"
    for event in events[:-2]:
        if event.startswith(":"):  # keep-alive comment during a slow prefill
            continue
        ChatCompletionChunk.model_validate_json(event.removeprefix("data: "))
    body = {"model": model, "prompt": "Hi", "temperature": 0, "max_tokens": 4}
    Completion.model_validate_json(raw_post(base_url, "/completions", body))


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
        ({"messages": [{"role": "user", "content": "word " * 10000}]}, "messages"),
    ],
)
def test_bad_requests(client, model, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, "no-such-model")
    assert e.value.body["code"] == "model_not_found"
