"""What `trainmem estimate` loads: its own command and the core, not the other commands or the heavy libraries; and
the dataclass code cache (dataclass_cache.py) makes the classes Python's own ``exec`` makes. Behaviour, not time
(benchmarks/estimate_speed.py prints the times)."""

import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "pydantic", "matplotlib", "fastapi", "uvicorn", "rich", "numpy", "peft",
         "huggingface_hub", "jsonschema")
OTHER_COMMANDS = ("trainmem.commands.plan", "trainmem.commands.trace", "trainmem.commands.validate",
                  "trainmem.commands.serve", "trainmem.commands.measure", "trainmem.commands.sweep",
                  "trainmem.plan", "trainmem.validate", "trainmem.web", "trainmem.trace", "trainmem.plots",
                  "trainmem.modelparallel")

_RUN_MODULE = ("import runpy, sys\n"
               "sys.argv = ['trainmem', *{args!r}]\n"
               "try:\n"
               "    runpy.run_module('trainmem', run_name='__main__', alter_sys=True)\n"
               "except SystemExit as exit:\n"
               "    code = exit.code\n"
               "print(code, sorted(sys.modules), file=sys.stderr)\n")


def _python_m_trainmem(*args: str) -> tuple[int, str, list[str]]:
    """`python -m trainmem ARGS` (run as -m runs it), with the modules it imported."""
    proc = subprocess.run([sys.executable, "-c", _RUN_MODULE.format(args=args)], capture_output=True, text=True)
    code, _, modules = proc.stderr.strip().splitlines()[-1].partition(" ")
    return int(code), proc.stdout, eval(modules)


def test_python_m_trainmem_estimate_imports_its_command_only():
    code, out, modules = _python_m_trainmem("estimate", "llama-2-7b")
    assert code == 0 and "6,738,415,616 parameters" in out
    assert "trainmem.commands.estimate" in modules and "trainmem.stepmodel" in modules  # (the list is read)
    assert sorted({m.split(".")[0] for m in modules} & set(HEAVY)) == []
    assert sorted(set(modules) & set(OTHER_COMMANDS)) == []


def test_help_lists_every_command_with_its_short_help():
    import click

    from trainmem.cli import COMMANDS, app

    code, out, _ = _python_m_trainmem("--help")
    assert code == 0
    listed = out.split("Commands:")[1]
    for name in COMMANDS:
        command = app.get_command(click.Context(app), name)
        assert f"  {name} " in listed and command.get_short_help_str(45)[:20] in " ".join(listed.split()), name


def test_a_command_registered_eagerly_still_runs():
    """``@app.command()`` in cli.py (or any module imported with it) works beside the lazy commands."""
    import click

    from trainmem.cli import app, main

    @click.command(name="speed-test-hello")
    def hello() -> None:
        """Say hello."""
        click.echo("hello")

    app.add_command(hello)
    try:
        assert main(["speed-test-hello"]) == 0
        assert "speed-test-hello" in app.list_commands(click.Context(app))
    finally:
        del app.commands["speed-test-hello"]


def test_dataclass_cache_makes_the_code_exec_makes():
    """A text through the cache gives the function the builtin exec gives: the same code object (the pitfall: a
    compile() from a module with ``from __future__ import annotations`` would turn annotations into strings)."""
    import builtins

    from trainmem import dataclass_cache
    from trainmem.timeline import Phase

    assert Phase.__init__.__annotations__["parameters"] == "int"  # (the field's type, not the name "_type_...")
    texts = [t for t in dataclass_cache._used if "__init__" in t][:20]
    assert texts
    for text in texts:
        ours, theirs = {}, {}
        globals_ = {"__name__": "trainmem.timeline"}
        dataclass_cache._exec(text, dict(globals_), ours)
        builtins.exec(text, dict(globals_), theirs)
        assert ours["__create_fn__"].__code__ == theirs["__create_fn__"].__code__


def test_a_second_process_compiles_no_dataclass_method(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    code = ("import trainmem, trainmem.report, trainmem.replay; from trainmem import dataclass_cache as d; "
            "print(d._state['new'], len(d._used))")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    new, used = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                               text=True).stdout.split()
    if not os.access(os.path.dirname(__import__("trainmem").__file__), os.W_OK):
        pytest.skip("a read-only install keeps no cache")
    assert int(new) == 0 and int(used) > 100
