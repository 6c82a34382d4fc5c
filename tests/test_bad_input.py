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
    from trainmem.stepmodel import estimate_model
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


# ------------------------------------------------------------------------------------------------------------------
# Round two (issue 24). Each class of hostile input, on the CLI in process and on the API: one line, exit code 2.
# ------------------------------------------------------------------------------------------------------------------

import glob  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

from hypothesis import HealthCheck  # noqa: E402

HERE = Path(__file__).parent


def _one_line(run_cli, *args):
    """Run the CLI; it must refuse in one line with exit code 2 (never a traceback)."""
    code, out, err = run_cli(*args)
    assert code == 2, (args, code, out[-300:], err)
    assert err.startswith("trainmem: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def alarm():
    """A hang is a failure, not a stuck suite: SIGALRM after ``seconds`` (POSIX; elsewhere no limit)."""
    def arm(seconds: int):
        if hasattr(signal, "SIGALRM"):
            def hung(*_):
                raise TimeoutError(f"still running after {seconds} s")
            signal.signal(signal.SIGALRM, hung)
            signal.alarm(seconds)
    yield arm
    if hasattr(signal, "SIGALRM"):
        signal.alarm(0)


# -- 1. Overflowing and non-finite numbers -------------------------------------------------------------------------

HUGE = str(10**400)


@pytest.mark.parametrize("args, says", [
    (("estimate", "llama-2-7b", "--batch", HUGE), "--batch must be at most 16,777,216"),
    (("estimate", "llama-2-7b", "--seq", HUGE), "--seq must be at most 16,777,216"),
    (("estimate", "llama-2-7b", "--grad-accum", HUGE), "--grad-accum must be at most 16,777,216"),
    (("estimate", "llama-2-7b", "--tp", HUGE), "--tp must be at most 1,048,576"),
    (("estimate", "llama-2-7b", "--gpus", "9" * 5000), "--gpus must be a whole number"),
    (("estimate", "llama-2-7b", "--seq", str(2**24 + 1)), "16,777,216"),
    (("trace", "gpt2", "--batch", HUGE), "batch"),
    (("measure", "gpt2", "--seq", HUGE), "seq"),
    (("measure", "gpt2", "--steps", HUGE), "--steps must be at most 1,000"),
    (("sweep", "gpt2", "--batch", f"1,{HUGE}"), "--batch must be a non-empty list of integers from 1 to 16,777,216"),
    (("sweep", "gpt2", "--seq", HUGE), "--seq must be"),
    (("precision-check", "gpt2", "--batch", HUGE), "--batch must be at most 4,096"),
    (("precision-check", "gpt2", "--seq", HUGE), "--seq must be at most"),
    (("precision-check", "gpt2", "--steps", HUGE), "--steps must be at most 10,000"),
    (("precision-check", "gpt2", "--layers", HUGE), "--layers must be at most"),
    (("precision-check", "gpt2", "--layers", "13"), "more than gpt2's 12"),
    (("precision-check", "gpt2", "--hidden", "1024"), "more than gpt2's 768"),
    (("amp-demo", "--steps", HUGE), "--steps must be at most 100,000"),
    (("amp-demo", "--batch", HUGE), "--batch must be at most 4,096"),
    (("validate", "--jobs", HUGE), "--jobs must be at most 1,024"),
    (("validate", "--random", HUGE), "--random must be at most 10,000"),
    (("validate", "--random", "1", "--seed", HUGE), "--seed must be at most"),
    (("amp-demo", "--runs", ""), "--runs is empty"),
])
def test_an_integer_past_its_range_is_one_line(run_cli, args, says):
    err = _one_line(run_cli, *args)
    assert says in err and len(err) < 400, err  # (the 401 digits are not echoed)


@pytest.mark.parametrize("args", [
    ("precision-check", "gpt2", "--lr", "nan"), ("precision-check", "gpt2", "--lr", "inf"),
    ("precision-check", "gpt2", "--lr", "-1"), ("precision-check", "gpt2", "--lr", "0"),
    ("precision-check", "gpt2", "--lr", "1e308"), ("precision-check", "gpt2", "--loss-scale", "nan"),
    ("precision-check", "gpt2", "--loss-scale", "inf"), ("precision-check", "gpt2", "--loss-scale", "-1"),
    ("precision-check", "gpt2", "--loss-scale", "1e308"), ("amp-demo", "--grad-scale-down", "nan"),
    ("amp-demo", "--grad-scale-down", "inf"), ("amp-demo", "--grad-scale-down", "1e308"),
    ("amp-demo", "--grad-scale-down", "-1"),
])
def test_a_float_that_is_not_finite_or_in_range_is_one_line(run_cli, args):
    assert args[-2] in _one_line(run_cli, *args)


INT_FLAGS = [("estimate", "llama-2-7b", flag) for flag in (
    "--batch", "--seq", "--grad-accum", "--tp", "--pp", "--cp", "--ep", "--gpus", "--gpus-per-node",
    "--virtual-stages", "--micro-batches", "--lora")] + [
    ("sweep", "gpt2", "--batch"), ("sweep", "gpt2", "--seq"), ("sweep", "gpt2", "--gpus"),
    ("trace", "gpt2", "--seq"), ("measure", "gpt2", "--steps"), ("measure", "gpt2", "--batch"),
    ("precision-check", "gpt2", "--batch"), ("precision-check", "gpt2", "--seq"),
    ("precision-check", "gpt2", "--steps"),
    ("precision-check", "gpt2", "--layers"), ("precision-check", "gpt2", "--hidden"), ("amp-demo", None, "--steps"),
    ("amp-demo", None, "--batch"), ("validate", None, "--jobs"), ("validate", None, "--random")]
FLOAT_FLAGS = [("estimate", "llama-2-7b", flag) for flag in (
    "--headroom", "--fragmentation", "--cuda-overhead", "--activation-k", "--dropout")] + [
    ("estimate", "llama-2-7b --lora 8", "--lora-alpha"), ("estimate", "llama-2-7b --lora 8", "--lora-dropout"),
    ("precision-check", "gpt2", "--lr"), ("precision-check", "gpt2", "--loss-scale"),
    ("amp-demo", None, "--grad-scale-down")]


@settings(max_examples=120, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(INT_FLAGS),
       st.one_of(st.integers(2**64, 10**400).map(str), st.integers(-(10**400), -(2**64)).map(str),
                 st.sampled_from(["1e400", "inf", "nan", "0x10", "9" * 5000, "1.5", "", " "])))
def test_any_absurd_integer_on_any_command_is_one_line(run_cli, where, value):
    command, model, flag = where
    args = [command, *(model.split() if model else []), flag, value]
    err = _one_line(run_cli, *args)
    assert len(err) < 600


@settings(max_examples=80, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(FLOAT_FLAGS),
       st.one_of(st.sampled_from(["nan", "-nan", "inf", "-inf", "1e308", "-1e308", "1e400", "Infinity", "x", ""]),
                 st.floats(min_value=1e30, allow_infinity=True).map(repr),
                 st.floats(max_value=-1e-3, allow_infinity=True).map(repr)))
def test_any_non_finite_or_absurd_float_on_any_command_is_one_line(run_cli, where, value):
    command, model, flag = where
    _one_line(run_cli, command, *(model.split() if model else []), flag, value)


def test_the_api_bounds_what_the_cli_bounds():
    from trainmem.planner import MAX_SEARCH
    from trainmem.precision import check_arguments, precision_check
    from trainmem.settings import MAX_BATCH, MAX_SEQ, TrainingSettings, make_settings

    # The searches (--max-batch, --max-seq) stay inside what the settings accept.
    assert MAX_SEARCH <= MAX_BATCH and MAX_SEARCH <= MAX_SEQ
    for kwargs in ({"batch": 10**400}, {"seq": MAX_SEQ + 1}, {"grad_accum": 2**63}, {"batch": 2.0}):
        with pytest.raises(TrainmemError):
            make_settings(**kwargs)
    with pytest.raises(TrainmemError):
        TrainingSettings().at(MAX_BATCH + 1, 1)
    for kwargs in ({"lr": math.nan}, {"lr": math.inf}, {"lr": -1.0}, {"loss_scale": math.nan},
                   {"loss_scale": 1e308}, {"steps": 0}, {"steps": True}):
        with pytest.raises(TrainmemError):
            check_arguments(**kwargs)
        with pytest.raises(TrainmemError):  # (refused before the model is touched)
            precision_check(None, [], **kwargs)


def test_estimates_at_the_bounds_are_finite():
    """The largest accepted batch and sequence give whole, finite byte counts (valid JSON), not inf or an overflow."""
    import trainmem
    from trainmem.report import json_safe, to_dict
    from trainmem.settings import MAX_BATCH, MAX_SEQ

    for attention in ("eager", "sdpa"):
        est = trainmem.estimate("llama-2-7b", batch=MAX_BATCH, seq=MAX_SEQ, attention=attention, grad_accum=2**24,
                                gpu="H100-80GB")
        json.dumps(json_safe(to_dict(est, est.gpu)), allow_nan=False)
        assert all(isinstance(p.allocated_bytes, int) and p.allocated_bytes > 0 for p in est.phases)


# -- 2. Output paths -----------------------------------------------------------------------------------------------

FILE_WRITERS = {
    "estimate --plot": (["estimate", "gpt2", "--plot"], ".png", "trainmem.planner.estimate_searched"),
    "sweep --plot": (["sweep", "gpt2", "--batch", "1,2", "--seq", "64", "--plot"], ".png", "trainmem.planner.sweep"),
    "precision-check --plot": (["precision-check", "gpt2", "--plot"], ".png", "trainmem.probe.build_model"),
    "amp-demo --plot": (["amp-demo", "--plot"], ".png", "trainmem.amp_demo.run_all"),
    "measure --snapshot": (["measure", "gpt2", "--device", "cuda", "--snapshot"], ".pickle",
                           "trainmem.measure.measure_steps"),
    "validate -o": (["validate", "--quick", "-o"], ".md", "trainmem.validate.validate"),
}


def _never_called(monkeypatch, dotted: str) -> None:
    """The command's expensive step must not run before the path is refused."""
    import importlib

    module, name = dotted.rsplit(".", 1)

    def called(*args, **kwargs):
        raise AssertionError(f"{dotted} ran before the bad path was refused")

    monkeypatch.setattr(importlib.import_module(module), name, called)


def _bad_file_paths(tmp: Path, suffix: str) -> dict[str, tuple[str, str]]:
    (tmp / f"dangling{suffix}").symlink_to(tmp / "nowhere")
    (tmp / f"loop-a{suffix}").symlink_to(tmp / f"loop-b{suffix}")
    (tmp / f"loop-b{suffix}").symlink_to(tmp / f"loop-a{suffix}")
    (tmp / f"folder{suffix}").mkdir()
    (tmp / "a-file").write_text("x")
    paths = {
        "empty": ("", "is empty"),
        "blank": ("  ", "is empty"),
        "dangling link": (str(tmp / f"dangling{suffix}"), "dangling symbolic link"),
        "link loop": (str(tmp / f"loop-a{suffix}"), "symbolic link loop"),
        "name over 255 bytes": (str(tmp / ("n" * 300 + suffix)), "at most 255"),
        "multi-byte name over 255 bytes": (str(tmp / ("é" * 130 + suffix)), "at most 255"),
        "folder": (str(tmp / f"folder{suffix}"), "folder"),
        "/proc": (f"/proc/self/x{suffix}", "/proc"),
        "/dev": ("/dev/null", "/dev"),
        "missing folder": (str(tmp / "missing" / f"x{suffix}"), "does not exist"),
        "a file as its folder": (str(tmp / "a-file" / f"x{suffix}"), "is a file, not a folder"),
    }
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp / f"fifo{suffix}")
        paths["FIFO"] = (str(tmp / f"fifo{suffix}"), "not a regular file")
    return paths


@pytest.mark.parametrize("writer", sorted(FILE_WRITERS))
def test_every_written_file_refuses_a_bad_path_before_any_work(run_cli, tmp_path, monkeypatch, alarm, writer):
    args, suffix, expensive = FILE_WRITERS[writer]
    _never_called(monkeypatch, expensive)
    alarm(60)
    for kind, (path, says) in _bad_file_paths(tmp_path, suffix).items():
        code, out, err = run_cli(*args, path)
        assert code == 2 and err.startswith("trainmem: error: ") and err.count("\n") == 1, (writer, kind, err)
        # click's own check of dir_okay names a folder "a directory"
        assert says in err or (kind == "folder" and "is a directory" in err), (writer, kind, err)


def test_plan_out_refuses_a_bad_folder_before_the_search(run_cli, tmp_path, monkeypatch):
    _never_called(monkeypatch, "trainmem.plan.run_plan")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    for path, says in (("", "is empty"), (str(tmp_path / "dangling"), "dangling"), (str(tmp_path / ("d" * 256)),
                       "at most 255"), ("/proc/plan", "/proc"), (str(tmp_path / "no" / "plan"), "does not exist"),
                       (str(tmp_path / "file"), "is a file")):
        err = _one_line(run_cli, "plan", "llama-3-8b", "--gpu", "H100-80GB", "--gpus", "8", "--out", path)
        assert says in err, (path, err)


def test_an_unwritable_folder_is_refused_up_front(run_cli, tmp_path, monkeypatch):
    """A folder the user cannot create files in: tried by creating one (root may write in a 0555 folder, so the
    refusal is simulated by the operating system's answer)."""
    import errno

    import trainmem.outputs as outputs

    real_open = os.open

    def refuse(path, *args, **kwargs):
        if Path(path).parent == tmp_path:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(outputs.os, "open", refuse)
    _never_called(monkeypatch, "trainmem.planner.estimate_searched")
    assert "cannot write in the folder" in _one_line(run_cli, "estimate", "gpt2", "--plot", str(tmp_path / "x.png"))


def test_validate_refuses_an_existing_report_that_is_not_utf8(run_cli, tmp_path, monkeypatch):
    _never_called(monkeypatch, "trainmem.validate.validate")
    report = tmp_path / "accuracy.md"
    report.write_bytes(b"# accuracy\n\xff\xfe")
    assert "not UTF-8" in _one_line(run_cli, "validate", "--quick", "-o", str(report))
    assert report.read_bytes() == b"# accuracy\n\xff\xfe"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(run_cli, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    target = tmp_path / "memory.png"
    target.write_bytes(b"the old picture")

    def half_then_full_disk(self, path, *args, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_then_full_disk)
    err = _one_line(run_cli, "estimate", "gpt2", "--plot", str(target))
    assert "No space left on device" in err and "old file is kept" in err
    assert target.read_bytes() == b"the old picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.png"]


def test_replacing_writes_whole_files_or_nothing(tmp_path):
    from trainmem.outputs import check_output_file, replacing, write_text

    target = tmp_path / "r.md"
    write_text(target, "first")
    with pytest.raises(KeyboardInterrupt):
        with replacing(target) as temporary:
            temporary.write_text("half")
            raise KeyboardInterrupt
    assert target.read_text() == "first" and sorted(os.listdir(tmp_path)) == ["r.md"]
    with replacing(target):
        pass  # a writer that writes nothing leaves the file as it was
    assert target.read_text() == "first"
    write_text(target, "second")
    assert target.read_text() == "second" and sorted(os.listdir(tmp_path)) == ["r.md"]
    link = tmp_path / "link.md"
    link.symlink_to(target)
    assert check_output_file(link, "-o") == target.resolve()  # a link to a file writes the file, the link stays


def test_the_probe_leaves_nothing_behind(tmp_path):
    from trainmem.outputs import check_output_dir, check_output_file

    check_output_file(tmp_path / "x.png", "--plot", ".png")
    check_output_dir(tmp_path / "plan", "--out")
    check_output_dir(tmp_path, "--out")
    assert list(tmp_path.iterdir()) == []


# -- 3. A sequence past a learned position table ------------------------------------------------------------------

def test_measure_and_precision_check_refuse_a_sequence_past_the_position_table(run_cli, tmp_path, monkeypatch):
    from tiny_configs import TINY_CONFIGS

    _never_called(monkeypatch, "trainmem.measure.measure_steps")
    _never_called(monkeypatch, "trainmem.probe.build_model")
    err = _one_line(run_cli, "measure", "gpt2", "--seq", "2048", "--device", "cpu")
    assert "1,024" in err and "n_positions" in err
    err = _one_line(run_cli, "precision-check", "gpt2", "--seq", "1025", "--layers", "1")
    assert "1,024" in err
    opt = tmp_path / "opt.json"
    opt.write_text(json.dumps(TINY_CONFIGS["opt"]))  # max_position_embeddings 48
    assert "48 positions" in _one_line(run_cli, "measure", str(opt), "--seq", "49", "--device", "cpu")


def test_the_position_check_lets_through_what_runs():
    from trainmem.catalog import resolve_model
    from trainmem.models import check_learned_positions

    check_learned_positions(resolve_model("gpt2"), 1024, "measure")  # n_positions itself runs
    check_learned_positions(resolve_model("llama-2-7b"), 10**6, "measure")  # RoPE computes its positions


# -- 4. Round one again: configs counted through transformers, the sweep grid, hostile fields of every type -------

# (CodeGen, a GPT-J-shaped model_type with no hand-written description: GPT-J has one since 2026-12-02)
CODEGEN = {"model_type": "codegen", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 128,
        "rotary_dim": 8}


@pytest.mark.parametrize("fields, says", [
    ({"vocab_size": -5}, "'vocab_size' is -5"),
    ({"vocab_size": "100"}, "'vocab_size' is '100'; it must be an integer"),
    ({"vocab_size": 100.5}, "must be an integer"),
    ({"n_layer": True}, "must be an integer"),
    ({"n_layer": 100_000}, "1,024"),  # (it used to build for minutes)
    ({"n_embd": 2**40}, "2,147,483,648"),
    ({"rotary_dim": 10**30}, "31 digits"),
    ({"model_type": ["codegen"]}, "'model_type' is an array"),
    ({"model_type": {"a": 1}}, "'model_type' is an object"),
    ({"model_type": 5}, "'model_type' is a number"),
    ({"model_type": "x" * 500}, "short name"),
    ({"bos_token_id": 10**30}, "64 bits"),
])
def test_a_hostile_config_counted_through_transformers_is_one_line(run_cli, tmp_path, alarm, fields, says):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CODEGEN, **fields}))
    alarm(60)
    assert says in _one_line(run_cli, "estimate", str(path))


def test_a_flag_named_like_a_size_is_not_checked_as_one():
    """LFM2's default config holds ``block_auto_adjust_ff_dim: true``: a flag, not a width (it was refused as "a
    boolean; it must be an integer", so no LFM2 config could be estimated); a boolean width still is refused."""
    from trainmem.errors import ModelError
    from trainmem.meta_count import check_transformers_config

    check_transformers_config({**CODEGEN, "block_auto_adjust_ff_dim": True})
    with pytest.raises(ModelError, match="must be an integer"):
        check_transformers_config({**CODEGEN, "n_embd": True})


@pytest.mark.parametrize("fields, says", [
    ({"n_head": 0}, "positive integer"), ({"n_embd": None}, "n_embd"), ({"model_type": "codegenn"}, "unknown model_type"),
])
def test_what_transformers_refuses_is_one_line(run_cli, tmp_path, fields, says):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CODEGEN, **fields}))
    assert says in _one_line(run_cli, "estimate", str(path))


def test_a_model_type_that_is_not_a_string_in_a_wrapper():
    from trainmem.errors import ModelError
    from trainmem.models import read_config_file, spec_from_config

    with pytest.raises(ModelError, match="is an array"):
        spec_from_config({**LLAMA, "model_type": ["llama"]})
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps({"model_type": ["gemma3"], "text_config": {"model_type": "gemma3_text"}}))
        with pytest.raises(ModelError, match="is an array"):
            read_config_file(path)


def test_a_sweep_grid_past_its_bound_is_one_line(run_cli, monkeypatch):
    import trainmem

    _never_called(monkeypatch, "trainmem.planner.sweep")
    hundred = ",".join(str(i) for i in range(1, 101))
    err = _one_line(run_cli, "sweep", "llama-2-7b", "--batch", hundred, "--seq", hundred)
    assert "10,000 estimates" in err and "1,024" in err
    err = _one_line(run_cli, "sweep", "llama-2-7b", "--batch", ",".join(["1"] * 300), "--seq", "1,2",
                    "--gpus", "1,2", "--zero", "1,2")
    assert "layouts" in err
    with pytest.raises(TrainmemError, match="at most 1,024"):
        trainmem.sweep("gpt2", list(range(1, 101)), list(range(1, 101)))


def _tiny_types():
    from tiny_configs import TINY_CONFIGS

    return sorted(TINY_CONFIGS)


SIZE_FIELDS = ("hidden_size", "n_embd", "num_attention_heads", "n_head", "num_hidden_layers", "n_layer",
               "intermediate_size", "ffn_dim", "vocab_size", "num_key_value_heads", "head_dim", "num_local_experts",
               "num_experts", "n_routed_experts", "moe_intermediate_size", "kv_lora_rank", "n_positions",
               "max_position_embeddings", "num_experts_per_tok")
HOSTILE_SIZES = {"negative": -1, "zero": 0, "string": "64", "list": [64], "object": {"n": 64}, "huge": 10**400,
                 "past 64 bits": 2**64, "float": 64.5, "whole float": 64.0, "boolean": True, "nan": math.nan,
                 "infinity": math.inf}


@pytest.mark.parametrize("name", _tiny_types())
def test_every_type_refuses_hostile_sizes_in_one_line(run_cli, tmp_path, name):
    from tiny_configs import TINY_CONFIGS

    base = TINY_CONFIGS[name]
    path = tmp_path / "config.json"
    tried = 0
    for field in (f for f in SIZE_FIELDS if f in base):
        for kind, value in HOSTILE_SIZES.items():
            path.write_text(json.dumps({**base, field: value}))
            code, out, err = run_cli("estimate", str(path), "--seq", "32")
            assert code == 2, (name, field, kind, code, out[-200:])
            assert err.count("\n") == 1 and field in err and "Traceback" not in err, (name, field, kind, err)
            tried += 1
    assert tried >= 4 * len(HOSTILE_SIZES)


def _real_configs() -> dict[str, dict]:
    from tiny_configs import TINY_CONFIGS

    found = {f"tiny:{k}": v for k, v in TINY_CONFIGS.items()}
    for folder in (HERE / "configs", HERE.parent.parent / "shared" / "reference" / "configs"):
        for path in sorted(glob.glob(str(folder / "*.json"))):
            found[f"{folder.name}:{Path(path).name}"] = json.loads(Path(path).read_text())
    found["codegen (counted by transformers)"] = CODEGEN
    return found


REAL_CONFIGS = _real_configs()
HOSTILE_VALUES = st.one_of(
    st.integers(-3, 3), st.integers(2**31, 10**30), st.just(10**400), st.just(2**63),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["", "x", "64", "false", "silu"]), st.booleans(),
    st.none(), st.lists(st.one_of(st.integers(-2, 70), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.sampled_from(["type", "rope_type", "factor", "a"]), st.one_of(st.integers(), st.text(
        max_size=3), st.floats()), max_size=2))


def _fields_of(config: dict) -> list[str]:
    from trainmem.config_defaults import CONFIG_DEFAULTS

    extra = CONFIG_DEFAULTS.get(config.get("model_type"), {})
    return sorted(set(config) | set(extra) | {"model_type", "rope_scaling", "rope_parameters", "text_config",
                                              "layer_types", "partial_rotary_factor", "torch_dtype"})


def _mutated_config_case(run_cli, tmp_path, alarm, name, data):
    """Any field of a real config (tests/configs, the shared reference configs, every tiny type, a type counted by
    transformers) set to a hostile value: exit code 0 or 2, never a traceback, one line when refused, no hang."""
    config = dict(REAL_CONFIGS[name])
    keys = data.draw(st.lists(st.sampled_from(_fields_of(config)), min_size=1, max_size=3, unique=True))
    for key in keys:
        config[key] = data.draw(HOSTILE_VALUES, label=key)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    extra = data.draw(st.sampled_from([(), ("--checkpointing", "selective", "--attention", "eager"),
                                       ("--dropout", "0.1", "--recipe", "amp-bf16"), ("--json",)]))
    alarm(120)
    code, out, err = run_cli("estimate", str(path), "--seq", "64", *extra)
    assert code in (0, 2), (keys, code, err)
    assert "Traceback" not in err + out
    if code == 2:
        assert err.startswith("trainmem: error: ") and err.count("\n") == 1, err


_MUTATION = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])


@settings(max_examples=50, derandomize=True, **_MUTATION)
@given(st.sampled_from(sorted(REAL_CONFIGS)), st.data())
def test_real_configs_mutated_into_hostile_values_never_crash(run_cli, tmp_path, alarm, name, data):
    _mutated_config_case(run_cli, tmp_path, alarm, name, data)


@pytest.mark.slow
@settings(max_examples=600, **_MUTATION)
@given(st.sampled_from(sorted(REAL_CONFIGS)), st.data())
def test_many_more_mutated_configs_never_crash(run_cli, tmp_path, alarm, name, data):
    """The same with fresh random draws each run (not derandomized): a new hostile round every time."""
    _mutated_config_case(run_cli, tmp_path, alarm, name, data)


def test_measure_writes_its_snapshot_whole_through_a_temporary_file(run_cli, tmp_path, monkeypatch):
    """measure hands measure_steps a temporary path beside --snapshot and renames it once the run is done; a run
    that fails leaves the old snapshot. (The CUDA run itself is faked: this checks the path's handling.)"""
    import trainmem.measure as measure
    from trainmem.measure import Measurement, PhasePeak

    target = tmp_path / "memory.pickle"
    target.write_bytes(b"old snapshot")
    given = []

    def fake(config, settings, device, steps, snapshot, finetune=None, progress=None):
        given.append(snapshot)
        assert Path(snapshot).parent == tmp_path and Path(snapshot) != target
        Path(snapshot).write_bytes(b"new snapshot")
        return Measurement("cuda", [PhasePeak("forward", 1000, 2000)])

    monkeypatch.setattr(measure, "measure_steps", fake)
    code, out, err = run_cli("measure", "gpt2", "--seq", "32", "--device", "cuda", "--snapshot", str(target))
    assert code == 0, err
    assert target.read_bytes() == b"new snapshot" and sorted(os.listdir(tmp_path)) == ["memory.pickle"]

    def fails(config, settings, device, steps, snapshot, finetune=None, progress=None):
        Path(snapshot).write_bytes(b"half")
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(measure, "measure_steps", fails)
    assert "out of memory" in _one_line(run_cli, "measure", "gpt2", "--seq", "32", "--device", "cuda", "--snapshot",
                                        str(target))
    assert target.read_bytes() == b"new snapshot" and sorted(os.listdir(tmp_path)) == ["memory.pickle"]


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=12), st.text(st.characters(codec="utf-8"), min_size=200, max_size=300),
                          st.sampled_from(["..", ".", "", "~", "/proc", "/dev", "\0", "\ud800", "a.png", "é" * 128])),
                min_size=1, max_size=4),
       st.booleans(), st.sampled_from([None, ".png"]))
def test_any_path_is_checked_into_a_path_or_one_line(tmp_path, monkeypatch, parts, inside, suffix):
    """Whatever text names the file, the checker answers a writable path or the package's one-line error."""
    from trainmem.outputs import check_output_dir, check_output_file

    monkeypatch.chdir(tmp_path)
    path = "/".join(parts)
    if inside:
        path = f"{tmp_path}/{path}"
    for check in (lambda: check_output_file(path, "--plot", suffix), lambda: check_output_dir(path, "--out")):
        try:
            target = check()
        except TrainmemError as exc:
            assert "\n" not in str(exc) and len(str(exc)) < 400
        else:
            assert target.parent.is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".trainmem-")]  # no probe left


@pytest.mark.parametrize("field, value, says", [
    ("rms_norm_eps", "x", "rms_norm_eps"), ("initializer_range", [1], "initializer_range"),
    ("pad_token_id", 10**6, "cannot build"), ("rope_theta", "x", "cannot build"), ("torch_dtype", "x", "'x'"),
])
@pytest.mark.parametrize("command", ["trace", "measure", "precision-check"])
def test_a_field_only_transformers_reads_is_one_line_where_transformers_builds(run_cli, tmp_path, monkeypatch,
                                                                              command, field, value, says):
    """Fields the estimate does not read (norm epsilon, pad token, RoPE theta) but transformers does: trace,
    measure and precision-check build the model, so they refuse in one line before running, not mid-run."""
    pytest.importorskip("transformers")
    from tiny_configs import TINY_CONFIGS

    for expensive in ("trainmem.trace.trace_step", "trainmem.measure.measure_steps", "trainmem.probe.build_model"):
        _never_called(monkeypatch, expensive)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_CONFIGS["llama"], field: value}))
    device = ("--device", "cpu") if command == "measure" else ()
    assert says in _one_line(run_cli, command, str(path), "--seq", "16", *device)


def test_rope_numbers_are_checked_as_transformers_keeps_them():
    from trainmem.errors import ModelError
    from trainmem.meta_count import _check_rope

    _check_rope("c", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "short_factor": [1.0, 2.0]})
    _check_rope("c", {"full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    for bad in ({"rope_theta": "x"}, {"rope_theta": math.nan}, {"factor": -1}, {"rope_type": ["x"]},
                {"sliding_attention": {"rope_theta": math.inf}}, {"short_factor": [1.0, "x"]}):
        with pytest.raises(ModelError):
            _check_rope("c", bad)


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(st.sampled_from(["gpt2", "opt"]), st.integers(1, 4096), st.integers(1, 10_000))
def test_the_position_limit_refuses_exactly_the_sequences_past_the_table(family, positions, seq):
    from tiny_configs import TINY_CONFIGS
    from trainmem.models import check_learned_positions, spec_from_config

    key = "n_positions" if family == "gpt2" else "max_position_embeddings"
    spec = spec_from_config({**TINY_CONFIGS[family], key: positions})
    if seq <= positions:
        check_learned_positions(spec, seq, "measure")
    else:
        with pytest.raises(TrainmemError, match=f"{positions:,} positions"):
            check_learned_positions(spec, seq, "measure")
