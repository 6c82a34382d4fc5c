import os
import sys
from pathlib import Path

# One intra-op thread per test process (and the gloo ranks it starts): pytest-xdist already runs a worker per core,
# and torch's default of a thread per core in each of them oversubscribes the machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # tiny_configs

CONFIGS = HERE / "configs"


@pytest.fixture
def run_cli(capsys):
    """Run the trainmem CLI in process; return (exit code, stdout, stderr)."""
    from trainmem.cli import main

    def run(*args: str):
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture(autouse=True, scope="session")
def _trainmem_cache(tmp_path_factory):
    """The traced path's cache (recorded.py) in a folder of the test session's own, never the user's."""
    import os

    previous = os.environ.get("TRAINMEM_CACHE_DIR")
    os.environ["TRAINMEM_CACHE_DIR"] = str(tmp_path_factory.mktemp("trainmem-cache"))
    yield
    if previous is None:
        os.environ.pop("TRAINMEM_CACHE_DIR", None)
    else:
        os.environ["TRAINMEM_CACHE_DIR"] = previous
