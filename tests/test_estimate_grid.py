"""Every catalog model over a grid of settings: ``estimate --json`` is byte for byte what commit 3f7be64 printed
(apart from schema 2's renamed key and version), so reworking the core changes no number, moment or note."""

import gzip
import json

from estimate_grid import GRID_FILE, digest, documents


def test_estimate_documents_equal_the_recorded_grid():
    recorded = json.loads(gzip.open(GRID_FILE, "rt").read())
    changed = []
    seen = 0
    recorded_models = {key.split(" ", 1)[0] for key in recorded}
    for key, doc in documents():
        if key.split(" ", 1)[0] not in recorded_models:
            continue  # (a catalog model added after the recording: its figures are checked by its own tests)
        seen += 1
        want = recorded.get(key)
        peak = doc["peak"] and doc["peak"]["allocated_bytes"]
        if want is None or digest(doc) != want["sha256"]:
            changed.append(f"{key}: peak {peak} (recorded {want and want['peak_allocated_bytes']})")
    assert seen == len(recorded)
    assert not changed, f"{len(changed)} of {seen} documents changed, e.g.\n" + "\n".join(changed[:10])
