"""The app in a real browser: `python app.py` served on a free port, Debian's headless Chromium driven by Playwright.

A newcomer's path: open the page, press Run with the defaults, wait; then the generation panes,
the perplexity table and the plots must be on the page with data in them. A full-page
screenshot goes to tests/artifacts/ (gitignored) for a human to look at.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = "/usr/bin/chromium"  # Debian's package; Playwright downloads no browser
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STARTUP_SECONDS = 240
RUN_SECONDS = 900  # the default run takes about a minute on 2 idle cores; CI machines may be busier


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    """`python app.py` in a subprocess, on a port given through GRADIO_SERVER_PORT."""
    ARTIFACTS.mkdir(exist_ok=True)
    port = free_port()
    env = os.environ | {"GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
                        "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    log = open(ARTIFACTS / "app-server.log", "w")
    process = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + STARTUP_SECONDS
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"app.py exited with code {process.returncode}; see {ARTIFACTS / 'app-server.log'}")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"app.py did not serve {url} within {STARTUP_SECONDS} s")
            time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture(scope="module")
def page():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run `make browser` (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        yield page
        browser.close()


PLOTS_WITH_DATA = """() => Array.from(document.querySelectorAll('.js-plotly-plot'))
    .filter(el => (el.data || []).some(trace => (trace.y || []).length > 0)).map(el => el.closest('[id]')?.id)"""


def test_default_run_renders_generations_table_and_plots(server_url, page):
    page.goto(server_url, wait_until="networkidle")
    page.get_by_role("button", name="Run", exact=True).click()
    page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('Run complete')",
                           timeout=RUN_SECONDS * 1000, polling=1000)
    page.wait_for_timeout(1500)  # let plotly finish drawing
    page.screenshot(path=str(ARTIFACTS / "app.png"), full_page=True)

    cards = page.locator("#generations .gen-card")
    variants = cards.evaluate_all("els => els.map(el => el.dataset.variant)")
    assert variants[0] == "dense" and {"none", "ghost", "ghost_capped"} <= set(variants)
    texts = page.locator("#generations .gen-text").all_inner_texts()
    assert len(texts) == len(variants) and all(text.strip() for text in texts)

    table = page.locator("#ppl-table")
    for text in ("ptb (exact) ppl", "wiki (stand-in) ppl", *variants):
        assert table.get_by_text(text, exact=True).count() >= 1, text
    caption = page.locator("#ppl-table").locator("xpath=preceding::*[contains(@class,'caption')][1]").inner_text()
    assert "stand-in for WikiText-2" in caption and "smollm2-135m" in caption

    plotted = page.evaluate(PLOTS_WITH_DATA)
    assert len(plotted) >= 3, plotted
    assert page.locator("#results-file").get_by_text("results.json").count() >= 1


def set_depth(page, value: int) -> None:
    box = page.locator("#depth input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def test_bad_input_shows_a_message_in_the_page(server_url, page):
    page.goto(server_url, wait_until="networkidle")
    set_depth(page, 30)
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("leaves none").first.wait_for(timeout=60_000)

    model = page.locator("#model input")
    model.fill("no-such-model")
    model.press("Enter")
    page.get_by_text("Cannot use this model").first.wait_for(timeout=60_000)  # the note under the model box
    page.get_by_role("button", name="Run", exact=True).click()
    page.locator(".toast-body").get_by_text("unknown model").first.wait_for(timeout=60_000)
    page.screenshot(path=str(ARTIFACTS / "app-error.png"))


def test_stop_cancels_a_run_and_the_app_keeps_serving(server_url, page):
    page.goto(server_url, wait_until="networkidle")
    page.get_by_role("button", name="Run", exact=True).click()
    page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('score blocks done')",
                           timeout=RUN_SECONDS * 1000, polling=500)
    page.get_by_role("button", name="Stop", exact=True).click()
    # Gradio stops the run once the stage computing at the time returns; then the progress overlay goes
    page.wait_for_function("() => !document.querySelector('#status .pending')", timeout=RUN_SECONDS * 1000,
                           polling=500)
    assert "Run complete" not in page.locator("#status").inner_text()

    set_depth(page, 30)
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("leaves none").first.wait_for(timeout=60_000)
