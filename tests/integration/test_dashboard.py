"""Live dashboard: the JSON state and page routes over fake backends, then the real page
in headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by Selenium)
over a running twin cluster: it loads, shows the backends, updates every second, works
with no outside network, and reflects a drained backend within 2 s. Saves a screenshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, running_gateway

from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import parse_cluster_config

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOT_ENV = "KILOSERVE_DASHBOARD_SCREENSHOT"  # also save the screenshot there (docs)
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1440,900", "--hide-scrollbars",
)  # fmt: skip


async def _get_json(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as r:
        assert r.status == 200
        return await r.json()


async def _stream_one(s: aiohttp.ClientSession, url: str) -> None:
    body = {"model": "m", "prompt": "hi", "stream": True}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        await r.read()


async def test_state_reports_backends_decisions_and_latency() -> None:
    async with fake_backends(FakeBackend(), FakeBackend(mode="500")) as (good, bad):
        backends = [{"url": good.url, "name": "good"}, {"url": bad.url, "name": "bad"}]
        cfg = gateway_config(backends, retries=1)
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            for _ in range(6):
                await _stream_one(s, url)
            await asyncio.sleep(1.3)  # at least one tick after the requests
            state = await _get_json(s, url + "/dashboard/state")
    rows = {b["name"]: b for b in state["backends"]}
    assert set(rows) == {"good", "bad"}
    assert rows["good"]["state"] == "healthy" and rows["good"]["pools"] == ["m"]
    assert [p["pool"] for p in state["pools"]] == ["m"]
    assert state["pools"][0]["num_backends"] == 2
    ttft = rows["good"]["latency_ms"]["ttft_p50"]
    assert ttft and ttft[-1] is not None and ttft[-1] > 0
    assert rows["bad"]["latency_ms"]["ttft_p50"][-1] is None  # it never answered
    recent = state["decisions"]["recent"]
    assert len(recent) == 6 and {d["policy"] for d in recent} == {"round_robin"}
    assert {d["backend"] for d in recent} == {"good", "bad"}
    # round robin picked "bad" first for half the requests: each 500 there was retried
    # onto "good", so the error rate is positive (and no client saw an error)
    totals = state["totals"]
    assert max(totals["req_per_s_series"]) > 0 and max(totals["err_per_s_series"]) > 0
    assert state["gateway"]["policy"] == "round_robin"


async def test_page_and_assets_are_served_from_the_package() -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}])
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            async with s.get(url + "/dashboard") as r:
                assert r.status == 200 and r.content_type == "text/html"
                html = await r.text()
                assert "default-src 'none'" in r.headers["Content-Security-Policy"]
            assert "dashboard/static/dashboard.js" in html and "http" not in html.lower()
            for name, ctype in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
                async with s.get(url + "/dashboard/static/" + name) as r:
                    assert r.status == 200 and r.content_type == ctype
                    assert "https://" not in await r.text()
            async with s.get(url + "/dashboard/static/../app.py") as r:
                assert r.status == 404


async def test_dashboard_can_be_disabled() -> None:
    async with fake_backends(FakeBackend()) as (fake,):
        cfg = gateway_config([{"url": fake.url}], dashboard={"enabled": False})
        async with running_gateway(cfg) as url, aiohttp.ClientSession() as s:
            for path in ("/dashboard", "/dashboard/state"):
                async with s.get(url + path) as r:
                    assert r.status == 404
            await _stream_one(s, url)  # the proxy path works without a recorder


# -- the real page in headless Chromium over a twin cluster ---------------------------------


def _chrome(tmp_path: Path) -> Any:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("chromium/chromium-driver not installed (scripts/ensure_tools.sh)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(
        executable_path=str(CHROMEDRIVER), log_output=str(tmp_path / "chromedriver.log")
    )
    return webdriver.Chrome(options=opts, service=service)


def _post(url: str, body: dict[str, Any] | None = None) -> bytes:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return bytes(resp.read())


@contextlib.contextmanager
def _background_load(gateway_url: str, model: str) -> Iterator[list[int]]:
    """Streaming requests one after another until the block ends; yields the done count."""
    stop = threading.Event()
    done = [0]

    def loop() -> None:
        body = {"model": model, "prompt": "tell me a story " * 40, "max_tokens": 24, "stream": True}
        while not stop.is_set():
            with contextlib.suppress(OSError):
                _post(gateway_url + "/v1/completions", body)
                done[0] += 1

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        yield done
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)


def _wait(driver: Any, timeout_s: float, predicate: Any, what: str) -> float:
    """Poll ``predicate(driver)`` every 50 ms; return the seconds it took."""
    t0 = time.monotonic()
    while not predicate(driver):
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def _row_states(driver: Any) -> dict[str, str]:
    script = (
        "return Array.from(document.querySelectorAll('#backends tbody tr[data-backend]'))"
        ".map(r => [r.dataset.backend, r.dataset.state]);"
    )
    return dict(driver.execute_script(script))


TWINS = {
    "name": "dash",
    "gateway": {"port": 0, "policy": "least_request"},
    "backends": [
        {"name": "h100", "gpu": "H100", "model": "llama-3.1-8b"},
        {"name": "a100", "gpu": "A100", "model": "llama-3.1-8b", "group": "rack-b"},
    ],
}


@pytest.mark.timeout(120)
def test_page_in_chromium_shows_twins_and_a_drain(tmp_path: Path) -> None:
    driver = _chrome(tmp_path)
    try:
        cluster = LocalCluster(parse_cluster_config(TWINS), run_dir=tmp_path / "run")
        with cluster:
            _check_page(driver, str(cluster.gateway_url), tmp_path)
    finally:
        driver.quit()


def _check_page(driver: Any, url: str, tmp_path: Path) -> None:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        model = json.load(resp)["data"][0]["id"]
    with _background_load(url, model) as done:
        driver.get(url + "/dashboard")
        loaded_s = time.monotonic()
        _wait(driver, 10, lambda d: set(_row_states(d)) == {"h100", "a100"}, "both backends")
        _wait(driver, 10, lambda d: set(_row_states(d).values()) == {"healthy"}, "healthy")
        text = driver.find_element("css selector", "#backends").text
        assert "H100" in text and "A100" in text and model in text
        _wait(driver, 10, lambda d: d.execute_script(_NUM_SPARK_POINTS_JS) > 0, "sparklines")
        _wait(driver, 10, lambda d: "least_request" in _decisions_text(d), "decisions")
        _post(url + "/admin/backends/a100/drain")
        took_s = _wait(driver, 2.0, lambda d: _row_states(d).get("a100") == "draining", "drain")
        assert _row_states(driver)["h100"] == "healthy"
        routable = driver.find_element("css selector", "#card-backends").text
        assert routable == "1 of 2", routable
        time.sleep(1.2)  # one more refresh, so the screenshot shows settled sparklines
        _save_screenshot(driver, tmp_path)
        _post(url + "/admin/backends/a100/undrain")
        _wait(driver, 2.0, lambda d: _row_states(d).get("a100") == "healthy", "undrain")
        _check_live_updates(driver, time.monotonic() - loaded_s)
    assert done[0] > 0
    _check_offline_and_clean(driver, url)
    print(f"drain visible after {took_s:.2f} s; {done[0]} requests during the test")


_NUM_SPARK_POINTS_JS = (
    "return document.querySelectorAll("
    "'#backends tbody tr[data-backend] td:nth-child(10) polyline').length;"
)


def _decisions_text(driver: Any) -> str:
    return str(driver.find_element("css selector", "#decisions").text)


def _check_live_updates(driver: Any, elapsed_s: float) -> None:
    """The page fetched its state about once a second since it loaded (<= 1 s + latency)."""
    count_js = (
        "return performance.getEntriesByType('resource')"
        ".filter(e => e.name.endsWith('/dashboard/state')).length;"
    )
    num_fetches = driver.execute_script(count_js)
    assert elapsed_s > 2.0 and num_fetches >= elapsed_s / 1.25 - 1, (num_fetches, elapsed_s)


def _check_offline_and_clean(driver: Any, url: str) -> None:
    """Every resource came from the gateway itself, and the console shows no error."""
    names = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name);"
    )
    assert names and all(n.startswith(url + "/") for n in names), names
    severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, severe


def _save_screenshot(driver: Any, tmp_path: Path) -> None:
    path = tmp_path / "dashboard.png"
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    extra = os.environ.get(SCREENSHOT_ENV)
    if extra:
        shutil.copyfile(path, extra)


# -- `kiloserve up` prints (and with --open, opens) the dashboard URL ------------------------


@pytest.mark.timeout(90)
def test_up_prints_and_opens_the_dashboard_url(tmp_path: Path) -> None:
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("backends:\n  - {name: one, gpu: H100, model: llama-3.1-8b}\n")
    argv = [sys.executable, "-m", "kiloserve", "up", "-c", str(cfg), "--open", "--port", "0"]
    argv += ["--duration", "60"]
    env = {**os.environ, "BROWSER": "echo"}  # webbrowser runs `echo URL`: proves --open
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        lines = _read_until(proc, "Ctrl-C", timeout_s=60)
        url = next(ln.split()[-1] for ln in lines if ln.startswith("dashboard: "))
        assert url.startswith("http://127.0.0.1:") and url.endswith("/dashboard"), lines
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200 and b"dashboard/static/dashboard.js" in resp.read()
        # `echo URL` writes straight to the pipe, so it may come before rich's lines
        if url not in [ln.strip() for ln in lines]:
            _read_until(proc, url, timeout_s=10, exact=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def _read_until(
    proc: subprocess.Popen[str], needle: str, timeout_s: float, exact: bool = False
) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if (line.strip() == needle) if exact else (needle in line):
            return lines
    raise AssertionError(f"no {needle!r} in the output of kiloserve up: {lines}")
