"""The live confidence page, end to end in real headless Chromium (Selenium).

Needs Debian's `chromium` and `chromium-driver` packages (/usr/bin/chromium,
/usr/bin/chromedriver) and the `selenium` Python package; skipped with the reason
when they are missing. Saves a screenshot to artifacts/page.png.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import require

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    if os.environ.get("TOKENTRAIL_REQUIRE_BROWSER"):  # CI installs it: missing is a failure
        raise RuntimeError(f"TOKENTRAIL_REQUIRE_BROWSER is set but {CHROMIUM} is missing")
    pytest.skip(
        f"headless Chromium not installed ({CHROMIUM}, {CHROMEDRIVER}): "
        "apt-get install chromium chromium-driver",
        allow_module_level=True,
    )
webdriver = require("selenium.webdriver")
require("mlx_lm")

from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


def _server_helpers() -> Any:
    """tests/test_server.py's server helpers, loaded by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "tokentrail_server_test_helpers", Path(__file__).with_name("test_server.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


helpers = _server_helpers()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model_dir = helpers.pick_model_dir(tmp_path_factory)
    srv = helpers.start_server(model_dir, tmp_path_factory.mktemp("logs") / "page.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1200,900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def bucket(confidence: dict[str, Any] | None) -> str:
    """The page's shading rule: the tokens' geometric-mean probability."""
    if confidence is None:
        return "none"
    p = math.exp(confidence["mean_logprob"])
    for limit, name in ((0.9, "4"), (0.7, "3"), (0.45, "2"), (0.2, "1")):
        if p >= limit:
            return name
    return "0"


def js_fixed3(x: float) -> str:
    """JavaScript's x.toFixed(3), for the values the tooltip shows."""
    return f"{x:.3f}"


@pytest.mark.parametrize("mode", ["chat", "completion"])
def test_page_streams_shades_and_explains_segments(server: Any, browser: Any, mode: str) -> None:
    prompt = "What is a Python dictionary?" if mode == "chat" else "A Python dictionary"
    seed, temperature, max_tokens = 7, 0.8, 40
    driver = browser
    driver.get(server.url + "/")
    wait = WebDriverWait(driver, 60)
    wait.until(lambda d: d.find_element(By.ID, "output").get_attribute("data-models") == "1")

    def fill(element_id: str, value: str) -> None:
        box = driver.find_element(By.ID, element_id)
        box.clear()
        box.send_keys(value)

    fill("prompt", prompt)
    fill("seed", str(seed))
    fill("temperature", str(temperature))
    fill("max-tokens", str(max_tokens))
    fill("top", "3")
    Select(driver.find_element(By.ID, "mode")).select_by_value(mode)
    driver.find_element(By.ID, "go").click()
    WebDriverWait(driver, 300).until(
        lambda d: (
            d.find_element(By.ID, "output").get_attribute("data-state")
            in ("done", "error", "stopped")
        )
    )
    output = driver.find_element(By.ID, "output")
    assert output.get_attribute("data-state") == "done", driver.find_element(By.ID, "status").text

    # The same request through the API, not streamed: the oracle for what the page shows.
    body: dict[str, Any] = {
        "model": server.model,
        "seed": seed,
        "temperature": temperature,
        "max_tokens": max_tokens,
    }
    if mode == "chat":
        body.update(messages=[{"role": "user", "content": prompt}], logprobs=True, top_logprobs=3)
        path = "/v1/chat/completions"
    else:
        body.update(prompt=prompt, logprobs=3)
        path = "/v1/completions"
    api = httpx.post(server.url + path, json=body, timeout=300).json()
    choice = api["choices"][0]
    content = choice["message"]["content"] if mode == "chat" else choice["text"]
    segments = api["tokentrail"]["segments"]
    shown = driver.execute_script("return document.getElementById('output').textContent")
    assert shown == content
    assert output.get_attribute("data-tokens") == str(api["usage"]["completion_tokens"])
    assert output.get_attribute("data-finish") == api["choices"][0]["finish_reason"]

    spans = driver.find_elements(By.CSS_SELECTOR, "#output .seg")
    assert len(spans) == len(segments) >= 1
    transparent = "rgba(0, 0, 0, 0)"
    for span, seg in zip(spans, segments, strict=True):
        assert span.get_attribute("data-bucket") == bucket(seg["confidence"])
        assert span.value_of_css_property("background-color") != transparent
    # Different confidences get different shades.
    colors = {
        s.get_attribute("data-bucket"): s.value_of_css_property("background-color") for s in spans
    }
    assert len(set(colors.values())) == len(colors)

    # Hover the least sure segment with text: the tooltip lists its tokens and logprobs.
    candidates = [i for i, seg in enumerate(segments) if seg["text"].strip()]
    assert candidates
    target = min(candidates, key=lambda i: segments[i]["confidence"]["mean_logprob"])
    span = spans[target]
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", span)
    ActionChains(driver).move_to_element(span).perform()
    tip = driver.find_element(By.ID, "tip")
    WebDriverWait(driver, 10).until(lambda d: tip.is_displayed())
    rows = tip.find_elements(By.CSS_SELECTOR, "tr[data-token-index]")
    tokens = segments[target]["tokens"]
    assert [int(r.get_attribute("data-token-index")) for r in rows] == [t["index"] for t in tokens]
    assert [int(r.get_attribute("data-token-id")) for r in rows] == [t["id"] for t in tokens]
    for row, t in zip(rows, tokens, strict=True):
        assert row.find_element(By.CSS_SELECTOR, "td.logprob").text == js_fixed3(t["logprob"])
        alt_ids = [
            int(a.get_attribute("data-alt-id"))
            for a in row.find_elements(By.CSS_SELECTOR, "[data-alt-id]")
        ]
        assert alt_ids == [a["id"] for a in t["top_logprobs"]]
        assert len(alt_ids) == 3
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / ("page.png" if mode == "chat" else f"page-{mode}.png")
    driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 0

    # Escape closes it; tapping another segment pins that one's tooltip.
    ActionChains(driver).send_keys(Keys.ESCAPE).perform()
    WebDriverWait(driver, 10).until(lambda d: not tip.is_displayed())
    ActionChains(driver).move_to_element(driver.find_element(By.TAG_NAME, "h1")).perform()
    other = spans[candidates[0] if candidates[0] != target else candidates[-1]]
    other.click()
    WebDriverWait(driver, 10).until(lambda d: "active" in (other.get_attribute("class") or ""))
    assert tip.is_displayed()


def test_page_reports_api_errors(server: Any, browser: Any) -> None:
    driver = browser
    driver.get(server.url + "/")
    WebDriverWait(driver, 60).until(
        lambda d: d.find_element(By.ID, "output").get_attribute("data-models") == "1"
    )
    temp = driver.find_element(By.ID, "temperature")
    temp.clear()
    temp.send_keys("5")  # out of range: the server answers 400 naming the field
    driver.find_element(By.ID, "go").click()
    WebDriverWait(driver, 60).until(
        lambda d: d.find_element(By.ID, "output").get_attribute("data-state") == "error"
    )
    assert "temperature" in driver.find_element(By.ID, "status").text
