"""The disk cache of recorded steps: an entry is keyed by the code that recorded it, not only by the versions."""

import pytest

from trainmem import diskcache


def test_a_recording_of_other_code_is_not_read(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setenv(diskcache.CACHE_ENV, str(tmp_path))
    payload = {"config": "{}", "settings": "batch=1"}
    monkeypatch.setattr(diskcache, "source_digest", lambda: "code-of-release-a")
    path_a = diskcache.cache_path("phases", payload)
    assert diskcache.write_cached(path_a, {"peak": 1}) == ""
    assert diskcache.read_cached(diskcache.cache_path("phases", payload)) == {"peak": 1}
    monkeypatch.setattr(diskcache, "source_digest", lambda: "code-of-release-b")
    path_b = diskcache.cache_path("phases", payload)
    assert path_b != path_a and diskcache.read_cached(path_b) is None


def test_the_source_digest_covers_every_module(tmp_path, monkeypatch):
    """The digest is of the package's files: a copy of the package with one byte changed digests differently."""
    import shutil
    from pathlib import Path

    package = Path(diskcache.__file__).parent
    copy = tmp_path / "trainmem"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.json", "static", "catalog"))
    monkeypatch.setattr(diskcache, "__file__", str(copy / "diskcache.py"))
    diskcache.source_digest.cache_clear()
    before = diskcache.source_digest()
    (copy / "units.py").write_text((copy / "units.py").read_text() + "\n# edited\n")
    diskcache.source_digest.cache_clear()
    after = diskcache.source_digest()
    diskcache.source_digest.cache_clear()
    assert before != after and len(before) == 16
