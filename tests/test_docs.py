"""The documentation's code runs, and every command is documented."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).parent.parent / "docs"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks(DOCS / "mixed-precision.md"))))
def test_mixed_precision_checklist_code_runs(index, capsys):
    pytest.importorskip("torch")
    exec(compile(python_blocks(DOCS / "mixed-precision.md")[index], f"mixed-precision.md[{index}]", "exec"), {})


def test_autocast_claims_in_the_checklist():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.linear(x, w).dtype == torch.bfloat16
        assert F.layer_norm(x, (8,)).dtype == torch.float32
        assert F.cross_entropy(x, torch.tensor([0, 1, 2, 3])).dtype == torch.float32


def test_every_command_is_in_the_readme():
    from trainmem.cli import app

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for name in app.commands:
        assert f"trainmem {name}" in readme, name
