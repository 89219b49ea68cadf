"""The live confidence page, end to end in real headless Chromium (Selenium).

Needs Debian's `chromium` and `chromium-driver` packages (/usr/bin/chromium,
/usr/bin/chromedriver) and the `selenium` Python package; skipped with the reason
when they are missing. Saves a screenshot to artifacts/page.png.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require

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

from tests.helpers.servers import pick_model_dir, start_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model_dir = pick_model_dir(tmp_path_factory)
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs") / "page.log")
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


def _generate_on_page(driver: Any, url: str, mode: str, settings: dict[str, Any]) -> None:
    """Open the page, fill in `settings` (by field id), pick `mode`, press Go and wait
    until the generation ends."""
    driver.get(url + "/")
    wait = WebDriverWait(driver, 60)
    wait.until(lambda d: d.find_element(By.ID, "output").get_attribute("data-models") == "1")
    for element_id, value in settings.items():
        fill(driver, element_id, str(value))
    Select(driver.find_element(By.ID, "mode")).select_by_value(mode)
    driver.find_element(By.ID, "go").click()
    WebDriverWait(driver, 300).until(
        lambda d: (
            d.find_element(By.ID, "output").get_attribute("data-state")
            in ("done", "error", "stopped")
        )
    )


def _same_request_through_the_api(server: Any, mode: str, settings: dict[str, Any]) -> Any:
    """The page's request through the API, not streamed: the oracle for what it shows."""
    body: dict[str, Any] = {
        "model": server.model,
        "seed": settings["seed"],
        "temperature": settings["temperature"],
        "max_tokens": settings["max-tokens"],
    }
    prompt = settings["prompt"]
    if mode == "chat":
        body.update(messages=[{"role": "user", "content": prompt}], logprobs=True, top_logprobs=3)
        path = "/v1/chat/completions"
    else:
        body.update(prompt=prompt, logprobs=3)
        path = "/v1/completions"
    return httpx.post(server.url + path, json=body, timeout=300).json()


@pytest.mark.parametrize("mode", ["chat", "completion"])
def test_page_streams_shades_and_explains_segments(server: Any, browser: Any, mode: str) -> None:
    prompt = "What is a Python dictionary?" if mode == "chat" else "A Python dictionary"
    driver = browser
    settings = {"prompt": prompt, "seed": 7, "temperature": 0.8, "max-tokens": 40, "top": 3}
    _generate_on_page(driver, server.url, mode, settings)
    output = driver.find_element(By.ID, "output")
    assert output.get_attribute("data-state") == "done", driver.find_element(By.ID, "status").text

    api = _same_request_through_the_api(server, mode, settings)
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


# -- controls, tooltip placement, Stop, CJK fonts ----------------------------------------

#: Records every request body the page sends (window.__bodies), for the checks below.
RECORD_FETCH = """
window.__bodies = [];
const realFetch = window.fetch;
window.fetch = (url, opts) => {
  if (opts && opts.body) window.__bodies.push([url, JSON.parse(opts.body)]);
  return realFetch(url, opts);
};
"""

#: Slows the response body down (64-byte pieces, 25 ms apart) so Stop lands mid-stream.
SLOW_FETCH = """
const realFetch = window.fetch;
window.fetch = async (url, opts) => {
  const r = await realFetch(url, opts);
  if (!opts || !opts.body) return r;
  const reader = r.body.getReader();
  let rest = null;
  const slow = new ReadableStream({
    async pull(ctrl) {
      if (!rest || !rest.length) {
        const { value, done } = await reader.read();
        if (done) { ctrl.close(); return; }
        rest = value;
      }
      await new Promise((res) => setTimeout(res, 25));
      ctrl.enqueue(rest.slice(0, 64));
      rest = rest.slice(64);
    },
    cancel(reason) { return reader.cancel(reason); },
  });
  return new Response(slow, { status: r.status, statusText: r.statusText, headers: r.headers });
};
"""


def open_page(driver: Any, url: str, script: str = "") -> None:
    driver.get(url + "/")
    WebDriverWait(driver, 60).until(
        lambda d: d.find_element(By.ID, "output").get_attribute("data-models") == "1"
    )
    if script:
        driver.execute_script(script)


def fill(driver: Any, element_id: str, value: str) -> None:
    box = driver.find_element(By.ID, element_id)
    box.clear()
    if value:
        box.send_keys(value)


def run_to_end(driver: Any) -> str:
    driver.find_element(By.ID, "go").click()
    WebDriverWait(driver, 300).until(
        lambda d: (
            d.find_element(By.ID, "output").get_attribute("data-state")
            in ("done", "error", "stopped")
        )
    )
    state = driver.find_element(By.ID, "output").get_attribute("data-state")
    assert state == "done", driver.find_element(By.ID, "status").text
    return str(driver.execute_script("return document.getElementById('output').textContent"))


def test_defaults_are_greedy_and_match_the_api(server: Any, browser: Any) -> None:
    open_page(browser, server.url, RECORD_FETCH)
    shown = run_to_end(browser)
    [(url, body)] = browser.execute_script("return window.__bodies")
    assert url == "/v1/chat/completions"
    assert body["temperature"] == 0 and body["top_p"] == 1  # README's defaults table
    assert "stop" not in body
    assert body["messages"] == [{"role": "user", "content": "What is a Python list?"}]
    body = {k: v for k, v in body.items() if k != "stream_options"}
    api = httpx.post(server.url + url, json={**body, "stream": False}, timeout=300).json()
    assert shown == api["choices"][0]["message"]["content"]


def test_system_prompt_stop_strings_and_top_p_are_sent(server: Any, browser: Any) -> None:
    system, prompt = "You answer about Python.", "What is a tuple?"
    base = {
        "model": server.model,
        "temperature": 0,
        "max_tokens": 80,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": prompt}],
    }
    free = httpx.post(server.url + "/v1/chat/completions", json=base, timeout=300).json()
    words = free["choices"][0]["message"]["content"].split()
    assert len(words) >= 4, words
    stops = [words[3], "never-in-the-output"]  # the first one cuts the text short

    open_page(browser, server.url, RECORD_FETCH)
    fill(browser, "prompt", prompt)
    fill(browser, "system", system)
    fill(browser, "stop-strings", "\n".join(stops))
    fill(browser, "top-p", "0.9")
    shown = run_to_end(browser)
    [(_, body)] = browser.execute_script("return window.__bodies")
    assert body["messages"] == base["messages"]
    assert body["stop"] == stops
    assert body["top_p"] == 0.9
    api = httpx.post(
        server.url + "/v1/chat/completions",
        json={**base, "stop": stops, "top_p": 0.9},
        timeout=300,
    ).json()
    content = api["choices"][0]["message"]["content"]
    assert shown == content and stops[0] not in shown
    assert browser.find_element(By.ID, "output").get_attribute("data-finish") == "stop"

    # The completion endpoint has no messages: the system field is not sent there.
    Select(browser.find_element(By.ID, "mode")).select_by_value("completion")
    assert not browser.find_element(By.ID, "system").is_enabled()
    fill(browser, "stop-strings", "")
    browser.execute_script("window.__bodies = []")
    run_to_end(browser)
    [(url, body)] = browser.execute_script("return window.__bodies")
    assert url == "/v1/completions" and body["prompt"] == prompt
    assert "messages" not in body and "stop" not in body


def rect(driver: Any, element: Any) -> dict[str, float]:
    return dict(
        driver.execute_script(
            "const r = arguments[0].getClientRects()[0] || arguments[0].getBoundingClientRect();"
            "return {left: r.left, top: r.top, right: r.right, bottom: r.bottom};",
            element,
        )
    )


def test_tooltip_stays_inside_the_viewport_and_off_the_lines_below(
    server: Any, browser: Any
) -> None:
    driver = browser
    open_page(driver, server.url)
    fill(driver, "prompt", "Translate water into French.")
    fill(driver, "max-tokens", "120")
    run_to_end(driver)
    spans = driver.find_elements(By.CSS_SELECTOR, "#output .seg:not(.empty)")
    tip = driver.find_element(By.ID, "tip")
    view = driver.execute_script(
        "return [document.documentElement.clientWidth, document.documentElement.clientHeight]"
    )
    for where, span in (
        ("center", spans[len(spans) // 2]),
        ("start", spans[0]),
        ("end", spans[-1]),
    ):
        driver.execute_script(f"arguments[0].scrollIntoView({{block: '{where}'}})", span)
        ActionChains(driver).move_to_element(span).perform()
        WebDriverWait(driver, 10).until(lambda d: tip.is_displayed())
        t, s = rect(driver, tip), rect(driver, span)
        assert t["left"] >= 0 and t["right"] <= view[0], (where, t)
        assert t["top"] >= 0 and t["bottom"] <= view[1], (where, t)
        side = tip.get_attribute("data-side")
        if side != "below":  # below only when neither above nor beside fits
            below = [rect(driver, o) for o in spans if rect(driver, o)["top"] >= s["bottom"] - 1]
            for o in below:
                overlap = not (
                    t["right"] <= o["left"]
                    or o["right"] <= t["left"]
                    or t["bottom"] <= o["top"]
                    or o["bottom"] <= t["top"]
                )
                assert not overlap, (where, side, t, o)
        if where == "center":
            assert side == "above" and t["bottom"] <= s["top"], (t, s)
            ARTIFACTS.mkdir(exist_ok=True)
            driver.save_screenshot(str(ARTIFACTS / "page-tooltip.png"))
        ActionChains(driver).send_keys(Keys.ESCAPE).perform()
        ActionChains(driver).move_to_element(driver.find_element(By.TAG_NAME, "h1")).perform()
        WebDriverWait(driver, 10).until(lambda d: not tip.is_displayed())


def test_token_count_stays_after_stop(server: Any, browser: Any) -> None:
    driver = browser
    open_page(driver, server.url, SLOW_FETCH)
    fill(driver, "max-tokens", "200")
    fill(driver, "temperature", "1")
    fill(driver, "seed", "3")
    driver.find_element(By.ID, "go").click()
    output = driver.find_element(By.ID, "output")
    WebDriverWait(driver, 120).until(lambda d: int(output.get_attribute("data-tokens")) >= 3)
    driver.find_element(By.ID, "stop").click()
    WebDriverWait(driver, 60).until(lambda d: output.get_attribute("data-state") == "stopped")
    n = int(output.get_attribute("data-tokens"))
    assert n >= 3
    assert driver.find_element(By.ID, "status").text == f"stopped after {n} tokens"
    assert output.text.strip()  # what was streamed stays on the page
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "page-stopped.png"))


def test_fonts_fall_back_to_cjk_faces(server: Any, browser: Any) -> None:
    driver = browser
    open_page(driver, server.url)
    for selector in ("body", "#output"):
        family = driver.execute_script(
            "return getComputedStyle(document.querySelector(arguments[0])).fontFamily", selector
        )
        names = [f.strip().strip('"') for f in family.split(",")]
        for face in ("Noto Sans CJK SC", "Noto Sans CJK JP", "PingFang SC", "Microsoft YaHei"):
            assert face in names, (selector, family)
        assert names[-1] in ("sans-serif", "monospace")
    fill(driver, "prompt", "Translate water into French.")
    shown = run_to_end(driver)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in shown), shown  # CJK on the page
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "page-cjk.png"))


# -- JSON output and the fields table ----------------------------------------------------

#: A schema with a string, an enum and a boolean leaf (the last two get alternatives).
FIELDS_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "size": {"enum": ["small", "big"]},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "size", "sunny"],
    "additionalProperties": False,
}

#: Notes, for every row the fields table gains, the page's token count at that moment.
WATCH_FIELDS = """
window.__rows = [];
new MutationObserver((records) => {
  for (const r of records) for (const n of r.addedNodes) {
    window.__rows.push([n.dataset.path, Number(document.getElementById('output').dataset.tokens)]);
  }
}).observe(document.querySelector('#fields tbody'), {childList: true});
"""


def pointer(doc: Any, path: str) -> Any:
    """Resolve an RFC 6901 JSON Pointer in `doc` (the oracle for each field's value)."""
    for raw in path.split("/")[1:]:
        key = raw.replace("~1", "/").replace("~0", "~")
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]
    return doc


def openai_chat(server: Any, **kwargs: Any) -> Any:
    """The page's request through the official `openai` client, not streamed."""
    openai = require("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model=server.model, **kwargs)


def test_json_schema_output_fills_a_fields_table_shaded_by_level(server: Any, browser: Any) -> None:
    jsonschema = require("jsonschema")
    driver = browser
    open_page(driver, server.url, RECORD_FETCH + WATCH_FIELDS)
    box = driver.find_element(By.ID, "fields-box")
    assert not box.is_displayed()  # no fields yet: no table
    Select(driver.find_element(By.ID, "format")).select_by_value("json_schema")
    fill(driver, "schema", json.dumps(FIELDS_SCHEMA))
    fill(driver, "prompt", "Describe Paris as JSON.")
    shown = run_to_end(driver)
    [(url, body)] = driver.execute_script("return window.__bodies")
    fmt = body["response_format"]
    assert url == "/v1/chat/completions" and fmt["type"] == "json_schema"
    assert fmt["json_schema"]["schema"] == FIELDS_SCHEMA and fmt["json_schema"]["strict"]

    api = openai_chat(
        server,
        messages=body["messages"],
        temperature=0,
        max_tokens=body["max_tokens"],
        logprobs=True,
        response_format=fmt,
    )
    content = api.choices[0].message.content
    assert shown == content
    doc = json.loads(content)
    jsonschema.validate(doc, FIELDS_SCHEMA)
    fields = api.model_extra["tokentrail"]["fields"]
    assert sorted(f["path"] for f in fields) == ["/city", "/size", "/sunny"]

    assert box.is_displayed()
    assert box.get_attribute("data-fields") == str(len(fields))
    rows = driver.find_elements(By.CSS_SELECTOR, "#fields tbody tr")
    headers = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "#fields thead th")]
    assert headers == ["path", "value", "confidence", "alternatives"]
    legend = {
        s.get_attribute("data-bucket"): s.value_of_css_property("background-color")
        for s in driver.find_elements(By.CSS_SELECTOR, ".legend .seg")
    }
    for row, field in zip(rows, fields, strict=True):
        assert row.get_attribute("data-path") == field["path"]
        value = row.find_element(By.CSS_SELECTOR, "td.value").text
        assert value == field["text"]
        assert json.loads(value) == field["value"] == pointer(doc, field["path"])
        level = bucket(field["confidence"])
        assert row.get_attribute("data-bucket") == level
        assert row.value_of_css_property("background-color") == legend[level]
        shown_alts = [
            json.loads(a.get_attribute("data-alt-value"))
            for a in row.find_elements(By.CSS_SELECTOR, "[data-alt-value]")
        ]
        if field["path"] in ("/size", "/sunny"):  # enum and boolean: the allowed values
            expected = {"/size": {"small", "big"}, "/sunny": {True, False}}[field["path"]]
            assert set(shown_alts) == expected
        assert shown_alts == [a["value"] for a in field["alternatives"] or ()]

    # Each row came in while streaming, with (or after) its field's last token.
    watched = driver.execute_script("return window.__rows")
    assert [path for path, _ in watched] == [f["path"] for f in fields]
    for (_, seen), field in zip(watched, fields, strict=True):
        assert seen >= 1 + max(t["index"] for t in field["tokens"])
    driver.execute_script("arguments[0].scrollIntoView({block: 'end'})", box)
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "page-fields.png"))

    # Back to text: the next reply has no fields and the table goes away.
    Select(driver.find_element(By.ID, "format")).select_by_value("text")
    assert not driver.find_element(By.ID, "schema").is_displayed()
    driver.execute_script("window.__bodies = []")
    run_to_end(driver)
    [(_, body)] = driver.execute_script("return window.__bodies")
    assert "response_format" not in body and "tokentrail" not in body
    assert not box.is_displayed()
    assert not driver.find_elements(By.CSS_SELECTOR, "#fields tbody tr")


def test_fields_for_text_and_schema_errors_are_reported(server: Any, browser: Any) -> None:
    driver = browser
    open_page(driver, server.url, RECORD_FETCH)
    # "JSON fields" on an unconstrained reply: the server says why there are none.
    driver.find_element(By.ID, "want-fields").click()
    fill(driver, "max-tokens", "12")
    run_to_end(driver)
    [(url, body)] = driver.execute_script("return window.__bodies")
    assert body["tokentrail"] == {"fields": True}
    api = openai_chat(
        server,
        messages=body["messages"],
        temperature=0,
        max_tokens=12,
        extra_body={"tokentrail": {"fields": True}},
    )
    ext = api.model_extra["tokentrail"]
    error = driver.find_element(By.ID, "fields-error")
    if ext.get("fields_error"):
        assert error.is_displayed() and error.text == "no fields: " + ext["fields_error"]
    else:
        assert len(driver.find_elements(By.CSS_SELECTOR, "#fields tbody tr")) == len(ext["fields"])
    driver.find_element(By.ID, "want-fields").click()

    # A schema box that is not JSON never leaves the page; a schema the server cannot
    # compile is its 400, naming response_format.
    Select(driver.find_element(By.ID, "format")).select_by_value("json_schema")
    fill(driver, "schema", "{not json")
    driver.execute_script("window.__bodies = []")
    driver.find_element(By.ID, "go").click()
    output = driver.find_element(By.ID, "output")
    WebDriverWait(driver, 10).until(lambda d: output.get_attribute("data-state") == "error")
    assert "not JSON" in driver.find_element(By.ID, "status").text
    assert driver.execute_script("return window.__bodies") == []
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    fill(driver, "schema", json.dumps(bad))
    driver.find_element(By.ID, "go").click()
    WebDriverWait(driver, 60).until(lambda d: output.get_attribute("data-state") == "error")
    [(url, body)] = driver.execute_script("return window.__bodies")
    body = {k: v for k, v in body.items() if k != "stream_options"}
    r = httpx.post(server.url + url, json={**body, "stream": False}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert driver.find_element(By.ID, "status").text == r.json()["error"]["message"]


def test_legend_names_levels_not_thresholds(server: Any, browser: Any) -> None:
    """The page grades nothing itself: its legend names the server's levels."""
    open_page(browser, server.url)
    legend = browser.find_element(By.CSS_SELECTOR, ".legend")
    buckets = [
        s.get_attribute("data-bucket") for s in legend.find_elements(By.CSS_SELECTOR, ".seg")
    ]
    assert buckets == ["4", "3", "2", "1", "0", "none"]
    assert "%" not in legend.text
