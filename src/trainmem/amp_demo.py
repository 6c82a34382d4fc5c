"""trainmem amp-demo: the same tiny GPT trained under six precision set-ups, side by side, on the CPU.

Runs (same initial weights, same batches, AdamW):
- ``fp32``: the reference.
- ``fp16-autocast``: ``torch.autocast(float16)`` without a scaler.
- ``fp16-autocast+scaler``: the same with ``torch.amp.GradScaler`` (scale, backward, unscale_, step, update).
- ``bf16-autocast``: ``torch.autocast(bfloat16)``.
- ``pure-bf16``: the model and AdamW in bf16 (no fp32 master weights).
- ``pure-bf16+master``: bf16 model, fp32 master weights and AdamW states.

A small model's gradients are rarely small enough to underflow fp16 by themselves. ``grad_scale_down`` reproduces
the small-gradient regime of deep models: the loss is multiplied by it before backward and the gradients divided
by it afterwards (after the scaler's own unscale), so fp32 and bf16 runs train exactly as without it, while fp16's
backward sees gradients that many times smaller. docs/mixed-precision.md reports what the runs show.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Iterable

RUNS = ("fp32", "fp16-autocast", "fp16-autocast+scaler", "bf16-autocast", "pure-bf16", "pure-bf16+master")


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    zero_grad_fraction: float = 0.0
    """Mean over steps of the fraction of gradient values that are exactly zero."""
    skipped_steps: int = 0
    """Steps the GradScaler skipped because it found inf/NaN gradients."""
    weight_change: float = 0.0
    """The largest |final - initial| over every weight, in fp32: 0.0 exactly when no update ever moved a weight."""

    @property
    def final_loss(self) -> float:
        tail = self.losses[-10:]
        return sum(tail) / len(tail)


def corpus_tokens(torch: Any) -> Any:
    text = (resources.files("trainmem") / "data" / "tiny_corpus.txt").read_bytes()
    return torch.tensor(list(text), dtype=torch.long)


def _model(torch: Any, seed: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config)


def run(name: str, steps: int = 300, batch: int = 16, seq: int = 64, lr: float = 3e-3, seed: int = 0,
        grad_scale_down: float = 1.0, on_step: Callable[[str, int], None] | None = None) -> RunResult:
    """Train one set-up; ``on_step(name, step)`` is called after each step (the CLI's progress line)."""
    import torch

    if name not in RUNS:
        raise ValueError(f"unknown run {name!r}; accepted: {', '.join(RUNS)}")
    model = _model(torch, seed)
    data = corpus_tokens(torch)
    generator = torch.Generator().manual_seed(seed + 1)
    masters = None
    if name.startswith("pure-bf16"):
        model = model.to(torch.bfloat16)
        if name.endswith("+master"):
            masters = [p.detach().float().requires_grad_(True) for p in model.parameters()]
    params = list(model.parameters())
    initial = [p.detach().float().clone() for p in params]
    # eps small enough not to matter at any gradient scale, so that the runs differ only by their precision
    optimizer = torch.optim.AdamW(masters or params, lr=lr, eps=1e-12, weight_decay=0.0)
    autocast = {"fp16-autocast": torch.float16, "fp16-autocast+scaler": torch.float16,
                "bf16-autocast": torch.bfloat16}.get(name)
    # A dynamic scaler that may grow every 10 good steps (the default waits 2000, longer than the demo).
    scaler = torch.amp.GradScaler("cpu", growth_interval=10) if name.endswith("+scaler") else None
    result = RunResult(name)
    zero_total = 0.0
    for step in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
        ids = torch.stack([data[s:s + seq] for s in starts.tolist()])
        ctx = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        result.losses.append(float(loss.detach().float()))
        scaled = loss * grad_scale_down
        if scaler is not None:
            scaler.scale(scaled).backward()
            scaler.unscale_(optimizer)  # before any gradient clipping: clip the true gradients
        else:
            scaled.backward()
        grads = [p.grad for p in params if p.grad is not None]
        zeros = sum(int((g == 0).sum()) for g in grads)
        zero_total += zeros / max(1, sum(g.numel() for g in grads))
        for g in grads:
            g.div_(grad_scale_down)
        if masters is not None:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            result.skipped_steps += int(scaler.get_scale() < scale_before)
        else:
            optimizer.step()
        if masters is not None:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(name, step)
    result.zero_grad_fraction = zero_total / steps
    result.weight_change = max(float((p.detach().float() - w).abs().max()) for p, w in zip(params, initial))
    return result


def run_all(steps: int = 300, grad_scale_down: float = 1.0, runs: Iterable[str] = RUNS,
            **kwargs: Any) -> tuple[list[RunResult], float]:
    started = time.perf_counter()
    results = [run(name, steps=steps, grad_scale_down=grad_scale_down, **kwargs) for name in runs]
    return results, time.perf_counter() - started


def rounded_away(torch: Any, weights: Any, update: Any) -> tuple[int, int, int]:
    """How many elements of one update tensor each scheme loses, applied once to the same weights:
    (pure bf16: the bf16 weight plus the update, rounded to bf16, is the bf16 weight;
    fp32 master weights: the fp32 weight plus the update is the fp32 weight; elements with a non-zero update).

    Each element is one IEEE-754 fp32 addition and at most one conversion to bf16, both rounded to nearest even,
    so the counts are the same on every machine (no kernel, thread count or bf16 hardware enters). This is the
    deterministic form of "fp32 master weights keep updates that pure bf16 loses"; the demo's losses, which depend
    on the CPU's bf16/fp16 kernels, are a measured observation (docs/mixed-precision.md, section 8)."""
    master = weights.detach().float()
    bf16 = master.bfloat16()
    u = update.detach().float()
    moving = u != 0
    bf16_lost = int((((bf16.float() + u).bfloat16() == bf16) & moving).sum())
    fp32_lost = int(((master + u == master) & moving).sum())
    return bf16_lost, fp32_lost, int(moving.sum())


def repeated_update(torch: Any, weights: Any, update: Any, steps: int) -> tuple[int, int]:
    """Apply the same update ``steps`` times: (weights pure bf16 has moved, weights whose bf16 copy of the fp32
    master has moved). An update below half a bf16 spacing never moves a pure-bf16 weight however often it comes;
    the master accumulates it until its bf16 copy moves. Exact, as rounded_away."""
    start = weights.detach().float().bfloat16()
    u = update.detach().float()
    pure, master = start.clone(), start.float()
    for _ in range(steps):
        pure = (pure.float() + u).bfloat16()
        master = master + u
    return int((pure != start).sum()), int((master.bfloat16() != start).sum())


def plot(results: list[RunResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        window = 10
        smooth = [sum(r.losses[max(0, i - window + 1):i + 1]) / len(r.losses[max(0, i - window + 1):i + 1])
                  for i in range(len(r.losses))]
        ax.plot(smooth, label=f"{r.name} (final {r.final_loss:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title("Tiny GPT on the CPU under six precision set-ups")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
