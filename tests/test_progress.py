"""trainmem.progress: a transient progress line on stderr for the long commands, never on stdout, never with --json,
and the work it reports counted."""

import io
import json
import sys

import pytest

from trainmem import progress


def test_counts_and_draws_only_when_enabled():
    stream = io.StringIO()
    with progress.Progress("work", total=5, stream=stream, force=True) as bar:
        for _ in range(5):
            bar.advance(description="work [step]")  # markup in a description is text, not markup
    assert bar.count == 5 and stream.getvalue()  # something was drawn (on the given stream)
    quiet = io.StringIO()
    with progress.Progress("work", total=5, stream=quiet) as bar:  # a StringIO is not a terminal
        for _ in range(5):
            bar.advance()
    assert bar.count == 5 and quiet.getvalue() == ""
    with progress.Progress("work", stream=io.StringIO(), force=True, as_json=True) as bar:
        bar.advance(3)
    assert bar.count == 3 and not bar.enabled


@pytest.fixture
def terminal(monkeypatch):
    """Make the CLI believe stderr is a terminal (stdout a pipe), and record each progress line's final count."""
    counts = []
    original_exit = progress.Progress.__exit__

    def record(self, *exc):
        counts.append((self.description, self.count, self.enabled))
        return original_exit(self, *exc)

    monkeypatch.setattr(progress, "_isatty", lambda stream: stream is not sys.stdout)  # stderr only: stdout is piped
    monkeypatch.setattr(progress.Progress, "__exit__", record)
    return counts


@pytest.mark.slow
def test_amp_demo_progress_on_stderr_never_in_json(run_cli, terminal):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    code, out, err = run_cli("amp-demo", "--steps", "3", "--batch", "1", "--runs", "fp32,bf16-autocast", "--json")
    assert code == 0, err
    json.loads(out)  # stdout is the document alone
    assert err == "" and terminal == [("amp-demo", 6, False)]
    code, out, err = run_cli("amp-demo", "--steps", "3", "--batch", "1", "--runs", "fp32")
    assert code == 0, err
    assert terminal[-1] == ("amp-demo", 3, True) and "amp-demo" in err and "amp-demo" not in out


@pytest.mark.slow
def test_precision_check_progress(run_cli, terminal):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    args = ("precision-check", "gpt2", "--layers", "1", "--hidden", "64", "--batch", "1", "--seq", "16", "--steps", "2")
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    json.loads(out)
    assert err == "" and terminal[-1][1:] == (2, False)
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert terminal[-1][1:] == (2, True) and "precision-check" in err


@pytest.mark.slow
def test_plan_min_gpus_progress_only_for_the_search(run_cli, terminal):
    code, out, err = run_cli("plan", "llama-3.2-1b", "--gpu", "H100-80GB", "--seq", "1024", "--min-gpus", "--json")
    assert code == 0, err
    assert json.loads(out)["min_gpus"] == 1 and err == "" and not terminal[-1][2]
    code, out, err = run_cli("plan", "llama-3.2-1b", "--gpu", "H100-80GB", "--seq", "1024", "--min-gpus")
    assert code == 0 and terminal[-1][2] and "searching the fewest" in err
    code, out, err = run_cli("plan", "llama-3.2-1b", "--gpu", "H100-80GB", "--gpus", "8", "--seq", "1024")
    assert code == 0 and not terminal[-1][2] and err == ""  # a plain plan answers in well under a second


TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.mark.slow
def test_the_cli_prints_no_library_warnings(tmp_path):
    """A LoRA trace (peft calls transformers' deprecated is_gradient_checkpointing: a FutureWarning; bitsandbytes
    logs a missing CPU kernel on AVX512-BF16 CPUs) and then DeepSpeed's import (its "Setting accelerator to CPU" goes
    to stdout, into the JSON), in a fresh interpreter as a user runs them: stdout is the JSON document alone and
    stderr has no warning line."""
    import re
    import subprocess

    pytest.importorskip("torch")
    pytest.importorskip("peft")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    script = ("import sys; from trainmem.cli import main; code = main(sys.argv[1:]); import importlib.util; "
              "importlib.util.find_spec('deepspeed') and __import__('deepspeed'); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script, "trace", str(config), "--recipe", "pure-bf16-bf16states",
                           "--lora", "8", "--seq", "32", "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["engine"] == "trace"
    assert not re.search(r"Warning\b|\[WARNING\]|warnings\.warn|Failed to load", done.stderr), done.stderr


@pytest.mark.slow
def test_validate_counts_its_rows(run_cli, terminal, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    code, out, err = run_cli("validate", "--random", "2", "-o", str(tmp_path / "accuracy.md"))
    assert code == 0, out + err
    assert terminal[-1] == ("validate: rows traced", 2, True)
    assert "case 0" in out and "case 1" in out and "rows traced" in err and "rows traced" not in out


def test_own_lines_go_above_the_bar_on_one_terminal(monkeypatch):
    """validate's rows while its bar runs: on stdout when stdout is not a terminal; through the bar's console (the
    same screen) when it is."""
    from rich.console import Console

    out, err = io.StringIO(), io.StringIO()
    console = Console(file=out, width=80)
    with progress.Progress("rows", total=2, stream=err, force=True) as bar:
        bar.print(console, "row 1")
    assert "row 1" in out.getvalue() and "row 1" not in err.getvalue()
    monkeypatch.setattr(progress, "_isatty", lambda stream: True)
    out, err = io.StringIO(), io.StringIO()
    with progress.Progress("rows", total=2, stream=err, force=True) as bar:
        bar.print(Console(file=out, width=80), "row 2", highlight=False)
    assert out.getvalue() == "" and "row 2" in err.getvalue()
