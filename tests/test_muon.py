"""Muon: torch.optim.Muon (one tensor at a time) for the 2-D decoder-layer weights and foreach AdamW for the rest.

Its step temporaries are checked against torch itself: one matrix's Newton-Schulz step under MemTracker, and a
whole traced training step of a small Llama, phase by phase."""

import pytest
from hypothesis import given, settings as hyp_settings, strategies as st

from trainmem.catalog import catalog_spec
from trainmem.stepmodel import estimate_model
from trainmem.optimizers import TRACEABLE_OPTIMIZERS, get_optimizer, muon_tensor_temporaries
from trainmem.settings import make_settings


def test_muon_tensor_temporaries_by_hand():
    # (1024, 256), fp32 gradient: lerp result 1 MiB, bf16 X 512 KiB, 256 x 256 bf16 gram 128 KiB;
    # peak = update + 2 X + 2 gram
    assert muon_tensor_temporaries((1024, 256), 4) == 1048576 + 2 * 524288 + 2 * 131072
    assert muon_tensor_temporaries((256, 1024), 4) == 1048576 + 2 * 524288 + 2 * 131072
    # square bf16: update 128 KiB (the first X itself), X 128 KiB, gram 128 KiB: update + max(2X + 2g, X + 3g)
    assert muon_tensor_temporaries((256, 256), 2) == 131072 + 4 * 131072


def _traced_muon_peak(shape, dtype_name: str) -> tuple[int, int]:
    """(optimizer-step peak of torch.optim.Muon over one parameter, its momentum buffer's bytes), MemTracker."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    dtype = getattr(torch, dtype_name)
    with FakeTensorMode():
        p = torch.nn.Parameter(torch.randn(shape, dtype=dtype))
        opt = torch.optim.Muon([p], lr=0.02)
        p.grad = torch.randn_like(p)
        opt.step()  # makes the momentum buffer
        tracker = MemTracker()
        tracker.track_external(p, opt)
        with tracker:
            opt.step()
        peak = tracker.get_tracker_snapshot("peak")
    (device,) = peak.values()
    return device[_MemRefType.OPT], p.numel() * p.element_size()


@hyp_settings(max_examples=25, deadline=None, derandomize=True)
@given(m=st.integers(1, 400), n=st.integers(1, 400), dtype=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_muon_tensor_temporaries_match_torch(m, n, dtype):
    """Inside torch.optim.Muon's step, what it allocates beside the momentum buffer (MemTracker counts the step's
    tensors as optimizer state) is muon_tensor_temporaries, for any shape and gradient dtype."""
    peak, buffer = _traced_muon_peak((m, n), dtype)
    assert peak - buffer == muon_tensor_temporaries((m, n), 4 if dtype == "float32" else 2)


def test_muon_is_traceable_and_its_own_shape():
    assert "muon" in TRACEABLE_OPTIMIZERS
    assert get_optimizer("muon").step_temporaries_fn is not None
    assert all(get_optimizer(o).step_temporaries_fn is None for o in ("adamw", "adam", "sgd", "lion", "adafactor"))


@pytest.mark.parametrize("recipe, expected", [
    # the rest (embeddings and LM head 2 x 128,256 x 4,096, 65 norms of 4,096) in bf16: AdamW's foreach buffer
    ("pure-bf16", (2 * 128256 * 4096 + 65 * 4096) * 2),
    # the same in fp32 (states of the fp32 masters), plus the fp32 cast of every bf16 gradient
    ("mixed-bf16", (2 * 128256 * 4096 + 65 * 4096) * 4 + 8030261248 * 4),
])
def test_llama_3_8b_muon_step_temporaries(recipe, expected):
    """Muon's worst matrix (14,336 x 4,096) is far below AdamW's buffer over the 1.05 B other elements: the step's
    temporaries are that buffer (before: one buffer the size of all 8.03 B parameters)."""
    est = estimate_model(catalog_spec("llama-3-8b"), make_settings(recipe=recipe, optimizer="muon"))
    step = next(p for p in est.phases if p.name == "optimizer")
    assert step.temporaries == expected


_LLAMA = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)


@pytest.mark.slow
@pytest.mark.parametrize("intermediate", [2048, 688])  # Muon's gate/up/down the larger; AdamW's rest the larger
@pytest.mark.parametrize("recipe", ["fp32", "mixed-bf16", "pure-bf16", "amp-bf16"])
def test_muon_step_matches_its_trace(recipe, intermediate):
    """A traced step of a small Llama with trainmem's muon (torch.optim.Muon + torch.optim.AdamW): every phase
    within 1% of the estimate, and the optimizer step's temporaries within 1%."""
    pytest.importorskip("transformers")
    from trainmem.models import spec_from_config
    from trainmem.trace import trace_step

    config = dict(_LLAMA, intermediate_size=intermediate)
    settings = make_settings(recipe=recipe, batch=1, seq=64, optimizer="muon", dropout=0.0)
    spec = spec_from_config(config)
    est = estimate_model(spec, settings)
    traced = trace_step(config, settings, spec)
    assert [p.name for p in est.phases] == [p.name for p in traced.phases]
    for e, t in zip(est.phases, traced.phases):
        assert abs(e.allocated_bytes - t.allocated_bytes) <= 0.01 * t.allocated_bytes, (e, t)
    e, t = (next(p for p in phases if p.name == "optimizer") for phases in (est.phases, traced.phases))
    assert t.temporaries > 0
    assert abs(e.temporaries - t.temporaries) <= 0.01 * t.temporaries, (e, t)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp32", "pure-bf16"])
def test_muon_with_lora_matches_its_trace(recipe):
    """With LoRA the adapters (and trained copies) go to AdamW, as the estimate counts them: every phase of the
    traced step within 1%, and the traced step's states are AdamW's two per adapter value."""
    pytest.importorskip("peft")
    from trainmem.lora import FineTune, LoraOptions, adapter_parameters
    from trainmem.models import spec_from_config
    from trainmem.trace import trace_step

    config = dict(_LLAMA, intermediate_size=688)
    settings = make_settings(recipe=recipe, batch=1, seq=64, optimizer="muon", dropout=0.0)
    spec, finetune = spec_from_config(config), FineTune(LoraOptions(8))
    est = estimate_model(spec, settings, finetune=finetune)
    traced = trace_step(config, settings, spec, finetune=finetune)
    for e, t in zip(est.phases, traced.phases):
        assert e.name == t.name
        assert abs(e.allocated_bytes - t.allocated_bytes) <= 0.01 * t.allocated_bytes, (e, t)
    load = traced.phases[0]
    assert abs(load.optimizer_states - 2 * 4 * adapter_parameters(spec, finetune.lora)) <= 4096  # (+ step scalars)
