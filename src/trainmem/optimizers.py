"""Optimizer states: the bytes each optimizer keeps per parameter tensor, from its real implementation.

Every optimizer here computes its state size tensor by tensor (some states depend on shape, not only on
the element count), from the parameter tensors of a :class:`~trainmem.models.ModelSpec`.
The per-step scalar ``state["step"]`` is left out: torch keeps it on the CPU unless ``fused`` or
``capturable`` is set, and it is 4 bytes per tensor when it is on the device.

Sources:
- adamw/adam: ``exp_avg`` and ``exp_avg_sq``, ``torch.zeros_like(p)`` (torch/optim/adamw.py, adam.py).
- sgd: no state without momentum; sgd-momentum: ``momentum_buffer`` (torch/optim/sgd.py).
- lion: one ``exp_avg`` (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"; lion-pytorch).
- adafactor: ``row_var`` with the last dim reduced to 1 and ``col_var`` with the second-to-last reduced to 1
  for tensors of 2+ dims, a full ``variance`` for 1-D tensors, no first moment
  (torch/optim/_adafactor.py, ``_init_group``; Shazeer & Stern 2018).
- adamw-8bit / paged-adamw-8bit: bitsandbytes ``Optimizer2State.init_state``: two uint8 states plus, per state,
  one fp32 ``absmax`` per block of 256 elements (block-wise quantisation, Dettmers et al. 2022); tensors with
  fewer than ``min_8bit_size = 4096`` elements keep two fp32 states. The two 256-entry fp32 quantisation maps
  are shared by all tensors.
- paged-adamw-8bit: bitsandbytes ``Optimizer8bit.get_state_buffer`` (optim/optimizer.py, 0.50) allocates a
  state with ``F.get_paged`` (functional.py: ``lib.cget_managed_ptr``, i.e. ``cudaMallocManaged``, wrapped with
  ``torch.frombuffer`` and registered with ``GlobalPageManager``) when the optimizer ``is_paged`` and the parameter
  has ``p.numel() >= 1e5`` elements; smaller tensors' states, the ``absmax`` blocks and the quantisation maps are
  ordinary ``torch.zeros`` on the device. Unified memory bypasses torch's caching allocator, so
  ``torch.cuda.max_memory_allocated()`` does not count it, and the driver can evict it to host memory under
  pressure: :meth:`Optimizer.paged_bytes` is reported apart from the allocated figures.
- muon: ``momentum_buffer`` for 2-D weights inside the decoder layers (torch/optim/_muon.py accepts only 2-D
  parameters; its docstring and Keller Jordan's reference recipe train embeddings, the LM head, norms, biases and
  other non-2-D tensors with AdamW), AdamW's two states for the rest.

Step temporaries (``Optimizer.step_temporaries``): a foreach implementation computes over all of a group's
tensors at once, so ``foreach_temporaries`` parameter-sized buffers exist (AdamW's ``_foreach_sqrt``). Muon is
``torch.optim.Muon`` for the 2-D decoder-layer weights, which torch runs one tensor at a time
(``_single_tensor_muon``; ``foreach=True`` raises), stepped before ``torch.optim.AdamW`` (foreach) for the rest,
as torch's Muon docstring shows: its temporaries are the larger of Muon's worst single tensor
(:func:`muon_tensor_temporaries`) and AdamW's foreach buffer over the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .errors import unknown_choice
from .models import ParamGroup, ParamTensor

BNB_BLOCK_SIZE = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_QMAP_BYTES = 2 * 256 * 4
BNB_PAGED_MIN_NUMEL = 100_000
"""``get_state_buffer``: ``if not self.is_paged or p.numel() < 1e5: torch.zeros_like(...)``, else paged."""


def _adam(t: ParamTensor, state_bytes: int) -> int:
    return 2 * t.numel * state_bytes


def _one_state(t: ParamTensor, state_bytes: int) -> int:
    return t.numel * state_bytes


def _no_state(t: ParamTensor, state_bytes: int) -> int:
    return 0


def _adafactor(t: ParamTensor, state_bytes: int) -> int:
    if len(t.shape) < 2:
        return t.numel * state_bytes
    row = math.prod(t.shape[:-1])  # shape with the last dim set to 1
    col = math.prod(t.shape[:-2]) * t.shape[-1]  # shape with the second-to-last dim set to 1
    return (row + col) * state_bytes


def _adam_8bit(t: ParamTensor, state_bytes: int) -> int:
    if t.numel < BNB_MIN_8BIT_SIZE:
        return 2 * t.numel * 4
    blocks = -(-t.numel // BNB_BLOCK_SIZE)
    return 2 * (t.numel * 1 + blocks * 4)


def _adam_8bit_paged(t: ParamTensor, state_bytes: int) -> int:
    """The bytes of ``_adam_8bit`` that bitsandbytes allocates in unified memory: the two uint8 states of a
    tensor with at least 1e5 elements (past min_8bit_size, so 8-bit); its absmax blocks stay on the device."""
    return 2 * t.numel if t.numel >= BNB_PAGED_MIN_NUMEL else 0


MUON_NS_STEPS = 5
"""torch.optim.Muon's default ``ns_steps`` (torch/optim/_muon.py, DEFAULT_NS_STEPS)."""


def muon_tensor_temporaries(shape: tuple[int, ...], grad_bytes: int, ns_steps: int = MUON_NS_STEPS) -> int:
    """Bytes alive at once inside ``torch.optim.Muon``'s step of one (m, n) matrix whose gradient (and momentum
    buffer) have ``grad_bytes`` per element, at the Newton-Schulz peak (torch/optim/_muon.py, torch 2.13):

    - ``update = grad.lerp(buf, momentum)`` (nesterov, the default): m x n in the gradient's dtype, held by
      ``_single_tensor_muon`` for the whole ``_zeropower_via_newtonschulz`` call;
    - ``ortho_grad = grad.bfloat16()``: an m x n bf16 copy (the tensor itself when it is bf16 already), transposed
      (a view) so that it is s x l, s = min(m, n);
    - per iteration ``gram_matrix = X @ X.T`` and ``gram_update = addmm(gram, gram, gram)``, s x s bf16 each, then
      ``X = addmm(X, gram_update, X)``, a new s x l bf16. From the second iteration the previous gram matrices are
      still bound while the new ones are made (three s x s at once), and the old X while the new X is made (two
      s x l beside two s x s).

    The peak is ``update + max(2 X + 2 gram, X + 3 gram)``; with one iteration, ``update + 2 X + 2 gram``
    (or ``X + 2 gram`` beside a bf16 ``update``, which is the first X)."""
    m, n = shape
    s = min(m, n)
    update, x, gram = m * n * grad_bytes, m * n * 2, s * s * 2
    if ns_steps <= 0:
        return update + (x if grad_bytes != 2 else 0)
    first = update + (x if grad_bytes != 2 else 0) + x + 2 * gram
    later = update + max(2 * x + 2 * gram, x + 3 * gram) if ns_steps > 1 else 0
    return max(first, later)


def _is_muon_matrix(group: ParamGroup, t: ParamTensor) -> bool:
    """What trainmem's ``muon`` gives to torch.optim.Muon: 2-D weights of the decoder layers."""
    return group.is_layer and len(t.shape) == 2


def _muon_step_temporaries(groups: Sequence[ParamGroup], numel: int, state_bytes: int) -> int:
    """torch.optim.Muon over the 2-D decoder-layer weights (one tensor at a time: its worst tensor), then foreach
    AdamW over the rest (one buffer the size of the rest, in the state dtype); the larger of the two, since each
    frees its temporaries before the other steps. ``numel`` is the elements this rank updates: the rest's share
    of it is the rest's share of the model (a sharded rank's Muon still orthogonalises whole matrices)."""
    muon_numel = sum(g.repeat * t.numel for g in groups for t in g.tensors if _is_muon_matrix(g, t))
    total = sum(g.numel for g in groups)
    rest = numel if total == 0 else numel * (total - muon_numel) // total
    worst = max((muon_tensor_temporaries(t.shape, state_bytes) for g in groups for t in g.tensors
                 if _is_muon_matrix(g, t)), default=0)
    return max(worst, rest * state_bytes)


StepTemporariesFn = Callable[[Sequence[ParamGroup], int, int], int]
"""(the model's parameter groups, the elements the optimizer updates, bytes per state element) -> bytes."""


@dataclass(frozen=True)
class Optimizer:
    name: str
    states: str
    """What the optimizer keeps, in words."""
    state_fn: Callable[[ParamTensor, int], int]
    """Bytes of state for one tensor, given the recipe's state dtype size."""
    fixed_bytes: int = 0
    """State shared by all tensors (bitsandbytes' quantisation maps)."""
    needs_shapes: bool = False
    """The state size depends on tensor shapes, so a bare parameter count is not enough."""
    layer_matrices_only_fn: Callable[[ParamTensor, int], int] | None = None
    """For optimizers that treat 2-D decoder-layer weights differently (Muon)."""
    nominal_bytes_per_param: float | None = None
    """Bytes per parameter at 4-byte states, for the recipes table (None where it depends on shapes)."""
    paged: bool = False
    paged_fn: Callable[[ParamTensor, int], int] | None = None
    """Of ``state_fn``'s bytes, those allocated in CUDA unified memory (paged optimizers), not by torch."""
    source: str = ""
    fused_available: bool = False
    """A fused implementation exists (``fused=True`` in torch.optim, bitsandbytes' kernels): no parameter-sized
    temporaries in step(). Without one, ``--optimizer-impl fused`` is rejected."""
    foreach_temporaries: int = 0
    """Parameter-sized temporaries (in the state dtype) of the foreach implementation's step: AdamW's
    ``_foreach_sqrt(exp_avg_sqs)``, Adafactor's ``row_var @ col_var`` estimates; 0 for SGD."""
    step_temporaries_fn: StepTemporariesFn | None = None
    """The non-fused step's temporaries where they are not ``foreach_temporaries`` parameter-sized buffers (Muon:
    one tensor at a time, beside AdamW for the rest); None for the foreach shape."""

    def step_temporaries(self, groups: Sequence[ParamGroup], numel: int, state_dtype_bytes: int) -> int:
        """Bytes of temporaries of a non-fused ``step()`` updating ``numel`` elements of ``groups``' tensors."""
        if self.step_temporaries_fn is not None:
            return self.step_temporaries_fn(groups, numel, state_dtype_bytes)
        return self.foreach_temporaries * numel * state_dtype_bytes

    def state_bytes(self, groups: Iterable[ParamGroup], state_dtype_bytes: int) -> int:
        total = self.fixed_bytes
        for group in groups:
            for t in group.tensors:
                fn = self.state_fn
                if self.layer_matrices_only_fn and _is_muon_matrix(group, t):
                    fn = self.layer_matrices_only_fn
                total += group.repeat * fn(t, state_dtype_bytes)
        return total

    def paged_bytes(self, groups: Iterable[ParamGroup], state_dtype_bytes: int) -> int:
        """Of :meth:`state_bytes`, the bytes in unified memory (0 unless the optimizer is paged)."""
        if self.paged_fn is None:
            return 0
        return sum(group.repeat * self.paged_fn(t, state_dtype_bytes) for group in groups for t in group.tensors)

    def bytes_per_param(self, state_dtype_bytes: int) -> float | None:
        """Bytes per parameter for a large dense tensor (what the recipes table shows)."""
        if self.needs_shapes:
            return None
        big = ParamTensor("w", (1 << 20,))
        return self.state_fn(big, state_dtype_bytes) / big.numel


OPTIMIZERS: dict[str, Optimizer] = {
    o.name: o
    for o in (
        Optimizer("adamw", "exp_avg + exp_avg_sq", _adam, source="torch/optim/adamw.py", fused_available=True,
                  foreach_temporaries=1),
        Optimizer("adam", "exp_avg + exp_avg_sq", _adam, source="torch/optim/adam.py", fused_available=True,
                  foreach_temporaries=1),
        Optimizer("sgd", "none (momentum=0)", _no_state, source="torch/optim/sgd.py", fused_available=True),
        Optimizer("sgd-momentum", "momentum_buffer", _one_state, source="torch/optim/sgd.py", fused_available=True),
        Optimizer("lion", "exp_avg", _one_state, source="Chen et al. 2023; lion-pytorch", foreach_temporaries=1),
        Optimizer("adafactor", "factored row_var + col_var (full variance for 1-D)", _adafactor,
                  needs_shapes=True, source="torch/optim/_adafactor.py", foreach_temporaries=1),
        Optimizer("adamw-8bit", "2 x uint8 + fp32 absmax per 256-element block", _adam_8bit,
                  fixed_bytes=BNB_QMAP_BYTES, source="bitsandbytes optim/optimizer.py Optimizer2State",
                  fused_available=True),
        Optimizer("paged-adamw-8bit", "as adamw-8bit, in evictable unified memory", _adam_8bit,
                  fixed_bytes=BNB_QMAP_BYTES, paged=True, paged_fn=_adam_8bit_paged,
                  source="bitsandbytes optim/optimizer.py Optimizer2State, get_state_buffer",
                  fused_available=True),
        Optimizer("muon", "momentum_buffer for 2-D layer weights, AdamW states for the rest", _adam,
                  needs_shapes=True, layer_matrices_only_fn=_one_state, source="torch/optim/_muon.py",
                  foreach_temporaries=1, step_temporaries_fn=_muon_step_temporaries),
    )
}


TRACEABLE_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "muon")
"""Optimizers torch itself implements, which trace and measure run (muon: torch.optim.Muon with torch.optim.AdamW
for the rest, step.py's MuonWithAdamW); the others' states follow their libraries' documented layouts
(bitsandbytes, the Lion paper) without a run to check them."""


def get_optimizer(name: str) -> Optimizer:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise unknown_choice("optimizer", name, OPTIMIZERS) from None
