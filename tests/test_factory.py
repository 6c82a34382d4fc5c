"""trainmem trace --factory: a model that is not a transformers one, traced from the function that builds it, and
its step estimated at other batch sizes and sequence lengths from four recorded sizes, against direct traces."""

import json

import pytest

pytest.importorskip("torch")

import factory_models  # noqa: E402

from trainmem import record_module, trace_module  # noqa: E402
from trainmem.settings import make_settings  # noqa: E402


def test_a_module_of_ones_own_is_traced_with_its_parameters_and_adam_states():
    """fp32 AdamW: the parameters, their gradients at the step, two fp32 states each and torch's one-element
    ``step`` tensor per parameter (each rounded to 512 bytes, as the CUDA caching allocator rounds), against the
    module's own tensors."""
    result = trace_module(factory_models.build_model, make_settings(recipe="fp32", batch=2, seq=16),
                          factory_models.make_batch)
    model = factory_models.build_model()
    stored = sum(-(-p.numel() * 4 // 512) * 512 for p in model.parameters())
    load, forward, backward, step, after = result.phases
    steps = 512 * len(list(model.parameters()))
    assert load.parameters == stored and load.optimizer_states == 2 * stored + steps and step.gradients == stored
    assert forward.activations > 0 and after.gradients == 0


def test_the_recorded_program_matches_direct_traces_at_other_sizes():
    """Recorded at 1 x 64, 1 x 128, 1 x 192 and 2 x 64; estimated at 3 x 320, where the eager scores (b x s x s)
    are 25 times those of the first size and the peak of backward has moved from its end to its start."""
    settings = make_settings(recipe="fp32", batch=1, seq=64)
    program = record_module(factory_models.build_wide_model, settings, factory_models.make_batch)
    direct = trace_module(factory_models.build_wide_model, settings.at(3, 320), factory_models.make_batch)
    for fitted, traced in zip(program.phases(3, 320), direct.phases, strict=True):
        assert abs(fitted.allocated_bytes - traced.allocated_bytes) <= 0.01 * traced.allocated_bytes, (fitted, traced)


def test_trace_factory_on_the_command_line(run_cli):
    code, out, err = run_cli("trace", "--factory", "factory_models:build_model", "--batch-fn",
                             "factory_models:make_batch", "--seq", "16", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["factory"] == "factory_models:build_model" and doc["settings"]["recipe"] == "fp32"
    assert {p["name"] for p in doc["phases"]} == {"load", "forward", "backward", "optimizer", "between_steps"}


@pytest.mark.parametrize("args, message", [
    (("--factory", "nope"), "--factory 'nope' is not pkg.module:function"),
    (("--factory", "no_such_module_here:build"), "cannot import module 'no_such_module_here'"),
    (("--factory", "factory_models:missing"), "module 'factory_models' has no attribute 'missing'"),
    (("--factory", "factory_models:NOT_A_FUNCTION"), "'NOT_A_FUNCTION' is a int, not a function"),
    (("gpt2", "--factory", "factory_models:build_model"), "not both"),
    (("--factory", "factory_models:build_model", "--gpus", "2"), "--gpus are for transformers models"),
    (("--factory", "factory_models:build_model", "--recipe", "mixed-bf16"), "trace --factory runs the recipes"),
    (("--batch-fn", "factory_models:make_batch"), "go with --factory"),
])
def test_a_bad_factory_is_one_line(run_cli, args, message):
    code, out, err = run_cli("trace", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
