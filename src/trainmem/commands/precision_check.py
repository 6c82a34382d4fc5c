"""`trainmem precision-check`: what a model's gradients lose in each format."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import click

from ..cli import _console, _header, _model_dict, _emit_json, _Whole
from ..errors import ConfigError

if TYPE_CHECKING:
    from rich.table import Table


def _runnable_config(config: dict[str, Any], name: str, seq: int, build: bool = True) -> None:
    """A config precision-check can build and run at ``seq``: read by its parser (a model_type without one: checked
    as meta_count does), no longer than a learned position table, and (``build``) built by transformers on the meta
    device."""
    from ..meta_count import check_buildable, check_transformers_config
    from ..models import UnsupportedModelType, check_learned_positions, spec_from_config

    try:
        spec = spec_from_config(config, name=name, source=name)
    except UnsupportedModelType:
        spec = None
        check_buildable(config, name)
    if spec is not None:
        check_learned_positions(spec, seq, "precision-check")
    if build:
        check_transformers_config(config, name)


def _checked_model(config: dict[str, Any], name: str, source: str, net: Any) -> dict[str, Any]:
    """The model object of estimate's document for the (resized) model precision-check ran; a family without an
    analytic parser gets the counted parameters and what its config says."""
    from ..errors import TrainmemError
    from ..models import spec_from_config

    try:
        return _model_dict(spec_from_config(config, name=name, source=source))
    except TrainmemError:
        count = sum(p.numel() for p in net.parameters())
        return {"name": name, "model_type": str(config.get("model_type")), "source": source, "parameters": count,
                "active_parameters": count, "largest_layer_parameters": max(p.numel() for p in net.parameters()),
                "num_layers": config.get("num_hidden_layers"), "hidden_size": config.get("hidden_size"),
                "vocab_size": config.get("vocab_size"), "analytic": False}


@click.command(name="precision-check")
@click.argument("model")
@click.option("--layers", type=_Whole(10_000), help="Scale down to this many layers (default: the config's).")
@click.option("--hidden", type=_Whole(1 << 31), help="Scale down to this hidden size, keeping the head size.")
@click.option("--weights", type=click.Path(exists=True, dir_okay=False), help="A local .safetensors checkpoint.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), help="A local text file (bytes as tokens).")
@click.option("--batch", type=_Whole(4096), default=4, show_default=True)
@click.option("--seq", type=_Whole(1 << 24), default=128, show_default=True)
@click.option("--steps", type=_Whole(10_000), default=3, show_default=True,
              help="Training steps; the last is analysed.")
@click.option("--lr", type=float, default=1e-4, show_default=True, help="AdamW learning rate for the updates.")
@click.option("--loss-scale", type=float, default=1024.0, show_default=True, help="The scale to evaluate.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write the gradient histogram as a PNG.")
@click.option("--hub", is_flag=True, help="Allow fetching a Hub model's config.json from the network.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def precision_check(model: str, layers: int | None, hidden: int | None, weights: str | None, data: str | None,
                    batch: int, seq: int, steps: int, lr: float, loss_scale: float, plot: str | None, hub: bool,
                    as_json: bool) -> None:
    """Run real fp32 training steps of MODEL on the CPU and measure whether fp16 or bf16 would lose its gradients,
    activations or weight updates.

    \b
    Example: trainmem precision-check llama-2-7b --layers 2 --hidden 256
    """
    from ..catalog import load_config
    from ..outputs import check_output_file, replacing
    from ..precision import check_arguments, check_resize, plot_gradients, precision_check as run_check, \
        resize_config, text_batches
    from ..settings import make_settings
    from ..step import vocab_size

    v: int | Table | None  # (each number checked here, then the verdict table below)
    for flag, v in (("--batch", batch), ("--seq", seq), ("--steps", steps), ("--layers", layers),
                    ("--hidden", hidden)):
        if v is not None and v <= 0:
            raise ConfigError(f"{flag} must be a positive integer, got {v}")
    check_arguments(steps=steps, lr=lr, loss_scale=loss_scale, batch=batch, flags=True)
    make_settings(seq=seq)  # (the sequence's bounds)
    plot_path = check_output_file(plot, "--plot", ".png") if plot is not None else None
    import os
    import stat

    for flag, path in (("--weights", weights), ("--data", data)):
        if path is not None:
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise ConfigError(f"{flag} {path!r} is not a regular file")
    config, name, source = load_config(model, hub)
    _runnable_config(config, name, seq, build=False)  # read before it is resized (no torch yet)
    check_resize(config, hidden, layers, name)
    config = resize_config(config, hidden, layers)
    _runnable_config(config, name, seq)  # the resized model, built on the meta device

    import torch

    from ..probe import build_model
    from ..recipes import get_recipe

    torch.manual_seed(0)
    net = build_model(config, get_recipe("fp32"), "sdpa", None)
    if weights:
        from safetensors.torch import load_file

        try:
            missing, unexpected = net.load_state_dict(load_file(weights), strict=False)
        except Exception as exc:  # noqa: BLE001 (safetensors' SafetensorError, a shape mismatch's RuntimeError)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ConfigError(f"--weights {weights!r}: cannot load it into {name} ({first})") from None
        if unexpected:
            raise ConfigError(f"{weights}: {len(unexpected)} tensors do not belong to {name} "
                              f"(first: {unexpected[0]})")
    # the tokens' range: the config's vocab_size, else the one transformers built the model with (int(None) was a
    # traceback)
    vocab = vocab_size(config, net)
    try:
        batches = text_batches(torch, data, vocab, batch, seq, steps)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from ..progress import Progress

    with Progress(f"precision-check: fp32 steps of {name}", total=steps, as_json=as_json) as bar:
        report = run_check(net, batches, steps=steps, lr=lr, loss_scale=loss_scale, on_step=lambda _: bar.advance())
    raw, scaled = report.gradient_stats(torch), report.gradient_stats(torch, loss_scale)
    low, high = report.scale_range(torch)
    per_type = {k: {"gradients": report.gradient_stats(torch, 1.0, {k: d}),
                    "bf16_lost_updates": report.bf16_lost_updates(torch, {k: report.update_ratio[k]})
                    if k in report.update_ratio else None}
                for k, d in sorted(report.gradients.items())}
    verdict = report.verdict(torch)
    if plot_path is not None:
        with replacing(plot_path) as temporary:
            plot_gradients(torch, report, str(temporary))
    doc = {**_header("precision-check"), "model": _checked_model(config, name, source, net),
           "parameters": sum(p.numel() for p in net.parameters()),
           "losses": report.losses,
           "gradients": raw, "gradients_scaled": {"scale": loss_scale, **scaled},
           "loss_scale_range": {"smallest": low, "largest": high},
           "activations": {"max": report.max_activation(torch), "overflow_fp16": report.activation_overflow(torch)},
           "bf16_lost_updates": report.bf16_lost_updates(torch), "by_layer_type": per_type,
           "verdict": [{"recipe": r, "ok": ok, "why": why} for r, ok, why in verdict]}
    if as_json:
        _emit_json(doc)
        return
    from rich.table import Table

    console = _console()
    console.print(f"[bold]{name}[/bold]: {doc['parameters']:,} parameters, {steps} fp32 steps on the CPU, "
                  f"losses {', '.join(f'{x:.3f}' for x in report.losses)}")
    t = Table(title="Gradients in fp16, by layer type (fractions of all gradient values)")
    for col in ("layer type", "values", "zero in fp32", "flush to 0 (no scaling)", "subnormal", "max |g|",
                f"flush to 0 (scale {loss_scale:g})", "bf16 lost updates"):
        t.add_column(col, justify="left" if col == "layer type" else "right")
    for k, d in sorted(report.gradients.items()):
        g, gs = report.gradient_stats(torch, 1.0, {k: d}), report.gradient_stats(torch, loss_scale, {k: d})
        lost = per_type[k]["bf16_lost_updates"]
        t.add_row(k, f"{g['count']:,}", f"{g['zero_in_fp32']:.3%}", f"{g['underflow_to_zero']:.3%}",
                  f"{g['subnormal']:.3%}", f"{g['max']:.3g}", f"{gs['underflow_to_zero']:.3%}",
                  "" if lost is None else f"{lost:.2%}")
    t.add_row("all", f"{raw['count']:,}", f"{raw['zero_in_fp32']:.3%}", f"{raw['underflow_to_zero']:.3%}",
              f"{raw['subnormal']:.3%}", f"{raw['max']:.3g}", f"{scaled['underflow_to_zero']:.3%}",
              f"{doc['bf16_lost_updates']:.2%}", style="bold")
    console.print(t)
    console.print(f"loss scales from {low:g} (2^{math.log2(low):.0f}) keep {0.999:.1%} of non-zero gradients "
                  f"representable; up to {high:g} (2^{math.log2(high):.0f}) keep the largest finite. "
                  f"Largest activation {doc['activations']['max']:.4g} "
                  f"({doc['activations']['overflow_fp16']:.4%} above 65504).")
    v = Table(title="Verdict")
    v.add_column("recipe")
    v.add_column("usable", justify="center")
    v.add_column("why")
    for r, ok, why in verdict:
        v.add_row(r, "[green]yes[/green]" if ok else "[red]no[/red]", why)
    console.print(v)
    if plot:
        console.print(f"histogram written to {plot}")
