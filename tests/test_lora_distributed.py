"""LoRA, DoRA and QLoRA on several GPUs (finetune_sharding.py): each rank's model states against shard sizes worked
out here from the tensors' shapes (FSDP2: ceil(dim0 / W) rows of every parameter in its own dtype; ZeRO: flat
partitions of what trains padded to 2 x W; DDP: everything whole, buckets for what trains), against real FSDP2 on
gloo processes to the byte, and against one rank of FSDP2 traced on the fake process group in every phase."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainmem.stepmodel import estimate_model
from trainmem.lora import FineTune, LoraOptions
from trainmem.models import spec_from_config
from trainmem.settings import make_settings
from trainmem.sharding import DeepSpeedConfig, Parallel

HERE = Path(__file__).parent

ODD = dict(model_type="llama", hidden_size=66, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=2,
           vocab_size=101, intermediate_size=90, max_position_embeddings=64)
"""Widths no world size divides; rank 5 (fewer rows than 8 ranks) makes every lora_A one padded row per rank."""
H, I, V, L, R = 66, 90, 101, 2, 5
LAYER_BASE = [(H, H)] * 4 + [(I, H), (I, H), (H, I), (H,), (H,)]  # q k v o, gate up down, two norms
ROOT_BASE = [(V, H), (H,), (V, H)]  # embedding, final norm, untied LM head
ADAPTERS = [(R, H), (H, R), (R, H), (H, R), (R, I), (H, R)]  # q, v, down: lora_A (r, in), lora_B (out, r)
QVD = FineTune(LoraOptions(R, None, ("q", "v", "down")))


def numel(shape):
    out = 1
    for d in shape:
        out *= d
    return out


def fsdp_shard(shape, world):
    """torch.chunk's first chunk on dim 0, which every rank allocates."""
    return -(-shape[0] // world) * (numel(shape) // shape[0])


def _static(est):
    return {c.name: c.bytes for c in est.static}


def _estimate(parallel, recipe="mixed-bf16", finetune=QVD, **settings):
    return estimate_model(spec_from_config(ODD), make_settings(recipe=recipe, optimizer="adamw", batch=2, seq=16,
                                                               **settings), parallel=parallel, finetune=finetune)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fsdp2_rank_holds_every_parameter_sharded_in_its_own_dtype(world):
    base = L * sum(fsdp_shard(s, world) for s in LAYER_BASE) + sum(fsdp_shard(s, world) for s in ROOT_BASE)
    adapters = L * sum(fsdp_shard(s, world) for s in ADAPTERS)
    static = _static(_estimate(Parallel(gpus=world, fsdp="full")))
    assert static["weights"] == 2 * base + 4 * adapters  # bf16 base, fp32 adapters (peft's autocast_adapter_dtype)
    assert static["gradients"] == 4 * adapters  # only the adapters take gradients
    assert static["optimizer_states"] == 2 * 4 * adapters  # AdamW's two fp32 states
    assert static["master_weights"] == 0


def test_fsdp2_pads_a_lora_a_of_fewer_rows_than_ranks_to_one_row_each():
    """At 8 ranks a rank-5 lora_A is 1 row per rank, 8/5 of its size over the world: the shards are not 1/W."""
    adapters = L * sum(numel(s) for s in ADAPTERS)
    per_rank = _static(_estimate(Parallel(gpus=8, fsdp="full")))["gradients"] // 4
    assert per_rank == L * (H + 9 * R + H + 9 * R + I + 9 * R)  # lora_A: one row; lora_B: ceil(66 / 8) rows
    assert per_rank > adapters // 8


def test_fsdp2_buffers_gather_the_frozen_base_and_reduce_only_the_adapters():
    world = 4
    est = _estimate(Parallel(gpus=world, fsdp="full"))
    buffers = {b.name: b.bytes for b in est.rank.buffers}
    layer = 2 * sum(numel(s) for s in LAYER_BASE) + 4 * L * sum(numel(s) for s in ADAPTERS) // L
    assert buffers["the running layer's gathered parameters (frozen base and adapters)"] == layer
    assert buffers["gathered root parameters (embedding, final norm, LM head)"] == 2 * sum(numel(s)
                                                                                           for s in ROOT_BASE)
    # the reduce-scatter input is W padded shards of the adapters' fp32 gradients only
    assert buffers["a layer's reduce-scatter input (the adapters' gradients)"] == \
        4 * world * sum(fsdp_shard(s, world) for s in ADAPTERS)


def test_ddp_keeps_everything_whole_and_buckets_only_the_adapters():
    adapters = L * sum(numel(s) for s in ADAPTERS)
    base = L * sum(numel(s) for s in LAYER_BASE) + sum(numel(s) for s in ROOT_BASE)
    est = _estimate(Parallel(gpus=2))
    static = _static(est)
    assert static["weights"] == 2 * base + 4 * adapters and static["gradients"] == 4 * adapters
    assert static["optimizer_states"] == 8 * adapters
    assert [b.bytes for b in est.rank.buffers] == [4 * adapters]  # reducer's buckets: requires_grad only


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_partitions_what_trains_in_bf16_with_fp32_masters(stage):
    """DeepSpeed casts every parameter to bf16 (the adapters too) and partitions the adapters' fp32 masters and
    states (stage 1), their gradients (2), and every parameter (3: each padded to W; none is at or under a
    persistence threshold of 0)."""
    world = 4
    adapters = L * sum(numel(s) for s in ADAPTERS)
    base = L * sum(numel(s) for s in LAYER_BASE) + sum(numel(s) for s in ROOT_BASE)
    part = -(-adapters // (2 * world)) * 2  # padded to 2 x W elements, split in W
    ds = DeepSpeedConfig(stage3_param_persistence_threshold=0)
    static = _static(_estimate(Parallel(gpus=world, zero=stage, deepspeed=ds)))
    assert static["master_weights"] == 4 * part and static["optimizer_states"] == 8 * part
    assert static["gradients"] == (2 * adapters if stage == 1 else 2 * part)
    if stage < 3:
        assert static["weights"] == 2 * (base + adapters)
    else:
        shapes = L * (LAYER_BASE + ADAPTERS) + ROOT_BASE
        assert static["weights"] == 2 * sum(-(-numel(s) // world) for s in shapes)


def test_zero3_keeps_parameters_at_or_under_the_persistence_threshold_whole():
    """Every tensor of this model is under DeepSpeed's default 100,000 elements: nothing is partitioned."""
    adapters = L * sum(numel(s) for s in ADAPTERS)
    base = L * sum(numel(s) for s in LAYER_BASE) + sum(numel(s) for s in ROOT_BASE)
    assert _static(_estimate(Parallel(gpus=4, zero=3)))["weights"] == 2 * (base + adapters)


def test_fsdp2_cpu_offload_moves_the_shards_to_the_host():
    on_gpu = _estimate(Parallel(gpus=4, fsdp="full"))
    offloaded = _estimate(Parallel(gpus=4, fsdp="full", offload="optimizer+params"))
    assert sum(_static(offloaded).values()) == 0
    assert offloaded.rank.host_bytes_per_rank == sum(_static(on_gpu).values())


def test_qlora_70b_on_two_gpus_holds_half_the_packed_nf4_base_and_the_whole_quantization_state():
    """fsdp_qlora's set-up: the 4-bit data (numel / 2 bytes per Linear) split over 2 ranks, the blockwise absmax
    (one uint8 per 64 values, double-quantized: fp32 per 256 blocks) on every rank, embedding, norms and head in
    bf16 split over 2."""
    from trainmem.catalog import catalog_spec

    spec = catalog_spec("llama-2-70b")
    linear = sum(g.repeat * t.numel for g in spec.param_groups for t in g.tensors
                 if len(t.shape) == 2 and t.role not in ("embedding", "head"))
    other = spec.num_parameters - linear
    est = estimate_model(spec, make_settings(recipe="pure-bf16", checkpointing="full", batch=1, seq=512),
                         parallel=Parallel(gpus=2, fsdp="full"), finetune=FineTune(LoraOptions(8), "nf4", True))
    adapters = est.finetune.as_dict(spec)["adapter_parameters"]
    expected = linear * 0.5 / 2 + linear / 64 + 4 * linear / (64 * 256) + 2 * other / 2 + 4 * adapters / 2
    assert abs(_static(est)["weights"] - expected) <= 1e-4 * expected
    assert est.peak is not None


@pytest.mark.parametrize("args", [
    ("--gpus", "2", "--fsdp", "full"), ("--gpus", "8", "--zero", "3"), ("--gpus", "4", "--zero", "1"),
    ("--gpus", "2",), ("--gpus", "4", "--zero", "2", "--offload", "optimizer"), ("--gpus", "2", "--dora"),
    ("--gpus", "2", "--fsdp", "full", "--qlora"), ("--gpus", "8", "--fsdp", "full", "--offload",
                                                   "optimizer+params"),
])
def test_estimate_takes_lora_on_every_data_parallel_engine(run_cli, args):
    code, out, err = run_cli("estimate", "llama-3.1-8b", "--lora", "8", *args, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["lora"]["rank"] == 8 and doc["parallel"]["gpus"] == int(args[1]) and doc["peak"]


def test_lora_with_model_parallelism_is_refused_in_one_line(run_cli):
    code, _, err = run_cli("estimate", "llama-3.1-8b", "--lora", "8", "--gpus", "4", "--pp", "2")
    assert code == 2 and "not modelled yet" in err and err.count("\n") == 1


def test_plan_searches_lora_on_data_parallel_engines(run_cli):
    code, out, err = run_cli("plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--gpus", "2", "--lora", "8", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plans"] and all(p["layout"]["tensor_parallel"] == 1 and p["layout"]["pipeline_parallel"] == 1
                                for p in doc["plans"])
    assert all(p["estimate"]["lora"]["rank"] == 8 for p in doc["plans"])
    full = json.loads(run_cli("plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--gpus", "2", "--json")[1])
    assert len(doc["plans"]) > len(full["plans"])  # a frozen base fits where full fine-tuning does not
    code, _, err = run_cli("plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--gpus", "2", "--qlora")
    assert code == 2 and "need --lora" in err


def test_plans_lora_step_time_counts_no_weight_gradients():
    from trainmem.catalog import catalog_spec
    from trainmem.hardware import get_gpu
    from trainmem.plan import Layout, step_time

    spec = catalog_spec("llama-3.1-8b")
    layout = Layout("mixed-bf16", "DDP", None, None, "none", "none", 1, 1, 2, 2)
    full = step_time(spec, layout, 2048, get_gpu("H100-80GB"))
    lora = step_time(spec, layout, 2048, get_gpu("H100-80GB"), trained=3_407_872)
    assert lora.compute_seconds == pytest.approx(full.compute_seconds * 2 / 3)  # forward + input gradients
    assert lora.communication_seconds == pytest.approx(full.communication_seconds * 3_407_872
                                                       / spec.num_parameters)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])
def test_fsdp2_lora_ranks_hold_what_trainmem_says_to_the_byte(world):
    """Real FSDP2 over gloo processes with peft's adapters on a bf16 base (tests/fsdp_ranks.py)."""
    pytest.importorskip("peft")
    lora = {"r": R, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    proc = subprocess.run([sys.executable, str(HERE / "fsdp_ranks.py"), str(world), "mixed-bf16", json.dumps(ODD),
                           json.dumps(lora)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    static = _static(_estimate(Parallel(gpus=world, fsdp="full")))
    assert {r["parameters"] for r in ranks} == {static["weights"]}
    assert max(r["gradients"] for r in ranks) == static["gradients"]
    assert max(r["optimizer_states"] for r in ranks) == static["optimizer_states"]
    assert min(r["gradients"] for r in ranks) < static["gradients"]  # rank 1 holds 2 of a 5-row lora_A's rows


TINY = dict(model_type="llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=4096, intermediate_size=688, max_position_embeddings=512, tie_word_embeddings=False)


@pytest.mark.slow
@pytest.mark.parametrize("world, recipe, checkpointing, targets, dora", [
    (2, "mixed-bf16", "none", ("q", "v"), False),
    (8, "mixed-bf16", "full", ("all-linear",), False),
    (64, "amp-bf16", "none", ("q", "k", "v", "o"), False),
    (8, "fp32", "none", ("q", "v"), True),
])
def test_fsdp2_lora_trace_of_one_rank_matches_the_estimate(world, recipe, checkpointing, targets, dora):
    """peft's model under fully_shard on the fake process group (trace_fsdp_step): within 3% in every phase."""
    pytest.importorskip("peft")
    from trainmem.trace import trace_fsdp_step

    finetune = FineTune(LoraOptions(16, None, targets, dora=dora))
    settings = make_settings(recipe=recipe, checkpointing=checkpointing, batch=2, seq=256, optimizer_impl="foreach")
    parallel = Parallel(gpus=world, fsdp="full")
    spec = spec_from_config(TINY)
    est = estimate_model(spec, settings, parallel=parallel, finetune=finetune)
    # (bytes as allocated, not rounded to CUDA's 512-byte blocks: at 64 ranks this tiny model's shards are a few
    # hundred bytes each, and the estimate counts bytes)
    traced = trace_fsdp_step(TINY, settings, parallel, spec, round_to_cuda=False, finetune=finetune)
    assert len(est.phases) == len(traced.phases) == 5
    for e, t in zip(est.phases, traced.phases):
        assert abs(e.allocated_bytes - t.allocated_bytes) <= 0.03 * t.allocated_bytes, (e, t)
