"""torchtune's compiled per-slice loss as inductor runs it: the buffers of the program inductor generates.

torchtune's ``compile_loss`` wraps ``CEWithChunkedOutputLoss.compute_cross_entropy`` (torchtune/modules/loss/
ce_chunked_output_loss.py: ``F.cross_entropy(logits.float(), labels, reduction="sum")`` on one slice of the
sequence) in ``torch.compile`` with its default backend, inductor. Inductor fuses the upcast, log_softmax and
nll_loss into one kernel each way, so no vocabulary-wide fp32 tensor exists: the forward writes two values per row,
which the partitioner saves (with the slice's logits, the loss's own input), and the backward writes the logits'
gradient in the logits' dtype straight from them. ``FORWARD`` and ``BACKWARD`` are the buffers inductor's generated
wrapper allocates (``empty_strided``), in its order; tests/test_compiled_loss.py compiles the loss with inductor
and reads them back from the code it generates (torch 2.13, its C++ backend on this machine's CPU: the graph and
the partitioner's choice are the backend's input, Triton's kernels on a GPU are not validated here).

The estimate counts these buffers (activations.py, timeline.py); the trace runs ``slice_loss(torch)``, which
allocates the same buffers for fake tensors (FakeTensorMode cannot run inductor's kernels) and runs inductor itself
for real ones (``trainmem measure``). Torch is imported only by ``slice_loss``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

FP32 = 4

Shape = Literal["row", "vocabulary", "scalar"]
"""rows x 1, rows x vocabulary, or one value: the slice's rows are its tokens."""
Role = Literal["saved", "temporary", "output"]


@dataclass(frozen=True)
class Buffer:
    """One buffer of the generated program."""

    name: str
    shape: Shape
    in_logits_dtype: bool
    """The logits' own dtype (the compute dtype), else fp32."""
    role: Role
    """saved for backward, freed when its kernel ends, or the program's result."""

    def bytes(self, rows: int, vocab: int, logits_bytes: int) -> int:
        count = {"row": rows, "vocabulary": rows * vocab, "scalar": 1}[self.shape]
        return count * (logits_bytes if self.in_logits_dtype else FP32)

    def dims(self, rows: int, vocab: int) -> tuple[int, ...]:
        return {"row": (rows, 1), "vocabulary": (rows, vocab), "scalar": ()}[self.shape]


FORWARD = (
    Buffer("row max (amax)", "row", False, "saved"),
    Buffer("row log-sum-exp", "row", False, "saved"),
    Buffer("loss", "scalar", False, "output"),
)
BACKWARD = (
    Buffer("row sum of log_softmax's gradient", "row", False, "temporary"),
    Buffer("logits gradient", "vocabulary", True, "output"),
)


def total(buffers: tuple[Buffer, ...], role: Role, rows: int, vocab: int, logits_bytes: int) -> int:
    return sum(b.bytes(rows, vocab, logits_bytes) for b in buffers if b.role == role)


def backward_bytes(rows: int, vocab: int, logits_bytes: int) -> int:
    """What one slice's backward holds besides its saved tensors while its kernel runs: the logits' gradient and
    the row temporary."""
    return sum(b.bytes(rows, vocab, logits_bytes) for b in BACKWARD if b.role != "saved")


_EMPTY = re.compile(r"empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")


def generated_buffers(code: str) -> list[tuple[tuple[int, ...], str]]:
    """The (shape, dtype) of every buffer a generated inductor module's ``call`` allocates, in order (a buffer
    reused in place, ``reinterpret_tensor``, is not a new one)."""
    found = []
    for match in _EMPTY.finditer(code.split("def call(", 1)[-1]):
        dims = tuple(int(d) for d in match.group(1).split(",") if d.strip())
        found.append((dims, match.group(2)))
    return found


def cross_entropy_sum(torch: Any, logits: Any, target: Any) -> Any:
    """CEWithChunkedOutputLoss.compute_cross_entropy."""
    return torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=-100, reduction="sum")


def slice_loss(torch: Any) -> Callable[[Any, Any], Any]:
    """The compiled per-slice loss: inductor's for real tensors, its buffers for fake ones."""
    from torch._subclasses.fake_tensor import is_fake

    compiled = torch.compile(lambda logits, target: cross_entropy_sum(torch, logits, target), backend="inductor")

    def allocate(like: Any, buffer: Buffer, rows: int, vocab: int) -> Any:
        dtype = like.dtype if buffer.in_logits_dtype else torch.float32
        return like.new_empty(buffer.dims(rows, vocab), dtype=dtype)

    class InductorBuffers(torch.autograd.Function):  # type: ignore[misc]
        @staticmethod
        def forward(ctx: Any, logits: Any, target: Any) -> Any:
            rows, vocab = logits.shape
            made = [allocate(logits, b, rows, vocab) for b in FORWARD]
            ctx.save_for_backward(logits, target, *[t for t, b in zip(made, FORWARD) if b.role == "saved"])
            (loss,) = [t for t, b in zip(made, FORWARD) if b.role == "output"]
            return loss

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            logits = ctx.saved_tensors[0]
            rows, vocab = logits.shape
            made = [allocate(logits, b, rows, vocab) for b in BACKWARD]
            (logits_grad,) = [t for t, b in zip(made, BACKWARD) if b.role == "output"]
            return logits_grad, None

    def run(logits: Any, target: Any) -> Any:
        if is_fake(logits):
            return InductorBuffers.apply(logits, target)
        return compiled(logits, target)

    return run
