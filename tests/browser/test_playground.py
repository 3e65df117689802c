"""The playground in a real browser (Debian's chromium and chromedriver, driven by Selenium),
on a real gateway and worker, reached through a TCP proxy that can cut a stream: a question
streams an answer; Stop cancels the run and the worker confirms it; a connection cut mid-stream
is followed again to the same text. Each test saves a screenshot under its tmp_path."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.probes import scraped
from tests.browser.conftest import BROWSER_KEY
from tests.support.chromium import chromium
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import until_sync

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

AUTH = {"Authorization": f"Bearer {BROWSER_KEY}"}
QUESTION = "Tell me a story about 你好 and café."


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    with chromium(1100, 900) as driver:
        yield driver


class Page:
    """The playground as a user drives it."""

    def __init__(self, driver, root: str) -> None:
        self.driver = driver
        driver.get(f"{root}/playground")
        key = self.find("api-key")
        key.send_keys(BROWSER_KEY)
        self.driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
        until_sync(lambda: Select(self.find("model")).options, "the models to be listed")

    def find(self, element_id: str):
        return self.driver.find_element(By.ID, element_id)

    def text(self, element_id: str) -> str:
        return self.find(element_id).text

    def answer(self) -> str:
        # NOTE: textContent, not .text: the rendered text of a pre-wrap block may differ in
        # whitespace from what the stream carried
        (*_, last) = self.driver.find_elements(By.CSS_SELECTOR, ".message.assistant")
        return last.get_property("textContent")

    def ask(self, question: str, max_tokens: int) -> None:
        """Greedy (temperature 0): sampled, the tiny model may draw its EOS within a few tokens,
        and these tests need an answer that runs to `max_tokens`."""
        for field, value in (("max-tokens", max_tokens), ("temperature", 0)):
            box = self.find(field)
            box.clear()
            box.send_keys(str(value))
        prompt = self.find("prompt")
        prompt.clear()
        prompt.send_keys(question)
        self.find("send").click()

    def wait_for_status(self, *statuses: str, within: float = 120) -> str:
        """Until the page shows one of the run's `statuses` (returned); a timeout says what the
        page showed."""
        try:
            shown = " or ".join(statuses)
            until_sync(lambda: self.text("run-status") in statuses, f"status {shown}", within)
            return self.text("run-status")
        except AssertionError as exc:
            shown = {i: self.text(i) for i in ("run-id", "run-status", "resumes", "notice")}
            shown["answer"] = self.answer()[:80]
            errors = [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, ".error")]
            raise AssertionError(f"{exc}; the page shows {shown}, errors {errors}") from None

    def screenshot(self, tmp_path: Path, name: str) -> Path:
        path = tmp_path / f"{name}.png"
        self.driver.save_screenshot(str(path))
        print(f"screenshot: {path}")
        return path


def stored(served, run_id: str) -> dict:
    return httpx.get(f"{served.base_url}/chat/completions/{run_id}", headers=AUTH).json()


def test_a_question_streams_an_answer(served, proxy: TcpProxy, browser, tmp_path):
    page = Page(browser, proxy.root)
    page.ask(QUESTION, max_tokens=120)
    page.wait_for_status("completed")
    run = stored(served, page.text("run-id"))
    assert run["status"] == "completed"
    assert page.answer() == run["choices"][0]["message"]["content"] != ""
    assert page.text("ttft").endswith(" ms")
    usage = run["usage"]
    assert page.text("usage") == (
        f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens"
    )
    assert page.text("resumes") == "0" and proxy.cuts == 0
    assert page.screenshot(tmp_path, "answered").stat().st_size > 0
    # the page sent its temperature: the API's greedy answer to the same question
    body = {"model": run["model"], "messages": [{"role": "user", "content": QUESTION}]}
    body |= {"max_tokens": 120, "temperature": 0}
    direct = httpx.post(f"{served.base_url}/chat/completions", json=body, headers=AUTH, timeout=60)
    assert page.answer() == direct.raise_for_status().json()["choices"][0]["message"]["content"]


def confirmed_client_cancels(served) -> float:
    """Client cancels the worker confirmed (clean: no token after it; tail: some)."""
    return sum(
        scraped(served.root, "sluice_cancellations_total", source="client", outcome=outcome)
        for outcome in ("clean", "tail")
    )


def stop_a_running_answer(page: Page, served, attempts: int = 3) -> None:
    """Ask, pause the worker once the first text shows, click Stop; until a run is cancelled.

    NOTE: the tiny model writes 900 tokens in about a second, less than a click and a cancel may
    take: the worker is paused so the run is still going when Stop reaches the gateway. A run
    already completed when the worker is paused is asked again, before the pool's watchdog (10
    s) takes the paused worker for a hung one."""
    worker = served.worker_process()
    for _ in range(attempts):
        page.ask(QUESTION, max_tokens=900)
        until_sync(page.answer, "the first text", within=120)
        worker.send_signal(signal.SIGSTOP)
        try:
            page.find("stop").click()
            if page.wait_for_status("cancelled", "completed") == "cancelled":
                return
        finally:
            worker.send_signal(signal.SIGCONT)
    raise AssertionError(f"each of {attempts} runs completed before Stop reached it")


def test_stop_cancels_the_run_and_the_worker_confirms(served, proxy, browser, tmp_path):
    before = confirmed_client_cancels(served)
    page = Page(browser, proxy.root)
    stop_a_running_answer(page, served)
    page.screenshot(tmp_path, "stopped")
    run = stored(served, page.text("run-id"))
    assert run["status"] == "cancelled"
    assert run["usage"] is None or run["usage"]["completion_tokens"] < 900
    until_sync(
        lambda: confirmed_client_cancels(served) > before, "the worker to confirm the cancel"
    )
    assert page.answer() == run["choices"][0]["message"]["content"]


def test_a_cut_connection_resumes_the_same_run_with_the_text_intact(
    served, proxy, browser, tmp_path
):
    proxy.cut_streams_after(2000)  # the POST's stream, a few frames in
    page = Page(browser, proxy.root)
    page.ask(QUESTION, max_tokens=400)
    try:
        page.wait_for_status("completed")
    finally:
        page.screenshot(tmp_path, "resumed")
        print("the cut stream passed:", b"".join(proxy.passed)[:2000])
    assert proxy.cuts == 1
    assert int(page.text("resumes")) >= 1
    run = stored(served, page.text("run-id"))
    assert page.answer() == run["choices"][0]["message"]["content"]
