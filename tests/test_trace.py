"""The trace's corrections for running under a dispatch mode.

Any active TorchDispatchMode (MemTracker, FakeTensorMode) makes autograd treat every tensor as a subclass
(``isTensorSubclassLike``), so backward takes out-of-place paths a plain GPU run does not: ``index_backward`` and
the engine's sum of two gradients of one tensor. The trace turns them back into the in-place ones. Each case below
is 1 MiB tensors whose backward peak is known by counting: with the plain-tensor paths it is 2 MiB of temporaries,
with the mode's it would be 3 MiB."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from torch.distributed._tools import mem_tracker  # noqa: E402

from trainmem.trace import _device_snapshot, _phase, _recompute_aware_tracker  # noqa: E402

MIB = 1 << 20


class _Gather(torch.nn.Module):
    """``w[idx] * 2``: backward makes d(gathered) (1 MiB), then index_backward a zero d(w) that it fills."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(256, 1024))

    def forward(self, idx):
        return self.w[idx] * 2


class _UsedTwice(torch.nn.Module):
    """``h * 2 + h * 3`` with ``h = x * w``: h's two gradients (1 MiB each) are summed, then d(w) is made."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(256, 1024))

    def forward(self, x):
        h = x * self.w
        return h * 2 + h * 3


def _backward_temporaries(module, *inputs) -> int:
    tracker = _recompute_aware_tracker(mem_tracker, SimpleNamespace(recomputing=False))
    tracker.track_external(module)
    with tracker:
        module(*inputs).sum().backward()
    peak = tracker.memory_tracking[module].snapshots[mem_tracker._ModState.PEAK_BW][-1]
    return _phase("backward", "peak", _device_snapshot(peak)).temporaries


def test_index_backward_fills_its_zeros_in_place():
    assert _backward_temporaries(_Gather(), torch.arange(256)) == 2 * MIB


def test_two_gradients_of_one_tensor_are_summed_in_place():
    assert _backward_temporaries(_UsedTwice(), torch.ones(256, 1024)) == 2 * MIB


def test_a_model_that_converts_its_modules_in_init_builds_on_fake_tensors():
    """``Module.to(dtype)`` in a model's ``__init__`` (DeepSeek-V4's fp32 norms) fails on fake tensors (the fake
    mode's weakrefs make ``swap_tensors`` refuse); while a model is built the conversion replaces the parameters."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from trainmem.probe import _conversions_by_replacement

    original = torch.nn.Module._apply
    with FakeTensorMode():
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            torch.nn.Linear(4, 4).to(dtype=torch.bfloat16)
        with _conversions_by_replacement(torch):
            block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4).to(dtype=torch.bfloat16))
            block[0].weight.requires_grad_(False)
            block.to(dtype=torch.float16)
    assert [p.dtype for p in block.parameters()] == [torch.float16] * 4
    assert [p.requires_grad for p in block.parameters()] == [False, True, True, True]
    assert all(isinstance(p, torch.nn.Parameter) and isinstance(p, FakeTensor) for p in block.parameters())
    assert torch.nn.Module._apply is original  # (restored: real tensors convert as before)
