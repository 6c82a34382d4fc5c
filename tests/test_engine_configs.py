"""The files `trainmem plan --out` writes: each engine's own parser reads back the planned layout (recipe dtypes,
checkpointing, offload, micro-batch, accumulation, degrees), `trainmem estimate` on the file gives the plan's peak,
user strings cannot escape their field, the YAML needs no PyYAML, and bad DeepSpeed configs are refused as
DeepSpeed refuses them. Plus the search's bounds (time budget, caps, finite numbers)."""

import json
import math
import re
import shlex
import subprocess
import sys
import time
import types

import pytest
from hypothesis import given, settings, strategies as st

from trainmem.catalog import catalog_spec
from trainmem.engine_configs import plan_files, to_yaml, write_configs, writers
from trainmem.errors import ConfigError
from trainmem.hardware import get_gpu
from trainmem.plan import MAX_GLOBAL_BATCH, Layout, min_gpus, run_plan, search

H100 = get_gpu("H100-80GB")


def _script_flags(launch: str) -> dict:
    """What launch.sh passes the training script (transformers' TrainingArguments), as estimate's flags."""
    words = shlex.split(launch.replace("\\\n", " "), comments=True)
    flags = {}
    for i, word in enumerate(words):
        if word == "--per_device_train_batch_size":
            flags["--batch"] = words[i + 1]
        elif word == "--gradient_accumulation_steps":
            flags["--grad-accum"] = words[i + 1]
        elif word == "--gradient_checkpointing":
            flags["--checkpointing"] = "full"
        elif word == "--torch_dtype":
            flags["dtype"] = words[i + 1]
    return flags


def _best(spec_name, gpus, seq, global_batch, **options):
    found = search(catalog_spec(spec_name), H100, gpus, seq, global_batch, **options)
    assert found.plans, options
    return found.plans[0]


def _peak(run_cli, *args):
    code, out, err = run_cli("estimate", *args, "--gpu", "H100-80GB", "--json")
    assert code == 0, err
    return json.loads(out)["peak"]["required_bytes"]


@pytest.fixture
def deepspeed_world(monkeypatch, capsys):
    deepspeed = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is not installed here")
    capsys.readouterr()  # (its import prints a warning about the accelerator)

    def world(n):
        monkeypatch.setattr(deepspeed.dist, "get_rank", lambda *a, **k: 0)
        monkeypatch.setattr(deepspeed.dist, "get_world_size", lambda *a, **k: n)
        return deepspeed.DeepSpeedConfig

    return world


def test_a_zero_plan_is_deepspeeds_bf16_mode_and_re_estimates_to_the_plan(tmp_path, run_cli, deepspeed_world):
    """ZeRO-3 with optimizer offload and full checkpointing (70B on 8 GPUs needs both): DeepSpeed's own
    DeepSpeedConfig reads the stage, offload, micro-batch, accumulation and the bf16 mode with fp32 master weights
    and states; estimate --ds-config (and --accelerate-config, which names it) on the files gives the plan's peak."""
    plan = _best("llama-3-70b", 8, 4096, 16, recipes=("mixed-bf16",), engines=("ZeRO-3",))
    L = plan.layout
    assert L.checkpointing == "full" and L.offload != "none"
    out = tmp_path / "ds"
    assert {p.name for p in write_configs(L, 4096, "llama-3-70b", out)} == {"ds_config.json", "accelerate.yaml",
                                                                           "launch.sh"}
    parsed = deepspeed_world(8)(str(out / "ds_config.json"))
    assert parsed.zero_optimization_stage == 3
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (L.micro_batch,
                                                                                           L.grad_accum)
    bf16 = parsed.bfloat16_config
    assert bf16.enabled and not bf16.bf16_master_weights_and_grads and not bf16.bf16_optimizer_states
    assert parsed.zero_config.offload_optimizer.device == "cpu"
    assert (parsed.zero_config.offload_param is not None) == (L.offload == "optimizer+params")
    launch = (out / "launch.sh").read_text()
    flags = _script_flags(launch)
    assert flags["--checkpointing"] == "full" and "--bf16" in launch  # the script's gradient checkpointing
    assert _peak(run_cli, "llama-3-70b", "--seq", "4096", "--gpus", "8", "--ds-config", str(out / "ds_config.json"),
                 "--checkpointing", "full") == plan.peak.required_bytes
    accelerate_args = pytest.importorskip("accelerate.commands.config.config_args")
    cluster = accelerate_args.ClusterConfig.from_yaml_file(str(out / "accelerate.yaml"))
    assert cluster.distributed_type == "DEEPSPEED" and cluster.num_processes == 8
    assert cluster.deepspeed_config["deepspeed_config_file"] == "ds_config.json" and cluster.mixed_precision == "bf16"
    # launch.sh's accelerate line, as accelerate's launcher reads it: DeepSpeed with this folder's JSON
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    assert '--config_file "$HERE/accelerate.yaml"' in launch
    assert '--deepspeed_config_file "$HERE/ds_config.json"' in launch
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(out / "accelerate.yaml"), "--deepspeed_config_file", str(out / "ds_config.json"),
         "train.py"]))
    assert args.use_deepspeed and args.deepspeed_config_file == str(out / "ds_config.json")
    assert (args.mixed_precision, args.num_processes, args.zero3_init_flag) == ("bf16", 8, True)
    assert _peak(run_cli, "llama-3-70b", "--seq", "4096", "--accelerate-config", str(out / "accelerate.yaml"),
                 "--checkpointing", "full") == plan.peak.required_bytes


def test_fsdp2_hybrid_is_written_with_accelerates_parallelism_config(tmp_path, run_cli):
    """FSDP2 hybrid on 2 nodes: accelerate's ClusterConfig reads a parallelism_config that shards over a node and
    replicates over the nodes (accelerate's ParallelismConfig accepts the sizes), the bf16 model without mixed
    precision (pure-bf16-bf16states), and estimate --accelerate-config with launch.sh's flags gives the plan."""
    accelerate_args = pytest.importorskip("accelerate.commands.config.config_args")
    from accelerate.parallelism_config import ParallelismConfig

    plan = _best("llama-3-8b", 16, 2048, 64, recipes=("pure-bf16-bf16states",), engines=("FSDP2 hybrid",),
                 model_parallel=False)
    L = plan.layout
    assert writers(L)[0] == "accelerate"
    out = tmp_path / "hsdp"
    names = {p.name for p in write_configs(L, 2048, "llama-3-8b", out)}
    assert {"accelerate.yaml", "launch.sh"} == names  # (torchtitan reduces in fp32: not this recipe's FSDP2)
    cluster = accelerate_args.ClusterConfig.from_yaml_file(str(out / "accelerate.yaml"))
    par = cluster.parallelism_config
    assert (par["parallelism_config_dp_replicate_size"], par["parallelism_config_dp_shard_size"]) == (2, 8)
    sizes = ParallelismConfig(dp_replicate_size=2, dp_shard_size=8, tp_size=1, cp_size=1)
    assert sizes.total_size == cluster.num_processes == 16 and cluster.num_machines == 2
    fsdp = cluster.fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_activation_checkpointing"] == (L.checkpointing == "full")
    assert cluster.mixed_precision == "no"  # (accelerate would upcast the bf16 model to fp32 otherwise)
    # what `accelerate launch --config_file accelerate.yaml` hands the processes: a 2 x 8 mesh, not 16-way sharding
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(out / "accelerate.yaml"), "train.py"]))
    env = prepare_multi_gpu_env(args)
    assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "8")
    assert (env["FSDP_VERSION"], env["FSDP_RESHARD_AFTER_FORWARD"], env["ACCELERATE_MIXED_PRECISION"]) == \
        ("2", "true", "no")
    flags = _script_flags((out / "launch.sh").read_text())
    assert flags["dtype"] == "bfloat16" and "--checkpointing" not in flags  # (FSDP2's own checkpointing)
    args = ["llama-3-8b", "--accelerate-config", str(out / "accelerate.yaml"), "--batch", flags["--batch"],
            "--grad-accum", flags["--grad-accum"], "--recipe", "pure-bf16-bf16states"]
    assert _peak(run_cli, *args) == plan.peak.required_bytes
    # without the recipe the file cannot say the model's dtype: one line
    code, _, err = run_cli("estimate", "llama-3-8b", "--accelerate-config", str(out / "accelerate.yaml"))
    assert code == 2 and "--torch_dtype" in err and len(err.strip().splitlines()) == 1


def test_ddp_with_autocast_is_accelerates_multi_gpu(tmp_path, run_cli):
    accelerate_args = pytest.importorskip("accelerate.commands.config.config_args")
    plan = _best("llama-3.2-1b", 8, 2048, 32, recipes=("amp-bf16",), engines=("DDP",), model_parallel=False)
    out = tmp_path / "ddp"
    assert {p.name for p in write_configs(plan.layout, 2048, "llama-3.2-1b", out)} == {"accelerate.yaml", "launch.sh"}
    cluster = accelerate_args.ClusterConfig.from_yaml_file(str(out / "accelerate.yaml"))
    assert (cluster.distributed_type, cluster.mixed_precision, cluster.num_processes) == ("MULTI_GPU", "bf16", 8)
    flags = _script_flags((out / "launch.sh").read_text())
    args = ["llama-3.2-1b", "--accelerate-config", str(out / "accelerate.yaml"), "--batch", flags["--batch"],
            "--grad-accum", flags["--grad-accum"], *(["--checkpointing", "full"] if "--checkpointing" in flags else [])]
    assert flags["dtype"] == "float32" and _peak(run_cli, *args) == plan.peak.required_bytes


TORCHTITAN_030_FIELDS = {
    "training": {"local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "enable_cpu_offload",
                 "disable_cuda_graphs", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq",
                 "gc_debug"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "enable_fsdp_symm_mem", "tensor_parallel_degree", "enable_sequence_parallel", "spmd_backend",
                    "pipeline_parallel_degree", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size", "context_parallel_degree",
                    "context_parallel_load_balancer", "context_parallel_ptrr_mask_key", "expert_parallel_degree"},
}
"""TrainingConfig's and ParallelismConfig's fields in torchtitan 0.3.0 (torchtitan/config/configs.py of the wheel the
package registry serves). torchtitan itself is not installed by the dev extra: it pulls datasets, wandb,
tensorboard, tyro and spmd_types, so its ConfigManager does not run here; its config module is run against these
fields instead."""


def _run_torchtitan_module(folder, monkeypatch):
    """Import the written torchtitan_plan.py against a stand-in of torchtitan 0.3.0's config objects (slots
    classes with exactly its fields: setting any other name fails, as on the real dataclasses)."""
    def section(name):
        obj = type(name, (), {"__slots__": tuple(TORCHTITAN_030_FIELDS[name])})()
        for field in TORCHTITAN_030_FIELDS[name]:
            setattr(obj, field, "torchtitan's default")
        return obj

    class FullConfig:
        pass

    class Trainer:
        __slots__ = ("training", "parallelism", "activation_checkpoint")

    def llama3_70b():
        config = Trainer()
        config.training, config.parallelism, config.activation_checkpoint = section("training"), \
            section("parallelism"), "selective (0.3.0's per-op default)"
        return config

    ac = types.ModuleType("torchtitan.distributed.activation_checkpoint")
    ac.FullAC = types.SimpleNamespace(Config=FullConfig)
    registry = types.ModuleType("torchtitan.models.llama3.config_registry")
    registry.llama3_70b = registry.llama3_8b = llama3_70b
    for name in ("torchtitan", "torchtitan.distributed", "torchtitan.models", "torchtitan.models.llama3"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, ac.__name__, ac)
    monkeypatch.setitem(sys.modules, registry.__name__, registry)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv("TORCHTITAN_BASE", raising=False)
    monkeypatch.delitem(sys.modules, "torchtitan_plan", raising=False)
    import importlib

    return importlib.import_module("torchtitan_plan").trainmem_plan(), FullConfig


def test_a_tensor_and_pipeline_plan_is_torchtitans_and_re_estimates_to_the_plan(tmp_path, run_cli, monkeypatch):
    """Llama-3-70B on 64 GPUs, the best FSDP2 layout with TP and PP in mixed-bf16: torchtitan 0.3.0's config module
    sets every planned field (fp32 model, bf16 mixed precision through fully_shard, degrees, the local batch and
    the pipeline's micro-batch, FullAC or none); estimate --torchtitan-config gives the plan's peak."""
    found = search(catalog_spec("llama-3-70b"), H100, 64, 4096, 512, recipes=("mixed-bf16",),
                   engines=("FSDP2 full",))
    plan = next(p for p in found.plans if p.layout.tp * p.layout.pp > 1)
    L = plan.layout
    out = tmp_path / "titan"
    assert {p.name for p in write_configs(L, 4096, "llama-3-70b", out)} == {"torchtitan.json", "torchtitan_plan.py",
                                                                           "launch.sh"}
    config, full = _run_torchtitan_module(out, monkeypatch)
    t, p = config.training, config.parallelism
    assert (t.dtype, t.mixed_precision_param, t.mixed_precision_reduce) == ("float32", "bfloat16", "float32")
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree) == (L.tp, L.pp, L.cp)
    assert p.data_parallel_shard_degree * p.data_parallel_replicate_degree == L.data_parallel
    assert p.enable_sequence_parallel == (L.tp > 1) and t.seq_len == 4096 and not t.enable_cpu_offload
    if L.pp > 1:
        assert (p.pipeline_parallel_microbatch_size, t.local_batch_size) == (L.micro_batch,
                                                                             L.micro_batch * L.grad_accum)
    assert t.global_batch_size == 512
    assert isinstance(config.activation_checkpoint, full) if L.checkpointing == "full" else \
        config.activation_checkpoint is None
    assert _peak(run_cli, "llama-3-70b", "--torchtitan-config", str(out / "torchtitan.json")) == \
        plan.peak.required_bytes


def test_torchtitan_runs_fsdp2_in_mixed_bf16_or_fp32_only(tmp_path, run_cli):
    """torchtitan 0.3.0 applies fully_shard to every model and reduces in float32: its bf16 training dtype is not
    pure-bf16-bf16states (bf16 reduce) and its replicate-only runs are not DDP, so neither is written for it, and
    such a file is refused in one line."""
    for recipe, engine, fsdp in (("pure-bf16-bf16states", "FSDP2 full", "full"), ("amp-bf16", "DDP", None),
                                 ("mixed-bf16", "DDP", None)):
        assert "torchtitan" not in writers(Layout(recipe, engine, None, fsdp, "none", "none", 1, 1, 8, 8))
    assert "torchtitan" not in writers(Layout("pure-bf16-bf16states", "DDP", None, None, "none", "none", 1, 1, 64,
                                              8, tp=8, pp=2))
    for training, parallelism, says in (({"dtype": "bfloat16"}, {"data_parallel_shard_degree": 8}, "reduces"),
                                        ({}, {"data_parallel_replicate_degree": 8}, "shard degree of 1")):
        path = tmp_path / "t.json"
        path.write_text(json.dumps({"training": training, "parallelism": parallelism}))
        code, _, err = run_cli("estimate", "llama-3-8b", "--torchtitan-config", str(path))
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    fp32 = Layout("fp32", "FSDP2 grad-op", None, "grad-op", "none", "full", 1, 2, 8, 8)
    assert writers(fp32) == ("accelerate", "torchtitan")
    titan = torchtitan_json = json.loads(plan_files(fp32, 2048, "llama-3-8b")["torchtitan.json"])
    assert (titan["training"]["dtype"], titan["training"]["mixed_precision_param"]) == ("float32", "float32")
    assert titan["parallelism"]["fsdp_reshard_after_forward"] == "never" and torchtitan_json["activation_checkpoint"] \
        == "full"


def test_no_layout_an_engine_cannot_run_is_offered():
    """pure-bf16 (fp32 states without a master copy) and layer-selective checkpointing are written by no engine;
    DeepSpeed offers mixed-bf16 only; accelerate's FSDP2 no mixed precision (it would upcast and reduce in bf16)."""
    found = search(catalog_spec("llama-3-8b"), H100, 16, 4096, 64,
                   recipes=("mixed-bf16", "pure-bf16", "amp-bf16", "pure-bf16-bf16states"),
                   checkpointing=("none", "selective", "full"))
    assert found.plans
    for plan in found.plans:
        L = plan.layout
        assert writers(L) and L.recipe != "pure-bf16" and L.checkpointing != "selective"
        if L.zero is not None:
            assert L.recipe == "mixed-bf16"
        assert plan_files(L, 4096, "llama-3-8b")
    assert any("pure-bf16" in line for line in found.skipped)
    everything = search(catalog_spec("llama-3-8b"), H100, 16, 4096, 64, recipes=("pure-bf16",), writable=False)
    assert everything.plans  # (modelled, just not offered)
    assert writers(Layout("pure-bf16-bf16states", "ZeRO-3", 3, None, "none", "none", 1, 1, 8, 8)) == ()
    assert "accelerate" not in writers(Layout("mixed-bf16", "FSDP2 full", None, "full", "none", "none", 1, 1, 8, 8))


def test_the_70b_plan_with_bf16_states_says_so(run_cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run_cli("plan", "llama-3-70b", "--gpu", "H100-80GB", "--gpus", "64", "--seq", "4096",
                             "--global-batch", "512", "--top", "10")
    assert code == 0, err
    assert "pure-bf16-bf16states*" in out and "mixed-bf16, fp32 master weights and Adam states" in " ".join(out.split())
    table = out.split("layouts searched")[0]
    rows = [line for line in table.splitlines() if re.match(r"\s*\d+\s+\S+/\d+/\d+/\d+\s", line)]
    assert len(rows) == 10 and "…" not in table  # every cell whole, the recipe names too
    assert all(re.search(r"\s(mixed-bf16|amp-bf16|pure-bf16-bf16states\*)\s", row) for row in rows)
    code, out, _ = run_cli("plan", "llama-3-70b", "--gpu", "H100-80GB", "--gpus", "64", "--seq", "4096",
                           "--global-batch", "512", "--recipe", "mixed-bf16", "--json")
    doc = json.loads(out)
    assert code == 0 and {p["layout"]["recipe"] for p in doc["plans"]} == {"mixed-bf16"}
    assert "bf16_states_note" not in doc["search"] and doc["search"]["cut_short"] is False


def test_plan_help_names_what_is_searched(run_cli):
    code, out, _ = run_cli("plan", "--help")
    assert code == 0 and "not searched yet" not in out and "tensor" in out


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.dictionaries(st.text(max_size=20), st.one_of(
    st.text(), st.booleans(), st.none(), st.integers(-10**12, 10**12),
    st.dictionaries(st.text(max_size=10), st.one_of(st.text(), st.booleans(), st.integers()), max_size=4),
    st.lists(st.one_of(st.text(max_size=8), st.integers()), max_size=3)), max_size=6))
def test_the_yaml_reads_back_identically(config):
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load(to_yaml(config)) == (config or None)


def test_out_writes_without_pyyaml(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # (import yaml now fails, as on the core install)
    layout = Layout("mixed-bf16", "ZeRO-2", 2, None, "none", "none", 2, 2, 8, 8)
    names = {p.name for p in write_configs(layout, 2048, "llama-3-8b", tmp_path)}
    assert "accelerate.yaml" in names


HOSTILE = ['x"\n[checkpoint]\nfolder = "pwn"\n#', "a'; rm -rf / #\n", "$(touch /tmp/pwned)`id`", "\u2028\x00\x1b[2J"]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_user_string_stays_inside_its_field(tmp_path, name):
    yaml = pytest.importorskip("yaml")
    layout = Layout("fp32", "FSDP2 full", None, "full", "none", "full", 1, 4, 8, 8)
    write_configs(layout, 2048, name, tmp_path)
    titan = json.loads((tmp_path / "torchtitan.json").read_text())
    assert titan["trainmem"]["model"] == name and titan["base_config"] is None
    for path in tmp_path.iterdir():
        text = path.read_text()
        assert not re.search(r"^\[checkpoint\]|^folder", text, re.M) and "pwn" not in text.replace(
            json.dumps(name)[1:-1], "")
    assert yaml.safe_load((tmp_path / "accelerate.yaml").read_text())["num_processes"] == 8
    for script in ("launch.sh", "launch_torchtitan.sh"):
        assert subprocess.run(["bash", "-n", str(tmp_path / script)]).returncode == 0


# ------------------------------------------------------------------------------------------------ --ds-config


def _ds(tmp_path, text):
    path = tmp_path / "ds.json"
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return str(path)


@pytest.mark.parametrize("config, says", [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": "cpu"}}, "must be an object"),
    ({"zero_optimization": {"stage": 3, "offload_param": 1}}, "must be an object"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "CPU"}}}, "lower case"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "offload_param without"),
    ('{"zero_optimization": {"stage": 2}, "zero_optimization": {"stage": 3}}', "appears twice"),
    ('{"train_micro_batch_size_per_gpu": NaN}', "not a number"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
      "zero_optimization": {"stage": 3}}, "bf16 master partition"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both enabled"),
    ({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
      "zero_optimization": {"stage": 2}}, "train_batch_size 7"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu must be"),
    ({"bf16": "yes"}, "bf16 must be an object"),
])
def test_bad_deepspeed_configs_are_one_line(run_cli, tmp_path, config, says):
    code, _, err = run_cli("estimate", "llama-2-7b", "--gpus", "8", "--ds-config", _ds(tmp_path, config))
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_deepspeed_refuses_what_ds_config_refuses(tmp_path, deepspeed_world):
    DeepSpeedConfig = deepspeed_world(8)
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    for bad in ({**base, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "CPU"}}},
                {**base, "zero_optimization": {"stage": 3, "offload_optimizer": "cpu"}}):
        with pytest.raises(Exception):
            DeepSpeedConfig(_ds(tmp_path, bad))
    with pytest.raises(Exception, match="[Dd]uplicate"):
        DeepSpeedConfig(_ds(tmp_path, '{"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 2}'))


def test_ds_config_reads_the_recipe_batch_and_accumulation(run_cli, tmp_path):
    ds = _ds(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                        "train_batch_size": 64, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    code, out, err = run_cli("estimate", "llama-2-7b", "--gpus", "8", "--ds-config", ds, "--json")
    doc = json.loads(out)
    assert code == 0, err
    assert (doc["settings"]["recipe"], doc["settings"]["batch"], doc["settings"]["grad_accum"]) == ("mixed-fp16", 2, 4)
    same = run_cli("estimate", "llama-2-7b", "--gpus", "8", "--zero", "2", "--recipe", "mixed-fp16", "--batch", "2",
                   "--grad-accum", "4", "--json")[1]
    assert json.loads(same)["peak"] == doc["peak"]
    code, _, err = run_cli("estimate", "llama-2-7b", "--gpus", "8", "--ds-config", ds, "--batch", "3")
    assert code == 2 and "disagree" in err
    # offload_param below stage 3 is never read by DeepSpeed (stage_1_and_2.py): the same as the optimizer alone
    both = _ds(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                "offload_param": {"device": "cpu"}}})
    code, out, _ = run_cli("estimate", "llama-2-7b", "--gpus", "8", "--ds-config", both, "--json")
    assert code == 0 and json.loads(out)["parallel"]["offload"] == "optimizer"


# ------------------------------------------------------------------------------------------------ bounds


def test_a_time_budget_cuts_the_search_short_and_says_so(run_cli):
    spec = catalog_spec("llama-3-70b")
    full = search(spec, H100, 64, 4096, 512)
    short = search(spec, H100, 64, 4096, 512, time_budget_s=0.0)
    assert not full.cut_short and short.cut_short and short.candidates < full.candidates
    assert all(p.peak == p.estimate.peak for p in short.plans[:3])
    code, out, _ = run_cli("plan", "llama-3-70b", "--gpu", "H100-80GB", "--gpus", "64", "--seq", "4096",
                           "--global-batch", "512", "--time-budget", "0", "--json")
    doc = json.loads(out)
    assert doc["search"]["cut_short"] is True and "cut this search short" in doc["search"]["cut_short_note"]
    code, out, _ = run_cli("plan", "llama-3-70b", "--gpu", "H100-80GB", "--gpus", "64", "--seq", "4096",
                           "--global-batch", "512", "--time-budget", "0")
    assert "cut this search short" in out


def test_min_gpus_is_the_fewest_even_where_fitting_is_not_monotone():
    """Which counts fit is not monotone (405B at 65,536 tokens fits 128 and 160 H100s, not 144: no tensor x context
    split of 144 holds it), so --min-gpus tries the counts in order: every smaller count trains nothing."""
    from trainmem.plan import min_gpus_counts

    spec = catalog_spec("llama-3.1-405b")
    options = {"checkpointing": ("none", "full")}
    assert search(spec, H100, 160, 65536, None, 8, **options).plans
    assert not search(spec, H100, 144, 65536, None, 8, **options).plans
    for seq in (4096, 65536):
        found, answer = run_plan("llama-3.1-405b", "H100-80GB", seq=seq, min_gpus_wanted=True)
        assert found.plans and not found.cut_short and found.gpus == answer
        assert answer <= 160
        for n in [c for c in min_gpus_counts(8) if c < answer]:
            assert not search(spec, H100, n, seq, None, min(8, n), **options).plans, n


def test_run_plan_and_min_gpus_take_a_budget():
    spec = catalog_spec("llama-3.1-405b")
    cut = min_gpus(spec, H100, 4096, time_budget_s=0.0)
    assert cut is None or cut[1].cut_short
    with pytest.raises(ConfigError, match="time budget"):
        run_plan("llama-3-8b", "H100-80GB", min_gpus_wanted=True, time_budget_s=0.0)
    found, _ = run_plan("llama-3-8b", "H100-80GB", gpus=64, seq=4096, global_batch=512, time_budget_s=0.0)
    assert found.cut_short and found.candidates == 0


@pytest.mark.parametrize("keywords, says", [
    ({"mfu": float("inf")}, "mfu"), ({"mfu": 1e-320}, "mfu"), ({"mfu": float("nan")}, "mfu"),
    ({"inter_node_gbps": float("inf")}, "inter-node"), ({"inter_node_gbps": 1e-320}, "inter-node"),
    ({"host_memory_gib": 1e308}, "host memory"), ({"host_memory_gib": float("nan")}, "host memory"),
    ({"global_batch": 10**18}, "global batch"), ({"global_batch": MAX_GLOBAL_BATCH * 8}, "global batch"),
    ({"time_budget_s": -1.0}, "time budget"), ({"time_budget_s": float("inf")}, "time budget"),
])
def test_search_refuses_absurd_numbers_quickly(keywords, says):
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=says):
        search(catalog_spec("llama-3-8b"), H100, 8, 2048, **keywords)
    assert time.perf_counter() - started < 5


def test_the_largest_global_batch_answers(run_cli):
    code, out, err = run_cli("plan", "llama-3.2-1b", "--gpu", "H100-80GB", "--gpus", "8", "--global-batch",
                             str(MAX_GLOBAL_BATCH), "--json", "--top", "1")
    assert code == 0, err and json.loads(out)["plans"]


def _re_estimate_flags(folder, layout: dict) -> list[list[str]]:
    """Every way the written files can be re-estimated: each config file with what launch.sh gives the script
    (transformers' TrainingArguments, or Megatron-DeepSpeed's own flags)."""
    names = {p.name for p in folder.iterdir()}
    launch = (folder / "launch.sh").read_text()
    words = shlex.split(launch.replace("\\\n", " "), comments=True)
    script = _script_flags(launch)
    ways = []
    if "ds_config.json" in names and "pretrain_gpt.py" in launch:
        arg = dict(zip(words, words[1:]))
        flags = ["--ds-config", str(folder / "ds_config.json"), "--gpus", str(layout["gpus"]),
                 "--tp", arg["--tensor-model-parallel-size"], "--pp", arg["--pipeline-model-parallel-size"]]
        flags += ["--sp"] if "--sequence-parallel" in words else []
        if int(arg["--pipeline-model-parallel-size"]) > 1:
            flags += ["--micro-batches", str(layout["grad_accum"])]
        flags += ["--checkpointing", "full"] if "--recompute-granularity" in words else []
        ways.append(flags)
    elif "accelerate.yaml" in names:
        flags = ["--accelerate-config", str(folder / "accelerate.yaml"), "--batch", script["--batch"],
                 "--grad-accum", script["--grad-accum"]]
        flags += ["--checkpointing", "full"] if "--checkpointing" in script else []
        if "ds_config.json" not in names and "--bf16" not in launch and "--fp16" not in launch:
            flags += ["--recipe", {"bfloat16": "pure-bf16-bf16states", "float32": "fp32"}[script["dtype"]]]
        ways.append(flags)
    if "torchtitan.json" in names:
        ways.append(["--torchtitan-config", str(folder / "torchtitan.json")])
    assert ways, names
    return ways


@pytest.mark.parametrize("args", [
    ["llama-3-70b", "--gpus", "8", "--seq", "4096"],
    ["llama-3-70b", "--gpus", "64", "--seq", "4096", "--global-batch", "512"],
    ["llama-3-70b", "--gpus", "64", "--seq", "4096", "--global-batch", "512", "--recipe", "mixed-bf16"],
    ["llama-3-8b", "--nodes", "2", "--global-batch", "256", "--recipe", "mixed-bf16", "--checkpointing", "full"],
    ["llama-3-8b", "--gpus", "16", "--seq", "4096", "--global-batch", "64", "--recipe", "pure-bf16-bf16states"],
    ["llama-3.2-1b", "--gpus", "8", "--global-batch", "64", "--recipe", "amp-bf16"],
    ["llama-3.2-1b", "--gpus", "1", "--global-batch", "8"],
    ["mixtral-8x7b", "--gpus", "32", "--seq", "4096", "--global-batch", "256"],
    ["llama-3-8b", "--gpus", "16", "--seq", "32768", "--global-batch", "32"],
    ["llama-3-8b", "--gpus", "8", "--seq", "65536", "--global-batch", "8", "--recipe", "mixed-bf16"],
    ["mixtral-8x7b", "--gpus", "32", "--seq", "4096", "--global-batch", "256", "--recipe", "pure-bf16-bf16states"],
], ids=lambda a: " ".join(a))
def test_plan_out_re_estimates_to_the_plan(run_cli, tmp_path, args):
    """`trainmem plan ... --out DIR`, then `trainmem estimate` on each file written (with launch.sh's flags for what
    the script sets): the plan's peak, byte for byte."""
    code, out, err = run_cli("plan", *args, "--gpu", "H100-80GB", "--json", "--top", "1", "--out", str(tmp_path))
    assert code == 0, err
    plan = json.loads(out)["plans"][0]
    model = args[0]
    seq = args[args.index("--seq") + 1] if "--seq" in args else "2048"
    for flags in _re_estimate_flags(tmp_path, plan["layout"]):
        assert _peak(run_cli, model, "--seq", seq, *flags) == plan["estimate"]["peak"]["required_bytes"], flags
    for script in tmp_path.glob("*.sh"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_out_refuses_unusable_folders_in_one_line(run_cli, tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "launch.sh").mkdir()
    (tmp_path / "full" / "accelerate.yaml").write_text("untouched")
    for out in (tmp_path / "dangling", tmp_path / ("x" * 300), tmp_path / "no" / "such", tmp_path / "full"):
        code, _, err = run_cli("plan", "llama-3.2-1b", "--gpu", "H100-80GB", "--gpus", "1", "--out", str(out))
        assert code == 2 and "--out" in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "full" / "accelerate.yaml").read_text() == "untouched"  # nothing half-written


@settings(max_examples=60, deadline=None, derandomize=True)
@given(name=st.sampled_from(["mfu", "inter_node_gbps", "host_memory_gib"]),
       value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**30, 10**30)))
def test_any_number_is_taken_in_range_or_refused_in_one_line(name, value):
    from trainmem.plan import HOST_MEMORY_GIB_RANGE, INTER_NODE_GBPS_RANGE, MFU_RANGE

    low, high = {"mfu": MFU_RANGE, "inter_node_gbps": INTER_NODE_GBPS_RANGE,
                 "host_memory_gib": HOST_MEMORY_GIB_RANGE}[name]
    spec = catalog_spec("gpt2")
    try:
        found = search(spec, H100, 1, 128, **{name: value}, checkpointing=("none",), recipes=("amp-bf16",))
    except ConfigError as exc:
        assert not low <= value <= high and "\n" not in str(exc)
    else:
        assert low <= value <= high and all(math.isfinite(p.time.seconds) for p in found.plans)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(device=st.one_of(st.sampled_from(["cpu", "nvme", "none", "CPU", "Cpu", "gpu", "", "cpu "]), st.text(max_size=6),
                        st.integers(), st.none(), st.booleans()))
def test_an_offload_device_is_deepspeeds_or_refused(device):
    from trainmem.sharding import read_deepspeed_config
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": device}}}))
        try:
            _, stage, offload = read_deepspeed_config(path, 4096)
        except ConfigError as exc:
            assert device not in ("cpu", "nvme", "none") and "\n" not in str(exc)
        else:
            assert device in ("cpu", "nvme", "none") and stage == 3
            assert offload == (None if device == "none" else "optimizer")


@pytest.mark.parametrize("text, says", [
    ("distributed_type: MEGATRON_LM\nnum_processes: 8\n", "not read here"),
    ("- a\n- b\n", "not a YAML mapping"),
    ("num_processes: [\n", "not readable YAML"),
    ("distributed_type: FSDP\nnum_processes: 8\nfsdp_config: {fsdp_version: 1}\n", "fsdp_version must be 2"),
    ("distributed_type: FSDP\nnum_processes: 8\nmixed_precision: bf16\nfsdp_config: {fsdp_version: 2}\n",
     "upcasts to fp32"),
    ("distributed_type: MULTI_GPU\nnum_processes: -1\n", "num_processes must be"),
    ("distributed_type: MULTI_GPU\nnum_processes: 8\nnum_machines: 3\n", "does not split"),
    ("distributed_type: DEEPSPEED\nnum_processes: 8\n", "deepspeed_config_file"),
])
def test_bad_accelerate_configs_are_one_line(run_cli, tmp_path, text, says):
    pytest.importorskip("yaml")
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    code, _, err = run_cli("estimate", "llama-2-7b", "--accelerate-config", str(path))
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_accelerate_config_without_pyyaml_is_one_line(run_cli, tmp_path, monkeypatch):
    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    code, _, err = run_cli("estimate", "llama-2-7b", "--accelerate-config", str(path))
    assert code == 2 and "PyYAML" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("doc, says", [
    ('{"training": {}, "parallelism": {}, "training": {}}', "appears twice"),
    ({"training": {"local_batch_size": "8"}, "parallelism": {}}, "local_batch_size must be"),
    ({"training": {"dtype": "float16"}, "parallelism": {}}, "must be float32 or bfloat16"),
    ({"training": {}, "parallelism": {"data_parallel_shard_degree": 8}, "activation_checkpoint": "selective"},
     "must be none or full"),
    ({"training": {"local_batch_size": 2, "global_batch_size": 3}, "parallelism": {}}, "not a multiple"),
    ({"parallelism": {}}, "needs a training"),
])
def test_bad_torchtitan_configs_are_one_line(run_cli, tmp_path, doc, says):
    path = tmp_path / "torchtitan.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    code, _, err = run_cli("estimate", "llama-2-7b", "--torchtitan-config", str(path))
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
