"""The status page in a real headless browser (Debian's chromium + chromedriver, driven by selenium): it asks
for the API key, draws every chart (checked on a screenshot: each chart's series colour is on its canvas),
and shows the numbers the data endpoint serves."""
from __future__ import annotations

import io
import shutil
import tempfile

import httpx
import numpy as np
import openai
import pytest

from lucebox.server.app import ServerConfig
from tests.server_helpers import build_model, start_server

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
                                       "chromium-driver; .ci/run installs them)")
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
Image = pytest.importorskip("PIL.Image", reason="needs pillow (pip install -e '.[test]')")

KEY = "page-secret"
# Chart id -> the series colours it must show (dashboard.js's COLORS), as RGB.
CHART_COLORS = {
    "chart-requests": ["#2563eb"],
    "chart-throughput": ["#16a34a"],
    "chart-ttft": ["#dc2626"],
    "chart-acceptance": ["#0891b2"],
    "chart-acceptance-position": ["#0d9488"],
    "chart-pools": ["#db2777", "#475569"],
    "timeline": ["#2563eb", "#f59e0b"],
}
# Tile id -> how the page formats the data endpoint's value (dashboard.js's TILES and fmt).
DASH = "\u2014"


def formatted(kind, v):
    if v is None:
        return DASH
    return {"int": lambda: str(round(v)), "f2": lambda: f"{v:.2f}", "pct": lambda: f"{100 * v:.1f}%",
            "ms": lambda: f"{1000 * v:.0f} ms"}[kind]()


def expected_tiles(d) -> dict:
    return {"running": formatted("int", d["engine"]["running"]), "waiting": formatted("int", d["engine"]["waiting"]),
            "mean-ttft": formatted("ms", d["totals"]["mean_ttft"]),
            "acceptance-length": formatted("f2", d["totals"]["acceptance_length"]),
            "kv-usage": formatted("pct", d["engine"]["kv_usage"]),
            "state-usage": formatted("pct", d["engine"]["state_usage"]),
            "prefix-hit-rate": formatted("pct", d["engine"]["prefix_hit_rate"]),
            "requests": formatted("int", d["totals"]["requests"]),
            "generated-tokens": formatted("int", d["totals"]["generated_tokens"]),
            "prompt-tokens": formatted("int", d["totals"]["prompt_tokens"]),
            "preemptions": formatted("int", d["engine"]["preemptions"])}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_model(tmp_path_factory.mktemp("page-model"))
    srv, llm, forcing = start_server(model_dir, ServerConfig(keepalive=0.3, api_key=KEY), block_size=16,
                                     max_num_seqs=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                         "adaptive": False})
    forcing.scripts["rep"] = "the cat sat on the mat. " * 6
    srv.server.config.app.state.lucebox.dashboard.period = 0.25
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="lucebox-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--force-device-scale-factor=1", "--window-size=1400,1800",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def hex_rgb(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


def pixels_of(image, color: str, tolerance: int = 40) -> int:
    near = np.abs(np.asarray(image, dtype=np.int16) - np.array(hex_rgb(color), dtype=np.int16)) <= tolerance
    return int(near.all(axis=-1).sum())


def test_the_page_asks_for_the_key_draws_its_charts_and_shows_the_endpoints_numbers(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    user = [{"role": "user", "content": "the cat sat on the mat. the cat"}]
    for model in ("force:rep", "force:slow", "force:rep"):
        oai.chat.completions.create(model=model, messages=user, max_tokens=40)

    browser.get(server.url + "/dashboard")
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "key-form").is_displayed())
    browser.find_element(By.ID, "key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    # a few polls, so that every time series has points to draw lines between
    WebDriverWait(browser, 20).until(lambda b: b.execute_script(
        "const d = window.luceboxDashboard; return d.updates >= 3 && d.data.series.t.length >= 3"))

    def tiles_match(b):
        d = httpx.get(server.url + "/dashboard/data", headers={"Authorization": f"Bearer {KEY}"}).json()
        shown = {tid: b.find_element(By.ID, "tile-" + tid).text for tid in expected_tiles(d)}
        return shown if shown == expected_tiles(d) else False

    shown = WebDriverWait(browser, 10).until(tiles_match, message="the page's tiles never matched /dashboard/data")
    assert shown["requests"] == "3" and shown["acceptance-length"] != DASH and shown["mean-ttft"].endswith(" ms")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#requests tbody tr")) == 3
    # no script error, no missing asset: only the keyless first poll's 401, which brought up the key form
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert [m for m in errors if "/dashboard/data" not in m or "401" not in m] == [] and len(errors) == 1

    path = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(path))
    shot = Image.open(io.BytesIO(path.read_bytes())).convert("RGB")
    ratio = browser.execute_script("return window.devicePixelRatio")
    for chart, colors in CHART_COLORS.items():
        canvas = browser.find_element(By.CSS_SELECTOR, f"#{chart} canvas" if chart != "timeline" else "#timeline")
        r = canvas.rect
        box = tuple(round(v * ratio) for v in (r["x"], r["y"], r["x"] + r["width"], r["y"] + r["height"]))
        assert box[2] <= shot.width and box[3] <= shot.height, f"{chart} lies outside the screenshot"
        crop = shot.crop(box)
        for color in colors:
            assert pixels_of(crop, color) >= 20, f"{chart}: nothing drawn in {color} (see {path})"
