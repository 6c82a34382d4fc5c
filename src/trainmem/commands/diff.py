"""`trainmem diff`: the estimate against a traced step, group by group (phase, category, owner)."""

from __future__ import annotations

from typing import Any

import click

from ..cli import (_MAX_STEP, _Whole, _console, _emit_json, _header, _model_dict, _one_process, _refuse_fit_only_flags,
                   _workload, _workload_options)
from ..errors import ConfigError


@click.command("diff")
@_workload_options
@click.option("--batch", type=_Whole(_MAX_STEP), default=1, show_default=True, help="Micro-batch size per GPU.")
@click.option("--seq", type=_Whole(_MAX_STEP), default=2048, show_default=True, help="Sequence length in tokens.")
@click.option("--no-round", is_flag=True, help="Keep raw tensor sizes (CUDA rounds each allocation to 512 B).")
@click.option("--all", "every", is_flag=True, help="Show every group, also those where the two agree.")
def diff(batch: int, seq: int, no_round: bool, every: bool, **options: Any) -> None:
    """Trace one step of MODEL (as trace does) and print, group by group (phase, category, owner: a layer, the
    embedding, the final norm, the head, the loss, the optimizer), what is alive at each traced peak that the
    estimate lacks or adds, with the traced tensors (op, dtype, shape) that make each group up.

    \b
    Example: trainmem diff llama-3.2-1b --batch 1 --seq 512 --recipe amp-bf16
    """
    _refuse_fit_only_flags("diff compares allocated bytes")
    w = _workload(options, batch, seq, need_config="diff")
    _one_process(w, "diff")
    from ..diff import check_diffable, diff_step, render, to_dict

    check_diffable(w.settings, w.finetune)
    from ..meta_count import check_transformers_config
    from ..step import check_runnable

    check_runnable(w.settings)
    check_transformers_config(w.model_config, w.spec.source or w.spec.name)
    from ..progress import Progress
    from ..stepmodel import estimate_model

    est = estimate_model(w.spec, w.settings, w.device, w.parallel, w.finetune)
    with Progress(f"tracing one step of {w.spec.name} on fake tensors", as_json=options["as_json"]):
        diffs = diff_step(w.model_config, w.spec, w.settings, est, round_to_cuda=not no_round, finetune=w.finetune)
    if options["as_json"]:
        _emit_json({**_header("diff"), "model": _model_dict(w.spec), "rounded_to_512_bytes": not no_round,
                    "phases": to_dict(diffs)})
    else:
        render(diffs, w.unit, _console(), every)
