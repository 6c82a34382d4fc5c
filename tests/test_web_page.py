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

    phone = browser.new_page(viewport={"width": 375, "height": 812})
    phone.goto(shared)
    _settled(phone)
    assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")  # no sideways scroll
    phone.screenshot(path=str(ARTIFACTS / "web-375x812.png"), full_page=True)


def test_bad_input_shows_the_servers_message_not_a_crash(server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(server)
    ready = _settled(page)
    page.fill("#gpus", "0")
    _settled(page, ready)
    assert "gpus: Input should be greater than or equal to 1" in page.text_content("#error")


def _results_are_down(page) -> bool:
    """Nothing of an earlier answer is on screen: no total, no badge, no charts, no GPU table."""
    return (page.text_content("#total") == "–" and page.text_content("#fits") == "–"
            and page.text_content("#max-batch") == "–" and page.locator("#bar svg").count() == 0
            and page.locator("#timeline svg").count() == 0 and page.locator("#fits-table table").count() == 0
            and page.text_content("#summary") == "")


def test_a_bad_input_or_upload_after_a_good_one_takes_the_old_results_down(server, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(server)
    ready = _settled(page)
    assert page.text_content("#total").endswith("GiB") and page.text_content("#error") == ""

    page.fill("#gpus", "0")  # no GPU: refused
    ready = _settled(page, ready)
    assert "gpus: Input should be" in page.text_content("#error") and _results_are_down(page)
    page.fill("#gpus", "1")
    ready = _settled(page, ready)
    assert page.text_content("#total").endswith("GiB") and page.text_content("#error") == ""

    for name, text, says in (("broken.json", "{not json", "broken.json is not JSON"),
                             ("list.json", "[1, 2]", "not an object"),
                             ("bad-config.json", json.dumps({"model_type": "llama", "hidden_size": "x"}), "config")):
        path = tmp_path / name
        path.write_text(text)
        page.set_input_files("#upload", str(path))
        ready = _settled(page, ready)
        assert says in page.text_content("#error"), page.text_content("#error")
        assert _results_are_down(page), name
        page.select_option("#model", "gpt2")  # choosing a model drops the file and answers again
        ready = _settled(page, ready)
        assert page.text_content("#error") == "" and page.text_content("#total").endswith("GiB")
        page.select_option("#model", "llama-3-8b")
        ready = _settled(page, ready)

    page.fill("#params", "7B")  # a nominal size: static memory only, said so
    ready = _settled(page, ready)
    assert page.text_content("#error") == "" and "nominal parameter count" in page.text_content("#path")
    page.fill("#params", "seven")
    ready = _settled(page, ready)
    assert "params" in page.text_content("#error") and _results_are_down(page)

    shared = browser.new_page(viewport={"width": 1280, "height": 800})
    shared.goto(server + "/?model=gpt2&config=%25not-base64")  # a shared URL whose config is broken
    _settled(shared)
    assert "could not be read" in shared.text_content("#error") and _results_are_down(shared)


def test_a_plan_row_loads_into_the_calculator_and_estimates_to_its_peak(server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(server)
    ready = _settled(page)
    page.select_option("#model", "llama-3-70b")
    page.fill("#gpus", "32")
    page.fill("#seq", "4096")
    page.fill("#batch", "2")  # (a global batch of 64: a tensor x pipeline layout in mixed-bf16 wins)
    ready = _settled(page, ready)
    page.click("#plan-button")
    page.wait_for_function("document.body.dataset.planned", timeout=60_000)
    plans = page.evaluate("plans")
    assert plans and "host/node" in page.text_content("#plan-table tr")
    assert any(p["layout"]["tensor_parallel"] > 1 or p["layout"]["pipeline_parallel"] > 1 for p in plans), plans
    for i, plan in enumerate(plans):
        row = page.locator("#plan-table tr").nth(i + 1)
        needed = _gib({"peak": plan["estimate"]["peak"]})
        assert needed in row.text_content() and _gib_text(plan["host_bytes_per_node"]) in row.text_content()
        row.locator("button.load").click()
        ready = _settled(page, ready)
        L = plan["layout"]
        assert page.text_content("#error") == ""
        assert page.text_content("#total") == needed, (L, page.text_content("#total"))
        assert page.input_value("#tp") == str(L["tensor_parallel"]) and page.input_value("#pp") == str(
            L["pipeline_parallel"]) and page.input_value("#offload") == L["offload"]


def _gib_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def test_the_phone_layout_does_not_scroll_sideways(server, browser):
    phone = browser.new_page(viewport={"width": 375, "height": 812})
    phone.goto(server)
    ready = _settled(phone)
    phone.fill("#gpus", "8")
    ready = _settled(phone, ready)
    phone.click("#plan-button")
    phone.wait_for_function("document.body.dataset.planned", timeout=60_000)
    phone.evaluate("document.querySelectorAll('details').forEach((d) => { d.open = true; })")
    phone.fill("#lora", "0")
    ARTIFACTS.mkdir(exist_ok=True)
    phone.screenshot(path=str(ARTIFACTS / "web-375x812-plan.png"), full_page=True)
    width = phone.evaluate("[document.documentElement.scrollWidth, document.body.scrollWidth, window.innerWidth]")
    assert width[0] <= width[2] and width[1] <= width[2], width


def test_the_api_documentation_renders_with_no_network(server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    outside: list[str] = []

    def only_loopback(route):
        if route.request.url.startswith(server):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_loopback)
    page.goto(server + "/docs")
    page.wait_for_selector(".swagger-ui .opblock", timeout=20_000)
    # (GET models, gpus, recipes, options; POST estimate, plan)
    assert page.locator(".swagger-ui .opblock").count() == 6 and not outside, outside


def test_a_phi_2_upload_is_answered_and_says_what_answered(server, browser, tmp_path):
    pytest.importorskip("transformers", reason="counting phi's parameters needs transformers (the trace extra)")
    from test_web import PHI_2

    import httpx

    # the server's first count of a phi config imports transformers (seconds on a busy machine): done here first,
    # so that the page's request, answered from the server's cache, is not raced against _settled's timeout
    assert httpx.post(server + "/api/estimate", json={"config": PHI_2}, timeout=300).status_code == 200
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(server)
    ready = _settled(page)
    assert "hand-written description of llama" in page.text_content("#path")
    path = tmp_path / "phi-2.json"
    path.write_text(json.dumps(PHI_2))
    page.set_input_files("#upload", str(path))
    _settled(page, ready)
    assert page.text_content("#error") == ""
    assert "2,779,683,840 parameters" in page.text_content("#summary")
    assert "hand-written description of phi" in page.text_content("#path")  # (models.py's phi parser)


def test_a_custom_gpu_memory_is_answered_for(server, browser):
    import inspect

    from trainmem.request import make_request

    if "gpu_memory" not in inspect.signature(make_request).parameters:
        pytest.skip("make_request has no gpu_memory keyword on this branch (another change adds it)")
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(server)
    ready = _settled(page)
    page.select_option("#model", "llama-3.2-1b")
    page.select_option("#gpu", "")
    page.fill("#gpu_memory", "48GiB")
    _settled(page, ready)
    expected = _api(server, {"model": "llama-3.2-1b", "gpu_memory": "48GiB"})
    assert page.text_content("#error") == "" and page.text_content("#total") == _gib(expected)
    assert page.text_content("#fits") == ("fits" if expected["gpu"]["fits"] else "does not fit")
    assert expected["gpu"]["name"] in page.text_content("#fits-label")


def test_every_other_option_of_the_cli_is_a_control_that_answers(server, browser):
    """The page makes a control for each CLI flag its form does not lay out (GET /api/options): FSDP1 and its
    use_orig_params there, set on a 2-GPU FSDP run, answer what the API answers for the same fields."""
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(server)
    ready = _settled(page)
    page.click("#every-option summary")
    for name in ("task", "num_labels", "fsdp_version", "fsdp_no_sync", "pp_layers", "bnb_version", "alloc_conf"):
        assert page.locator(f"#generated [name={name}]").count() == 1, name
    page.select_option("#model", "llama-3.2-1b")
    page.select_option("select[name=recipe]", "pure-bf16")  # (FSDP1 is modelled without MixedPrecision)
    page.fill("#gpus", "2")
    page.select_option("#sharding", "fsdp-full")
    ready = _settled(page, ready)
    same = {"model": "llama-3.2-1b", "recipe": "pure-bf16", "gpus": 2, "fsdp": "full", "gpu": "H100-80GB"}
    fsdp2 = _api(server, same)
    assert page.text_content("#total") == _gib(fsdp2)
    page.fill("#generated [name=fsdp_version]", "1")
    page.check("#generated [name=fsdp_use_orig_params]")
    _settled(page, ready)
    fsdp1 = _api(server, {**same, "fsdp_version": 1, "fsdp_use_orig_params": True})
    assert _gib(fsdp1) != _gib(fsdp2) and page.text_content("#error") == ""
    assert page.text_content("#total") == _gib(fsdp1)
