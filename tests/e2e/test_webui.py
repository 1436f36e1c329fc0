"""The web UI (router/webui/) in headless chromium against a real server with
scripted engines: chat streams, stop aborts, the Models page follows
/models/sse, the key dialog, and model output that looks like HTML stays text.

With ROUNDHOUSE_UPDATE_SCREENSHOTS=1 the tests also rewrite the screenshots
in docs/images/ that docs/webui.md shows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest

from tests.support.browser import (
    SCREENSHOTS_DIR,
    VIEWPORT,
    find_chromium,
    launched_chromium,
    update_screenshots,
)
from tests.support.scripted_models import ENGINE_ENV, scripted_model
from tests.support.server import Server, running_server, wait_until

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, LocatorAssertions, Page

pytestmark = [pytest.mark.slow, pytest.mark.browser]

KEY = "sk-webui-test-key"
HELLO_REPLY = ("<think>\nThe user greets me; a short answer with some code.\n</think>\n\n"
               "Hello from **Roundhouse**! A line of Python:\n\n"
               "```python\nprint(\"hello\")\n```\n")
HOSTILE_REPLY = ("Careful: <script>alert(1)</script> and <img src=x onerror=alert(2)> "
                 "stay text.")
CHAT_SCRIPT = {
    # Slow enough that a stop lands mid-story, quick enough for the rest.
    "step_seconds": 0.02,
    "rules": [
        {"when": "Say hello", "reply": HELLO_REPLY},
        {"when": "Show me markup", "reply": HOSTILE_REPLY},
        {"when": "Tell me a long story",
         "reply": "Once upon a time " + "the engines rolled into the roundhouse, " * 400},
    ],
    "default": "I only know a few lines.",
}
OTHER_SCRIPT = {"rules": [], "default": "The other model answers."}
# How long the Models page is watched for polling; the page may poll /v1/load
# "every few seconds", so a state poll would show within this window.
QUIET_WINDOW_MS = 3000
TIMEOUT_MS = 20_000


@pytest.fixture(scope="module")
def chromium_browser() -> Iterator[Browser]:
    executable, reason = find_chromium()
    if executable is None:
        pytest.skip(f"browser tests skipped: {reason}")
    from playwright.sync_api import expect as playwright_expect

    playwright_expect.set_options(timeout=TIMEOUT_MS)
    with launched_chromium(executable) as browser:
        yield browser


@pytest.fixture(scope="module")
def webui_models(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Path:
    models = tmp_path_factory.mktemp("webui") / "models"
    models.mkdir()
    scripted_model(models / "alpha", tiny_qwen3_dir, CHAT_SCRIPT)
    scripted_model(models / "beta", tiny_qwen3_dir, OTHER_SCRIPT)
    return models


@pytest.fixture(scope="module")
def server(webui_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("webui-log") / "router.log"
    with running_server(["--models-dir", str(webui_models)], log, env=ENGINE_ENV) as running:
        yield running


@pytest.fixture(scope="module")
def keyed_server(webui_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("webui-keyed-log") / "router.log"
    args = ["--models-dir", str(webui_models), "--api-key", KEY]
    with running_server(args, log, env=ENGINE_ENV) as running:
        yield running


@pytest.fixture
def dialogs() -> list[str]:
    """The messages of every alert/confirm/prompt the page opened."""
    return []


@pytest.fixture
def page(chromium_browser: Browser, dialogs: list[str]) -> Iterator[Page]:
    """A fresh page (its own localStorage) that records its dialogs."""
    context = chromium_browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    yield page
    context.close()


def expect(actual: Locator) -> LocatorAssertions:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(actual)


def open_chat(page: Page, server: Server, model: str = "alpha") -> None:
    page.goto(server.url + "/#/chat")
    pick_model(page, model)


def pick_model(page: Page, model: str) -> None:
    picker = page.locator("select[data-testid=model-select]")
    expect(picker.locator(f"option[value={model}]")).to_have_count(1)
    picker.select_option(model)


def send(page: Page, text: str) -> Locator:
    """Type and send a message; the assistant message it starts."""
    before = page.locator("[data-testid=message][data-role=assistant]").count()
    page.fill("[data-testid=chat-input]", text)
    page.click("[data-testid=send]")
    answers = page.locator("[data-testid=message][data-role=assistant]")
    expect(answers).to_have_count(before + 1)
    return answers.nth(before)


def record_states(page: Page) -> None:
    """Keep every data-state an assistant message passes through, in window.__states:
    a quick answer may be done before a test could look at it streaming."""
    page.evaluate("""() => {
        window.__states = [];
        const messages = document.querySelector('[data-testid=messages]');
        new MutationObserver((changes) => {
            for (const change of changes) {
                const nodes = change.type === 'attributes' ? [change.target]
                    : [...change.addedNodes].filter((n) => n.nodeType === 1);
                for (const node of nodes) {
                    if (node.dataset && node.dataset.role === 'assistant' && node.dataset.state) {
                        window.__states.push(node.dataset.state);
                    }
                }
            }
        }).observe(messages, {subtree: true, childList: true, attributes: true,
                              attributeFilter: ['data-state']});
    }""")


def screenshot(page: Page, name: str) -> None:
    if update_screenshots():
        SCREENSHOTS_DIR.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS_DIR / name))


# ---- chat ------------------------------------------------------------------------------


def test_a_message_streams_its_answer_with_reasoning_markdown_and_stats(page: Page, server: Server) -> None:
    open_chat(page, server)
    record_states(page)
    answer = send(page, "Say hello")
    expect(answer).to_have_attribute("data-state", "done")
    states = page.evaluate("window.__states")
    assert "streaming" in states and states[-1] == "done", states

    user = page.locator("[data-testid=message][data-role=user]")
    expect(user).to_have_count(1)
    expect(user).to_contain_text("Say hello")
    content = answer.locator("[data-testid=message-content]")
    expect(content).to_contain_text("Hello from Roundhouse! A line of Python:")
    expect(content.locator("strong")).to_have_text("Roundhouse")
    expect(content.locator("pre code")).to_have_text('print("hello")')
    # The reasoning is kept apart, not in the answer.
    reasoning = answer.locator("details[data-testid=reasoning]")
    expect(reasoning).to_contain_text("The user greets me")
    reasoning.locator("summary").click()
    expect(reasoning.get_by_text("The user greets me")).to_be_visible()
    assert "The user greets me" not in content.inner_text()
    stats = answer.locator("[data-testid=stats]")
    expect(stats).to_contain_text("tok/s")
    expect(stats).to_contain_text("TTFT")
    expect(page.locator("[data-testid=conversation]")).to_have_count(1)
    saved = page.evaluate("localStorage.getItem('roundhouse.conversations')")
    assert saved and "Hello from **Roundhouse**" in saved
    screenshot(page, "webui-chat.png")


def test_stop_ends_the_generation_in_the_page_and_on_the_server(page: Page, server: Server) -> None:
    cancelled_before = server.log().count("cancelled by the client")
    open_chat(page, server)
    answer = send(page, "Tell me a long story")
    content = answer.locator("[data-testid=message-content]")
    expect(content).to_contain_text("Once upon a time")
    expect(answer).to_have_attribute("data-state", "streaming")
    stop = page.locator("[data-testid=stop]")
    expect(stop).to_be_visible()
    stop.click()
    expect(answer).to_have_attribute("data-state", "stopped")
    expect(stop).to_be_hidden()
    # The story is 400 sentences at 20 ms a token: a stop that did not reach
    # the server would leave it generating for most of a minute.
    wait_until(lambda: server.log().count("cancelled by the client") > cancelled_before, 10,
               "the server to log the request cancelled", server)
    wait_until(lambda: server.load()["alpha"]["in_flight"] == 0, 10,
               "the engine to drop the stopped request", server)
    shown = content.inner_text()
    assert "Once upon a time" in shown and shown.count("roundhouse") < 400


def test_model_output_that_looks_like_html_is_shown_as_text(page: Page, server: Server,
                                                             dialogs: list[str]) -> None:
    open_chat(page, server)
    answer = send(page, "Show me markup")
    expect(answer).to_have_attribute("data-state", "done")
    content = answer.locator("[data-testid=message-content]")
    expect(content).to_contain_text(HOSTILE_REPLY)
    messages = page.locator("[data-testid=messages]")
    assert messages.locator("script").count() == 0
    assert messages.locator("img").count() == 0
    assert messages.locator("[onerror]").count() == 0
    assert dialogs == []


# ---- models ----------------------------------------------------------------------------


def test_the_models_page_loads_and_sleeps_a_model_from_the_event_stream(page: Page, server: Server) -> None:
    requests: list[tuple[str, str]] = []
    finished: list[str] = []
    page.on("request", lambda request: requests.append((request.method, request.url)))
    page.on("requestfinished", lambda request: finished.append(request.url))
    page.on("requestfailed", lambda request: finished.append(request.url))

    def state_polls() -> int:
        return sum(1 for method, url in requests
                   if method == "GET" and urlsplit(url).path in ("/models", "/v1/models"))

    page.goto(server.url + "/#/models")
    row = page.locator("[data-testid=model-row][data-model=beta]")
    state = row.locator("[data-testid=model-state]")
    expect(state).to_have_text("unloaded")
    expect(page.locator("[data-testid=model-row]")).to_have_count(2)
    row.locator("[data-testid=load]").click()
    expect(state).to_have_text("loaded")
    assert server.load()["beta"]["state"] == "loaded"
    # The scripted models have the tiny Qwen3's 2,048-token context.
    expect(row.locator("[data-testid=model-context]")).to_contain_text(re.compile(r"2[,. ]?048"))
    row.locator("[data-testid=sleep]").click()
    expect(state).to_have_text("sleeping")

    # The states came from one open /models/sse stream, not from polling.
    polls = state_polls()
    page.wait_for_timeout(QUIET_WINDOW_MS)
    assert state_polls() == polls, requests
    assert polls <= 1, requests
    streams = [url for method, url in requests if urlsplit(url).path == "/models/sse"]
    assert len(streams) == 1, requests
    assert streams[0] not in finished
    screenshot(page, "webui-models.png")

    row.locator("[data-testid=unload]").click()
    expect(state).to_have_text("unloaded")


# ---- keys ------------------------------------------------------------------------------


def test_a_keyed_server_asks_for_the_key_then_chat_works(page: Page, keyed_server: Server) -> None:
    refused: list[str] = []
    authorized: list[str | None] = []
    page.on("response", lambda response: refused.append(response.url)
            if response.status == 401 else None)
    page.on("request", lambda request: authorized.append(request.headers.get("authorization"))
            if urlsplit(request.url).path == "/v1/chat/completions" else None)

    page.goto(keyed_server.url + "/#/chat")
    dialog = page.locator("[data-testid=key-dialog]")
    expect(dialog).to_be_visible()
    assert refused, "the dialog opened without a 401"
    # Without the key the page learned nothing about the models.
    assert page.locator("select[data-testid=model-select] option[value=alpha]").count() == 0
    assert page.evaluate("localStorage.getItem('roundhouse.apiKey')") is None

    page.fill("[data-testid=key-input]", KEY)
    page.click("[data-testid=key-save]")
    expect(dialog).to_be_hidden()
    assert page.evaluate("localStorage.getItem('roundhouse.apiKey')") == KEY
    # A reload reads the key back from localStorage: no dialog this time.
    page.reload()
    pick_model(page, "alpha")
    expect(dialog).to_be_hidden()
    answer = send(page, "Say hello")
    expect(answer).to_have_attribute("data-state", "done")
    expect(answer.locator("[data-testid=message-content]")).to_contain_text("Hello from Roundhouse!")
    assert authorized and set(authorized) == {f"Bearer {KEY}"}, authorized
