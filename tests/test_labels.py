"""Names are for people: rewriting every display label (a saved tensor's Term name, a parameter group's name) must
not move a single byte of any estimate. The timeline and the formulas find tensors by their typed fields (``kind``,
``module``, ``ParamGroup.is_layer``), never by what a label says."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from trainmem import activations, models, stepmodel
from trainmem.errors import ConfigError
from trainmem.stepmodel import estimate_model
from trainmem.lora import FineTune, LoraOptions
from trainmem.models import spec_from_config
from trainmem.settings import make_settings
from trainmem.validate import random_case

REWRITES = {
    "prefix": lambda name: "label: " + name,
    "brackets": lambda name: name.replace("(", "[").replace(")", "]"),
    "reversed": lambda name: name[::-1],
    "upper": lambda name: name.upper(),
}


def _phases(spec, training, finetune=None) -> dict:
    stepmodel._ACTIVATIONS.clear()  # (computed anew: the cache would answer with the other labels' activations)
    return {p.name: p.by_category() for p in estimate_model(spec, training, finetune=finetune).phases}


def _patch_labels(patch: pytest.MonkeyPatch, rewrite) -> None:
    """Make every Term and ParamGroup built from now on carry ``rewrite(name)`` as its label."""
    for cls in (activations.Term, models.ParamGroup):
        original = cls.__init__

        def init(self, name, *args, _original=original, **kwargs):
            _original(self, rewrite(name), *args, **kwargs)

        patch.setattr(cls, "__init__", init)


@pytest.fixture
def relabel(monkeypatch):
    return lambda rewrite: _patch_labels(monkeypatch, rewrite)


def _draw_case(data):
    config, training = random_case(lambda label, options: data.draw(st.sampled_from(tuple(options)), label=label))
    return config, make_settings(**training)


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.data(), rewrite=st.sampled_from(sorted(REWRITES)))
def test_rewritten_labels_leave_every_phase_unchanged(data, rewrite):
    config, training = _draw_case(data)
    try:
        if training.checkpointing == "none" and data.draw(st.booleans(), label="selective"):
            training = dataclasses.replace(training, checkpointing="selective")
        plain = _phases(spec_from_config(config), training)
    except ConfigError:
        return  # (a set-up the estimate refuses, e.g. selective checkpointing under autocast)
    with pytest.MonkeyPatch.context() as patch:  # (per example: the fixture's patch would outlive it)
        _patch_labels(patch, REWRITES[rewrite])
        spec = spec_from_config(config)
        # the rewrite reached the labels (the test would prove nothing otherwise)
        assert all(g.name.startswith("label: ") for g in spec.param_groups) or rewrite != "prefix"
        relabelled = _phases(spec, training)
    assert relabelled == plain


LLAMA = dict(model_type="llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
             intermediate_size=688, vocab_size=4096, tie_word_embeddings=False)


@pytest.mark.parametrize("rewrite", sorted(REWRITES))
@pytest.mark.parametrize("targets, dora, dropout, checkpointing, recipe", [
    (("q", "v"), False, 0.0, "none", "pure-bf16-bf16states"),
    (("all-linear",), False, 0.0, "full", "amp-bf16"),
    (("q", "k", "v", "o"), False, 0.1, "full", "amp-bf16"),
    (("all-linear",), True, 0.0, "full", "fp32"),
])
def test_rewritten_labels_leave_lora_estimates_unchanged(relabel, rewrite, targets, dora, dropout, checkpointing,
                                                         recipe):
    training = make_settings(recipe=recipe, checkpointing=checkpointing, batch=2, seq=256)
    finetune = FineTune(LoraOptions(8, None, targets, "auto", dropout, dora, ()), None, False)
    plain = _phases(spec_from_config(LLAMA), training, finetune)
    relabel(REWRITES[rewrite])
    assert _phases(spec_from_config(LLAMA), training, finetune) == plain


def test_the_patch_reaches_the_labels(relabel):
    relabel(REWRITES["prefix"])
    spec = spec_from_config(LLAMA)
    assert spec.param_groups and all(g.name.startswith("label: ") for g in spec.param_groups)
    assert activations.Term("x", 1.0).name == "label: x"
    assert dataclasses.is_dataclass(activations.Term)


@pytest.mark.parametrize("rewrite", sorted(REWRITES))
@pytest.mark.parametrize("layout", [
    dict(gpus=8, fsdp="full"), dict(gpus=8, zero=3), dict(gpus=4, zero=2, offload="optimizer"),
    dict(gpus=12, tp=2, sp=True, pp=3, zero=1), dict(gpus=2, fsdp="full", optimizer="muon"),
    dict(optimizer="muon"), dict(optimizer="adamw-8bit"),
])
def test_rewritten_labels_leave_sharded_and_optimizer_estimates_unchanged(relabel, rewrite, layout):
    from trainmem.request import estimate

    options = dict(recipe="mixed-bf16", batch=2, seq=512, **layout)

    def phases():
        stepmodel._ACTIVATIONS.clear()
        return {p.name: p.by_category() for p in estimate(spec_from_config(LLAMA), **options).phases}

    plain = phases()
    relabel(REWRITES[rewrite])
    assert phases() == plain


def _numbers(document, out: list, path: str = "") -> list:
    """Every number of a command's JSON document (a bool is not one), the search's wall time left out."""
    if isinstance(document, dict):
        for key, value in document.items():
            if f"{path}.{key}" != ".search.seconds":
                _numbers(value, out, f"{path}.{key}")
    elif isinstance(document, list):
        for value in document:
            _numbers(value, out, path + "[]")
    elif isinstance(document, (int, float)) and not isinstance(document, bool):
        out.append(document)
    return out


def _relabel_plan_engines(patch: pytest.MonkeyPatch, rewrite) -> None:
    """The plan's engine labels ("ZeRO-1", "FSDP2 full") rewritten where the search takes them from."""
    from trainmem import plan

    for name in ("_engines", "_model_parallel_engines"):
        original = getattr(plan, name)

        def engines(*args, _original=original, **kwargs):
            return [(rewrite(label), *rest) for label, *rest in _original(*args, **kwargs)]

        patch.setattr(plan, name, engines)


# Every command that answers numbers without a trace, with the switches that build their own terms and groups:
# LoRA, DoRA, QLoRA, compile, op-level checkpointing, TP/SP/PP, EP, FSDP2, ZeRO, the sweep and the plan.
COMMANDS = [
    "estimate llama-3-8b --checkpointing full --loss chunked",
    "estimate llama-3-8b --lora 8 --checkpointing full",
    "estimate gpt2 --lora 8 --dora --attention eager",
    "estimate llama-3-8b --qlora --lora 16 --lora-targets all-linear",
    "estimate llama-3-8b --compile --checkpointing op",
    "estimate llama-3-8b --gpus 8 --tp 2 --sp --pp 2 --zero 1",
    "estimate llama-3-8b --gpus 8 --fsdp full --lora 16 --lora-targets all-linear",
    "estimate mixtral-8x7b --gpus 8 --ep 8 --fsdp full",
    "sweep llama-2-7b --batch 1,2 --seq 1024,2048",
    "plan llama-3-8b --gpu H100-80GB --gpus 16 --seq 2048 --global-batch 32",
    "plan llama-3-8b --gpu A100-40GB --gpus 4 --lora 8",
]


@pytest.mark.parametrize("rewrite", ["prefix", "reversed"])
def test_rewritten_labels_leave_every_commands_numbers_unchanged(rewrite):
    """The commands' JSON documents, run in process with the labels as they are and rewritten: the same numbers
    (labels are text in them, so the documents' strings differ, and a label-keyed table may order its rows by
    label: the numbers are compared as one sorted list). A parameter's name is not a label: it is the module path
    peft's ``target_modules`` match, as the real model's is."""
    import json

    from click.testing import CliRunner

    from trainmem import plan, timeline
    from trainmem.cli import app

    def run(command: str) -> list:
        stepmodel._ACTIVATIONS.clear()  # (the caches would answer with the other labels' numbers)
        timeline._MEMO.clear()
        plan._SEARCH_RATIOS.clear()
        result = CliRunner().invoke(app, command.split() + ["--json"])
        assert result.exit_code == 0, (command, result.output[-2000:])
        return sorted(_numbers(json.loads(result.output), []))

    plain = [run(command) for command in COMMANDS]
    with pytest.MonkeyPatch.context() as patch:
        _patch_labels(patch, REWRITES[rewrite])
        _relabel_plan_engines(patch, REWRITES[rewrite])
        assert plan._engines(8, 8)[1][0] == REWRITES[rewrite]("ZeRO-1")  # (the rewrite reached the plan's labels)
        relabelled = [run(command) for command in COMMANDS]
    for command, before, after in zip(COMMANDS, plain, relabelled):
        assert after == before, command
