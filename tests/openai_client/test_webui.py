"""The chat page at `/`, in a real headless Chromium (Debian's chromium and chromium-driver, which
scripts/test-openai-client.sh installs when they are missing): load it, pick the model, send a
message, see the answer stream in, press stop, and find the conversation again after a reload.

Screenshots go to $PEREGRINE_ARTIFACTS (default target/artifacts): webui-streaming.png while the
answer streams, webui-stopped.png after the reload.
"""
import os
import pathlib
import time

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
ARTIFACTS = pathlib.Path(os.environ.get("PEREGRINE_ARTIFACTS", "target/artifacts"))
PROMPT = "Tell me a long story about a dragon who learns to bake bread."


@pytest.fixture
def browser():
    for path in (CHROMIUM, CHROMEDRIVER):
        assert os.path.exists(path), f"{path} is missing: apt-get install chromium chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1100,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def answer(browser):
    """The text of the last assistant message shown ("" before there is one)."""
    found = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .content")
    return found[-1].text if found else ""


def test_the_chat_page_streams_an_answer_and_stops_it(browser, base_url, model):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    wait = WebDriverWait(browser, 120, poll_frequency=0.05)
    browser.get(base_url.removesuffix("/v1") + "/")

    # The model picker is filled from /v1/models.
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
    models = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#model option")]
    assert model in models, models
    stop = browser.find_element(By.ID, "stop")
    assert not stop.is_displayed()

    # Long enough that the stop button lands mid-answer; greedy, so that the answer is the same
    # long story every run (sampled, a short one ended before it grew: a CI run timed out here).
    browser.execute_script(
        "for (const [id, v] of [['max-tokens', '800'], ['temperature', '0']]) {"
        "  const e = document.getElementById(id); e.value = v;"
        "  e.dispatchEvent(new Event('change')); }")
    browser.find_element(By.ID, "input").send_keys(PROMPT)
    browser.find_element(By.ID, "send").click()

    # Streamed: text shows and then grows while the reply is still running (stop shown).
    first = wait.until(lambda d: stop.is_displayed() and answer(d))
    grown = wait.until(lambda d: stop.is_displayed() and len(answer(d)) > len(first) + 20 and answer(d))
    assert grown.startswith(first.strip()[:5]), (first, grown)
    browser.save_screenshot(str(ARTIFACTS / "webui-streaming.png"))

    stop.click()
    wait.until(lambda d: "[stopped]" in answer(d))
    assert not stop.is_displayed()
    assert browser.find_element(By.ID, "send").is_enabled()
    stopped = answer(browser)
    time.sleep(1.0)
    assert answer(browser) == stopped, "text kept arriving after stop"

    # The conversation is kept in the browser's local storage.
    browser.refresh()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.user"))
    users = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".message.user .content")]
    assert users == [PROMPT]
    assert answer(browser) == stopped
    browser.save_screenshot(str(ARTIFACTS / "webui-stopped.png"))

    # A new chat forgets it.
    browser.find_element(By.ID, "new-chat").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".message")


def test_answers_render_as_markdown_never_as_markup(browser, base_url):
    browser.get(base_url.removesuffix("/v1") + "/")
    answer_text = "\n".join([
        "# Title", "**bold**, *slanted* and `a<b>`", "- one", "- two", "",
        "```python", "<script>alert(1)</script>", "```",
        "<img src=x onerror=alert(1)> [bad](javascript:alert(1)) [good](https://example.org/a)",
    ])
    html = browser.execute_script("return renderMarkdown(arguments[0]);", answer_text)
    for expected in ("<h1>Title</h1>", "<strong>bold</strong>", "<em>slanted</em>",
                     "<code>a&lt;b&gt;</code>", "<ul><li>one</li><li>two</li></ul>",
                     "<pre><code>&lt;script&gt;alert(1)&lt;/script&gt;</code></pre>",
                     '<a href="https://example.org/a"'):
        assert expected in html, (expected, html)
    # What a model writes is shown, never run: no element or link comes from it.
    for forbidden in ("<script", "<img", 'href="javascript'):
        assert forbidden not in html, (forbidden, html)
