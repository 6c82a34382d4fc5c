"""torchtune's compiled per-slice loss: the buffers compiled_loss.py says inductor allocates are the ones the code
inductor generates allocates, and the trace's stand-in for fake tensors allocates those same buffers."""

import pytest

from trainmem import compiled_loss
from trainmem.compiled_loss import BACKWARD, FORWARD

torch = pytest.importorskip("torch")

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _expected(buffers, rows, vocab, dtype):
    return [(b.dims(rows, vocab), DTYPE_NAMES[dtype] if b.in_logits_dtype else "float32") for b in buffers]


@pytest.mark.slow
@pytest.mark.parametrize("rows, vocab, dtype", [(100, 1000, torch.bfloat16)])  # (fp32 alike: one compile for CI)
def test_inductor_generates_the_buffers_the_estimate_counts(rows, vocab, dtype):
    """Compile CEWithChunkedOutputLoss.compute_cross_entropy with inductor (its C++ backend, on this CPU), run a
    forward and a backward, and read what the generated wrappers allocate: two fp32 values per row and the scalar
    loss forward, one fp32 value per row and the logits' gradient (in their dtype) backward; no vocabulary-wide fp32
    buffer either way."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    loss = torch.compile(lambda x, y: compiled_loss.cross_entropy_sum(torch, x, y), backend="inductor",
                         dynamic=False)
    logits = torch.randn(rows, vocab, dtype=dtype, requires_grad=True)
    target = torch.randint(0, vocab, (rows,))

    def step():
        loss(logits, target).backward()

    _, codes = run_and_get_code(step)
    assert len(codes) == 2  # the forward's module, then the backward's
    assert compiled_loss.generated_buffers(codes[0]) == _expected(FORWARD, rows, vocab, dtype)
    assert compiled_loss.generated_buffers(codes[1]) == _expected(BACKWARD, rows, vocab, dtype)
    expected = torch.nn.functional.cross_entropy(logits.detach().float(), target, reduction="sum")
    assert torch.allclose(loss(logits, target).detach(), expected, rtol=1e-2)


def test_the_trace_allocates_inductors_buffers_for_fake_tensors():
    """Under FakeTensorMode (the trace) the loss saves the logits, the labels and the two per-row values, and its
    backward returns the logits' gradient in their dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rows, vocab = 24, 333
    run = compiled_loss.slice_loss(torch)
    with FakeTensorMode():
        logits = torch.empty(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
        target = torch.zeros(rows, dtype=torch.long)
        value = run(logits, target)
        saved = value.grad_fn.saved_tensors
        assert [tuple(t.shape) for t in saved] == [(rows, vocab), (rows,), (rows, 1), (rows, 1)]
        assert value.shape == () and value.dtype == torch.float32
        value.backward()
        assert logits.grad.shape == (rows, vocab) and logits.grad.dtype == torch.bfloat16


def test_byte_counts_follow_the_program():
    rows, vocab = 512, 128_256
    assert compiled_loss.total(FORWARD, "saved", rows, vocab, 2) == 2 * 4 * rows
    assert compiled_loss.total(FORWARD, "temporary", rows, vocab, 2) == 0
    assert compiled_loss.backward_bytes(rows, vocab, 2) == rows * vocab * 2 + 4 * rows


def test_generated_buffers_reads_a_wrapper():
    code = """
def call(self, args):
    buf0 = empty_strided_cpu((100, 1), (1, 1), torch.float32)
    buf1 = empty_strided_cpu((100, 1), (1, 100), torch.float32)
    buf2 = reinterpret_tensor(buf1, (100, 1), (1, 1), 0); del buf1  # reuse
    buf3 = empty_strided_cuda((), (), torch.bfloat16)
"""
    assert compiled_loss.generated_buffers(code) == [((100, 1), "float32"), ((100, 1), "float32"), ((), "bfloat16")]
