"""The web page as a person uses it, in headless Chromium driven by Playwright against a server on loopback.

Debian's chromium (`make test` installs it; Playwright's own browser download does not work here) and the Python
playwright package (the dev extra). Where either is missing the test is skipped with the reason, never silently.
Screenshots go to test-artifacts/ (ignored by git).
"""

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
"""Chromium's background connections are refused by a closed network; these keep it quiet (and root needs
--no-sandbox)."""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi", reason="the web extra (fastapi) is not installed")
    uvicorn = pytest.importorskip("uvicorn", reason="the web extra (uvicorn) is not installed")
    from trainmem.web import create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        if time.monotonic() > deadline:
            pytest.fail("the server did not start in 20 s")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; `make test` tries)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


def _settled(page, after: int = 0) -> int:
    """Wait until the page has shown the answer to a request newer than ``after``; its number."""
    page.wait_for_function(f"Number(document.body.dataset.ready || 0) > {after}", timeout=20_000)
    page.wait_for_timeout(300)  # (a change still debouncing starts a newer request: let it land)
    page.wait_for_function("document.body.dataset.ready == String(sequence)", timeout=20_000)
    return int(page.evaluate("document.body.dataset.ready"))


def _api(server, body) -> dict:
    import httpx

    response = httpx.post(server + "/api/estimate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _gib(doc) -> str:
    return f"{doc['peak']['required_bytes'] / 2**30:.2f} GiB"


def test_pick_a_model_change_the_batch_upload_a_config_and_share_it(server, browser, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(server)
    ready = _settled(page)

    page.select_option("#model", "llama-3-8b")
    page.select_option("#gpu", "H100-80GB")
    page.fill("#batch", "4")
    ready = _settled(page, ready)
    expected = _api(server, {"model": "llama-3-8b", "batch": 4, "gpu": "H100-80GB"})
    assert page.text_content("#total") == _gib(expected)
    assert page.text_content("#fits") == ("fits" if expected["gpu"]["fits"] else "does not fit")
    page.select_option("select[name=recipe]", "pure-bf16")
    page.select_option("select[name=checkpointing]", "full")
    ready = _settled(page, ready)
    expected = _api(server, {"model": "llama-3-8b", "batch": 4, "gpu": "H100-80GB", "recipe": "pure-bf16",
                             "checkpointing": "full"})
    assert page.text_content("#total") == _gib(expected)
    searched = _api(server, {"model": "llama-3-8b", "batch": 4, "gpu": "H100-80GB", "recipe": "pure-bf16",
                             "checkpointing": "full", "max_batch": True})
    assert page.text_content("#max-batch") == (f"{searched['max_batch']:,}" if searched["max_batch"] else "none")
    assert page.locator("#bar svg rect").count() >= 3 and page.locator("#timeline svg rect").count() >= 5
    page.fill("#gpus", "8")
    ready = _settled(page, ready)
    page.click("#plan-button")
    page.wait_for_function("document.body.dataset.planned", timeout=60_000)
    import httpx

    planned = httpx.post(server + "/api/plan", json={"model": "llama-3-8b", "gpu": "H100-80GB", "gpus": 8,
                                                     "seq": 2048, "global_batch": 32, "top": 5}, timeout=60).json()
    rows = page.locator("#plan-table tr")
    assert planned["plans"] and rows.count() == len(planned["plans"]) + 1
    first = planned["plans"][0]
    assert _gib({"peak": first["estimate"]["peak"]}) in rows.nth(1).text_content()
    assert first["layout"]["engine"] in rows.nth(1).text_content()
    page.screenshot(path=str(ARTIFACTS / "web-1280x800.png"), full_page=True)
    page.fill("#gpus", "1")
    ready = _settled(page, ready)

    config = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
              "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
              "max_position_embeddings": 4096}
    path = tmp_path / "my-config.json"
    path.write_text(json.dumps(config))
    page.set_input_files("#upload", str(path))
    ready = _settled(page, ready)
    expected = _api(server, {"config": config, "batch": 4, "gpu": "H100-80GB", "recipe": "pure-bf16",
                             "checkpointing": "full"})
    assert page.text_content("#total") == _gib(expected)
    assert "my-config.json" in page.text_content("#config-name")

    shared = page.input_value("#share")
    other = browser.new_page(viewport={"width": 1280, "height": 800})
    other.goto(shared)
    _settled(other)
    assert other.text_content("#total") == _gib(expected)
    assert other.input_value("#batch") == "4" and other.input_value("select[name=recipe]") == "pure-bf16"
    assert "my-config.json" in other.text_content("#config-name")

    phone = browser.new_page(viewport={"width": 390, "height": 844})
    phone.goto(shared)
    _settled(phone)
    assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")  # no sideways scroll
    phone.screenshot(path=str(ARTIFACTS / "web-390x844.png"), full_page=True)


def test_bad_input_shows_the_servers_message_not_a_crash(server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(server)
    ready = _settled(page)
    page.fill("#lora", "8")
    page.fill("#gpus", "4")
    _settled(page, ready)
    assert "LoRA on several GPUs" in page.text_content("#error")
