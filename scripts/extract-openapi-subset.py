#!/usr/bin/env python3
"""Extracts the response schemas of chat completions and completions from OpenAI's OpenAPI spec.

Usage: scripts/extract-openapi-subset.py SPEC.yaml [OUT.json]
  SPEC.yaml  openapi.yaml of the openai/openai-openapi repository (or the excerpt of it kept in
             tests/data/openapi/, which gives the same output)
  OUT.json   default tests/data/openapi/openai-completions-subset.json

Keeps `components.schemas` entries reachable through `$ref` from the roots below, copied as
they are (OpenAPI 3.0 form: `nullable`, `$ref: '#/components/schemas/X'`; the test's loader
turns them into JSON Schema). The one thing removed is every `x-oaiMeta` key: documentation-site
metadata (names, groups, examples) that does not constrain anything. Needs PyYAML.
"""
import json
import sys

import yaml

ROOTS = [
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
]
PREFIX = "#/components/schemas/"


def strip_meta(node):
    if isinstance(node, dict):
        return {k: strip_meta(v) for k, v in node.items() if k != "x-oaiMeta"}
    if isinstance(node, list):
        return [strip_meta(v) for v in node]
    return node


def refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                if not v.startswith(PREFIX):
                    raise SystemExit(f"unexpected $ref {v!r}")
                yield v[len(PREFIX):]
            else:
                yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


def main():
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    out = sys.argv[2] if len(sys.argv) == 3 else "tests/data/openapi/openai-completions-subset.json"
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = yaml.safe_load(f)
    schemas = spec["components"]["schemas"]
    keep, todo = {}, list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = strip_meta(schemas[name])
        todo.extend(refs(keep[name]))
    subset = {
        "openapi": spec["openapi"],
        "info": {"title": spec["info"]["title"], "version": spec["info"]["version"]},
        "components": {"schemas": {name: keep[name] for name in sorted(keep)}},
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(subset, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"{out}: {len(keep)} schemas: {', '.join(sorted(keep))}")


if __name__ == "__main__":
    main()
