"""The step timeline and the peak, against the traced step of the real transformers model (MemTracker under
FakeTensorMode), plus the seed article's activation example, the GPU fit and the searches."""

import json

import pytest
from hypothesis import given, settings as hyp_settings, strategies as st

from scaled import SCALED
from trainmem.catalog import catalog_spec
from trainmem.estimate import DeviceOptions
from trainmem.stepmodel import estimate_model
from trainmem.hardware import GPUS, get_gpu
from trainmem.models import spec_from_config
from trainmem.planner import max_batch, max_seq
from trainmem.settings import make_settings


def test_seed_activation_example():
    """1*2048*4096*32*34*2 bytes: about 18.3 GB, 17.0 GiB (the seed article, section 5)."""
    est = estimate_model(catalog_spec("llama-2-7b"), make_settings(activation_k=34, batch=1, seq=2048))
    assert est.activation_bytes == 1 * 2048 * 4096 * 32 * 34 * 2 == 18_253_611_008
    assert round(est.activation_bytes / 2**30, 1) == 17.0
    assert any("k = 22.8" in note for note in est.notes)  # what the architecture model says instead


TRACED = [
    ("Llama-2-7B", dict(recipe="fp32", batch=2, seq=64)),
    ("Llama-3-8B", dict(recipe="mixed-bf16", batch=4, seq=256)),
    ("Llama-3-8B", dict(recipe="amp-bf16", batch=2, seq=64)),
    ("GPT-2", dict(recipe="amp-bf16", batch=2, seq=64)),
    ("Mixtral-8x7B", dict(recipe="mixed-bf16", batch=2, seq=64)),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, kw", TRACED, ids=[f"{f}-{kw['recipe']}" for f, kw in TRACED])
def test_phases_match_the_traced_step(family, kw):
    pytest.importorskip("transformers")
    from trainmem.trace import trace_step

    cfg = SCALED[family]
    s = make_settings(dropout=0.0, **kw)
    traced = trace_step(cfg, s, spec_from_config(cfg), round_to_cuda=False)
    est = estimate_model(spec_from_config(cfg), s)
    assert [p.name for p in est.phases] == [p.name for p in traced.phases]
    for e, t in zip(est.phases, traced.phases):
        assert e.allocated_bytes == pytest.approx(t.allocated_bytes, rel=0.05), e.name
    assert est.peak.allocated_bytes == pytest.approx(traced.peak.allocated_bytes, rel=0.03)


def test_reserved_device_and_required_are_ordered_and_documented_defaults():
    est = estimate_model(catalog_spec("llama-3-8b"), make_settings(batch=2, seq=4096))
    pk = est.peak
    assert pk.allocated_bytes < pk.reserved_bytes < pk.device_bytes < pk.required_bytes
    assert pk.device_bytes - pk.reserved_bytes == 768 * 2**20
    assert pk.required_bytes == int(pk.device_bytes * 1.25)


def test_fit_table_agrees_with_required_bytes():
    est = estimate_model(catalog_spec("llama-3.2-1b"), make_settings(recipe="mixed-bf16", batch=4, seq=2048))
    for name, fits in est.fit_table().items():
        assert fits == (est.peak.required_bytes <= GPUS[name].memory_bytes)
    assert est.fit_table()["H200"] and not est.fit_table()["T4"]


def test_gpu_names():
    assert get_gpu("h100").name == "H100-80GB"
    assert get_gpu("A100_80GB").name == "A100-80GB"
    with pytest.raises(Exception, match="unknown GPU 'A100'"):
        get_gpu("A100")


def test_max_batch_and_seq_are_exact_boundaries():
    from dataclasses import replace

    spec, gpu, dev = catalog_spec("llama-3.2-1b"), get_gpu("A100-80GB"), DeviceOptions()
    s = make_settings(recipe="mixed-bf16", seq=2048)
    b = max_batch(spec, s, gpu, dev)
    assert b >= 1
    assert estimate_model(spec, replace(s, batch=b), dev).fits(gpu)
    assert not estimate_model(spec, replace(s, batch=b + 1), dev).fits(gpu)
    s1 = make_settings(recipe="mixed-bf16", batch=1)
    n = max_seq(spec, s1, gpu, dev)
    assert estimate_model(spec, replace(s1, seq=n), dev).fits(gpu)
    assert not estimate_model(spec, replace(s1, seq=n + 1), dev).fits(gpu)


def test_checkpointing_and_chunked_loss_lower_the_forward_peak():
    spec = catalog_spec("llama-3-8b")
    forward = lambda **kw: next(p for p in estimate_model(spec, make_settings(seq=8192, **kw)).phases
                                if p.name == "forward").allocated_bytes
    assert forward(checkpointing="full") < forward()
    assert forward(loss="chunked") < forward()


def test_gradient_accumulation_keeps_gradients_through_forward():
    spec = catalog_spec("llama-3.2-1b")
    one = estimate_model(spec, make_settings(grad_accum=1)).phases[1]
    four = estimate_model(spec, make_settings(grad_accum=4)).phases[1]
    assert one.gradients == 0 and four.gradients == estimate_model(spec).component("gradients").bytes


@hyp_settings(max_examples=30, deadline=None)
@given(model=st.sampled_from(["gpt2", "llama-3.2-1b", "qwen2.5-0.5b", "mixtral-8x7b", "gemma-2-9b"]),
       batch=st.integers(1, 16), seq=st.integers(1, 8192), grow=st.sampled_from(["batch", "seq"]),
       recipe=st.sampled_from(["fp32", "amp-bf16", "mixed-bf16", "pure-bf16"]),
       ckpt=st.sampled_from(["none", "full"]), attention=st.sampled_from(["sdpa", "eager"]))
def test_peak_never_decreases_when_batch_or_sequence_grow(model, batch, seq, grow, recipe, ckpt, attention):
    spec = catalog_spec(model)
    s = dict(recipe=recipe, batch=batch, seq=seq, checkpointing=ckpt, attention=attention)
    a = estimate_model(spec, make_settings(**s))
    s[grow] += 1
    b = estimate_model(spec, make_settings(**s))
    assert b.peak.allocated_bytes >= a.peak.allocated_bytes
    assert b.activation_bytes >= a.activation_bytes
    assert all(v >= 0 for p in a.phases for v in p.by_category().values())


def test_estimate_json_has_the_issue_fields(run_cli):
    code, out, err = run_cli("estimate", "llama-2-7b", "--batch", "2", "--seq", "1024", "--gpu", "H100-80GB",
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert isinstance(doc["activations"]["bytes"], int) and doc["activations"]["bytes"] > 0
    assert [p["name"] for p in doc["phases"]] == ["load", "forward", "backward", "optimizer", "between_steps"]
    assert doc["peak"]["phase"] in {p["name"] for p in doc["phases"]}
    assert max(p["allocated_bytes"] for p in doc["phases"]) == doc["peak"]["allocated_bytes"]
    assert doc["peak"]["allocated_bytes"] < doc["peak"]["reserved_bytes"] < doc["peak"]["device_bytes"]
    assert set(doc["fits"]) >= {"RTX-3090", "RTX-4090", "RTX-5090", "A10G", "L4", "L40S", "A100-40GB", "A100-80GB",
                                "H100-80GB", "H200", "B200", "MI300X"}
    assert doc["gpu"]["name"] == "H100-80GB" and doc["gpu"]["fits"] == doc["fits"]["H100-80GB"]


def test_max_batch_cli_and_sweep_cli(run_cli):
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "--gpu", "A100-80GB", "--max-batch", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["max_batch"] >= 1 and doc["settings"]["batch"] == doc["max_batch"] and doc["gpu"]["fits"]
    code, out, _ = run_cli("sweep", "gpt2", "--batch", "1,2", "--seq", "128,256", "--json")
    rows = json.loads(out)["sweep"]
    assert code == 0 and [(r["settings"]["batch"], r["settings"]["seq"]) for r in rows] == [
        (1, 128), (1, 256), (2, 128), (2, 256)]
    code, out, _ = run_cli("sweep", "gpt2", "--batch", "1,2", "--seq", "128", "--gpu", "T4")
    assert code == 0 and "fits T4" in out


def test_timeline_reads_term_kinds_and_parameter_roles_never_names(monkeypatch):
    """Relabel every activation term and parameter tensor the timeline sees: no candidate moment of any phase may
    change."""
    import dataclasses
    import itertools

    from trainmem import models
    from trainmem.activations import Term, estimate_activations
    from trainmem.catalog import catalog_config
    from trainmem.estimate import static_components
    from trainmem.models import spec_from_config
    from trainmem.optimizers import get_optimizer
    from trainmem.recipes import get_recipe
    from trainmem.settings import make_settings
    from trainmem.timeline import step_candidates

    counter = itertools.count()

    def relabel(obj):
        if isinstance(obj, Term):
            return dataclasses.replace(obj, name=f"label {next(counter)}")
        if isinstance(obj, tuple):
            return tuple(relabel(x) for x in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, models.Layer):
            return dataclasses.replace(obj, **{f.name: relabel(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                               if f.init})
        return obj

    names = ["gpt2", "gemma-2-9b", "qwen1.5-moe-a2.7b", "deepseek-v3", "llama-3.2-1b", "falcon-7b", "opt-1.3b"]
    cases = []
    for name, (r, c, a) in itertools.product(names, itertools.product(["fp32", "amp-bf16"], ["none", "full"],
                                                                        ["eager", "sdpa"])):
        settings = make_settings(recipe=r, checkpointing=c, attention=a, seq=256, batch=2)
        spec = spec_from_config(catalog_config(name))
        static = {x.name: x.bytes for x in static_components(spec, settings)}
        acts = estimate_activations(spec, get_recipe(r), settings)
        cases.append((name, settings, static, acts,
                      step_candidates(spec, static, acts, get_recipe(r), get_optimizer("adamw"), settings,
                                      every_layer=True)))
    original = models.ParamTensor
    monkeypatch.setattr(models, "ParamTensor", lambda name, *args: original(f"p{next(counter)}", *args))
    for name, settings, static, acts, before in cases:
        spec = spec_from_config(catalog_config(name))
        assert spec.param_groups[0].tensors[0].name.startswith("p")
        relabelled = relabel(acts)
        assert relabelled.layers[0].terms[0].name.startswith("label")
        # (every layer: relabelled, alike layers are no longer alike objects, which _interior_layers looks for)
        after = step_candidates(spec, static, relabelled, get_recipe(settings.recipe), get_optimizer("adamw"), settings,
                                every_layer=True)
        assert after == before, (name, settings)


def test_optimizer_in_backward_leaves_no_gradients_waiting_and_nothing_for_step():
    import trainmem

    kwargs = dict(recipe="pure-bf16-bf16states", batch=1, seq=1024)
    plain = trainmem.estimate("llama-3.2-3b", **kwargs)
    stepped = trainmem.estimate("llama-3.2-3b", optimizer_in_backward=True, **kwargs)
    assert stepped.static_bytes == plain.static_bytes
    phase = {p.name: p for p in stepped.phases}
    assert phase["optimizer"].gradients == 0 and phase["optimizer"].temporaries == 0
    assert phase["optimizer"].allocated_bytes == phase["load"].allocated_bytes
    assert stepped.peak.allocated_bytes < plain.peak.allocated_bytes
    assert "optimizer_in_backward" not in plain.settings.as_dict()
    assert stepped.settings.as_dict()["optimizer_in_backward"] is True


@pytest.mark.parametrize("kwargs, says", [
    (dict(recipe="mixed-bf16"), "without fp32 master weights"), (dict(recipe="fp32", grad_accum=2), "--grad-accum"),
    (dict(recipe="fp32", optimizer_in_backward="yes"), "true or false"),
])
def test_optimizer_in_backward_refusals(kwargs, says):
    from trainmem.errors import ConfigError
    from trainmem.settings import make_settings

    with pytest.raises(ConfigError, match=says):
        make_settings(**{"optimizer_in_backward": True, **kwargs})


@pytest.mark.slow
@pytest.mark.parametrize("name, recipe, checkpointing, optimizer", [
    ("llama-3.2-1b", "pure-bf16-bf16states", "none", "adamw"), ("llama-3.2-1b", "fp32", "full", "adamw"),
    ("qwen2.5-0.5b", "pure-bf16", "none", "adamw"), ("gpt2", "amp-bf16", "none", "adamw"),
    ("llama-2-7b", "pure-bf16-bf16states", "full", "sgd"),
])
def test_optimizer_in_backward_matches_its_trace(name, recipe, checkpointing, optimizer):
    """One optimizer per parameter stepped by its post-accumulate hook (torchtune's optimizer_in_bwd), traced."""
    from trainmem.catalog import catalog_config
    from trainmem.stepmodel import estimate_model
    from trainmem.models import spec_from_config
    from trainmem.settings import make_settings
    from trainmem.trace import trace_step

    config = dict(catalog_config(name))
    config.update({k: 2 for k in ("n_layer", "num_hidden_layers") if k in config or k == "num_hidden_layers"})
    settings = make_settings(recipe=recipe, batch=2, seq=256, checkpointing=checkpointing, optimizer=optimizer,
                             optimizer_impl="foreach", dropout=0.0, optimizer_in_backward=True)
    spec = spec_from_config(config)
    est = estimate_model(spec, settings)
    traced = trace_step(config, settings, spec)
    for e, t in zip(est.phases, traced.phases):
        assert abs(e.allocated_bytes - t.allocated_bytes) <= 0.005 * t.allocated_bytes, (e, t)


@hyp_settings(max_examples=20, deadline=None, derandomize=True)
@given(model=st.sampled_from(["llama-3-8b", "mixtral-8x7b", "gemma-2-9b", "qwen1.5-moe-a2.7b", "deepseek-v3",
                              "falcon-7b", "gpt2", "phi-3-mini-4k", "gemma-3-1b", "bloom-560m"]),
       recipe=st.sampled_from(["fp32", "amp-bf16", "mixed-bf16", "pure-bf16-bf16states"]),
       checkpointing=st.sampled_from(["none", "selective", "full"]),
       engine=st.sampled_from([None, "ddp", "fsdp", "zero3"]),
       batch=st.integers(1, 6), seq=st.sampled_from([128, 1000, 4096]), stepped=st.booleans(),
       lora=st.sampled_from([None, ("q", "v"), ("all-linear",)]))
def test_pruned_walk_and_peaks_only_give_the_every_layer_peaks(model, recipe, checkpointing, engine, batch, seq,
                                                                stepped, lora):
    """The backward walk skips the layers inside a stretch of alike ones (timeline._interior_layers) and an
    evaluation builds only each phase's peak (peaks_only): both must give byte for byte the peaks of the plain
    every-layer walk, moment names included, for every engine's buffers and shards."""
    from trainmem.sharding import Parallel
    from trainmem.stepmodel import compile_step
    from trainmem.timeline import forward_floor, peak_of, step_candidates

    if checkpointing == "selective" and recipe == "amp-bf16":
        checkpointing = "full"  # (refused: selective is modelled without autocast)
    stepped = stepped and recipe in ("fp32", "amp-bf16", "pure-bf16-bf16states")
    settings = make_settings(recipe=recipe, checkpointing=checkpointing, optimizer_in_backward=stepped)
    parallel = {None: None, "ddp": Parallel(gpus=8), "fsdp": Parallel(gpus=8, fsdp="full"),
                "zero3": Parallel(gpus=8, zero=3)}[engine]
    from trainmem.activations import lora_layers_modelled
    from trainmem.lora import FineTune, LoraOptions

    spec = catalog_spec(model)
    finetune = None
    if lora and engine is None and lora_layers_modelled(spec) and checkpointing != "selective":
        finetune = FineTune(LoraOptions(8, targets=lora))
    step = compile_step(spec, settings, None, parallel, finetune)
    at = step.settings_at(batch, seq)
    acts = step.activations(at)
    args = (step.spec, step._static_bytes, acts, step.recipe, step.optimizer, at, step.rank, finetune)
    every = step_candidates(*args, every_layer=True)
    pruned = step_candidates(*args)
    peaks = [peak_of(c) for c in every]
    assert [peak_of(c) for c in pruned] == peaks
    assert [peak_of(c) for c in step_candidates(*args, peaks_only=True)] == peaks
    assert step.phases(batch, seq) == tuple(peaks)
    if step.spec.num_layers > 8 and checkpointing != "selective":  # (the pruning is there to be tested)
        assert len(pruned[2]) < len(every[2])
    # the search's lower bound is one
    assert forward_floor(step._static_bytes, acts, step.recipe, at, step.rank) <= max(p.allocated_bytes for p in peaks)
