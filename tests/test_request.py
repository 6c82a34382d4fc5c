"""One request API: the CLI and the Python API validate through request.make_request, refuse the same input with
the same line, and answer the same questions with the same numbers."""

import json
import math
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import trainmem
from trainmem.errors import TrainmemError

from conftest import CONFIGS

# (API keywords, CLI arguments) asking the same thing
REFUSED = [
    (dict(model="gpt2", headroom=0.5), ["gpt2", "--headroom", "0.5"]),
    (dict(model="gpt2", headroom=math.nan), ["gpt2", "--headroom", "nan"]),
    (dict(model="gpt2", fragmentation=1.0), ["gpt2", "--fragmentation", "1.0"]),
    (dict(model="gpt2", cuda_overhead=math.inf), ["gpt2", "--cuda-overhead", "inf"]),
    (dict(model="gpt2", cuda_overhead=-1), ["gpt2", "--cuda-overhead", "-1"]),
    (dict(model="gpt2", gpu=" "), ["gpt2", "--gpu", " "]),
    (dict(model="gpt2", gpu="B200-3000GB"), ["gpt2", "--gpu", "B200-3000GB"]),
    (dict(params="inf"), ["--params", "inf"]),
    (dict(params="7B", optimizer="adafactor"), ["--params", "7B", "--optimizer", "adafactor"]),
    (dict(), []),
    (dict(model="gpt2", params="7B"), ["gpt2", "--params", "7B"]),
    (dict(model="gpt2", batch=0), ["gpt2", "--batch", "0"]),
    (dict(model="gpt2", dropout=1.5), ["gpt2", "--dropout", "1.5"]),
    (dict(model="gpt2", recipe="fp64"), ["gpt2", "--recipe", "fp64"]),
    (dict(model="gpt2", checkpointing="selective", recipe="amp-bf16"),
     ["gpt2", "--checkpointing", "selective", "--recipe", "amp-bf16"]),
    (dict(model="llama-2-8b"), ["llama-2-8b"]),
    (dict(model=""), [""]),
]


@pytest.mark.parametrize("kwargs, args", REFUSED)
def test_the_api_and_the_cli_refuse_alike(run_cli, kwargs, args):
    with pytest.raises(TrainmemError) as refused:
        trainmem.estimate(**kwargs)
    code, out, err = run_cli("estimate", *args)
    assert code == 2 and not out and err.count("\n") == 1
    message = err.removeprefix("trainmem: error: ").strip()
    assert message.lstrip("-") == str(refused.value), (message, str(refused.value))


@pytest.mark.parametrize("kwargs", [
    dict(model=5), dict(model=b"gpt2"), dict(model="gpt2", recipe=5), dict(model="gpt2", dropout="0.1"),
    dict(model="gpt2", activation_k="3"), dict(model="gpt2", batch=2.0), dict(model="gpt2", batch=True),
    dict(model="gpt2", gpu=80), dict(params=True), dict(params=[7]), dict(model="gpt2", headroom="1.2"),
    dict(model="gpt2", tokens=5),
])
def test_api_arguments_of_the_wrong_type_are_refused_in_one_line(kwargs):
    with pytest.raises(TrainmemError) as refused:
        trainmem.estimate(**kwargs)
    assert "\n" not in str(refused.value)


def test_the_api_answers_what_the_cli_answers(run_cli):
    est = trainmem.estimate("llama-2-7b", recipe="amp-bf16", batch=2, seq=1024, gpu="A100-80GB",
                            checkpointing="full")
    code, out, _ = run_cli("estimate", "llama-2-7b", "--recipe", "amp-bf16", "--batch", "2", "--seq", "1024",
                           "--gpu", "A100-80GB", "--checkpointing", "full", "--json")
    doc = json.loads(out)
    assert code == 0 and est.peak.required_bytes == doc["peak"]["required_bytes"]
    assert est.fits() == doc["gpu"]["fits"]

    best = trainmem.max_batch("llama-3.2-1b", "A100-80GB", seq=2048)
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "--gpu", "A100-80GB", "--max-batch", "--json")
    assert best == json.loads(out)["max_batch"] > 1
    assert trainmem.estimate("llama-3.2-1b", batch=best, gpu="A100-80GB").fits()
    assert not trainmem.estimate("llama-3.2-1b", batch=best + 1, gpu="A100-80GB").fits()
    longest = trainmem.max_seq("gpt2", "A100-80GB", batch=64)
    code, out, _ = run_cli("estimate", "gpt2", "--gpu", "A100-80GB", "--batch", "64", "--max-seq", "--json")
    assert longest == json.loads(out)["max_seq"]

    grid = trainmem.sweep("gpt2", [1, 4], [512, 1024], recipe="fp32", gpu="T4")
    code, out, _ = run_cli("sweep", "gpt2", "--batch", "1,4", "--seq", "512,1024", "--recipe", "fp32", "--json")
    assert [e.peak.allocated_bytes for e in grid] == [d["peak"]["allocated_bytes"] for d in json.loads(out)["sweep"]]
    assert [e.fits() for e in grid] == [e.fits(trainmem.hardware.GPUS["T4"]) for e in grid]


def test_params_paths_and_specs_are_models():
    assert trainmem.estimate(params=7e9, recipe="pure-bf16").static_bytes == 12 * 7_000_000_000
    assert trainmem.estimate(params="7B").model.num_parameters == 7_000_000_000
    path = Path(CONFIGS) / "gpt2.json"
    assert trainmem.resolve_model(path).num_parameters == trainmem.resolve_model("gpt2").num_parameters
    spec = trainmem.resolve_model("gpt2")
    assert trainmem.estimate(spec).peak == trainmem.estimate("gpt2").peak
    with pytest.raises(TrainmemError, match="not both"):
        trainmem.estimate("gpt2", device=trainmem.estimate("gpt2").device, headroom=1.5)
    with pytest.raises(TrainmemError, match="needs a GPU"):
        trainmem.estimate("gpt2").fits()


HOSTILE = ["", " ", "0", "-1", "1.5", "nan", "inf", "-inf", "1e308", "99999999999999999999", "abc", "7B", "0x10",
           "1,2", "None", "\u00e9", "sdpa", "full", "fp32", "adamw", "8", "q,v", "all-linear", "nf4", "3"]
FLAGS = ["--batch", "--seq", "--grad-accum", "--dropout", "--headroom", "--fragmentation", "--cuda-overhead",
         "--activation-k", "--gpu", "--recipe", "--optimizer", "--optimizer-impl", "--attention", "--checkpointing",
         "--loss", "--units", "--gpus", "--zero", "--fsdp", "--offload", "--lora", "--lora-targets", "--base-quant",
         "--adapter-dtype", "--lora-alpha"]


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


@settings(max_examples=120, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # run_cli reads and resets its capture per call
@given(st.sampled_from(["estimate", "sweep"]), st.sampled_from(["gpt2", "llama-2-7b", "mixtral-8x7b", "--params"]),
       st.lists(st.tuples(st.sampled_from(FLAGS), st.sampled_from(HOSTILE)), max_size=4))
def test_random_flag_values_give_an_answer_or_one_line(run_cli, command, model, flags):
    args = [command, *([model, "7B"] if model == "--params" else [model])]
    for flag, value in flags:
        args += [flag, value]
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)  # a hang, not a speed bound: refusals take milliseconds
    try:
        code, out, err = run_cli(*args)
    except _Hang:
        pytest.fail(f"hung: trainmem {' '.join(args)}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code in (0, 1, 2), (args, err)
    assert "Traceback" not in err
    if code == 2:
        assert err.count("\n") == 1 and not out, (args, err)
