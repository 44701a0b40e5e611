"""Fixtures for the openai-client suite: a client pointed at a running `peregrine serve`.

scripts/test-openai-client.sh starts the server and sets PEREGRINE_BASE_URL and PEREGRINE_MODEL.
"""
import os

import openai
import pytest


@pytest.fixture(scope="session")
def base_url():
    return os.environ.get("PEREGRINE_BASE_URL", "http://127.0.0.1:5413/v1")


@pytest.fixture(scope="session")
def model():
    return os.environ["PEREGRINE_MODEL"]


@pytest.fixture(scope="session")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
