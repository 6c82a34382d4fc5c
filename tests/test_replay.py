"""The estimate's step as an allocation log (replay.py) and the reserved memory it gives (estimate, search,
--fragmentation, --explain-reserved). The log's peak of live bytes must be the estimate's peak allocated, found by
the timeline (timeline.py), not by the walker: a walk that loses or doubles a tensor, or allocates before it
frees, moves it."""

import json

import pytest

from trainmem.allocator import AllocEvent, replay
from trainmem.catalog import catalog_spec
from trainmem.estimate import DeviceOptions
from trainmem.models import spec_from_config
from trainmem.replay import step_sequence
from trainmem.settings import TrainingSettings
from trainmem.sharding import Parallel
from trainmem.stepmodel import compile_step

_SMALL = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=5000, max_position_embeddings=512)

SETUPS = [
    ("llama-3.2-1b", dict(recipe="mixed-bf16"), None),
    ("llama-3.2-1b", dict(recipe="pure-bf16", checkpointing="full"), None),
    ("llama-3.2-1b", dict(recipe="amp-bf16", grad_accum=2), None),
    ("gpt2", dict(recipe="fp32", dropout=0.1), None),
    ("mixtral-8x7b", dict(recipe="pure-bf16", checkpointing="full"), None),
    ("llama-2-7b", dict(recipe="mixed-bf16"), Parallel(gpus=8, fsdp="full")),
    ("llama-2-7b", dict(recipe="mixed-bf16", checkpointing="full"), Parallel(gpus=4, zero=2)),
]


def _live(events: tuple[AllocEvent, ...]) -> tuple[int, dict[int, int]]:
    """The largest sum of live bytes over ``events`` and what is alive at the end (key -> bytes)."""
    live: dict[int, int] = {}
    total = top = 0
    for e in events:
        if e.nbytes:
            assert e.key not in live
            live[e.key] = e.nbytes
            total += e.nbytes
            top = max(top, total)
        else:
            total -= live.pop(e.key)  # (a free of a key never allocated raises)
    return top, live


@pytest.mark.parametrize("name, settings, parallel", SETUPS, ids=[f"{n}-{p and p.engine}-{s}" for n, s, p in SETUPS])
def test_the_logs_peak_is_the_estimates_peak_allocated(name, settings, parallel):
    spec = catalog_spec(name)
    s = TrainingSettings(batch=2, seq=512, **settings)
    step = compile_step(spec, s, DeviceOptions(fragmentation=0.1), parallel)
    est = step.estimate(2, 512)
    sequence = step_sequence(step, 2, 512)
    top, _ = _live(sequence.log.events)
    assert top == sequence.peak_live == est.peak.allocated_bytes


def test_frees_balance_and_each_step_ends_where_it_started():
    """Between steps only the model state is alive (weights, masters, states): the second step ends holding the
    bytes it started with, so a third would replay as the second did."""
    step = compile_step(catalog_spec("llama-3.2-1b"), TrainingSettings(batch=1, seq=256, recipe="mixed-bf16"))
    log = step_sequence(step, 1, 256).log
    static = step._static_bytes
    first, second = log.step_starts
    _, before = _live(log.events[:second])
    _, after = _live(log.events)
    held = static["weights"] + static["master_weights"] + static["optimizer_states"]
    assert sum(before.values()) == sum(after.values()) == held
    assert sum(_live(log.events[:first])[1].values()) == static["weights"] + static["master_weights"]
    report = replay(log, steps=3)
    assert report.unmatched_frees == 0
    assert replay(log, steps=2).max_reserved == report.max_reserved  # (the third step reuses the second's cache)


def test_reserved_is_replayed_unless_fragmentation_is_given():
    spec = catalog_spec("llama-3.2-1b")
    s = TrainingSettings(batch=2, seq=1024, recipe="mixed-bf16")
    replayed = compile_step(spec, s).estimate(2, 1024)
    flat = compile_step(spec, s, DeviceOptions(fragmentation=0.2)).estimate(2, 1024)
    assert replayed.peak.reserved_from == "replay" and flat.peak.reserved_from == "flat"
    assert replayed.peak.allocated_bytes == flat.peak.allocated_bytes
    assert replayed.peak.reserved_bytes == replayed.allocator.max_reserved > replayed.peak.allocated_bytes
    assert flat.allocator is None
    top = max(flat.phases, key=lambda ph: ph.allocated_bytes)
    assert flat.peak.reserved_bytes == top.allocated_bytes + int(0.2 * (top.activations + top.temporaries))


def test_expandable_segments_reserve_less():
    """expandable_segments maps pages of one segment per pool as needed: what it reserves at the peak is the
    allocated bytes rounded to 2 MiB pages, below the default allocator's (allocator.py)."""
    spec = catalog_spec("llama-3.2-1b")
    s = TrainingSettings(batch=2, seq=1024, recipe="mixed-bf16")
    from trainmem.allocator import parse_alloc_conf

    default = compile_step(spec, s).estimate(2, 1024).peak
    expandable = compile_step(spec, s, DeviceOptions(alloc_config=parse_alloc_conf("expandable_segments:True")))
    peak = expandable.estimate(2, 1024).peak
    assert peak.allocated_bytes <= peak.reserved_bytes < default.reserved_bytes


def test_max_batch_answers_what_the_estimate_at_that_batch_says():
    """--max-batch replays each probe: the estimate at its answer fits, one more does not."""
    import trainmem

    best = trainmem.max_batch("llama-3.2-1b", "A100-40GB", seq=1024)
    assert best >= 1
    assert trainmem.estimate("llama-3.2-1b", batch=best, seq=1024, gpu="A100-40GB").fits()
    assert not trainmem.estimate("llama-3.2-1b", batch=best + 1, seq=1024, gpu="A100-40GB").fits()


def test_estimate_explain_reserved(run_cli, tmp_path):
    code, out, err = run_cli("estimate", "llama-3.2-1b", "--seq", "512", "--explain-reserved")
    assert code == 0, err
    assert "segments at the peak" in out and "largest inactive split" in out and "allocated vs reserved" in out
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "--seq", "512", "--json", "--alloc-conf",
                           "expandable_segments:True")
    peak = json.loads(out)["peak"]
    assert peak["reserved_from"] == "replay" and peak["alloc_conf"] == "expandable_segments:True"
    assert peak["allocator"]["max_memory_reserved_bytes"] == peak["reserved_bytes"]
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "--seq", "512", "--json", "--fragmentation", "0.1")
    peak = json.loads(out)["peak"]
    assert peak["reserved_from"] == "flat" and peak["allocator"] is None and peak["fragmentation"] == 0.1
    code, _, err = run_cli("estimate", "llama-3.2-1b", "--explain-reserved", "--fragmentation", "0.1")
    assert code == 2 and "--explain-reserved" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("estimate", "llama-3.2-1b", "--alloc-conf", "bogus:1")
    assert code == 2 and "--alloc-conf" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_replayed_estimate_is_near_the_replayed_trace():
    """The estimate's synthetic log and the traced step's own allocations (trace_step(record_allocations=True)),
    both through the allocator: max_memory_reserved within 5% (docs/accuracy.md, Reserved memory)."""
    pytest.importorskip("transformers")
    from trainmem.trace import trace_step

    spec = spec_from_config(_SMALL)
    s = TrainingSettings(batch=2, seq=256, recipe="mixed-bf16")
    traced = replay(trace_step(_SMALL, s, spec, record_allocations=True).allocations)
    estimated = replay(step_sequence(compile_step(spec, s), 2, 256).log)
    assert abs(estimated.max_reserved / traced.max_reserved - 1) < 0.05


def test_the_device_lines_sum_to_the_cuda_overhead_and_read_cublas_workspace_config():
    """CublasHandlePool.cpp parseChosenWorkspaceSize: ``:SIZE_KIB:COUNT`` entries summed as SIZE x COUNT KiB;
    unset, 32 MiB on Hopper and 8 MiB + 128 KiB before; two workspaces (forward's and backward's threads)."""
    from trainmem.device_overhead import overhead_lines
    from trainmem.hardware import get_gpu

    mib = 1 << 20
    hopper = overhead_lines(768 * mib, get_gpu("H100-80GB"))
    assert [line.kind for line in hopper] == ["cublas_workspaces", "cuda_context"]
    assert hopper[0].bytes == 2 * 32 * mib and sum(line.bytes for line in hopper) == 768 * mib
    ampere = overhead_lines(768 * mib, get_gpu("A100-80GB"))
    assert ampere[0].bytes == 2 * (8 * mib + 128 * 1024)
    configured = overhead_lines(768 * mib, get_gpu("A100-80GB"), environ={"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"})
    assert configured[0].bytes == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)
    several = overhead_lines(768 * mib, get_gpu("H100-80GB"), gpus=8)
    assert several[-1].kind == "nccl_buffers" and not several[-1].in_total
    assert sum(line.bytes for line in several if line.in_total) == 768 * mib


def test_a_step_fits_a_card_its_unlimited_replay_outgrows():
    """On a card, the allocator frees its cache before an allocation fails (allocator.runs_within): Llama-2-7B,
    pure-bf16, full checkpointing, batch 34 x 2,048 reserves more than an H200 without a limit, but its replay runs
    in the H200's memory / headroom less the CUDA context, so it fits, with a margin over the least memory it runs
    in, and --max-batch answers at least 34."""
    import trainmem
    from trainmem.hardware import GPUS
    from trainmem.report import gpu_verdict

    est = trainmem.estimate("llama-2-7b", batch=34, seq=2048, recipe="pure-bf16", checkpointing="full", gpu="H200")
    gpu = GPUS["H200"]
    assert est.peak.reserved_from == "replay" and est.peak.required_bytes > gpu.memory_bytes
    assert est.fits(gpu)
    verdict = gpu_verdict(est, gpu, search_batch=False)
    assert verdict["fits"] and 0 <= verdict["margin_bytes"] < gpu.memory_bytes - est.peak.allocated_bytes
    assert trainmem.max_batch("llama-2-7b", "H200", seq=2048, recipe="pure-bf16", checkpointing="full") >= 34


def test_an_fsdp2_rank_walks_its_first_gather_before_the_layers():
    """FSDP2's first forward moment (the first layer gathered while only the embedding's tensors exist,
    timeline.gathers_before_first_layer) is walked before the layers: walked after them, it freed every saved
    activation at the end of forward and backward remade them as one shrinking transient per moment, which
    replayed Llama-3-70B's 64-GPU rank (batch 1 x 4096, no checkpointing) to 366.6 GiB reserved for 146.9 GiB
    allocated. Walked in order, the saved tensors live from forward to backward and the replay holds within 10%."""
    spec = catalog_spec("llama-3-70b")
    settings = TrainingSettings(batch=1, seq=4096, recipe="mixed-bf16")
    step = compile_step(spec, settings, DeviceOptions(), Parallel(gpus=64, fsdp="full"))
    sequence = step_sequence(step, 1, 4096)
    report = replay(sequence.log, steps=2)
    assert report.max_allocated >= sequence.peak_live
    assert report.max_reserved <= 1.10 * report.max_allocated


def test_a_data_parallel_rank_applies_its_replayed_ratio_in_estimate_and_search():
    """A rank's estimate adds its step's replayed fragmentation (at micro-batch 1) over the dynamic memory, as the
    search's fit check does, so the two agree; the ratio is not the flat 10%."""
    from trainmem.hardware import get_gpu
    from trainmem.stepmodel import estimate_model

    spec = catalog_spec("llama-2-7b")
    settings = TrainingSettings(batch=4, seq=2048, recipe="mixed-bf16", checkpointing="full")
    parallel = Parallel(gpus=8, fsdp="full")
    est = estimate_model(spec, settings, DeviceOptions(), parallel)
    assert est.peak.reserved_from == "ratio"
    step = compile_step(spec, settings, DeviceOptions(), parallel)
    assert step.fitting_peak(4, 2048, get_gpu("H200")) == est.peak
    flat = estimate_model(spec, settings, DeviceOptions(fragmentation=0.1), parallel).peak
    assert flat.reserved_from == "flat" and est.peak.reserved_bytes != flat.reserved_bytes
    assert est.peak.allocated_bytes == flat.allocated_bytes
