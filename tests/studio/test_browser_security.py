"""HTML attacks in a real browser: `<script>` and `<img onerror>` in the model's folder name, the prompt, your text, a
generation and an error message are shown as text, and none of them runs (headless Chromium, the tiny model)."""

from __future__ import annotations

import pytest

from test_browser import DESKTOP, browser, choose_model, open_page, press_run, wait_for_status  # noqa: F401 (browser: a fixture)
from test_security import FOLDER_XSS, XSS, hostile_model

pytestmark = pytest.mark.slow

RAN = """() => ({xss: window.__xss ?? null, onerror: document.querySelectorAll('[onerror]').length,
  scripts: Array.from(document.scripts).filter(s => s.textContent.includes('__xss')).length,
  imgs: Array.from(document.images).filter(i => (i.getAttribute('src') || '') === 'x').length})"""


def test_nothing_a_user_or_the_model_writes_runs_in_the_page(tiny_server, browser, monkeypatch):
    from ghosted_core.run import pipeline

    monkeypatch.setattr(pipeline, "generate", lambda models, *args, **kwargs: {name: f"{XSS} says {name}" for name in models})
    page = open_page(browser, tiny_server.url, DESKTOP)
    choose_model(page, str(hostile_model(tiny_server.model)))
    page.get_by_text("6 decoder blocks").first.wait_for(timeout=30_000)
    page.get_by_label("Prompt").fill(f"Once {XSS}")
    page.locator("#your-text-box").get_by_text("Your text").first.click()
    page.locator("#your-text textarea").fill(f"{XSS} " + "words of my own for the run. " * 400)
    press_run(page)
    wait_for_status(page, "Run complete", 300)
    page.locator("#history-box").get_by_text("Runs in this session").first.click()
    page.wait_for_timeout(1000)
    assert page.evaluate(RAN) == {"xss": None, "onerror": 0, "scripts": 0, "imgs": 0}
    shown = page.locator("body").inner_text()
    assert XSS in shown and FOLDER_XSS in shown  # shown as text: in the generations, the status, the history

    choose_model(page, f"nowhere/{FOLDER_XSS}")  # a refusal quotes the name: in the note, the status and the
    page.get_by_text("Cannot use this model").first.wait_for(timeout=30_000)  # validator's message on the Model box
    press_run(page)
    wait_for_status(page, "Run refused", 30)
    page.wait_for_timeout(500)
    assert page.evaluate(RAN) == {"xss": None, "onerror": 0, "scripts": 0, "imgs": 0}
    page.close()
