"""The page's branch tree (issue #31 part 4), in real headless Chromium on a real server
(the demo model): pick an alternative token in a pinned tooltip, the branch streams in,
the tree walks back to the original and forward to the branch; a low-confidence
segment's "retry" branches there with the token sampled afresh.

The oracle for what the page shows is the same request through the HTTP API, not
streamed. Uses `tests/test_page.py`'s server, browser and page helpers.
"""

from __future__ import annotations

from typing import Any

import httpx
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.test_page import ARTIFACTS, RECORD_FETCH, browser, fill, open_page, run_to_end, server

__all__ = ["browser", "server"]  # the fixtures, shared with test_page.py


def _text(driver: Any) -> str:
    return str(driver.execute_script("return document.getElementById('output').textContent"))


def _wait_done(driver: Any, node: int) -> None:
    output = driver.find_element(By.ID, "output")
    WebDriverWait(driver, 300).until(
        lambda d: output.get_attribute("data-node") == str(node)
        and output.get_attribute("data-state") in ("done", "error", "stopped")
    )
    assert output.get_attribute("data-state") == "done", driver.find_element(By.ID, "status").text


def _api(server: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in body.items() if k != "stream_options"}
    r = httpx.post(server.url + url, json={**body, "stream": False}, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _walk(driver: Any, button: str, node: int, text: str) -> None:
    driver.find_element(By.ID, button).click()
    output = driver.find_element(By.ID, "output")
    WebDriverWait(driver, 10).until(lambda d: output.get_attribute("data-node") == str(node))
    assert _text(driver) == text
    current = driver.find_element(By.CSS_SELECTOR, '#tree button[aria-current="true"]')
    assert current.get_attribute("data-node") == str(node)


def test_pick_an_alternative_branches_and_the_tree_walks_back_and_forth(
    server: Any, browser: Any
) -> None:
    driver = browser
    open_page(driver, server.url, RECORD_FETCH)
    fill(driver, "max-tokens", "24")
    fill(driver, "top", "3")
    original = run_to_end(driver)
    [(url, body)] = driver.execute_script("return window.__bodies")
    api = _api(server, url, body)
    segments = api["tokentrail"]["segments"]
    ids = [t["id"] for s in segments for t in s["tokens"]]
    assert original == api["choices"][0]["message"]["content"]
    assert driver.find_element(By.ID, "tree").is_displayed() is False  # one reply: no tree

    # Tap a segment past the start: its tooltip pins; pick a token it did not take.
    spans = driver.find_elements(By.CSS_SELECTOR, "#output .seg")
    target = next(
        i for i, s in enumerate(segments) if s["tokens"] and s["tokens"][0]["index"] >= 2
    )
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", spans[target])
    spans[target].click()
    tip = driver.find_element(By.ID, "tip")
    WebDriverWait(driver, 10).until(lambda d: tip.is_displayed())
    pick = tip.find_elements(By.CSS_SELECTOR, ".pick")[0]
    at, token = int(pick.get_attribute("data-at")), int(pick.get_attribute("data-alt-id"))
    assert token != ids[at]
    pick.click()
    _wait_done(driver, 1)
    shown = _text(driver)

    bodies = driver.execute_script("return window.__bodies")
    assert len(bodies) == 2
    branch_url, branch_body = bodies[1]
    assert branch_url == url
    assert branch_body["tokentrail"]["branch"] == {"ids": ids, "at": at, "token": token}
    oracle = _api(server, branch_url, branch_body)
    assert shown == oracle["choices"][0]["message"]["content"]
    kept = "".join(
        s["text"] for s in segments if all(t["index"] < at for t in s["tokens"])
    )
    assert shown.startswith(kept) and original.startswith(kept)
    assert shown != original
    nodes = driver.find_elements(By.CSS_SELECTOR, "#tree button[data-node]")
    assert [n.get_attribute("data-node") for n in nodes] == ["0", "1"]
    marked = driver.find_elements(By.CSS_SELECTOR, "#output .seg.branch-point")
    assert len(marked) == 1
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "page-branch.png"))

    _walk(driver, "back", 0, original)
    _walk(driver, "forward", 1, shown)
    driver.find_element(By.CSS_SELECTOR, '#tree button[data-node="0"]').click()
    WebDriverWait(driver, 10).until(lambda d: _text(d) == original)


def test_a_low_confidence_segment_offers_retry_from_its_first_token(
    server: Any, browser: Any
) -> None:
    driver = browser
    open_page(driver, server.url, RECORD_FETCH)
    fill(driver, "max-tokens", "24")
    fill(driver, "top", "3")
    original = run_to_end(driver)
    [(url, body)] = driver.execute_script("return window.__bodies")
    segments = _api(server, url, body)["tokentrail"]["segments"]
    low = [
        i for i, s in enumerate(segments)
        if s["confidence"] and s["confidence"]["level"] <= 1 and s["tokens"]
        and s["tokens"][0]["index"] > 0
    ]  # fmt: skip
    assert low, "the demo model's greedy reply has no unsure segment to retry"
    sure = [i for i, s in enumerate(segments) if s["confidence"] and s["confidence"]["level"] > 1]
    spans = driver.find_elements(By.CSS_SELECTOR, "#output .seg")
    tip = driver.find_element(By.ID, "tip")
    if sure:  # a sure segment offers no retry
        spans[sure[0]].click()
        WebDriverWait(driver, 10).until(lambda d: tip.is_displayed())
        assert not tip.find_elements(By.CSS_SELECTOR, "[data-retry-at]")
        spans[sure[0]].click()  # unpin
    target = segments[low[0]]
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", spans[low[0]])
    spans[low[0]].click()
    WebDriverWait(driver, 10).until(lambda d: tip.is_displayed())
    retry = tip.find_element(By.CSS_SELECTOR, "[data-retry-at]")
    at = int(retry.get_attribute("data-retry-at"))
    assert at == target["tokens"][0]["index"]
    retry.click()
    _wait_done(driver, 1)
    _, sent = driver.execute_script("return window.__bodies")[1]
    assert sent["temperature"] > 0 and "seed" not in sent
    assert "token" not in sent["tokentrail"]["branch"]
    assert sent["tokentrail"]["branch"]["at"] == at
    kept = "".join(s["text"] for s in segments[: low[0]])
    assert _text(driver).startswith(kept)
    _walk(driver, "back", 0, original)
