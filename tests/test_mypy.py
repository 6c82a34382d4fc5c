"""mypy stays clean over src/trainmem with the project's configuration ([tool.mypy] in pyproject.toml: mypy --strict's
flags on every module of the package)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_is_clean(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                             "--cache-dir", str(tmp_path / "cache"), str(ROOT / "src" / "trainmem")],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Success: no issues found" in result.stdout


def test_every_module_is_checked_strictly():
    """The strict override names the whole package, not a list that a new module could be left out of."""
    import tomllib

    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    strict = [o for o in overrides if o.get("disallow_untyped_defs")]
    assert len(strict) == 1 and set(strict[0]["module"]) >= {"trainmem", "trainmem.*"}
    assert not any(o.get("ignore_errors") for o in overrides)
