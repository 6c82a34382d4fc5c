import sys
from pathlib import Path

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
