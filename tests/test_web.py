"""The web API: its documents are the CLI's for the same inputs, and bad input is a 422 naming the field."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from trainmem.web import MAX_BODY_BYTES, create_app  # noqa: E402


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app())


# (API body, the same inputs as CLI flags)
SAME_INPUTS = [
    ({"model": "llama-3-8b"}, ["llama-3-8b"]),
    ({"model": "llama-3-8b", "batch": 4, "seq": 4096, "checkpointing": "full", "recipe": "pure-bf16",
      "gpu": "H100-80GB"},
     ["llama-3-8b", "--batch", "4", "--seq", "4096", "--checkpointing", "full", "--recipe", "pure-bf16", "--gpu",
      "H100-80GB"]),
    ({"model": "llama-2-7b", "gpus": 8, "zero": 3, "gpu": "A100-80GB", "headroom": 1.1},
     ["llama-2-7b", "--gpus", "8", "--zero", "3", "--gpu", "A100-80GB", "--headroom", "1.1"]),
    ({"model": "mixtral-8x7b", "gpus": 16, "fsdp": "full", "attention": "eager", "seq": 1024},
     ["mixtral-8x7b", "--gpus", "16", "--fsdp", "full", "--attention", "eager", "--seq", "1024"]),
    ({"model": "llama-3-70b", "gpus": 64, "tp": 8, "sp": True, "pp": 4, "zero": 1, "seq": 4096},
     ["llama-3-70b", "--gpus", "64", "--tp", "8", "--sp", "--pp", "4", "--zero", "1", "--seq", "4096"]),
    ({"model": "llama-3.1-8b", "recipe": "pure-bf16-bf16states", "batch": 2, "checkpointing": "full", "lora": 8,
      "lora_alpha": 16, "lora_targets": "q,v", "loss": "chunked-output"},
     ["llama-3.1-8b", "--recipe", "pure-bf16-bf16states", "--batch", "2", "--checkpointing", "full", "--lora", "8",
      "--lora-alpha", "16", "--lora-targets", "q,v", "--loss", "chunked-output"]),
    ({"model": "llama-3.1-8b", "lora": 8, "qlora": True, "dora": True, "grad_accum": 4, "optimizer": "adafactor"},
     ["llama-3.1-8b", "--lora", "8", "--qlora", "--dora", "--grad-accum", "4", "--optimizer", "adafactor"]),
    ({"model": "gpt2", "gpu": "T4", "max_batch": True}, ["gpt2", "--gpu", "T4", "--max-batch"]),
]


@pytest.mark.parametrize("body, flags", SAME_INPUTS)
def test_api_estimate_is_the_cli_document(client, run_cli, body, flags):
    response = client.post("/api/estimate", json=body)
    code, out, err = run_cli("estimate", *flags, "--json")
    assert response.status_code == 200 and code == 0, (response.text, err)
    assert response.json() == json.loads(out)


@pytest.mark.parametrize("body, flags", [
    ({"model": "llama-3-70b", "gpu": "H100-80GB", "gpus": 8, "seq": 4096, "top": 3},
     ["llama-3-70b", "--gpu", "H100-80GB", "--gpus", "8", "--seq", "4096", "--top", "3"]),
    ({"model": "llama-3-8b", "gpu": "A100-80GB", "nodes": 2, "global_batch": 64, "recipe": "pure-bf16-bf16states",
      "mfu": 0.5},
     ["llama-3-8b", "--gpu", "A100-80GB", "--nodes", "2", "--global-batch", "64", "--recipe", "pure-bf16-bf16states",
      "--mfu", "0.5"]),
])
def test_api_plan_is_the_cli_document(client, run_cli, body, flags):
    response = client.post("/api/plan", json=body)
    code, out, err = run_cli("plan", *flags, "--json")
    assert response.status_code == 200 and code == 0, (response.text, err)
    api, cli = response.json(), json.loads(out)
    assert api["search"].pop("seconds") >= 0 and cli["search"].pop("seconds") >= 0  # (the one measured figure)
    assert api == cli


def test_plan_input_errors_name_the_field(client):
    for body, field in (({"model": "llama-3-8b"}, "gpu"), ({"model": "llama-3-8b", "gpu": "A10G"}, "gpu"),
                        ({"model": "llama-3-8b", "gpu": "H100-80GB", "gpus": 8, "global_batch": 12}, None)):
        response = client.post("/api/plan", json=body)
        assert response.status_code == 422
        loc = response.json()["detail"][0]["loc"]
        assert field is None or loc[-1] == field, loc


def test_an_uploaded_config_is_estimated_as_the_cli_estimates_its_file(client, run_cli, tmp_path):
    config = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 2048}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    response = client.post("/api/estimate", json={"config": config, "batch": 2, "seq": 512})
    code, out, _ = run_cli("estimate", str(path), "--batch", "2", "--seq", "512", "--json")
    api, cli = response.json(), json.loads(out)
    assert response.status_code == 200 and code == 0
    # the CLI names the model by its file; everything else is the same document
    assert (api["model"].pop("name"), api["model"].pop("source")) == ("uploaded config", "upload")
    assert cli["model"].pop("source") == str(path) and cli["model"].pop("name")
    assert api == cli


def test_catalog_gpus_and_recipes_are_the_cli_documents(client, run_cli):
    for path, command in (("/api/models", "models"), ("/api/recipes", "recipes")):
        code, out, _ = run_cli(command, "--json")
        assert client.get(path).json() == json.loads(out)
    gpus = client.get("/api/gpus").json()["gpus"]
    assert {g["name"] for g in gpus} >= {"H100-80GB", "A100-80GB", "RTX-4090"}
    assert next(g for g in gpus if g["name"] == "H100-80GB")["memory_bytes"] == 81559 * 2**20


@pytest.mark.parametrize("body, field, says", [
    ({"model": "llama-3-8b", "batch": -2}, "batch", "greater than or equal to 1"),
    ({"model": "llama-3-8b", "batch": "four"}, "batch", "integer"),
    ({"model": "/etc/passwd"}, "model", "unknown model"),
    ({"model": "meta-llama/Llama-2-7b-hf"}, "model", "unknown model"),  # no Hub ids: nothing is fetched
    ({}, "model", "one of them"),
    ({"model": "gpt2", "config": {"model_type": "gpt2"}}, "model", "one of them"),
    ({"model": "llama-3-8b", "recipe": "fp64"}, "recipe", "unknown recipe"),
    ({"model": "llama-3-8b", "gpu": "H900"}, "gpu", "unknown GPU"),
    ({"config": {"foo": 1}}, "config", "model_type"),
    ({"config": {"model_type": "llama", "hidden_size": "x"}}, "config", "must be an integer"),
    ({"model": "llama-3-8b", "trust_remote_code": True}, "trust_remote_code", "Extra inputs"),
    ({"model": "llama-3-8b", "gpus": 3, "zero": 3, "lora": 8}, "gpus", "several GPUs"),
    ({"model": "llama-3-8b", "gpus": 3, "tp": 3}, "tp", "must divide the attention heads"),
    ({"model": "llama-3-8b", "gpus": 6, "tp": 4}, "gpus", "not a multiple of tp x pp x cp"),
])
def test_bad_input_is_a_422_naming_the_field(client, body, field, says):
    response = client.post("/api/estimate", json=body)
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"][-1] == field and says in detail["msg"], detail


def test_bodies_are_json_and_at_most_64_kib(client):
    big = {"config": {"model_type": "llama", "padding": "x" * MAX_BODY_BYTES}}
    response = client.post("/api/estimate", json=big)
    assert response.status_code == 413 and "64 KiB" in response.json()["detail"][0]["msg"]
    response = client.post("/api/estimate", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422


def test_the_page_and_the_api_documentation_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and "trainmem" in page.text
    assert "http://" not in page.text.replace("http://127.0.0.1", "") and "https://" not in page.text  # no CDN
    paths = client.get("/openapi.json").json()["paths"]
    assert set(paths) == {"/api/models", "/api/gpus", "/api/recipes", "/api/estimate", "/api/plan"}
    assert client.get("/docs").status_code == 200


def test_serve_binds_loopback_by_default(run_cli, monkeypatch):
    seen = {}
    monkeypatch.setattr("trainmem.web.serve", lambda host, port: seen.update(host=host, port=port))
    code, out, _ = run_cli("serve")
    assert code == 0 and seen == {"host": "127.0.0.1", "port": 8000} and "http://127.0.0.1:8000" in out
    code, _, err = run_cli("serve", "--port", "0")
    assert code == 2 and "--port" in err
