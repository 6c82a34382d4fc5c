"""Run on the CPU what a CUDA GPU would run: CUDA's autocast policy, CUDA's SDPA kernel choice, CUDA's dropout.

``trainmem trace`` executes a real transformers step on fake CPU tensors. Three things the CPU does differently from
a GPU change which tensors exist and in which dtype, so the trace replaces them for its duration:

- **Autocast.** ``torch.autocast("cpu")`` and ``torch.autocast("cuda")`` cast different op lists. On CUDA,
  ``softmax``, ``log_softmax``, ``layer_norm``, ``exp``, ``pow``, ``rsqrt``, ``sum``, ``cumsum`` and the losses run in
  fp32 (``aten/src/ATen/autocast_mode.h``: ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``); on the CPU a
  ``softmax`` of a bf16 input stays bf16. :func:`cuda_autocast_policy` registers, at the ``AutocastCPU`` dispatch
  key, CUDA's policy for every op CUDA lists and a pass-through for every op only the CPU lists, with autocast's
  weight-cast cache (fp32 leaf tensors that require grad are cast once per autocast region).
- **SDPA kernel.** :func:`trainmem.kernels.sdpa_backend` applies PyTorch's CUDA selection rules (``sdp_utils.cpp``,
  ``select_sdp_backend``: flash, then memory-efficient, then math) to the actual query, key, value, mask and
  dropout, and the trace calls that kernel (its meta implementation) instead of the CPU's.
- **Dropout.** On CUDA ``F.dropout`` is the fused ``native_dropout`` and keeps a bool mask; the CPU keeps a mask in
  the input's dtype.

:func:`fake_gpu` puts these together with fake tensors and the answers a fake tensor cannot give (``item()``,
transformers' packed-sequence check, the meta ``grouped_mm``'s bf16-only rule): the trace's and the probe's device.

The GPU assumed is an Ampere-or-newer data-centre part (see :mod:`trainmem.kernels`).

Needs torch (the ``trace`` extra).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterator, Sequence

from .kernels import EFFICIENT, FLASH, flash_head_dim, sdpa_backend

LOWER = "lower_precision_fp"
FP32 = "fp32"
SET_OPT_DTYPE = "fp32_set_opt_dtype"
APPEND_DTYPE = "fp32_append_dtype"
PROMOTE = "promote"
BANNED = "banned"
PASS = "pass"
"""Ops the CPU autocast lists and CUDA's does not: they run in their inputs' dtype, as on CUDA."""

_LOWER_OPS = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "cudnn_convolution",
    "cudnn_convolution_transpose",
)
_FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
_SET_OPT_DTYPE_OPS = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                      "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                      "sum.dim_IntList")
_APPEND_DTYPE_OPS = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
_PROMOTE_OPS = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                "tensordot", "scatter_add")

CUDA_AUTOCAST_POLICY: dict[str, str] = {
    **dict.fromkeys(_LOWER_OPS, LOWER), **dict.fromkeys(_FP32_OPS, FP32),
    **dict.fromkeys(_SET_OPT_DTYPE_OPS, SET_OPT_DTYPE), **dict.fromkeys(_APPEND_DTYPE_OPS, APPEND_DTYPE),
    **dict.fromkeys(_PROMOTE_OPS, PROMOTE), "binary_cross_entropy": BANNED,
}
"""CUDA's autocast policy per ATen overload, transcribed from torch 2.13's ``ATen/autocast_mode.h`` (the
``AT_FORALL_*`` lists) and ``autocast_mode.cpp`` (``binary_cross_entropy`` is banned). tests/test_cuda_emulation.py
checks that it names exactly the overloads torch registers at the ``AutocastCUDA`` key."""


def _overload(torch: Any, name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


class _CastCache:
    """Autocast's weight-cast cache (``cached_cast`` in autocast_mode.cpp): the half copy of an fp32 leaf tensor that
    requires grad is made once per autocast region and reused by every op that reads it."""

    def __init__(self) -> None:
        self.casts: dict[int, tuple[weakref.ref[Any], object]] = {}

    def cast(self, torch: Any, tensor: Any, dtype: Any) -> Any:
        if not _eligible(torch, tensor) or tensor.dtype == dtype:
            return tensor
        cacheable = (dtype == torch.get_autocast_dtype("cpu") and tensor.dtype == torch.float32
                     and tensor.requires_grad and tensor.is_leaf and not tensor._is_view()
                     and torch.is_autocast_cache_enabled())
        if not cacheable:
            return tensor.to(dtype)
        hit = self.casts.get(id(tensor))
        if hit is not None and hit[0]() is tensor:
            return hit[1]
        casted = tensor.to(dtype)
        self.casts[id(tensor)] = (weakref.ref(tensor), casted)
        return casted

    def clear(self) -> None:
        self.casts.clear()


def _eligible(torch: Any, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return fn(value)


def _tensors(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    else:
        yield value


def _kernel(torch: Any, name: str, policy: str, cache: _CastCache) -> Callable[..., Any]:
    op = _overload(torch, name)
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_index = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype" and not a.kwarg_only),
                       None)

    def run(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return target(*args, **kwargs)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == PASS:
            return run(op, args, kwargs)
        if policy == BANNED:
            raise RuntimeError("torch.nn.functional.binary_cross_entropy is unsafe to autocast (CUDA autocast bans it)")
        if policy in (SET_OPT_DTYPE, APPEND_DTYPE):
            eligible = _eligible(torch, args[0])
            if policy == APPEND_DTYPE:
                dtype = torch.float32 if eligible else args[0].dtype
                return run(_overload(torch, _APPEND_DTYPE_OPS[name]), args, dict(kwargs, dtype=dtype))
            if eligible:
                if dtype_index is not None and len(args) > dtype_index:
                    if args[dtype_index] is None:
                        args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = dict(kwargs, dtype=torch.float32)
            return run(op, args, kwargs)
        lower = torch.get_autocast_dtype("cpu")
        if policy == LOWER:
            to = lower
        elif policy == FP32:
            to = torch.float32
        else:  # PROMOTE: the widest floating dtype among the eligible inputs, starting from the lower precision
            to = lower
            for t in _tensors(list(args) + list(kwargs.values())):
                if _eligible(torch, t):
                    to = torch.promote_types(to, t.dtype)
        cast = lambda t: cache.cast(torch, t, to)  # noqa: E731
        args = tuple(_map_tensors(a, cast) for a in args)
        kwargs = {k: _map_tensors(v, cast) for k, v in kwargs.items()}
        return run(op, args, kwargs)

    return kernel


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """While active, ``torch.autocast("cpu", dtype=...)`` casts what ``torch.autocast("cuda", dtype=...)`` casts."""
    import torch

    cache = _CastCache()
    cpu_only = {name.split("::", 1)[1] for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")}
    policies = {name: PASS for name in cpu_only}
    policies.update({name: p for name, p in CUDA_AUTOCAST_POLICY.items() if _has_overload(torch, name)})
    library = torch.library.Library("aten", "IMPL")
    original_clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:  # the autocast context manager calls this when its outermost region ends
        cache.clear()
        original_clear()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel" for the CPU's own lists
            for name, policy in policies.items():
                library.impl(name, _kernel(torch, name, policy, cache), "AutocastCPU")
        torch.clear_autocast_cache = clear_autocast_cache
        yield
    finally:
        torch.clear_autocast_cache = original_clear
        library._destroy()  # the CPU's own autocast kernels are registered again
        cache.clear()


def _has_overload(torch: Any, name: str) -> bool:
    try:
        _overload(torch, name)
        return True
    except (AttributeError, RuntimeError):
        return False


# --------------------------------------------------------------------------------------------------------------
# SDPA: which kernel CUDA runs
# --------------------------------------------------------------------------------------------------------------

_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def _cuda_sdpa(torch: Any, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
    """``F.scaled_dot_product_attention`` as on CUDA: autocast's cast (SDPA is on its lower-precision list), then
    the kernel :func:`sdpa_backend` picks, called below autocast as the autocast wrapper does."""
    if torch.is_autocast_enabled("cpu"):
        half = torch.get_autocast_dtype("cpu")
        cast: Callable[[Any], Any] = lambda t: t.to(half) if _eligible(torch, t) else t  # noqa: E731
        query, key, value, attn_mask = cast(query), cast(key), cast(value), cast(attn_mask)
    backend = sdpa_backend(
        dtype=_DTYPE_NAMES.get(str(query.dtype), "fp32"), head_dim_qk=query.shape[-1], head_dim_v=value.shape[-1],
        q_heads=query.shape[-3], kv_heads=key.shape[-3], has_mask=attn_mask is not None, enable_gqa=enable_gqa,
        q_len=query.shape[-2], kv_len=key.shape[-2], is_causal=is_causal,
        storage_offsets=(query.storage_offset(), key.storage_offset(), value.storage_offset()),
        last_dim_contiguous=all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (query, key, value)))
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    with torch._C._ExcludeDispatchKeyGuard(excluded):
        if backend == FLASH:
            head_dim = query.shape[-1]
            pad = flash_head_dim(head_dim) - head_dim  # attention.cpp pads the head dim for the flash kernel
            if pad:
                query, key, value = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale or head_dim ** -0.5)[0]
            return out[..., :head_dim] if pad else out
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # convert_boolean_attn_mask (aten/src/ATen/native/transformers/attention.cpp): one float mask made in
            # the query's dtype, ``at::where(mask, 0.0, at::scalar_tensor(-inf, dtype))`` (the real CPU run makes the
            # same); no fp32 mask cast afterwards, no logical_not (as was emulated: under autocast an fp32 s x s
            # mask beside its half cast, 1.5x the bytes, at a checkpointed recompute's peak)
            attn_mask = torch.where(attn_mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=query.dtype,
                                                                        device=attn_mask.device))
        if backend == EFFICIENT:
            if attn_mask is not None:
                attn_mask = _mem_efficient_mask(torch, attn_mask, query, key)
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


def _mem_efficient_mask(torch: Any, mask: Any, query: Any, key: Any) -> Any:
    """sdp::preprocess_mask: the bias's last dim padded to a multiple of 16 (a copy when it is not), then expanded
    to (batch, heads, q_len, kv_len) (a view)."""
    kv_len = key.shape[-2]
    pad = (-mask.shape[-1]) % 16
    if pad:
        mask = torch.nn.functional.pad(mask, (0, pad))[..., :kv_len]
    return mask.expand(query.shape[0], query.shape[1], query.shape[-2], kv_len)


def _cuda_dropout(torch: Any, input: Any, p: float, train: bool) -> Any:
    """aten::dropout on CUDA (aten/src/ATen/native/Dropout.cpp): the fused native_dropout, which keeps a bool mask,
    when 0 < p < 1 (``is_fused_kernel_acceptable``); the CPU keeps a mask in the input's dtype instead."""
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    if train and p == 1:
        return input.mul(input.new_zeros(()))
    return input  # _dropout_impl: p == 0, eval mode or an empty input return the input itself


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """While active, ``aten::scaled_dot_product_attention`` and ``aten::dropout`` run what CUDA runs. Both are
    registered at the ``AutogradCPU`` key, which takes precedence over their composite CPU implementation, so every
    caller is covered: transformers' attention functions, ``nn.Dropout``, the math SDPA kernel's own dropout, and a
    checkpointed layer's recompute inside the autograd engine (where Python function modes are not active)."""
    import torch

    library = torch.library.Library("aten", "IMPL")

    def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                                     is_causal: bool = False, scale: float | None = None,
                                     enable_gqa: bool = False) -> Any:
        return _cuda_sdpa(torch, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def dropout(input: Any, p: float, train: bool) -> Any:
        return _cuda_dropout(torch, input, p, train)

    flash_backward_op = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    below_autograd = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU)

    def flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        workspace = _flash_backward_workspace(torch, query, key)
        with torch._C._ExcludeDispatchKeyGuard(below_autograd):
            grads = flash_backward_op(grad_out, query, key, value, *args, **kwargs)
        del workspace
        return grads

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            library.impl("scaled_dot_product_attention", scaled_dot_product_attention, "AutogradCPU")
            library.impl("dropout", dropout, "AutogradCPU")
            library.impl("_scaled_dot_product_flash_attention_backward", flash_backward, "AutogradCPU")
        yield
    finally:
        library._destroy()


def _flash_backward_workspace(torch: Any, query: Any, key: Any) -> list[Any]:
    """What CUDA's flash backward allocates beside dq, dk and dv (flash_api.cpp ``mha_bwd``; the meta kernel
    allocates only those): fp32 ``softmax_d`` (b, a, round128(s)), an fp32 ``dq_accum`` (b, round128(s), a,
    head dim rounded to 32, or 64 above 128), and with fewer key/value heads dk and dv expanded to every head."""
    b, a, s, d = query.shape
    rounded_s = -(-s // 128) * 128
    multiple = 32 if d <= 128 else 64
    rounded_d = -(-d // multiple) * multiple
    workspace = [query.new_empty((b, a, rounded_s), dtype=torch.float32),
                 query.new_empty((b, rounded_s, a, rounded_d), dtype=torch.float32)]
    if key.shape[1] != a:
        workspace += [query.new_empty((b, s, a, d)), query.new_empty((b, s, a, d))]
    return workspace


@contextlib.contextmanager
def cuda_layer_norm_statistics() -> Iterator[None]:
    """``native_layer_norm`` on CUDA returns its mean and rstd in the accumulation type, fp32 for half inputs
    (aten/src/ATen/native/cuda/layer_norm_kernel.cu, ``acc_type``), and backward keeps them; on the CPU they are
    in the input's dtype. Fake tensors follow the CPU (torch/_refs ``native_layer_norm``: ``if input.device.type in
    ["cpu", "mtia"]``), so for the duration of a trace their LayerNorm keeps CUDA's."""
    import torch
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.aten.native_layer_norm.default
    original = fake_impls.op_implementations_dict.get(op)

    def native_layer_norm_fake(fake_mode: Any, func: Any, input: Any, normalized_shape: Sequence[int],
                               weight: Any = None, bias: Any = None, eps: float = 1e-5) -> tuple[Any, Any, Any]:
        with fake_mode:
            out = torch.empty_like(input, memory_format=torch.contiguous_format)
            stats_shape = tuple(input.shape[:input.dim() - len(normalized_shape)]) + (1,) * len(normalized_shape)
            acc = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
            return out, input.new_empty(stats_shape, dtype=acc), input.new_empty(stats_shape, dtype=acc)

    fake_impls.op_implementations_dict[op] = native_layer_norm_fake
    FakeTensorMode.cache.clear()  # results cached under the CPU's rule must not be reused
    try:
        yield
    finally:
        if original is None:
            fake_impls.op_implementations_dict.pop(op, None)
        else:
            fake_impls.op_implementations_dict[op] = original
        FakeTensorMode.cache.clear()


@contextlib.contextmanager
def emulate_cuda() -> Iterator[None]:
    """CUDA's autocast policy, kernels and LayerNorm statistics, for the duration of a trace."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with cuda_autocast_policy(), cuda_kernels(), cuda_layer_norm_statistics():
        FakeTensorMode.cache.clear()
        try:
            yield
        finally:
            FakeTensorMode.cache.clear()


@contextlib.contextmanager
def scalars_from_fake_tensors() -> Iterator[None]:
    """``Tensor.item()`` on a fake tensor has no value to return; optimizers that read one (Adafactor's update
    clipping and relative step size: ``param.norm(2).item()``) get 1.0, which changes no tensor's size."""
    import torch

    original = torch.Tensor.item
    torch.Tensor.item = lambda self: 1.0 if self.is_floating_point() else 1
    try:
        yield
    finally:
        torch.Tensor.item = original


@contextlib.contextmanager
def grouped_mm_fallback_for_non_bf16() -> Iterator[None]:
    """The fake (meta) ``grouped_mm`` accepts bf16 only, so routed experts with fp32 or fp16 weights take
    transformers' own fallback (``transformers::grouped_mm_fallback``), which keeps the same tensors for backward
    (the gathered input and the weights) and returns the same output."""
    from transformers.integrations import moe

    original = moe._can_use_grouped_mm

    def can_use_grouped_mm(input: Any, weight: Any, offs: Any) -> bool:
        import torch

        # grouped_mm also needs 16-byte aligned strides (a GPU run with such a config fails).
        aligned = all(stride == 1 or stride * t.element_size() % 16 == 0 for t in (input, weight)
                      for stride in t.stride())
        return weight.dtype == torch.bfloat16 and aligned and original(input, weight, offs)

    moe._can_use_grouped_mm = can_use_grouped_mm
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@contextlib.contextmanager
def unpacked_batches() -> Iterator[None]:
    """Without a KV cache (use_cache is off under checkpointing) transformers checks position_ids for packed
    sequences, a data-dependent check that fake tensors cannot answer, so it would build a dense causal mask (and
    SDPA would then repeat k and v to every head) where a real run with one sequence per row builds none. The
    trace's batches are one sequence per row, which is what the real check finds."""
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # older transformers: no packed-sequence detection
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def fake_gpu(emulate: str = "cuda") -> Iterator[None]:
    """Fake tensors behaving as on a GPU: CUDA's autocast policy and kernels (``emulate="cuda"``), transformers'
    data-dependent checks answered as a real run answers them, and ops that need a value given one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device_behaviour = emulate_cuda() if emulate == "cuda" else contextlib.nullcontext()
    with FakeTensorMode(), unpacked_batches(), scalars_from_fake_tensors(), grouped_mm_fallback_for_non_bf16(), \
            device_behaviour:
        yield
