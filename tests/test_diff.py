"""trainmem diff: the traced live tensors at each phase's peak, matched with the estimate's moment by owner.

A tiny fp32 Llama (2 layers, 1 x 16 tokens, raw sizes) whose estimate is exact tensor by tensor but for a few bytes
the trace knows and the estimate does not model (the rotary inv_freq buffer, Adam's step scalars, the loss's scalar
locals) and the input ids, which the estimate counts and the trace's trackers do not see (made before them)."""

import json
from collections import OrderedDict

import pytest

torch = pytest.importorskip("torch")

from tiny_configs import TINY_CONFIGS  # noqa: E402

from trainmem import activations, stepmodel  # noqa: E402
from trainmem.diff import diff_of, render, to_dict  # noqa: E402
from trainmem.owners import Owner, OwnerKind  # noqa: E402
from trainmem.stepmodel import estimate_model  # noqa: E402
from trainmem.tracelive import live_sets  # noqa: E402
from trainmem.validate import make_settings, spec_from_config  # noqa: E402

CONFIG = dict(TINY_CONFIGS["llama"], num_hidden_layers=2)
SETTINGS = make_settings(recipe="fp32", checkpointing="none", batch=1, seq=16, optimizer="adamw", dropout=0.0,
                         attention="sdpa")
FEW_BYTES = 128
"""The largest group difference of the exact case: the 16 int64 input ids (see the module's docstring)."""


@pytest.fixture(scope="module")
def traced():
    spec = spec_from_config(CONFIG)
    result, live = live_sets(CONFIG, SETTINGS, spec)
    return spec, result, live


def test_the_recorder_changes_no_traced_number_and_its_tensors_sum_to_each_phase(traced):
    from trainmem.trace import trace_step

    spec, result, live = traced
    assert result.phases == trace_step(CONFIG, SETTINGS, spec, round_to_cuda=False).phases
    for phase in result.phases:
        if phase.name in live:
            for category, nbytes in phase.by_category().items():
                assert sum(t.nbytes for t in live[phase.name] if t.category == category) == nbytes, (phase.name,
                                                                                                     category)


def _rows(diffs):
    return {(d.phase, r.category, r.owner): r for d in diffs for r in d.rows}


def test_an_exact_estimate_differs_by_a_few_bytes_in_every_group(traced):
    spec, result, live = traced
    est = estimate_model(spec, SETTINGS)
    diffs = diff_of(result.phases, live, spec, SETTINGS, est)
    traced_phases, estimated = {p.name: p for p in result.phases}, {p.name: p for p in est.phases}
    for d in diffs:
        # the total line is the phase's error as validate reports it: estimate less trace
        assert d.difference == estimated[d.phase].allocated_bytes - traced_phases[d.phase].allocated_bytes
        assert sum(r.difference for r in d.rows) == d.difference
        assert all(abs(r.difference) <= FEW_BYTES for r in d.rows), [r for r in d.rows if r.difference]
    rows = _rows(diffs)
    for layer in (0, 1):  # forward's activations are matched layer by layer, exactly
        row = rows[("forward", "activations", Owner(OwnerKind.LAYER, layer))]
        assert row.traced > 0 and row.difference == 0
    assert rows[("optimizer", "gradients", Owner(OwnerKind.HEAD))].difference == 0
    # backward's peak is the embedding's backward (timeline: Phase.at): every other gradient is done, by its owner
    for owner in (Owner(OwnerKind.LAYER, 0), Owner(OwnerKind.LAYER, 1), Owner(OwnerKind.HEAD)):
        row = rows[("backward", "gradients", owner)]
        assert row.traced > 0 and row.difference == 0


def test_a_dropped_saved_tensor_is_a_lacks_row_of_its_bytes_at_its_layer(traced, monkeypatch):
    """The MLP's activation output (silu(gate), kept by the product's mul) left out of the operation model."""
    spec, result, live = traced
    before = _rows(diff_of(result.phases, live, spec, SETTINGS, estimate_model(spec, SETTINGS)))
    original = activations._mlp_terms

    def without_activation_output(mlp, p, fc1_bytes=None):
        terms = original(mlp, p, fc1_bytes)
        assert mlp.gated and len(terms) == 3  # gate and up outputs, act(gate), the product
        return [terms[0], terms[2]]

    monkeypatch.setattr(activations, "_mlp_terms", without_activation_output)
    monkeypatch.setattr(stepmodel, "_ACTIVATIONS", OrderedDict())  # (the estimates made before are cached)
    after = _rows(diff_of(result.phases, live, spec, SETTINGS, estimate_model(spec, SETTINGS)))
    silu_output = 4 * CONFIG["intermediate_size"] * SETTINGS.batch * SETTINGS.seq
    changed = {key: after[key].difference - before[key].difference for key in after
               if key[0] == "forward" and after[key].difference != before.get(key, after[key]).difference}
    assert changed == {("forward", "activations", Owner(OwnerKind.LAYER, 0)): -silu_output,
                       ("forward", "activations", Owner(OwnerKind.LAYER, 1)): -silu_output}
    assert after[("forward", "activations", Owner(OwnerKind.LAYER, 1))].verdict == "lacks"
    layer = [t for t in live["forward"] if t.owner == Owner(OwnerKind.LAYER, 1) and t.op == "silu"]
    assert [t.nbytes for t in layer] == [silu_output]  # the tensor the estimate lacks, as the trace saw it


def test_the_diff_command_prints_json_and_refuses_in_one_line(run_cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    code, out, err = run_cli("diff", str(path), "--recipe", "fp32", "--batch", "1", "--seq", "16", "--no-round",
                             "--dropout", "0", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["engine"] == "diff" and [p["phase"] for p in doc["phases"]] == ["forward", "backward", "optimizer"]
    for phase in doc["phases"]:
        assert phase["difference_bytes"] == phase["estimated_bytes"] - phase["traced_bytes"]
        assert sum(g["difference_bytes"] for g in phase["groups"]) == phase["difference_bytes"]
    for bad, word in ((("--gpus", "2", "--zero", "2"), "one process"), (("--compile",), "--compile"),
                      (("--gpu", "H100"), "--gpu"), (("--units", "parsecs"), "unit")):
        code, out, err = run_cli("diff", str(path), "--seq", "16", *bad)
        assert code == 2 and err.strip().count("\n") == 0 and word in err, (bad, err)
    jsonschema = pytest.importorskip("jsonschema")
    from trainmem.report import json_schema

    errors = list(jsonschema.Draft202012Validator(json_schema()).iter_errors(doc))
    assert not errors, [f"{list(e.path)}: {e.message[:200]}" for e in errors[:5]]


def test_the_json_names_owners_by_kind_and_layer_and_the_table_says_lacks(traced, capsys):
    from trainmem.plaintext import console

    spec, result, live = traced
    diffs = diff_of(result.phases, live, spec, SETTINGS, estimate_model(spec, SETTINGS))
    owners = {(g["owner"]["kind"], g["owner"]["layer"]) for p in to_dict(diffs) for g in p["groups"]}
    assert {("layer", 0), ("layer", 1), ("embedding", None), ("head", None), ("loss", None)} <= owners
    render(diffs, "KiB", console(160), every=True)
    out = capsys.readouterr().out
    assert "lacks" in out and "layer 1" in out and "total" in out and "KiB" in out
