"""The admin page in a real browser (Debian's chromium and chromedriver, driven by Selenium) on
a real gateway in front of the scripted upstream: a wrong key is refused; the admin key signs
in and lists the tenants; a new key is shown once and works; after a run the usage chart has a
bar. Each test saves a screenshot under its tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from policies.tenants_file import create_key
from tests.support.chromium import chromium
from tests.support.processes import scripted_upstream_process
from tests.support.serve import Served, serving
from tests.support.waiting import until_sync

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402

ADMIN_KEY = "sk-admin-browser-0123456789"


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    with chromium(1100, 1200) as driver:
        yield driver


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[tuple[Served, str]]:
    """A gateway with an admin key and tenant `acme`, whose key is answered with it."""
    tenants = tmp_path_factory.mktemp("admin-page") / "tenants.toml"
    tenants.write_text("[tenants.acme]\nrpm = 600\n")
    key, _ = create_key(tenants, "acme")
    with scripted_upstream_process() as upstream:
        flags = ("--upstream", f"scripted={upstream}", "--tenants", str(tenants))
        with serving(None, *flags, "--admin-key", ADMIN_KEY) as served:
            yield served, key


def chat(served: Served, key: str) -> int:
    body = {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}]}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{served.base_url}/chat/completions", json=body, headers=headers).status_code


class AdminPage:
    """The admin page as an operator drives it."""

    def __init__(self, driver, root: str) -> None:
        self.driver = driver
        driver.get(f"{root}/admin")
        driver.execute_script("sessionStorage.clear()")

    def find(self, element_id: str):
        return self.driver.find_element(By.ID, element_id)

    def sign_in(self, key: str) -> None:
        self.find("admin-key").send_keys(key)
        self.driver.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()

    def tenants(self) -> list[str]:
        rows = self.driver.find_elements(By.CSS_SELECTOR, "#tenants tr")
        return [row.get_attribute("data-tenant") for row in rows]

    def bars(self) -> int:
        return len(self.driver.find_elements(By.CSS_SELECTOR, "#usage-chart svg rect.bar"))

    def screenshot(self, tmp_path: Path, name: str) -> Path:
        path = tmp_path / f"{name}.png"
        self.driver.save_screenshot(str(path))
        print(f"screenshot: {path}")
        return path


def test_a_key_that_is_not_an_admins_is_refused(gateway, browser, tmp_path):
    served, tenant_key = gateway
    page = AdminPage(browser, served.root)
    page.sign_in(tenant_key)
    until_sync(lambda: "not an admin key" in page.find("notice").text, "the refusal")
    assert not page.find("console").is_displayed()
    page.screenshot(tmp_path, "refused")


def test_sign_in_list_tenants_make_a_key_and_see_usage(gateway, browser, tmp_path):
    served, tenant_key = gateway
    assert chat(served, tenant_key) == 200  # a run, so the chart has a day to show
    page = AdminPage(browser, served.root)
    page.sign_in(ADMIN_KEY)
    until_sync(lambda: page.tenants() == ["acme"], "the tenants to be listed")
    until_sync(lambda: page.bars() >= 1, "the usage chart to draw a bar")
    browser.find_element(By.CSS_SELECTOR, "#tenants tr[data-tenant=acme] button.new-key").click()
    new_key = until_sync(lambda: page.find("new-key").text, "the new key to be shown")
    assert new_key.startswith("sk-sluice-")
    assert chat(served, new_key) == 200
    assert page.screenshot(tmp_path, "signed-in").stat().st_size > 0
    page.find("new-key-done").click()
    assert page.find("new-key").text == ""  # shown once: gone from the page
    assert browser.execute_script("return sessionStorage.getItem('sluice-admin-key')") == ADMIN_KEY
    keys = browser.find_elements(By.CSS_SELECTOR, "#tenants tr[data-tenant=acme] li")
    assert len(keys) == 2
