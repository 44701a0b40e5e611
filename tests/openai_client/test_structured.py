"""Structured output and forced tool calls on SmolLM2 at temperature 1.0: every sample must
parse and validate, which a 135M model does not manage unconstrained (the grammar does the work)."""
import json

import jsonschema

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "role", "tags", "address"],
    "additionalProperties": False,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


def test_fifty_samples_match_a_nested_schema(client, model):
    texts = []
    for seed in range(5):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe a user of our wiki as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}},
            temperature=1.0,
            n=10,
            seed=seed,
            max_tokens=200,
        )
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            texts.append(c.message.content)
    assert len(texts) == 50
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10, "temperature 1.0 should give varied samples"


def test_required_tool_choice_always_gives_a_valid_call(client, model):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls = 0
    for seed in range(2):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Is it warm in Lisbon? And what is 2 + 3?"}],
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            n=10,
            seed=seed,
            max_tokens=200,
        )
        for c in r.choices:
            assert c.finish_reason == "tool_calls"
            assert c.message.tool_calls
            for call in c.message.tool_calls:
                assert call.function.name in schemas
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
                calls += 1
    assert calls >= 20


def test_named_tool_choice_calls_that_function(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello!"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=1.0,
        n=4,
        max_tokens=100,
    )
    for c in r.choices:
        assert [t.function.name for t in c.message.tool_calls] == ["add"]
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), TOOLS[1]["function"]["parameters"])
