"""The settings grid whose ``estimate --json`` documents are pinned byte for byte (tests/test_estimate_grid.py).

Recorded from commit 3f7be64, the last before issue 10's rework of the core (JSON schema 1), by
``python tests/estimate_grid.py record``: each document is brought to schema 2 (the version and the renamed phase
key, the only changes schema 2 made to an estimate) and hashed. A change to any byte of any document fails the test.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import sys
from pathlib import Path

GRID_FILE = Path(__file__).parent / "data" / "estimate_grid.json.gz"

CORE = [dict(recipe=r, batch=b, seq=s, checkpointing=c, attention=a)
        for r, b, s, c, a in itertools.product(["fp32", "amp-bf16", "mixed-bf16", "pure-bf16"], [1, 3], [512, 4096],
                                               ["none", "full"], ["sdpa", "eager"])]
EXTRA = [
    dict(recipe="amp-fp16", batch=2, seq=1024),
    dict(recipe="amp-bf16", batch=2, seq=1024, dropout=0.1),
    dict(recipe="amp-bf16", batch=2, seq=1024, dropout=0.1, checkpointing="full"),
    dict(recipe="fp32", batch=2, seq=1024, dropout=0.1, attention="eager"),
    dict(recipe="mixed-bf16", batch=2, seq=1024, grad_accum=4),
    dict(recipe="pure-bf16", batch=2, seq=1024, optimizer="sgd"),
    dict(recipe="pure-bf16", batch=2, seq=1024, optimizer="adamw-8bit"),
    dict(recipe="mixed-bf16", batch=2, seq=1024, optimizer_impl="foreach"),
    dict(recipe="fp32", batch=2, seq=1024, optimizer_impl="fused"),
    dict(recipe="mixed-bf16", batch=2, seq=1024, attention="flash"),
    dict(recipe="amp-bf16", batch=2, seq=1024, loss="chunked"),
    dict(recipe="mixed-bf16", batch=2, seq=1024, activation_k=34),
    dict(recipe="mixed-bf16", batch=1, seq=131072),
    dict(recipe="amp-bf16", batch=5, seq=777, attention="eager", checkpointing="full"),
]
SETTINGS = CORE + EXTRA


def case_key(model: str, settings: dict) -> str:
    return model + " " + " ".join(f"{k}={v}" for k, v in sorted(settings.items()))


def canonical(doc: dict) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def to_schema_2(doc: dict) -> dict:
    """A schema-1 estimate document as schema 2 writes it (docs/json-schema.md, "Changes")."""
    doc = dict(doc, schema_version=2)
    doc["phases"] = [{("states_and_master_bytes" if k == "optimizer_states_bytes" else k): v for k, v in p.items()}
                     for p in doc["phases"]]
    return doc


def documents():
    """(key, estimate document) for every catalog model and every setting in the grid, in order."""
    from trainmem.catalog import catalog_names, catalog_spec
    from trainmem.estimate import DeviceOptions
    from trainmem.stepmodel import estimate_model
    from trainmem.report import to_dict
    from trainmem.settings import make_settings

    flat = DeviceOptions(fragmentation=0.1)  # (the recording's reserved memory: the flat 10%, not the replay)
    for name in catalog_names():
        spec = catalog_spec(name)
        for values in SETTINGS:
            yield case_key(name, values), to_dict(estimate_model(spec, make_settings(**values), flat))


ADDED_PER_LAYER_KEYS = ("checkpointed", "kept_bytes_per_token")
"""Keys an estimate document gained after the recording, which carry no new figure of the step: each per-layer
entry's checkpointing flag and the bytes per token it keeps (its bytes_per_token when not checkpointed, the
checkpoint's input when it is; added with the activation table's fix for selective checkpointing). They are left out
of the digest; every figure the recording pinned is still compared byte for byte."""


ADDED_GPUS = ("A40", "H100-PCIe", "H100-NVL", "Gaudi-2", "L40", "MI250X", "RTX-A6000", "Gaudi-3")
"""Cards added to the catalog after the recording: their answers in ``fits`` are left out of the digest too."""


ADDED_TOP_KEYS = ("activation_source", "traced")
ADDED_PEAK_KEYS = ("reserved_from", "alloc_conf", "allocator", "device_lines")
"""Keys the peak gained with the replayed reserved memory (how reserved was found, the allocator settings, the
device total's labelled lines): the figures they describe are the peak's own, still compared."""
"""Top-level keys added after the recording: which model answered (activation_source) and, for the traced path,
what it recorded. Neither is a figure of the step."""


def without_additions(doc: dict) -> dict:
    doc = {k: v for k, v in doc.items() if k not in ADDED_TOP_KEYS}
    if isinstance(doc.get("peak"), dict):
        doc["peak"] = {k: v for k, v in doc["peak"].items() if k not in ADDED_PEAK_KEYS}
    if isinstance(doc.get("fits"), dict):
        doc = dict(doc, fits={gpu: fits for gpu, fits in doc["fits"].items() if gpu not in ADDED_GPUS})
    activations = doc.get("activations") or {}
    if not activations.get("per_layer"):
        return doc
    per_layer = [{k: v for k, v in layer.items() if k not in ADDED_PER_LAYER_KEYS} for layer in activations["per_layer"]]
    return dict(doc, activations=dict(activations, per_layer=per_layer))


def digest(doc: dict) -> str:
    return hashlib.sha256(canonical(without_additions(doc)).encode()).hexdigest()[:16]


def record() -> None:
    grid = {}
    for key, doc in documents():
        doc = to_schema_2(doc) if doc["schema_version"] == 1 else doc
        peak = doc["peak"]
        grid[key] = {"sha256": digest(doc), "peak_allocated_bytes": peak and peak["allocated_bytes"]}
    GRID_FILE.parent.mkdir(exist_ok=True)
    with gzip.open(GRID_FILE, "wt") as f:
        json.dump(grid, f, indent=0, sort_keys=True)
    print(f"{len(grid)} documents recorded in {GRID_FILE}")


if __name__ == "__main__" and sys.argv[1:] == ["record"]:
    record()
