"""Many GPUs: per-rank model states under DDP, ZeRO and FSDP2 (sharding.py), checked against the ZeRO paper's
table and against FSDP2 itself on CPU processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import trainmem
from trainmem.catalog import catalog_spec
from trainmem.stepmodel import estimate_model
from trainmem.models import spec_from_config
from trainmem.settings import make_settings
from trainmem.sharding import Parallel

HERE = Path(__file__).parent


def _states(est):
    return {c.name: c.bytes for c in est.static}


def test_zero_stages_follow_the_zero_paper_table():
    """ZeRO (Rajbhandari et al. 2020, Table 1): per GPU, with K = 12, 4P + KP/N, 2P + (2 + K)P/N, (4 + K)P/N."""
    spec = catalog_spec("llama-2-7b")
    p, n = spec.num_parameters, 8
    assert p % 16 == 0  # no padding: the partitions are exact
    settings = make_settings(recipe="mixed-bf16")
    totals = {z: estimate_model(spec, settings, parallel=Parallel(gpus=n, zero=z)).static_bytes for z in (1, 2, 3)}
    assert totals[1] == 4 * p + 12 * p // n
    assert totals[2] == 2 * p + 14 * p // n
    # ZeRO-3 never partitions the parameters under stage3_param_persistence_threshold (1e5 elements): the norms
    persistent = sum(g.repeat * t.numel for g in spec.param_groups for t in g.tensors if t.numel < 100_000)
    assert persistent == (2 * 32 + 1) * 4096
    unit = 2 * n
    partitioned = -(-(p - persistent) // unit) * unit // n
    assert totals[3] == 2 * (partitioned + persistent) + 14 * p // n


def test_partitions_are_padded_to_twice_the_world():
    spec = catalog_spec("gpt2")  # 124,439,808 parameters: not a multiple of 2 x 50
    p, n = spec.num_parameters, 50
    est = estimate_model(spec, make_settings(recipe="mixed-bf16"), parallel=Parallel(gpus=n, zero=2))
    part = -(-p // (2 * n)) * 2  # elements per rank
    assert part * n > p
    assert _states(est)["master_weights"] == 4 * part and _states(est)["gradients"] == 2 * part


def test_every_buffer_is_itemized_and_counted_in_its_phases(run_cli):
    code, out, _ = run_cli("estimate", "llama-2-7b", "--recipe", "mixed-bf16", "--gpus", "8", "--zero", "3", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["parallel"]["engine"] == "deepspeed" and doc["parallel"]["zero"] == 3
    buffers = doc["static"]["buffers"]
    assert {b["name"] for b in buffers} >= {"gradient reduce bucket", "gathered parameters"}
    states = sum(doc["static"][k]["bytes"] for k in ("weights", "gradients", "master_weights", "optimizer_states"))
    assert doc["static"]["total_bytes"] == states  # the model states alone
    bucket = next(b for b in buffers if b["name"] == "gradient reduce bucket")
    assert bucket["bytes"] == 500_000_000 * 2 and bucket["phases"] == ["backward"]
    single = estimate_model(catalog_spec("llama-2-7b"), make_settings(recipe="mixed-bf16"))
    forward = next(p for p in doc["phases"] if p["name"] == "forward")
    single_forward = next(p for p in single.phases if p.name == "forward")
    assert forward["moment"] == single_forward.moment  # activations are per micro-batch per GPU, as on one GPU
    assert forward["activations_bytes"] == single_forward.activations
    gathered = next(b for b in buffers if b["name"] == "gathered parameters")
    assert forward["parameters_bytes"] == doc["static"]["weights"]["bytes"] + gathered["bytes"]
    backward = next(p for p in doc["phases"] if p["name"] == "backward")
    assert backward["temporaries_bytes"] >= bucket["bytes"]


def test_ddp_keeps_a_second_copy_of_the_gradients_in_its_buckets():
    spec = catalog_spec("llama-3.2-1b")
    settings = make_settings(recipe="mixed-bf16")
    one = estimate_model(spec, settings)
    ddp = estimate_model(spec, settings, parallel=Parallel(gpus=4))
    view = estimate_model(spec, settings, parallel=Parallel(gpus=4, ddp_bucket_view=True))
    grads = 2 * spec.num_parameters
    load = {e: next(p for p in e.phases if p.name == "load") for e in (one, ddp, view)}
    # the buckets exist from the wrapping on; with bucket views the gradients are the buckets, else a second copy
    assert load[ddp].allocated_bytes - load[one].allocated_bytes == grads
    assert load[view].allocated_bytes - load[one].allocated_bytes == grads
    optimizer = {e: next(p for p in e.phases if p.name == "optimizer") for e in (one, ddp, view)}
    assert optimizer[ddp].allocated_bytes - optimizer[one].allocated_bytes == grads
    assert optimizer[view].allocated_bytes == optimizer[one].allocated_bytes
    assert ddp.peak.allocated_bytes > view.peak.allocated_bytes


def test_offload_moves_states_to_the_host(run_cli):
    code, out, _ = run_cli("estimate", "llama-2-7b", "--recipe", "mixed-bf16", "--gpus", "16", "--zero", "3",
                           "--offload", "optimizer+params", "--json")
    doc = json.loads(out)
    p = doc["model"]["parameters"]
    assert code == 0 and doc["static"]["master_weights"]["bytes"] == 0
    # per rank: the fp32 master, Adam's two states and the fp32 gradients of its partition (16 bytes a parameter),
    # and its bf16 parameters, less the persistent ones (under 1e5 elements: the norms), which stay on the GPU
    persistent = (2 * 32 + 1) * 4096
    assert p % 32 == 0
    partitioned = -(-(p - persistent) // 32) * 32 // 16
    assert doc["host"]["bytes_per_node"] == 8 * (16 * p // 16 + 2 * partitioned)


@pytest.mark.parametrize("args, says", [
    (["--gpus", "8", "--zero", "3", "--fsdp", "full"], "two engines"),
    (["--gpus", "1", "--zero", "2"], "needs more than one GPU"),
    (["--gpus", "0"], "at least 1"),
    (["--gpus", "8", "--zero", "4"], "zero must be 0, 1, 2 or 3"),
    (["--gpus", "8", "--fsdp", "half"], "unknown fsdp"),
    (["--gpus", "8", "--offload", "optimizer"], "--offload needs --zero"),
    (["--gpus", "8", "--zero", "2", "--offload", "optimizer+params"], "needs --zero 3"),
    (["--gpus", "8", "--fsdp", "full", "--offload", "optimizer"], "optimizer+params"),
    (["--gpus", "12", "--gpus-per-node", "8", "--fsdp", "hybrid"], "multiple of"),
    (["--gpus", "2,4"], "--gpus must be a whole number"),
])
def test_impossible_layouts_are_one_line(run_cli, args, says):
    code, out, err = run_cli("estimate", "llama-2-7b", *args)
    assert code == 2 and not out and err.count("\n") == 1 and says in err, err


def test_the_api_takes_the_same_layout_keywords():
    est = trainmem.estimate("llama-2-7b", recipe="mixed-bf16", gpus=8, zero=2, gpu="H100")
    assert est.per_gpu and est.static_bytes == 2 * est.model.num_parameters + 14 * est.model.num_parameters // 8
    best = trainmem.max_batch("llama-2-7b", "H100", recipe="mixed-bf16", gpus=8, zero=3, seq=4096)
    assert best > 0 and trainmem.estimate("llama-2-7b", recipe="mixed-bf16", gpus=8, zero=3, seq=4096,
                                          batch=best, gpu="H100").fits()
    assert not trainmem.estimate("llama-2-7b", recipe="mixed-bf16", gpus=8, zero=3, seq=4096, batch=best + 1,
                                 gpu="H100").fits()
    with pytest.raises(trainmem.ConfigError):
        trainmem.estimate("llama-2-7b", gpus=8, zero=1, fsdp="full")


def test_sweep_takes_gpus_and_zero_as_axes(run_cli):
    code, out, _ = run_cli("sweep", "llama-2-7b", "--batch", "1", "--seq", "2048", "--gpus", "1,8",
                           "--zero", "0,1,2,3", "--json")
    rows = json.loads(out)["sweep"]
    layouts = [(r.get("parallel", {}).get("gpus", 1), r.get("parallel", {}).get("zero")) for r in rows]
    assert code == 0 and layouts == [(1, None), (8, 0), (8, 1), (8, 2), (8, 3)]
    statics = [r["static"]["total_bytes"] for r in rows]
    assert statics[1] > statics[2] > statics[3] > statics[4] and statics[0] == statics[1]


def test_deepspeed_config_keys_apply(run_cli, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                                      "overlap_comm": True}}))
    code, out, err = run_cli("estimate", "llama-2-7b", "--gpus", "8", "--ds-config", str(path), "--json")
    doc = json.loads(out)
    assert code == 0, err
    assert doc["parallel"]["zero"] == 2 and doc["parallel"]["deepspeed"]["reduce_bucket_size"] == 4096 ** 2
    bucket = next(b for b in doc["static"]["buffers"] if b["name"].startswith("gradient reduce bucket"))
    assert bucket["bytes"] == 2 * 2 * 4096 ** 2  # two buckets with overlap_comm, bf16
    code, _, err = run_cli("estimate", "llama-2-7b", "--gpus", "8", "--zero", "3", "--ds-config", str(path))
    assert code == 2 and "disagree" in err


def test_single_gpu_documents_have_no_parallel_keys(run_cli):
    code, out, _ = run_cli("estimate", "gpt2", "--gpus", "1", "--json")
    assert code == 0 and "parallel" not in json.loads(out) and "buffers" not in json.loads(out)["static"]


ODD = dict(model_type="llama", hidden_size=66, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=2,
           vocab_size=101, intermediate_size=90, max_position_embeddings=64)
"""Widths and a vocabulary that no world size divides: every rank but the first holds a short shard."""


@pytest.mark.slow
@pytest.mark.parametrize("recipe, world", [("fp32", 4), ("mixed-bf16", 2), ("pure-bf16-bf16states", 4)])
def test_fsdp2_ranks_hold_what_trainmem_says(world, recipe):
    """Real FSDP2 ranks (gloo processes; each recipe once, at 2 or 4 ranks: CI's time)."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(HERE / "fsdp_ranks.py"), str(world), recipe, json.dumps(ODD)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert len(ranks) == world
    est = estimate_model(spec_from_config(ODD), make_settings(recipe=recipe, optimizer="adamw"),
                         parallel=Parallel(gpus=world, fsdp="full"))
    states = _states(est)
    # every rank allocates the padded shard for its parameters; the first rank's shards are the full chunks, so
    # it holds the most gradients and states
    assert {r["parameters"] for r in ranks} == {states["weights"]}
    assert max(r["gradients"] for r in ranks) == states["gradients"]
    assert max(r["optimizer_states"] for r in ranks) == states["optimizer_states"]
    assert min(r["gradients"] for r in ranks) < states["gradients"]  # the shards really are uneven


@pytest.mark.slow
@pytest.mark.parametrize("recipe, checkpointing, world", [("mixed-bf16", "none", 8), ("mixed-bf16", "full", 4),
                                                          ("fp32", "full", 8), ("amp-bf16", "none", 4)])
def test_fsdp2_trace_of_one_rank_matches_the_estimate(recipe, checkpointing, world):
    """FSDPMemTracker on a fake process group (trace_fsdp_step): every collective buffer and shard of rank 0."""
    pytest.importorskip("transformers")
    from trainmem.catalog import catalog_config
    from trainmem.trace import trace_fsdp_step

    config = dict(catalog_config("llama-3.2-1b"), num_hidden_layers=2)
    settings = make_settings(recipe=recipe, checkpointing=checkpointing, batch=2, seq=512, optimizer_impl="foreach")
    parallel = Parallel(gpus=world, fsdp="full")
    spec = spec_from_config(config)
    est = estimate_model(spec, settings, parallel=parallel)
    traced = trace_fsdp_step(config, settings, parallel, spec)
    for e, t in zip(est.phases, traced.phases):
        assert abs(e.allocated_bytes - t.allocated_bytes) <= 0.01 * t.allocated_bytes, (e, t)
    assert abs(est.peak.allocated_bytes - traced.peak.allocated_bytes) <= 0.01 * traced.peak.allocated_bytes


@pytest.mark.parametrize("args, says", [
    (["--gpus", "8", "--zero", "3"], "DeepSpeed are estimated only"),
    (["--gpus", "8", "--fsdp", "hybrid", "--gpus-per-node", "4"], "full or grad-op"),
    (["--gpus", "8", "--fsdp", "full", "--recipe", "pure-bf16"], "runs the recipes"),
    (["--gpus", "8", "--fsdp", "full", "--grad-accum", "2"], "without gradient accumulation"),
    (["--gpus", "8", "--fsdp", "full", "--loss", "chunked-output"], "the standard loss"),
    (["--gpus", "8", "--fsdp", "full", "--optimizer-in-backward", "--recipe", "fp32"], "--optimizer-in-backward"),
    (["--gpus", "8", "--fsdp", "full", "--compile", "--recipe", "pure-bf16-bf16states"], "--compile"),
    (["--gpus", "8", "--fsdp", "full", "--checkpointing", "full", "--offload-activations"], "--offload-activations"),
])
def test_trace_refuses_layouts_it_cannot_run_before_importing_torch(run_cli, args, says):
    code, out, err = run_cli("trace", "gpt2", *args)
    assert code == 2 and says in err and err.count("\n") == 1


def _zero2_gpu_bytes_as_deepspeed_writes_it(total_params: int, gpus: int) -> int:
    """deepspeed/runtime/zero/stage_1_and_2.py, estimate_zero2_model_states_mem_needs, cpu_offload=False
    (deepspeed 0.19.8): "2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit +
    8_optimizer_states_32bit"."""
    return 2 * total_params + int(18 * total_params / gpus)


@pytest.mark.parametrize("name, gpus", [("llama-2-7b", 8), ("llama-3-70b", 64), ("mixtral-8x7b", 16)])
def test_zero2_model_states_at_the_step_are_deepspeeds_estimate(name, gpus):
    """At optimizer.step() ZeRO-2 holds what DeepSpeed's estimator counts: its model states plus the fp32
    gradient partition it casts for the step."""
    spec = catalog_spec(name)
    est = estimate_model(spec, make_settings(recipe="mixed-bf16"), parallel=Parallel(gpus=gpus, zero=2))
    at_step = est.static_bytes + sum(b.bytes for b in est.rank.buffers if "optimizer" in b.phases)
    assert abs(at_step - _zero2_gpu_bytes_as_deepspeed_writes_it(spec.num_parameters, gpus)) <= 18 * 2 * gpus


def test_deepspeeds_own_estimator_when_it_is_installed():
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    spec = catalog_spec("llama-2-7b")
    _, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(spec.num_parameters, 8, 1, False)
    assert gpu == _zero2_gpu_bytes_as_deepspeed_writes_it(spec.num_parameters, 8)


DDP_WRAP = r"""
import json, os, socket, torch, torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)

class Allocations(TorchDispatchMode):
    total = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and func.__name__.startswith(("empty", "zeros")):
            self.total += out.numel() * out.element_size()
        return out

model = torch.nn.Sequential(*[torch.nn.Linear(300, 200) for _ in range(5)])
with Allocations() as wrap:
    torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters()), "wrap_bytes": wrap.total}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_allocates_buckets_for_every_gradient_when_it_wraps_the_model():
    """torch's Reducer (reducer.cpp, initialize_buckets): the buckets together hold every gradient, whatever their
    cap (here 0.1 MiB, so several buckets), allocated when the model is wrapped."""
    proc = subprocess.run([sys.executable, "-c", DDP_WRAP], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    gradients = 4 * row["parameters"]
    assert gradients <= row["wrap_bytes"] <= gradients + 4096  # (plus a few bookkeeping tensors)
