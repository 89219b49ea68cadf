"""The page against a server with `--api-key`, in real headless Chromium (Selenium).

The page's API calls get 401 until it sends the key: it must ask for it (a prompt), keep
it for the tab and send it as a Bearer token, so that it lists the model and streams.
Skipped, with the reason, where Chromium or selenium is missing (as tests/test_page.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
KEY = "page-key-9d2"

if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    if os.environ.get("TOKENTRAIL_REQUIRE_BROWSER"):
        raise RuntimeError(f"TOKENTRAIL_REQUIRE_BROWSER is set but {CHROMIUM} is missing")
    pytest.skip(
        f"headless Chromium not installed ({CHROMIUM}, {CHROMEDRIVER}): "
        "apt-get install chromium chromium-driver",
        allow_module_level=True,
    )
webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
require("mlx_lm")
require("uvicorn")

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from tests.helpers.servers import start_server  # noqa: E402


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("logs") / "page-auth.log"
    server = start_server(None, log, port=0, log_level=None, api_key=KEY)
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_page_asks_for_the_key_and_streams(url: str, browser: Any) -> None:
    driver = browser
    driver.get(url + "/")
    wait = WebDriverWait(driver, 60)
    wrong = wait.until(expected_conditions.alert_is_present())
    wrong.send_keys("not-the-key")
    wrong.accept()
    right = wait.until(expected_conditions.alert_is_present())  # 401 again: asks again
    right.send_keys(KEY)
    right.accept()
    wait.until(lambda d: d.find_element(By.ID, "output").get_attribute("data-models") == "1")
    assert driver.execute_script("return sessionStorage.getItem('tokentrail-api-key')") == KEY
    box = driver.find_element(By.ID, "max-tokens")
    box.clear()
    box.send_keys("12")
    driver.find_element(By.ID, "go").click()
    WebDriverWait(driver, 300).until(
        lambda d: d.find_element(By.ID, "output").get_attribute("data-state")
        in ("done", "error", "stopped")
    )
    output = driver.find_element(By.ID, "output")
    assert output.get_attribute("data-state") == "done", driver.find_element(By.ID, "status").text
    assert 0 < int(output.get_attribute("data-tokens")) <= 12
