"""The traced path's switches (tracedstep.py): the affine batch model and --max-batch, and a rank of FSDP2, each
checked against PyTorch's traced step (trace.trace_step, trace.trace_fsdp_step) of a model_type without a
hand-written description (ministral)."""

import pytest

MINISTRAL = {"model_type": "ministral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 211,
             "max_position_embeddings": 64}
"""No other helper adds a description of ministral; two layers, so each record is one trace (recorded.py)."""
SEQ = 32


def _spec():
    from trainmem.meta_count import spec_by_building

    return spec_by_building(MINISTRAL, "ministral", "test")


def _settings(batch=1, **kw):
    from trainmem.settings import TrainingSettings

    return TrainingSettings(batch=batch, seq=SEQ, **kw)


def _within(estimated, traced, tolerance):
    for e, t in zip(estimated, traced, strict=True):
        assert e.name == t.name
        assert abs(e.allocated_bytes - t.allocated_bytes) <= tolerance * t.allocated_bytes, (e, t)


def test_the_affine_batch_model_predicts_a_third_traced_batch():
    """Batches 2 and 3 make the line (tracedstep.BATCH_SAMPLES); a trace at batch 6 is on it, every phase within
    0.5% (the trace rounds small tensors to 512 bytes), and activations do grow with the batch."""
    pytest.importorskip("transformers")
    from trainmem.stepmodel import compile_step
    from trainmem.trace import trace_step
    from trainmem.tracedstep import single_phases

    spec = _spec()
    step = compile_step(spec, _settings())
    predicted, places = single_phases(step, 6, SEQ)
    traced = trace_step(MINISTRAL, _settings(6), spec).phases
    _within(predicted, traced, 0.005)
    assert predicted[1].activations > 2 * single_phases(step, 2, SEQ)[0][1].activations
    assert {label for label, _ in places} >= {"forward", "forward:layer", "backward:layer"}


def test_max_batch_on_the_traced_path_is_the_boundary_of_the_traced_step():
    """The largest batch the affine model says fits: traced there, it fits; traced one batch more, it does not (a
    card sized between batches 2 and 9)."""
    pytest.importorskip("transformers")
    from trainmem.estimate import DeviceOptions, peak_of_phases
    from trainmem.hardware import custom_gpu
    from trainmem.planner import max_batch
    from trainmem.stepmodel import compile_step
    from trainmem.trace import trace_step
    from trainmem.tracedstep import single_phases

    spec, device = _spec(), DeviceOptions(headroom=1.0, fragmentation=0.0, cuda_overhead_bytes=0)
    step = compile_step(spec, _settings())
    low, high = (single_phases(step, b, SEQ)[0] for b in (2, 9))  # (a card between them; the check is traced)
    gpu = custom_gpu((peak_of_phases(low, device).required_bytes + peak_of_phases(high, device).required_bytes) // 2)
    best = max_batch(spec, _settings(), gpu, device)
    assert 2 < best < 9
    assert peak_of_phases(trace_step(MINISTRAL, _settings(best), spec).phases, device).fits(gpu)
    assert not peak_of_phases(trace_step(MINISTRAL, _settings(best + 1), spec).phases, device).fits(gpu)


def test_max_seq_on_the_traced_path_is_one_line():
    pytest.importorskip("transformers")
    from trainmem.errors import ConfigError
    from trainmem.estimate import DeviceOptions
    from trainmem.hardware import get_gpu
    from trainmem.planner import max_seq

    with pytest.raises(ConfigError, match="--max-seq is not available on the traced path"):
        max_seq(_spec(), _settings(), get_gpu("A100-80GB"), DeviceOptions())


def test_a_rank_of_fsdp2_against_its_traced_step():
    """One GPU's recorded step with the rank's sharded states and FSDP2's buffers, against FSDP2 traced on the fake
    process group: load, forward, optimizer and between steps within 1%; backward's peak moment moves under FSDP2
    (its reduce-scatter buffers), which the recorded moments do not follow: above it, by at most 12% at these
    widths, where one layer's buffers weigh most (docs/accuracy.md)."""
    pytest.importorskip("transformers")
    from trainmem.sharding import Parallel
    from trainmem.stepmodel import estimate_model
    from trainmem.trace import trace_fsdp_step

    spec, settings, parallel = _spec(), _settings(2), Parallel(gpus=2, fsdp="full")
    estimated = estimate_model(spec, settings, parallel=parallel)
    traced = trace_fsdp_step(MINISTRAL, settings, parallel, spec).phases
    assert estimated.traced is not None and estimated.peak is not None
    _within([p for p in estimated.phases if p.name != "backward"], [p for p in traced if p.name != "backward"], 0.01)
    est_bw, trace_bw = estimated.phases[2].allocated_bytes, traced[2].allocated_bytes
    assert trace_bw <= est_bw <= 1.12 * trace_bw
    one_gpu = estimate_model(spec, settings)
    assert estimated.phases[0].allocated_bytes < 0.6 * one_gpu.phases[0].allocated_bytes  # (the states sharded)


def test_plan_on_the_traced_path_searches_data_parallelism_and_checkpointing():
    """`plan` on the traced path: the micro-batch it answers, with full checkpointing recorded for the search, is
    the traced step's within 1% in every phase (gradient accumulation, micro-batches on the affine line); tensor
    parallelism and the others are said not searched, in one line."""
    pytest.importorskip("transformers")
    from trainmem.estimate import DeviceOptions
    from trainmem.hardware import get_gpu
    from trainmem.plan import search
    from trainmem.trace import trace_step

    spec, device = _spec(), DeviceOptions(headroom=1.0, fragmentation=0.0, cuda_overhead_bytes=0)
    found = search(spec, get_gpu("A100-80GB"), 1, SEQ, global_batch=4, recipes=("mixed-bf16",),
                   checkpointing=("full",), device=device, writable=False)  # (one GPU: no engine file)
    best = found.plans[0]
    assert best.layout.micro_batch == 4 and best.layout.checkpointing == "full"
    traced = trace_step(MINISTRAL, _settings(4, checkpointing="full"), spec).phases
    _within(best.step.phases(4, SEQ), traced, 0.01)
    assert any("traced path" in line and "tensor" in line for line in found.skipped)
    assert best.estimate.traced is not None


def test_the_cli_answers_max_batch_and_zero_ranks_on_the_traced_path(run_cli, tmp_path):
    """`estimate --max-batch` and `--gpus N --zero 3` on a traced-path config: a peak, said to be traced (the
    records at batches 1 to 3 are the earlier tests', from the session's cache)."""
    pytest.importorskip("transformers")
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MINISTRAL))
    code, out, err = run_cli("estimate", str(path), "--seq", str(SEQ), "--gpu-memory", "3MiB", "--cuda-overhead", "0",
                             "--headroom", "1", "--fragmentation", "0", "--max-batch", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["activation_source"] == "traced" and doc["max_batch"] >= 1
    assert doc["settings"]["batch"] == doc["max_batch"] and doc["peak"]["required_bytes"] <= 3 * 2**20
    code, out, err = run_cli("estimate", str(path), "--seq", str(SEQ), "--batch", "2", "--gpus", "4", "--zero", "3",
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["peak"]["allocated_bytes"] > 0 and any("data parallel on the traced path" in n for n in doc["notes"])


def test_model_parallelism_on_the_traced_path_is_one_line_naming_why(run_cli, tmp_path):
    pytest.importorskip("transformers")
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MINISTRAL))
    code, _, err = run_cli("estimate", str(path), "--seq", str(SEQ), "--gpus", "2", "--tp", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "not available on the traced path" in err and "--params" not in err


MINISTRAL4 = {**MINISTRAL, "num_hidden_layers": 4}
"""Four layers: the LoRA step is recorded at 2 and 3 and extrapolated."""


@pytest.mark.parametrize("targets", [("q", "v"), ("all-linear",)])
def test_lora_on_the_traced_path_counts_peft_adapters_and_equals_a_full_trace(targets):
    """peft's LoRA step recorded at 2 and 3 of 4 layers and extrapolated, against the full 4-layer trace: every
    phase within 1% (q,v; all-linear's adapter count only, against peft's own model); the adapter count and the
    gradients are peft's."""
    pytest.importorskip("peft")
    from trainmem.lora import FineTune, LoraOptions, adapter_parameters
    from trainmem.meta_count import spec_by_building
    from trainmem.probe import build_lora_model
    from trainmem.recipes import get_recipe
    from trainmem.stepmodel import estimate_model
    from trainmem.trace import trace_step

    spec, settings = spec_by_building(MINISTRAL4, "ministral", "test"), _settings(2)
    finetune = FineTune(LoraOptions(8, targets=targets))
    model = build_lora_model(MINISTRAL4, get_recipe("mixed-bf16"), "sdpa", None, finetune, spec)
    assert adapter_parameters(spec, finetune.lora) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    if targets != ("q", "v"):
        return
    estimated = estimate_model(spec, settings, finetune=finetune)
    assert estimated.traced is not None and estimated.traced.plan.counts == (2, 3)
    traced = trace_step(MINISTRAL4, settings, spec, finetune=finetune).phases
    _within(estimated.phases, traced, 0.01)
    grads = next(c.bytes for c in estimated.static if c.name == "gradients")
    assert grads == traced[3].gradients  # (the adapters' alone, at the step)
