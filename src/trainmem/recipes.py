"""Precision recipes: which dtype each piece of training state is kept in.

A recipe fixes the dtype of the weights the forward pass reads, the gradients backward writes, the fp32
master copy (if any) the optimizer updates, the optimizer states, and the dtype activations are computed in.

Sources for the byte counts (per parameter, with AdamW's two states):
- ``fp32``: 4 + 4 + 8 = 16 B (the seed article's "FP32 + AdamW = 16P").
- ``amp-*``: ``torch.autocast`` over fp32 weights and gradients; the optimizer is unchanged, so also 16 B.
  Autocast's weight-cast cache adds a half copy of each matmul weight during forward/backward; that is an
  activation-time cost, counted in activations, not here.
- ``mixed-*``: half weights and gradients with fp32 master weights and fp32 Adam states, the ZeRO paper's
  accounting (Rajbhandari et al. 2020, section 3.1): 2 + 2 + (4 + 4 + 4) = 16 B, "K = 12".
- ``mixed-bf16-fp32grads``: Megatron-LM's default with ``accumulate_allreduce_grads_in_fp32``: bf16 params,
  fp32 main grads, fp32 main params, fp32 Adam states = 2 + 4 + 4 + 8 = 18 B
  (megatron/training/theoretical_memory_usage.py).
- ``pure-bf16``: bf16 weights and gradients updated in place, fp32 Adam states, no master copy: the seed
  article's "mixed precision" 2 + 2 + 8 = 12 B.
- ``pure-bf16-bf16states``: everything in bf16 (e.g. ``torch.optim.AdamW`` on a ``model.bfloat16()``): 8 B.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import unknown_choice

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}

FP32_STATE_OPTIMIZERS = ("adamw", "adam")
"""Optimizers whose states a recipe may keep in fp32 over half-precision parameters without a master copy."""


@dataclass(frozen=True)
class Recipe:
    name: str
    weights: str
    """dtype of the parameters the model holds (what ``model.parameters()`` are)."""
    gradients: str
    """dtype of ``param.grad`` (or of the fp32 main-grad buffer when that replaces it)."""
    master_weights: str | None
    """dtype of the separate optimizer-owned copy of the weights, None when the optimizer updates them in place."""
    optimizer_states: str
    """dtype of the optimizer's per-parameter states (for optimizers that keep them in a float dtype)."""
    compute: str
    """dtype the matmuls run in, hence of most saved activations."""
    autocast: bool
    """torch.autocast over fp32 weights: half copies of weights and Linear inputs are made on the fly."""
    description: str

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.weights]

    @property
    def gradient_bytes(self) -> int:
        return DTYPE_BYTES[self.gradients]

    @property
    def master_bytes(self) -> int:
        return DTYPE_BYTES[self.master_weights] if self.master_weights else 0

    @property
    def state_bytes(self) -> int:
        return DTYPE_BYTES[self.optimizer_states]

    def state_bytes_for(self, optimizer: str) -> int:
        """Bytes per state element for ``optimizer`` under this recipe. The states follow the tensors the optimizer
        updates: the fp32 masters where there are some, else the parameters. ``pure-bf16``'s fp32 states without a
        master copy are an Adam/AdamW implementation choice (torchao's and DeepSpeed's bf16 optimizers); torch's
        SGD momentum, Lion, Adafactor and Muon keep their states in the parameters' dtype."""
        if self.master_weights or optimizer in FP32_STATE_OPTIMIZERS:
            return self.state_bytes
        return min(self.state_bytes, self.weight_bytes)

    @property
    def persistent_gradients(self) -> bool:
        """fp32 gradients of half weights live in a buffer allocated once and zeroed, not freed, between steps
        (Megatron-LM's ``main_grad``): they exist in every phase."""
        return self.gradients == "fp32" and self.weights != "fp32"

    @property
    def loss_scaling(self) -> bool:
        """fp16 compute needs a (dynamic) loss scale to keep small gradients from underflowing."""
        return self.compute == "fp16"


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("fp32", "fp32", "fp32", None, "fp32", "fp32", False, "Everything in fp32."),
        Recipe("amp-bf16", "fp32", "fp32", None, "fp32", "bf16", True,
               "torch.autocast(bfloat16) over fp32 weights, gradients and optimizer."),
        Recipe("amp-fp16", "fp32", "fp32", None, "fp32", "fp16", True,
               "torch.autocast(float16) over fp32 weights with GradScaler."),
        Recipe("mixed-bf16", "bf16", "bf16", "fp32", "fp32", "bf16", False,
               "bf16 weights and gradients, fp32 master weights and states (DeepSpeed/ZeRO bf16)."),
        Recipe("mixed-fp16", "fp16", "fp16", "fp32", "fp32", "fp16", False,
               "fp16 weights and gradients, fp32 master weights and states, loss scaling (ZeRO paper)."),
        Recipe("mixed-bf16-fp32grads", "bf16", "fp32", "fp32", "fp32", "bf16", False,
               "bf16 weights, fp32 main gradients, master weights and states (Megatron-LM)."),
        Recipe("pure-bf16", "bf16", "bf16", None, "fp32", "bf16", False,
               "bf16 weights and gradients updated in place, fp32 optimizer states (the seed's 12 B/param)."),
        Recipe("pure-bf16-bf16states", "bf16", "bf16", None, "bf16", "bf16", False,
               "Everything in bf16, optimizer states included."),
    )
}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise unknown_choice("recipe", name, RECIPES) from None
