"""Bad input, as a hostile user would type it: one line naming what is wrong, exit code 2, no traceback, no hang;
in the API the package's own error type (issue 10, "Every input checked once, at the edge of the library")."""

import json
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmem.errors import TrainmemError

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 100}


def _refused(run_cli, *args):
    code, out, err = run_cli("estimate", *args)
    assert code == 2, (code, out, err)
    assert err.startswith("trainmem: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("field, value, says", [
    ("hidden_size", 64.5, "must be an integer"),
    ("hidden_size", True, "must be an integer"),
    ("hidden_size", "64", "must be an integer"),
    ("hidden_size", float("nan"), "must be an integer"),
    ("vocab_size", 0, "positive"),
    ("num_hidden_layers", 10**7, "at most 10,000"),
    ("num_hidden_layers", 1e12, "must be an integer"),
])
def test_a_config_field_of_the_wrong_type_or_size(run_cli, tmp_path, field, value, says):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, field: value}))
    assert says in _refused(run_cli, str(path))


@pytest.mark.parametrize("content, says", [
    ("[1, 2]", "got an array"),
    ('"llama"', "got a string"),
    ('{"model_type": "gemma3", "text_config": null}', "text_config must be a JSON object"),
    ('{"model_type": "gemma3", "text_config": [1]}', "text_config must be a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (b"\xff\xfe{}", "not UTF-8"),
])
def test_a_config_file_that_is_not_a_config(run_cli, tmp_path, content, says):
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert says in _refused(run_cli, str(path))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
def test_a_fifo_or_a_device_is_not_read(run_cli, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in _refused(run_cli, str(fifo))  # reading it would block forever
    if os.path.exists("/dev/zero"):
        assert "not a regular file" in _refused(run_cli, "/dev/zero")  # reading it would never end


def test_a_config_file_over_the_size_limit(run_cli, tmp_path):
    from trainmem.models import CONFIG_SIZE_LIMIT

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "padding": "x" * CONFIG_SIZE_LIMIT}))
    assert "a config.json is at most" in _refused(run_cli, str(path))


@pytest.mark.parametrize("model, says", [("", "no model given"), ("x" * 300, "at most 255")])
def test_a_model_name_that_names_nothing(run_cli, model, says):
    assert says in _refused(run_cli, model)


@pytest.mark.parametrize("args", [
    ("--headroom", "nan"), ("--headroom", "inf"), ("--headroom", "1e308"), ("--headroom", "0.5"),
    ("--fragmentation", "nan"), ("--cuda-overhead", "inf"), ("--cuda-overhead", "nan"),
    ("--activation-k", "inf"), ("--activation-k", "nan"), ("--gpu", " "),
])
def test_a_flag_that_is_not_finite_or_in_range(run_cli, args):
    _refused(run_cli, "llama-2-7b", *args)


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e30"])
def test_params_that_are_not_a_size(run_cli, value):
    _refused(run_cli, "--params", value)


def test_the_api_refuses_what_the_cli_refuses():
    from trainmem.estimate import DeviceOptions

    for kwargs in ({"headroom": -1}, {"headroom": math.inf}, {"fragmentation": 1.0},
                   {"cuda_overhead_bytes": -1}, {"cuda_overhead_bytes": 1.5}):
        with pytest.raises(TrainmemError):
            DeviceOptions(**kwargs)


JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**13), st.floats(allow_nan=True),
                        st.text(max_size=5), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                                                   st.integers(), max_size=2))


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(st.sampled_from(["llama", "gpt2", "falcon", "mixtral", "deepseek_v3", "qwen2_moe", "bloom", "opt"]),
       st.dictionaries(st.sampled_from(["hidden_size", "n_embd", "num_attention_heads", "n_head", "num_hidden_layers",
                                        "n_layer", "vocab_size", "intermediate_size", "num_key_value_heads",
                                        "head_dim", "num_local_experts", "num_experts_per_tok", "n_routed_experts",
                                        "text_config", "tie_word_embeddings", "rope_scaling", "sliding_window"]),
                       JSON_VALUES, max_size=6))
def test_random_malformed_configs_raise_only_the_packages_errors(model_type, fields):
    from trainmem.estimate import estimate_model
    from trainmem.models import spec_from_config
    from trainmem.settings import make_settings

    config = {**LLAMA, "model_type": model_type, **fields}
    try:
        estimate_model(spec_from_config(config), make_settings(batch=1, seq=64))
    except TrainmemError:
        pass  # refused with the package's one-line error


@pytest.mark.parametrize("args", [("--loss", "chunked"), ("--attention", "flash")])
def test_trace_refuses_what_it_cannot_run_before_importing_torch(args):
    """In a fresh interpreter: the refusal comes before torch is imported (so before any slow work)."""
    import subprocess
    import sys

    code = ("import sys; from trainmem.cli import main; rc = main(['trace', 'gpt2', *sys.argv[1:]]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("trainmem: error: "), done.stderr
