"""FP16/BF16 readiness of a real model, measured on its own gradients, activations and weight updates.

``precision_check`` runs real fp32 training steps (forward, loss, backward, an AdamW update) on the CPU and
collects, per layer type (attention, MLP, norm, embedding, LM head):
- gradient magnitudes: the fraction that fp16 flushes to zero (|g| below half its smallest subnormal, 2**-25)
  and the fraction that lands among its subnormals (below 2**-14, losing precision), without loss scaling and
  with a chosen scale; the smallest loss scale that keeps 99.9% of the non-zero gradients representable and the
  largest that keeps the largest gradient finite (below 65504);
- activation magnitudes (forward hooks on every Linear and norm output): the fraction above fp16's 65504;
- weight updates: AdamW's step ``lr * m_hat / (sqrt(v_hat) + eps)`` against each weight's bf16 spacing: the
  fraction smaller than half a bf16 ULP of the weight, which pure bf16 (no fp32 master weights, no Kahan
  summation) rounds away.
It ends with a verdict over fp32 / amp-fp16 with GradScaler / amp-bf16 / mixed-bf16 / pure-bf16, and the hardware
condition (bf16 needs compute capability 8.0+, checked when a CUDA device is present).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .dtypes import FORMATS
from .errors import ConfigError

FP16 = FORMATS["fp16"]
BF16 = FORMATS["bf16"]
# Round-to-nearest-even boundaries of fp16: up to half the smallest subnormal (a tie, rounded to the even 0) a value
# becomes 0; below the smallest normal minus half a subnormal step it stays subnormal; from 65504 + half an ULP
# (a tie, rounded to the even 65536, which does not exist) it becomes inf.
FP16_ZERO_AT_OR_BELOW = FP16.smallest_subnormal / 2
FP16_SUBNORMAL_BELOW = FP16.smallest_normal - FP16.smallest_subnormal / 2
FP16_INF_AT_OR_ABOVE = FP16.max + 2.0 ** (15 - FP16.mantissa_bits) / 2
COVERAGE = 0.999
LR_RANGE = (1e-12, 10.0)
"""AdamW learning rates accepted: far past any used (1e-6 to 1e-2), finite, so an update is a number."""
LOSS_SCALE_RANGE = (2.0**-24, 2.0**64)
"""Loss scales accepted: GradScaler's start at 2**16 and move by powers of two; beyond 2**64 every gradient above
fp16's smallest subnormal overflows 65504, so nothing is left to evaluate."""
MAX_STEPS = 10_000
MAX_BATCH = 4096
DATA_LIMIT = 256 * 2**20
"""The largest --data file read (each byte is a token; a few MB is plenty)."""


def check_arguments(steps: int = 1, lr: float = 1e-4, loss_scale: float = 1.0, batch: int = 1,
                    flags: bool = False) -> None:
    """precision_check's numbers, refused in one line (before torch is imported) when not whole, not finite or out
    of range. ``flags`` names them as the CLI's flags."""
    name: Callable[[str], str] = (lambda n: "--" + n.replace("_", "-")) if flags else (lambda n: n)
    for key, value, largest in (("steps", steps, MAX_STEPS), ("batch", batch, MAX_BATCH)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= largest:
            raise ConfigError(f"{name(key)} must be a whole number from 1 to {largest:,}, got {value!r}")
    for key, number, (low, high) in (("lr", lr, LR_RANGE), ("loss_scale", loss_scale, LOSS_SCALE_RANGE)):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not low <= number <= high:
            shown = (f"2**{math.log2(low):.0f} to 2**{math.log2(high):.0f}" if key == "loss_scale"
                     else f"{low:g} to {high:g}")
            raise ConfigError(f"{name(key)} must be a number from {shown}, got {number!r}")


def layer_type(name: str) -> str:
    """Group parameters and modules by role from their transformers names."""
    n = name.lower()
    if "embed" in n or ".wte" in n or ".wpe" in n or "word_embeddings" in n:
        return "embedding"
    if "lm_head" in n:
        return "lm_head"
    if "norm" in n or ".ln_" in n or "layernorm" in n:
        return "norm"
    if "attn" in n or "attention" in n:
        return "attention"
    if "mlp" in n or "expert" in n or ".fc" in n:
        return "mlp"
    return "other"


@dataclass
class Distribution:
    """Magnitudes of one quantity (absolute values, flattened), as one float64 tensor. Pieces are collected and
    concatenated once, on first read, rather than re-copied at every add."""

    pieces: list[Any] = field(default_factory=list)
    _values: Any = None

    def add(self, torch: Any, tensor: Any) -> None:
        self.pieces.append(tensor.detach().abs().flatten().to(torch.float64))
        self._values = None

    @property
    def values(self) -> Any:
        if self._values is None and self.pieces:
            import torch

            self._values = torch.cat(self.pieces)
            self.pieces = [self._values]
        return self._values

    @property
    def count(self) -> int:
        return sum(int(piece.numel()) for piece in self.pieces)


@dataclass
class PrecisionReport:
    gradients: dict[str, Distribution] = field(default_factory=dict)
    activations: dict[str, Distribution] = field(default_factory=dict)
    update_ratio: dict[str, Distribution] = field(default_factory=dict)
    """|update| / (half a bf16 ULP of the weight), per element: below 1 is lost in pure bf16."""
    loss_scale: float = 1.0
    losses: list[float] = field(default_factory=list)
    cuda_capability: tuple[int, int] | None = None

    # -- fractions --------------------------------------------------------------------------------------------
    def _all(self, torch: Any, parts: dict[str, Distribution]) -> Any:
        vals = [d.values for d in parts.values() if d.values is not None]
        return torch.cat(vals) if vals else torch.zeros(0, dtype=torch.float64)

    def gradient_stats(self, torch: Any, scale: float = 1.0,
                       parts: dict[str, Distribution] | None = None) -> dict[str, float]:
        g = self._all(torch, parts if parts is not None else self.gradients) * scale
        n = max(int(g.numel()), 1)
        nonzero = g[g > 0]
        return {
            "count": int(g.numel()),
            "zero_in_fp32": float((g == 0).sum()) / n,
            "underflow_to_zero": float(((g > 0) & (g <= FP16_ZERO_AT_OR_BELOW)).sum()) / n,
            "subnormal": float(((g > FP16_ZERO_AT_OR_BELOW) & (g < FP16_SUBNORMAL_BELOW)).sum()) / n,
            "overflow": float((g >= FP16_INF_AT_OR_ABOVE).sum()) / n,
            "max": float(g.max()) if g.numel() else 0.0,
            "min_nonzero": float(nonzero.min()) if nonzero.numel() else 0.0,
        }

    def scale_range(self, torch: Any) -> tuple[float, float]:
        """(smallest scale keeping 99.9% of non-zero gradients at or above fp16's smallest subnormal,
        largest scale keeping the largest gradient below 65504), as powers of two."""
        g = self._all(torch, self.gradients)
        nonzero = g[g > 0]
        if not nonzero.numel():
            return 1.0, FP16.max
        low_quantile = float(torch.quantile(nonzero[:: max(1, nonzero.numel() // 2_000_000)], 1 - COVERAGE))
        smallest = 2.0 ** math.ceil(math.log2(FP16.smallest_subnormal / low_quantile))
        largest = 2.0 ** math.floor(math.log2(FP16.max / float(nonzero.max())))
        return smallest, largest

    def activation_overflow(self, torch: Any) -> float:
        a = self._all(torch, self.activations)
        return float((a >= FP16_INF_AT_OR_ABOVE).sum()) / max(int(a.numel()), 1)

    def max_activation(self, torch: Any) -> float:
        a = self._all(torch, self.activations)
        return float(a.max()) if a.numel() else 0.0

    def bf16_lost_updates(self, torch: Any, parts: dict[str, Distribution] | None = None) -> float:
        r = self._all(torch, parts if parts is not None else self.update_ratio)
        return float((r < 1.0).sum()) / max(int(r.numel()), 1)

    # -- verdict ----------------------------------------------------------------------------------------------
    def verdict(self, torch: Any) -> list[tuple[str, bool, str]]:
        raw = self.gradient_stats(torch)
        low, high = self.scale_range(torch)
        overflow = self.activation_overflow(torch)
        lost = self.bf16_lost_updates(torch)
        bf16_hw = self.cuda_capability is None or self.cuda_capability >= (8, 0)
        hw_note = ("no CUDA device here: bf16 needs compute capability 8.0+ (Ampere or newer)"
                   if self.cuda_capability is None else f"this GPU is sm_{self.cuda_capability[0]}{self.cuda_capability[1]}")
        rows = [("fp32", True, "reference: 4 bytes per value, no range or rounding issue")]
        fp16_ok = overflow == 0 and low <= high
        rows.append(("amp-fp16 + GradScaler", fp16_ok,
                     f"{raw['underflow_to_zero']:.2%} of gradients underflow without scaling; scales 2^{math.log2(low):.0f}"
                     f"..2^{math.log2(high):.0f} keep {COVERAGE:.1%} representable and the largest finite; "
                     f"{overflow:.4%} of activations exceed 65504 (max {self.max_activation(torch):.3g})"))
        rows.append(("amp-bf16", bf16_hw, f"fp32's range: no underflow or overflow; {hw_note}"))
        rows.append(("mixed-bf16", bf16_hw, f"fp32 master weights keep every update; {hw_note}"))
        rows.append(("pure-bf16", bf16_hw and lost < 0.01,
                     f"{lost:.2%} of weight updates are below half a bf16 ULP of their weight and are rounded away "
                     "(fix: fp32 master weights or Kahan summation)"))
        return rows


def _hooks(torch: Any, model: Any, report: PrecisionReport) -> list[Any]:
    handles: list[Any] = []
    for name, module in model.named_modules():
        kind = type(module).__name__.lower()
        if isinstance(module, torch.nn.Linear) or "norm" in kind or "conv1d" in kind:
            def hook(mod: Any, args: Any, out: Any, key: str = layer_type(name)) -> None:
                t = out[0] if isinstance(out, tuple) else out
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    report.activations.setdefault(key, Distribution()).add(torch, t)
            handles.append(module.register_forward_hook(hook))
    return handles


def precision_check(model: Any, batches: list[Any], steps: int = 1, lr: float = 1e-4, loss_scale: float = 1.0,
                    loss_fn: Callable[[Any, Any], Any] | None = None,
                    on_step: Callable[[int], None] | None = None) -> PrecisionReport:
    """Run ``steps`` fp32 training steps of ``model`` on ``batches`` (tensors of token ids, or whatever
    ``loss_fn(model, batch)`` takes) and collect the distributions. The last step's gradients and updates are kept.
    ``on_step(step)`` is called after each step (the CLI's progress line).
    """
    check_arguments(steps=steps, lr=lr, loss_scale=loss_scale)
    if not batches:
        raise ConfigError("precision_check needs at least one batch")
    import torch

    model = model.float().train()
    report = PrecisionReport(loss_scale=loss_scale)
    if torch.cuda.is_available():
        report.cuda_capability = torch.cuda.get_device_capability()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = loss_fn or (lambda m, b: m(input_ids=b, labels=b).loss)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for step in range(steps):
        last = step == steps - 1
        handles = _hooks(torch, model, report) if last else []
        batch = batches[step % len(batches)]
        loss = loss_fn(model, batch)
        loss.backward()
        for h in handles:
            h.remove()
        report.losses.append(float(loss.detach()))
        if last:
            for n, p in named:
                if p.grad is not None:
                    report.gradients.setdefault(layer_type(n), Distribution()).add(torch, p.grad)
            before = {n: p.detach().clone() for n, p in named}
        optimizer.step()
        if last:
            for n, p in named:
                delta = (p.detach() - before[n]).abs().to(torch.float64)
                w = before[n].abs().to(torch.float64)
                # Half the bf16 spacing at |w|: 2**(floor(log2|w|) - 7) / 2 (for w = 0, the smallest subnormal).
                exponent = torch.floor(torch.log2(w.clamp_min(BF16.smallest_normal)))
                half_ulp = torch.pow(2.0, exponent - BF16.mantissa_bits - 1)
                ratio = torch.where(delta > 0, delta / half_ulp, torch.full_like(delta, math.inf))
                report.update_ratio.setdefault(layer_type(n), Distribution()).add(torch, ratio)
        optimizer.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step)
    return report


def text_batches(torch: Any, path: str | None, vocab: int, batch: int, seq: int, count: int,
                 seed: int = 0) -> list[Any]:
    """Token batches: bytes of a local text file (each byte one token, modulo the vocabulary), or random tokens."""
    generator = torch.Generator().manual_seed(seed)
    if path is None:
        return [torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(count)]
    data = torch.tensor(list(read_data(path)), dtype=torch.long) % vocab
    if data.numel() < seq + 1:
        raise ValueError(f"{path}: {data.numel()} bytes is shorter than one sequence of {seq}")
    out = []
    for _ in range(count):
        starts = torch.randint(0, data.numel() - seq, (batch,), generator=generator)
        out.append(torch.stack([data[s:s + seq] for s in starts.tolist()]))
    return out


def read_data(path: str) -> bytes:
    """The bytes of a --data file: a regular file (a FIFO would block, a device never end) of at most DATA_LIMIT."""
    import os
    import stat

    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"--data {str(path)!r} is not a regular file; give a text file")
        if info.st_size > DATA_LIMIT:
            raise ConfigError(f"--data {str(path)!r} is {info.st_size:,} bytes; at most {DATA_LIMIT:,} are read")
        with open(path, "rb") as handle:
            return handle.read(DATA_LIMIT + 1)[:DATA_LIMIT]
    except OSError as exc:
        raise ConfigError(f"--data {str(path)!r}: cannot read it ({exc.strerror or exc})") from None


def check_resize(config: dict[str, Any], hidden: int | None, layers: int | None, name: str) -> None:
    """--hidden and --layers scale a model down: whole numbers from 1 to the config's own size."""
    for flag, value, keys in (("--layers", layers, ("num_hidden_layers", "n_layer")),
                              ("--hidden", hidden, ("hidden_size", "n_embd"))):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
        have = next((config[k] for k in keys if isinstance(config.get(k), int) and not isinstance(config[k], bool)),
                    None)
        if have is None:
            raise ConfigError(f"{flag} resizes {' / '.join(keys)}, which {name}'s config does not give")
        if value > have:
            raise ConfigError(f"{flag} {value:,} is more than {name}'s {have:,}: {flag} scales the model down")
    if hidden is not None:
        heads = next((config[k] for k in ("num_attention_heads", "n_head") if isinstance(config.get(k), int)), None)
        if not heads:
            raise ConfigError(f"--hidden keeps the head width, but {name}'s config gives no num_attention_heads")


def resize_config(config: dict[str, Any], hidden: int | None, layers: int | None) -> dict[str, Any]:
    """Scale a config down for a CPU check: hidden size (keeping the head dimension and the query/kv grouping),
    number of layers, MLP width in proportion. None keeps the config's value."""
    cfg = dict(config)
    if layers is not None:
        for key in ("num_hidden_layers", "n_layer"):
            if key in cfg or key == "num_hidden_layers":
                cfg[key] = layers
    if hidden is not None:
        old_h = cfg.get("hidden_size") or cfg.get("n_embd")
        heads = cfg.get("num_attention_heads") or cfg.get("n_head")
        assert old_h and heads  # (check_resize refused a config without them)
        head_dim = cfg.get("head_dim") or old_h // heads
        new_heads = max(1, hidden // head_dim)
        kv = cfg.get("num_key_value_heads") or heads
        group = max(1, heads // kv)
        new_heads = max(group, new_heads // group * group)
        hidden = new_heads * head_dim
        for key in ("hidden_size", "n_embd"):
            if key in cfg or key == "hidden_size":
                cfg[key] = hidden
        for key in ("num_attention_heads", "n_head"):
            if key in cfg or key == "num_attention_heads":
                cfg[key] = new_heads
        if "num_key_value_heads" in cfg:
            cfg["num_key_value_heads"] = new_heads // group
        for key in ("intermediate_size", "ffn_dim", "moe_intermediate_size", "n_inner"):
            if cfg.get(key):
                cfg[key] = max(8, round(cfg[key] * hidden / old_h))
    return cfg


def plot_gradients(torch: Any, report: PrecisionReport, path: str) -> None:
    """Histogram of log10 |gradient| against fp16's and bf16's representable ranges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for kind, dist in sorted(report.gradients.items()):
        v = dist.values[dist.values > 0]
        if v.numel():
            ax.hist(torch.log10(v).numpy(), bins=120, histtype="step", label=f"{kind} ({v.numel():,})")
    marks = [(FP16.smallest_subnormal, "fp16 smallest subnormal", "red"), (FP16.smallest_normal,
             "fp16 smallest normal", "orange"), (FP16.max, "fp16 max", "red"),
             (BF16.smallest_normal, "bf16 smallest normal", "green")]
    for value, label, color in marks:
        x = math.log10(value)
        lo, hi = ax.get_xlim()
        if x < lo - 2 or x > hi + 2:
            continue
        ax.axvline(x, color=color, linestyle="--", linewidth=1)
        ax.text(x, ax.get_ylim()[1] * 0.95, label, rotation=90, va="top", ha="right", fontsize=7, color=color)
    ax.set_xlabel("log10 |gradient| (fp32, loss scale 1)")
    ax.set_ylabel("values")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("Gradient magnitudes against the fp16 and bf16 ranges")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
