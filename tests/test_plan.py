"""trainmem plan: every layout it keeps is the estimator's own estimate of that layout and fits; the largest micro-batch
is really the largest; --min-gpus is really the fewest; the configs it writes load in the engines' parsers."""

import json
import subprocess
import tomllib

import pytest
from hypothesis import given, settings, strategies as st

from trainmem.catalog import catalog_spec
from trainmem.errors import ConfigError
from trainmem.hardware import THROUGHPUT, get_gpu
from trainmem.plan import Layout, search, step_time

H100 = get_gpu("H100-80GB")


def _flags(layout: Layout) -> list[str]:
    flags = ["--recipe", layout.recipe, "--checkpointing", layout.checkpointing, "--batch", str(layout.micro_batch),
             "--grad-accum", str(layout.grad_accum), "--gpus", str(layout.gpus)]
    if layout.zero is not None:
        flags += ["--zero", str(layout.zero)]
    if layout.fsdp is not None:
        flags += ["--fsdp", layout.fsdp]
    if layout.offload != "none":
        flags += ["--offload", layout.offload]
    if layout.tp > 1:
        flags += ["--tp", str(layout.tp), "--sp"]
    if layout.pp > 1:
        flags += ["--pp", str(layout.pp), "--micro-batches", str(layout.grad_accum)]
    return flags


def _layout(doc: dict) -> Layout:
    fields = {k: doc[k] for k in Layout.__dataclass_fields__ if k in doc}
    return Layout(**fields, tp=doc["tensor_parallel"], pp=doc["pipeline_parallel"])


def test_llama_3_70b_on_8_h100_keeps_layouts_that_fit_and_are_the_estimators(run_cli):
    code, out, err = run_cli("plan", "llama-3-70b", "--gpu", "H100-80GB", "--gpus", "8", "--seq", "4096", "--json",
                             "--top", "4")
    doc = json.loads(out)
    assert code == 0, err
    assert doc["search"]["fitting"] >= 1 and doc["search"]["candidates"] >= doc["search"]["evaluated"] > 0
    for plan in doc["plans"]:
        layout = plan["layout"]
        assert plan["estimate"]["peak"]["required_bytes"] <= H100.memory_bytes
        # 70B's states do not fit 8 x 80 GB unsharded: ZeRO-3 or FSDP2 full, with offload
        assert layout["engine"] in ("ZeRO-3", "FSDP2 full") and layout["offload"] != "none"
        code, out, _ = run_cli("estimate", "llama-3-70b", "--seq", "4096", "--gpu", "H100-80GB",
                               *_flags(_layout(layout)), "--json")
        assert code == 0 and json.loads(out) == plan["estimate"]


def test_the_micro_batch_is_the_largest_that_fits():
    spec = catalog_spec("llama-3-8b")
    found = search(spec, H100, 8, 4096, global_batch=256)
    assert found.plans
    for plan in found.plans[:5]:
        layout = plan.layout
        per_gpu = layout.micro_batch * layout.grad_accum
        bigger = [d for d in range(layout.micro_batch + 1, per_gpu + 1) if per_gpu % d == 0]
        if bigger:
            import trainmem

            pipeline = {"pp": layout.pp, "micro_batches": per_gpu // bigger[0]} if layout.pp > 1 else \
                {"grad_accum": per_gpu // bigger[0]}
            est = trainmem.estimate("llama-3-8b", seq=4096, batch=bigger[0], gpu="H100-80GB", recipe=layout.recipe,
                                    checkpointing=layout.checkpointing, gpus=8, zero=layout.zero, fsdp=layout.fsdp,
                                    offload=layout.offload, tp=layout.tp, sp=layout.tp > 1, **pipeline)
            assert not est.fits(H100), layout


def test_min_gpus_for_llama_3_1_405b_on_h100_is_the_fewest(run_cli):
    code, out, err = run_cli("plan", "llama-3.1-405b", "--gpu", "H100-80GB", "--seq", "4096", "--min-gpus",
                             "--json", "--top", "1")
    doc = json.loads(out)
    assert code == 0, err
    fewest = doc["min_gpus"]
    assert fewest == doc["search"]["gpus"] and doc["plans"]
    # the count before it (the search's grid: 1, 2, 4, then multiples of 8) fits nothing
    before = {8: 4, 4: 2, 2: 1}.get(fewest, fewest - 8)
    assert not search(catalog_spec("llama-3.1-405b"), H100, before, 4096, None, min(8, before)).plans


def test_time_model_is_palms_flops_at_the_stated_fraction_of_peak():
    """PaLM's model FLOPs per token (Chowdhery et al. 2022, appendix B): 6N + 12 L h s for full attention, half the
    attention term under the causal mask; the forward once more (2N + 6 L h s / 3) under full checkpointing."""
    spec = catalog_spec("llama-2-7b")  # MHA: heads x head_dim = hidden
    n, layers, h, s = spec.num_parameters, 32, 4096, 4096
    layout = Layout("mixed-bf16", "one GPU", None, None, "none", "none", 2, 3, 1, 1)
    t = step_time(spec, layout, s, H100, mfu=0.5)
    tokens = 2 * 3 * s
    assert t.compute_seconds == pytest.approx(tokens * (6 * n + 6 * layers * h * s) / (989.4e12 * 0.5), rel=1e-12)
    assert t.communication_seconds == 0 and t.offload_seconds == 0
    recompute = step_time(spec, Layout(*(layout.__dict__ | {"checkpointing": "full"}).values()), s, H100, mfu=0.5)
    assert recompute.compute_seconds == pytest.approx(t.compute_seconds * 4 / 3, rel=1e-12)


def test_communication_follows_the_engines_collectives():
    spec = catalog_spec("llama-3-8b")
    p = spec.num_parameters
    link = THROUGHPUT["H100-80GB"].link_gbps * 1e9

    def comm(engine, zero, fsdp, accum):
        layout = Layout("mixed-bf16", engine, zero, fsdp, "none", "none", 1, accum, 8, 8)
        return step_time(spec, layout, 2048, H100).communication_seconds

    ring = 7 / 8
    assert comm("DDP", None, None, 4) == pytest.approx(2 * p * 2 * ring / link)  # bf16 gradients, once a step
    assert comm("ZeRO-3", 3, None, 4) == pytest.approx(4 * 3 * p * 2 * ring / link)  # every micro-batch
    assert comm("ZeRO-2", 2, None, 4) == pytest.approx((4 * p * 2 + p * 2) * ring / link)


def test_out_writes_configs_the_engines_parsers_load(run_cli, tmp_path):
    accelerate_args = pytest.importorskip("accelerate.commands.config.config_args")
    code, _, err = run_cli("plan", "llama-3-8b", "--gpu", "H100-80GB", "--gpus", "16", "--seq", "4096",
                           "--global-batch", "256", "--out", str(tmp_path / "ds"), "--recipe", "mixed-bf16",
                           "--checkpointing", "full")
    assert code == 0, err
    written = {p.name for p in (tmp_path / "ds").iterdir()}
    assert "launch.sh" in written
    if "accelerate.yaml" in written:
        config = accelerate_args.ClusterConfig.from_yaml_file(str(tmp_path / "ds" / "accelerate.yaml"))
        assert config.num_processes == 16 and config.num_machines == 2
    if "torchtitan.json" in written:
        titan = json.loads((tmp_path / "ds" / "torchtitan.json").read_text())
        par = titan["parallelism"]
        assert par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"] * \
            par["tensor_parallel_degree"] * par["pipeline_parallel_degree"] * par["context_parallel_degree"] == 16
        assert titan["training"]["global_batch_size"] * par["tensor_parallel_degree"] * \
            par["pipeline_parallel_degree"] * par["context_parallel_degree"] >= 256 // 16
        assert titan["activation_checkpoint"] == "full"
    if "ds_config.json" in written:
        ds = json.loads((tmp_path / "ds" / "ds_config.json").read_text())
        assert ds["bf16"]["enabled"] and not ds["bf16"]["bf16_optimizer_states"]
    assert subprocess.run(["bash", "-n", str(tmp_path / "ds" / "launch.sh")]).returncode == 0
    assert not [p for p in (tmp_path / "ds").iterdir() if p.name.startswith(".")]  # no staging folder left


def test_a_deepspeed_layout_writes_a_config_deepspeed_reads(tmp_path, monkeypatch):
    from trainmem.engine_configs import deepspeed_config, write_configs

    layout = Layout("mixed-bf16", "ZeRO-3", 3, None, "optimizer", "full", 2, 4, 8, 8)
    written = {p.name for p in write_configs(layout, 4096, "llama-3-70b", tmp_path)}
    assert written == {"accelerate.yaml", "launch.sh", "ds_config.json"}
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert ds == deepspeed_config(layout) and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    deepspeed = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is not installed here")
    # DeepSpeed reads the data-parallel world size from its communication layer: 8 ranks, without starting any
    monkeypatch.setattr(deepspeed.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(deepspeed.dist, "get_world_size", lambda *a, **k: 8)
    parsed = deepspeed.DeepSpeedConfig(str(tmp_path / "ds_config.json"))
    assert parsed.zero_optimization_stage == 3 and parsed.train_batch_size == 64
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (2, 4)
    assert parsed.zero_config.offload_optimizer.device == "cpu" and parsed.bfloat16_config.enabled


@pytest.mark.parametrize("args, says", [
    (["--gpus", "0"], "gpus must be"),
    (["--gpus", "8", "--global-batch", "12"], "split evenly"),
    (["--gpu", "A10G"], "does not give"),
    (["--gpu", "H900"], "unknown GPU"),
    (["--min-gpus", "--out", "x"], "--min-gpus answers"),
    (["--nodes", "2", "--gpus", "8"], "is not --nodes"),
    (["--mfu", "1.5"], "mfu must be"),
    (["--mfu", "inf"], "mfu must be"),
    (["--mfu", "nan"], "mfu must be"),
    (["--mfu", "1e-320"], "mfu must be"),
    (["--inter-node-gbps", "inf"], "inter-node bandwidth"),
    (["--inter-node-gbps", "1e-320"], "inter-node bandwidth"),
    (["--inter-node-gbps", "1e308"], "inter-node bandwidth"),
    (["--host-memory-gib", "inf"], "host memory"),
    (["--host-memory-gib", "1e308"], "host memory"),
    (["--host-memory-gib", "-1"], "host memory"),
    (["--global-batch", str(10**18)], "global batch must be"),
    (["--gpus", str(10**6)], "gpus must be"),
    (["--time-budget", "nan"], "time budget"),
    (["--recipe", "pure-bf16"], "no engine's config"),
    (["--out", ""], "--out is empty"),
])
def test_bad_plan_input_is_one_line(run_cli, args, says):
    gpu = [] if "--gpu" in args else ["--gpu", "H100-80GB"]
    code, _, err = run_cli("plan", "llama-3-8b", *gpu, *args)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_search_refuses_a_nominal_model():
    from trainmem.models import nominal_spec

    with pytest.raises(ConfigError, match="architecture"):
        search(nominal_spec(7e9), H100, 8, 2048)


def test_tensor_and_pipeline_layouts_are_the_estimators_and_win_where_data_parallelism_is_slow(run_cli):
    """Llama-3-70B on 64 H100s, 512 sequences of 4,096 tokens: the search takes tensor (with SP) and pipeline
    layouts too; each kept plan is `trainmem estimate` of that layout and fits."""
    code, out, err = run_cli("plan", "llama-3-70b", "--gpu", "H100-80GB", "--gpus", "64", "--seq", "4096",
                             "--global-batch", "512", "--json", "--top", "6")
    doc = json.loads(out)
    assert code == 0, err
    layouts = [p["layout"] for p in doc["plans"]]
    assert any(x["tensor_parallel"] * x["pipeline_parallel"] > 1 for x in layouts)
    for plan in doc["plans"]:
        layout = plan["layout"]
        assert layout["data_parallel"] * layout["tensor_parallel"] * layout["pipeline_parallel"] == 64
        assert layout["sequence_parallel"] == (layout["tensor_parallel"] > 1)
        assert plan["estimate"]["peak"]["required_bytes"] <= H100.memory_bytes
        code, out, _ = run_cli("estimate", "llama-3-70b", "--seq", "4096", "--gpu", "H100-80GB",
                               *_flags(_layout(layout)), "--json")
        assert code == 0 and json.loads(out) == plan["estimate"]


def test_time_model_of_tensor_and_pipeline_parallelism():
    spec = catalog_spec("llama-3-8b")
    sheet = THROUGHPUT["H100-80GB"]
    base = Layout("mixed-bf16", "FSDP2 full", None, "full", "none", "none", 1, 16, 64, 8)
    split = Layout("mixed-bf16", "FSDP2 full", None, "full", "none", "none", 1, 16, 64, 8, tp=4, pp=2)
    t0, t1 = step_time(spec, base, 4096, H100), step_time(spec, split, 4096, H100)
    # the same tokens per model replica, split over 8 GPUs, plus the 1F1B bubble (P - 1) / M
    assert t1.compute_seconds == pytest.approx(t0.compute_seconds / 8 * (1 + 1 / 16))
    hidden = 4096 * spec.hidden_size * 2
    tp_bytes = 16 * (32 / 2) * 8 * hidden * 3 / 4  # micro-batches x layers per stage x 8 collectives x (T-1)/T
    pp_bytes = 16 * 2 * hidden
    assert t1.exposed_seconds == pytest.approx(tp_bytes / (sheet.link_gbps * 1e9) + pp_bytes / (sheet.link_gbps * 1e9))
    assert t0.exposed_seconds == 0


def test_out_writes_torchtitan_for_a_tensor_and_pipeline_layout(tmp_path):
    from trainmem.engine_configs import write_configs

    layout = Layout("mixed-bf16", "FSDP2 full", None, "full", "none", "full", 2, 8, 64, 8, tp=4, pp=4)
    written = {p.name for p in write_configs(layout, 4096, "llama-3-70b", tmp_path / "tp")}
    # accelerate's and DeepSpeed's files cannot say TP and PP; torchtitan 0.3.0 loads a config_registry module
    assert written == {"torchtitan.json", "torchtitan_plan.py", "launch.sh"}
    titan = json.loads((tmp_path / "tp" / "torchtitan.json").read_text())
    par = titan["parallelism"]
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["data_parallel_shard_degree"]) == \
        (4, 4, 4)
    assert par["pipeline_parallel_microbatch_size"] == 2 and titan["training"]["local_batch_size"] == 16
    assert titan["training"]["global_batch_size"] == 64 and titan["base_config"] == "llama3:llama3_70b"
    assert (titan["training"]["dtype"], titan["training"]["mixed_precision_param"]) == ("float32", "bfloat16")
    launch = (tmp_path / "tp" / "launch.sh").read_text()
    assert "--module torchtitan_plan --config trainmem_plan" in launch and "job.config_file" not in launch
    assert subprocess.run(["bash", "-n", str(tmp_path / "tp" / "launch.sh")]).returncode == 0


def test_context_and_expert_parallel_layouts_are_searched_and_are_the_estimators():
    import trainmem

    long = search(catalog_spec("llama-3-8b"), H100, 16, 32768, global_batch=32)
    assert long.plans[0].layout.cp > 1  # at 32k tokens a step, splitting the sequence wins
    moe = search(catalog_spec("mixtral-8x7b"), H100, 32, 4096, global_batch=256)
    expert = next(p for p in moe.plans if p.layout.ep > 1)
    for plan, model, seq in ((long.plans[0], "llama-3-8b", 32768), (expert, "mixtral-8x7b", 4096)):
        L = plan.layout
        pipeline = {"pp": L.pp, "micro_batches": L.grad_accum} if L.pp > 1 else {}
        est = trainmem.estimate(model, seq=seq, batch=L.micro_batch, grad_accum=L.grad_accum, recipe=L.recipe,
                                checkpointing=L.checkpointing, gpus=L.gpus, fsdp=L.fsdp, zero=L.zero, tp=L.tp,
                                sp=L.tp > 1, cp=L.cp, ep=L.ep, **pipeline)
        assert est.peak == plan.peak and est.fits(H100)


def test_selective_checkpointing_is_modelled_but_not_offered(tmp_path, run_cli):
    """Layer-selective checkpointing is timed and estimated, but no engine's file sets it (torchtitan 0.3.0's
    SelectiveAC is per-op): the search keeps it only when asked for unwritable layouts, and plan refuses it."""
    from trainmem.engine_configs import write_configs

    spec = catalog_spec("llama-3-8b")
    none, selective, full = (step_time(spec, Layout("pure-bf16", "DDP", None, None, "none", c, 1, 4, 8, 8), 4096, H100)
                             for c in ("none", "selective", "full"))
    # half the layers (0, 2, ...) recompute their forward: (3 + 1/2) forward-equivalents against 3 and 4
    assert selective.compute_seconds == pytest.approx(none.compute_seconds * 3.5 / 3)
    assert full.compute_seconds == pytest.approx(none.compute_seconds * 4 / 3)
    modelled = search(spec, H100, 8, 8192, global_batch=64, checkpointing=("selective",), writable=False)
    assert modelled.plans and all(p.layout.zero is None and p.layout.offload == "none" and
                                  p.layout.recipe != "amp-bf16" for p in modelled.plans)
    assert not search(spec, H100, 8, 8192, global_batch=64, checkpointing=("selective",)).plans
    with pytest.raises(ConfigError, match="no engine's files"):
        write_configs(Layout("pure-bf16-bf16states", "DDP", None, None, "none", "selective", 2, 4, 8, 8), 4096,
                      "llama-3-8b", tmp_path / "sel")
    assert not (tmp_path / "sel").exists()
    code, _, err = run_cli("plan", "llama-3-8b", "--gpu", "H100-80GB", "--checkpointing", "selective")
    assert code == 2 and "selective" in err and len(err.strip().splitlines()) == 1


@settings(max_examples=150, deadline=None, derandomize=True)
@given(count=st.integers(0, 40), fitting=st.integers(0, 40), guess=st.one_of(st.none(), st.integers(0, 60)))
def test_largest_fitting_finds_the_last_that_fits_from_any_guess(count, fitting, guess):
    """The search's micro-batch lookup: the ones that fit are a prefix (memory grows with the micro-batch); from
    any guess it returns the prefix's last index and the peak found there, having probed no more than a guess's
    two and a bisection's."""
    from trainmem.plan import largest_fitting

    fitting = min(fitting, count)  # indices 0 .. fitting - 1 fit
    asked = []

    def peak_at(index):
        assert 0 <= index < count and index not in asked
        asked.append(index)
        return f"peak {index}" if index < fitting else None

    index, peak, probes = largest_fitting(count, peak_at, guess)
    assert (index, peak) == ((fitting - 1, f"peak {fitting - 1}") if fitting else (-1, None))
    assert probes == len(asked) <= 2 * max(count, 1).bit_length() + 2


def test_a_layouts_fitting_peak_is_its_estimate_where_it_fits():
    """What the search asks of a layout at each micro-batch (fitting_peak: a lower bound first, then the stages,
    stopping at the first that does not fit) agrees with the layout's full estimate at every micro-batch."""
    from trainmem.settings import make_settings
    from trainmem.sharding import Parallel
    from trainmem.stepmodel import compile_step, evaluate

    spec = catalog_spec("llama-3-8b")
    for parallel in (Parallel(gpus=16, fsdp="full", tp=2, sp=True, pp=4, micro_batches=4),
                     Parallel(gpus=16, fsdp="full"), Parallel(gpus=16, zero=3, offload="optimizer")):
        for ckpt in ("none", "full"):
            settings = make_settings(recipe="mixed-bf16", checkpointing=ckpt, grad_accum=4)
            search_step = compile_step(spec, settings, None, parallel, cache={})
            fresh = compile_step(spec, settings, None, parallel)
            for batch in (1, 2, 3, 4, 6, 8, 12, 16, 32):
                peak = evaluate(fresh, batch, 4096).peak
                assert search_step.fitting_peak(batch, 4096, H100) == (peak if peak.fits(H100) else None)


def test_tensor_and_pipeline_parallelism_with_zero_1_is_written_for_megatron_deepspeed(tmp_path, monkeypatch):
    """ZeRO-1 under TP x PP is searched (DeepSpeed's pipeline engine takes ZeRO-1 only) and written as
    Megatron-DeepSpeed's launch line and a DeepSpeed JSON whose batch counts the data-parallel ranks."""
    from trainmem.engine_configs import deepspeed_config, write_configs

    found = search(catalog_spec("llama-3-70b"), H100, 64, 4096, 512)
    zero_1 = [p.layout for p in found.plans if p.layout.zero == 1 and p.layout.tp * p.layout.pp > 1]
    assert zero_1 and not [p for p in found.plans if p.layout.zero in (2, 3) and p.layout.tp * p.layout.pp > 1]
    layout = zero_1[0]
    written = {p.name for p in write_configs(layout, 4096, "llama-3-70b", tmp_path)}
    assert written == {"launch.sh", "ds_config.json"}
    launch = (tmp_path / "launch.sh").read_text()
    assert subprocess.run(["bash", "-n", str(tmp_path / "launch.sh")]).returncode == 0
    for flag in (f"--tensor-model-parallel-size {layout.tp}", f"--pipeline-model-parallel-size {layout.pp}",
                 "--sequence-parallel", f"--micro-batch-size {layout.micro_batch}", "--global-batch-size 512",
                 "--seq-length 4096", "--zero-stage 1", "--deepspeed_config", "pretrain_gpt.py"):
        assert flag in launch, flag
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert ds == deepspeed_config(layout) and ds["train_batch_size"] == 512
    deepspeed = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is not installed here")
    # with Megatron's mpu DeepSpeed counts the data-parallel ranks: TP x PP x DP = 64
    monkeypatch.setattr(deepspeed.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(deepspeed.dist, "get_world_size", lambda *a, **k: layout.data_parallel)
    parsed = deepspeed.DeepSpeedConfig(str(tmp_path / "ds_config.json"))
    assert parsed.zero_optimization_stage == 1 and parsed.train_batch_size == 512
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == \
        (layout.micro_batch, layout.grad_accum)


def test_every_kept_layouts_search_peak_is_its_full_estimates():
    """What the search found for each layout it keeps (from shared compiled stages, lower bounds and the last
    answer's guess) is the peak `trainmem estimate` gives for that layout, over every layout that fits."""
    found = search(catalog_spec("llama-3-70b"), H100, 64, 4096, 512, recipes=("mixed-bf16", "pure-bf16",
                                                                              "amp-bf16", "pure-bf16-bf16states"),
                   checkpointing=("none", "selective", "full"), writable=False)  # (every layout modelled)
    assert len(found.plans) > 100
    assert {(p.layout.tp, p.layout.pp) for p in found.plans} > {(1, 1)}
    for plan in found.plans:
        assert plan.peak == plan.estimate.peak, plan.layout
