"""The disk cache of recorded steps and counted parameters (recorded.py, meta_count.py): one JSON file per key,
keyed by what changes it and by the library versions, written whole and renamed so a reader never sees half a file."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

CACHE_FORMAT = 2
"""Bumped when what the cache holds, or how it is recorded, changes: older entries are then never read."""
CACHE_ENV = "TRAINMEM_CACHE_DIR"

def cache_dir() -> Path:
    """Where recorded steps and counted parameters are kept."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trainmem"


def library_versions() -> dict[str, str] | None:
    """The versions that change a trace, read from the installed metadata (no import), and trainmem's own code
    (source_digest); None if torch or transformers is not installed."""
    from importlib import metadata

    from . import __version__

    try:
        return {"torch": metadata.version("torch"), "transformers": metadata.version("transformers"),
                "trainmem": __version__, "format": str(CACHE_FORMAT), "code": source_digest()}
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def source_digest() -> str:
    """A digest of every module of this trainmem (its .py files' bytes, about 4 ms once per process): a recording
    made by other code is never read back, whether a release or an edited checkout made it (a stale recording of
    BERT at one layer once moved a published row by 1.7%), without relying on CACHE_FORMAT being bumped."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def canonical_config(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)


def cache_path(kind: str, payload: dict[str, Any]) -> Path | None:
    """The file that holds ``kind`` ("phases", "params") for ``payload``, or None without torch/transformers."""
    versions = library_versions()
    if versions is None:
        return None
    text = json.dumps({"kind": kind, "versions": versions, **payload}, sort_keys=True, default=str)
    return cache_dir() / kind / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def read_cached(path: Path | None) -> dict[str, Any] | None:
    """A cached document, or None when absent or unreadable (a torn or edited file is recomputed, not trusted)."""
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def write_cached(path: Path | None, doc: dict[str, Any]) -> str:
    """Keep ``doc`` at ``path`` (written whole, then renamed, so a reader never sees half a file); returns "" or
    why it was not kept (a read-only home is no reason to fail the estimate)."""
    if path is None:
        return "torch or transformers not installed"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return ""
