"""The independent OpenAPI-spec checker `llm-comply` against `peregrine serve`, for OpenAI chat,
Anthropic Messages and OpenAI Responses. Every check must pass on SmolLM2 except the image-input
ones, which run against the tiny vision-language fixtures (Gemma 3, SmolVLM) instead; checks the
tool skips itself (reasoning models only) are skipped.

The checks sample at the server's default temperature from a 135M model, and some want a
natural end (`end_turn`) within 1,024 tokens, which such a model now and then misses by
rambling: `anth-system-prompt` ran to 1,024 tokens in 16 of 200 samples here, and once failed
three tries in a row in CI. So a failed check is run up to five more times on its own, and passes
if one of those runs passes (a broken endpoint fails all six; chance ones at 8% fail all six about
once in four million)."""
import json
import os
import subprocess
import sys

import pytest

COMPLY = os.path.join(os.path.dirname(sys.executable), "llm-comply")
RETRIES = 5


def comply(base_url, model, api, only=None):
    cmd = [COMPLY, "run", "--format", api, "-k", "unused", "-u", base_url, "-m", model, "--json"]
    if only:
        cmd += ["-f", only]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    return json.loads(run.stdout)["results"]


@pytest.mark.parametrize("api", ["openai-chat", "anthropic", "open-responses"])
def test_llm_comply(base_url, model, api):
    results = comply(base_url, model, api)
    failed = {
        r["id"]: [r.get("errors")]
        for r in results
        if r["status"] not in ("passed", "skipped") and "image" not in r["id"]
    }
    for check in list(failed):
        for _ in range(RETRIES):
            again = comply(base_url, model, api, only=check)[0]
            if again["status"] == "passed":
                print(f"{check}: passed on a rerun after {failed[check]}")
                del failed[check]
                break
            failed[check].append(again.get("errors"))
    assert not failed, failed
    passed = [r["id"] for r in results if r["status"] == "passed"]
    assert len(passed) >= 5, results


IMAGE_CHECKS = {"openai-chat": "chat-image-input", "anthropic": "anth-image-input",
                "open-responses": "image-input"}
VLM_FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "vlm")


@pytest.mark.parametrize("family", ["gemma3", "smolvlm", "qwen2_5_vl"])
def test_llm_comply_image_input(family):
    """The image-input checks (a base64 JPEG in each API's own form) against a served VLM fixture;
    its random weights must still stop on their own (`stop` / `end_turn`), so a failed check gets
    the same reruns as above."""
    from test_server_process import Server

    server = Server(model=os.path.join(VLM_FIXTURES, family, "hf"), alias=family)
    try:
        server.wait_ready()
        for api, check in IMAGE_CHECKS.items():
            errors = []
            for _ in range(1 + RETRIES):
                result = comply(server.url + "/v1", family, api, only=check)[0]
                if result["status"] == "passed":
                    break
                errors.append(result.get("errors"))
            else:
                pytest.fail(f"{family} {check}: {errors}")
    finally:
        server.close()
