"""The chat page at / in a real headless browser (Debian's chromium, driven by selenium): it loads from the package
alone, sends a message, shows the answer as it streams in, and ends with the tokens/s; --no-webui leaves it out."""

from __future__ import annotations

import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.server.app import create_app
from qinfer.runtime.server.thread import serve_in_thread

BROWSER, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.mark.skipif(BROWSER is None or DRIVER is None, reason="no chromium and chromedriver (apt-get install them)")
def test_the_page_streams_an_answer(
    gguf_files: dict[str, Path],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    engine = Engine.open(gguf_files["pi-f32"], slots=1, ctx_size=256)
    options = webdriver.ChromeOptions()
    options.binary_location = str(BROWSER)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    # The browser's scratch directories go under TMPDIR: one of pytest's, not the system's, which would keep them. A
    # short one: its singleton socket's path there must fit a socket address (107 bytes), and the test's own is long.
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("chromium")))
    with serve_in_thread(create_app(EngineWorker(engine), "tiny")) as url:
        browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(DRIVER)))
        try:
            browser.get(url + "/")
            wait = WebDriverWait(browser, 60)
            wait.until(lambda b: b.find_element(By.ID, "model").text == "tiny")
            browser.find_element(By.ID, "max_tokens").clear()
            browser.find_element(By.ID, "max_tokens").send_keys("24")
            browser.find_element(By.ID, "input").send_keys("Tell me about Lily.")
            browser.find_element(By.ID, "send").click()
            # Pieces arrive one by one: the page counts them as they stream in, before the answer is done.
            wait.until(lambda b: b.execute_script("return window.qinferChunks") >= 2)
            wait.until(lambda b: b.find_element(By.ID, "status").text.startswith("done"))
            status = browser.find_element(By.ID, "status").text
            answer = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text
            assert answer.strip() and re.fullmatch(r"done: \d+ tokens, [\d.]+ tok/s", status), status
            shot = tmp_path / "page.png"
            assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 1000
        finally:
            browser.quit()


def test_no_webui_leaves_the_page_out(gguf_files: dict[str, Path]) -> None:
    engine = Engine.open(gguf_files["pi-f32"], slots=1, ctx_size=64)
    with serve_in_thread(create_app(EngineWorker(engine), "tiny", webui=False)) as url:
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url + "/", timeout=10)
        assert missing.value.code == 404
    with serve_in_thread(create_app(EngineWorker(engine), "tiny")) as url:
        page = urllib.request.urlopen(url + "/", timeout=10).read().decode()
        assert "<title>qinfer</title>" in page and "http" not in page.split("<script>")[1]  # nothing from a CDN
