"""Every command's --json document validates against the JSON Schema in the package, and docs/json-schema.md
describes the keys the schema defines."""

import json
import re
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")

from trainmem.report import SCHEMA_VERSION, json_schema  # noqa: E402

DOCS = Path(__file__).parent.parent / "docs" / "json-schema.md"
CONFIGS = Path(__file__).parent / "configs"  # (2-layer copies of catalog configs: a model-running command's document
# has the same keys at any depth, and CI's time is spent where the layers matter)


@pytest.fixture(scope="module")
def validator():
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _document(run_cli, *args):
    code, out, err = run_cli(*args, "--json")
    assert code in (0, 1), err
    return json.loads(out)


FAST = [
    ("estimate", "llama-2-7b"),
    ("estimate", "mixtral-8x7b", "--gpu", "H100", "--max-batch", "--max-seq", "--checkpointing", "full"),
    ("estimate", "gpt2", "--activation-k", "34", "--gpu", "T4"),
    ("estimate", "--params", "7B"),
    ("estimate", "deepseek-v3", "--recipe", "amp-bf16", "--attention", "eager", "--explain"),
    ("sweep", "gpt2", "--batch", "1,2", "--seq", "128,256"),
    ("sweep", "gpt2", "--batch", "1,2", "--seq", "128", "--gpu-memory", "8GB"),
    ("estimate", "llama-3.2-1b", "--gpu-memory", "48GiB", "--checkpointing", "selective", "--recipe", "pure-bf16"),
    ("estimate", "llama-3.1-405b", "--gpu", "T4", "--gpu-memory", "16GB", "--max-batch"),
    ("estimate", "--params", "7B", "--gpu", "Gaudi-3"),
    ("estimate", "llama-2-7b", "--gpus", "16", "--zero", "3", "--offload", "optimizer+params"),
    ("estimate", "llama-2-7b", "--gpus", "16", "--fsdp", "hybrid", "--gpu", "H100"),
    ("estimate", "llama-2-7b", "--gpus", "2", "--fsdp", "full", "--fsdp-version", "1", "--fsdp-use-orig-params",
     "--fsdp-no-sync", "--grad-accum", "4", "--recipe", "pure-bf16", "--lora", "8", "--adapter-dtype", "bf16"),
    ("estimate", "llama-2-7b", "--gpus", "4"),
    ("estimate", "llama-3.2-3b", "--recipe", "pure-bf16", "--optimizer-in-backward"),
    ("estimate", "llama-3.1-8b", "--lora", "8", "--qlora", "--lora-targets", "all-linear"),
    ("estimate", "llama-3.2-1b", "--lora", "8", "--dora", "--lora-targets", "all-linear", "--checkpointing", "full",
     "--train-modules", "lm_head,embed_tokens"),
    ("estimate", "llama-3.2-1b", "--recipe", "pure-bf16", "--checkpointing", "full", "--offload-activations",
     "--loss", "chunked-output", "--compile"),
    ("sweep", "llama-2-7b", "--gpus", "1,8", "--zero", "1,3", "--batch", "1", "--seq", "512"),
    ("plan", "llama-3-8b", "--gpu", "H100-80GB", "--gpus", "16", "--global-batch", "64", "--top", "2"),
    ("plan", "llama-3.1-405b", "--gpu", "H100-80GB", "--seq", "4096", "--min-gpus", "--top", "1"),
    ("models",),
    ("recipes",),
    ("dtypes",),
    ("dtypes", "--value", "1e-8"),
]


@pytest.mark.parametrize("args", FAST, ids=" ".join)
def test_documents_validate(run_cli, validator, args):
    doc = _document(run_cli, *args)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message[:200]}" for e in errors[:5]]
    assert doc["schema_version"] == SCHEMA_VERSION and doc["engine"] == args[0]


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ("trace", str(CONFIGS / "gpt2-2-layers.json"), "--seq", "64", "--recipe", "amp-bf16"),
    ("trace", str(CONFIGS / "llama-3.2-1b-2-layers.json"), "--gpus", "2", "--fsdp", "full", "--seq", "64",
     "--recipe", "fp32"),
    ("measure", str(CONFIGS / "gpt2-2-layers.json"), "--seq", "32", "--device", "cpu", "--steps", "1"),
    ("precision-check", "gpt2", "--layers", "1", "--hidden", "64", "--seq", "16", "--batch", "2", "--steps", "1"),
    ("amp-demo", "--steps", "3", "--runs", "fp32,fp16-autocast+scaler"),
], ids=lambda args: " ".join(Path(a).name for a in args))
def test_documents_of_commands_that_run_models_validate(run_cli, validator, args):
    doc = _document(run_cli, *args)
    errors = list(validator.iter_errors(doc))
    assert not errors, [f"{list(e.path)}: {e.message[:200]}" for e in errors[:5]]


def test_a_document_that_breaks_the_schema_is_caught(run_cli, validator):
    doc = _document(run_cli, "estimate", "gpt2")
    doc["phases"][0]["optimizer_states_bytes"] = doc["phases"][0].pop("states_and_master_bytes")  # schema 1's name
    assert list(validator.iter_errors(doc))
    doc = _document(run_cli, "estimate", "gpt2")
    doc["peak"]["allocated_bytes"] = 1.5
    assert list(validator.iter_errors(doc))


def test_the_docs_describe_every_key_of_the_estimate_document():
    schema = json_schema()
    text = DOCS.read_text()
    assert f"(schema_version {SCHEMA_VERSION})" in text.splitlines()[0]
    documented = set(re.findall(r"`([a-z_][a-z_0-9.\[\]<>]*)`", text))
    words = {part for key in documented for part in re.split(r"[.\[\]]+", key) if part}
    estimate = schema["$defs"]["estimate"]["properties"]
    missing = []
    for key, sub in estimate.items():
        if key not in words:
            missing.append(key)
        for inner in (sub.get("properties") or {}):
            if inner not in words:
                missing.append(f"{key}.{inner}")
    for key in schema["$defs"]["phase"]["properties"]:
        if key not in words:
            missing.append(f"phases[].{key}")
    assert not missing, f"docs/json-schema.md does not mention: {missing}"
