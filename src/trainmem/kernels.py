"""Which attention kernel a CUDA GPU runs, and what it keeps: PyTorch's SDPA selection rules as data, torch-free.

The estimator (activations.py) and the trace's CUDA emulation (cuda_emulation.py) both call :func:`sdpa_backend`,
so the estimate models the kernel the trace runs; tests/test_cuda_emulation.py pins each rule with a case that
passes and one that fails it.

The GPU assumed is an Ampere-or-newer data-centre part (sm80/sm90: A100, H100, H200). cuDNN attention, which
PyTorch prefers on sm90+ with cuDNN newer than 9.15 (``check_prefer_cudnn_attention``), keeps the same output and
per-row statistics as flash and takes the same inputs; it is modelled as flash.
"""

from __future__ import annotations

import math

FLASH, EFFICIENT, MATH, EAGER = "flash", "efficient", "math", "eager"

FLASH_MAX_HEAD_DIM = 256
"""``check_head_dim_size_flash``: q, k and v head dims equal and at most 256."""
FLASH_HEAD_DIM_MULTIPLE = 8
"""aten/src/ATen/native/transformers/attention.cpp pads q, k and v to a multiple of 8 for the flash kernel
(``pad_last_dim<8, false>``) and slices the output back."""
EFFICIENT_LSE_MULTIPLE = 32
"""The memory-efficient kernel's logsumexp is (batch, heads, ceil(seq / 32) * 32) fp32 (``kAlignLSE``; also
torch/_meta_registrations.py ``meta__scaled_dot_product_efficient_attention``)."""
EFFICIENT_MASK_MULTIPLE = 16
"""``sdp::preprocess_mask`` pads an attention bias's last dim to a multiple of 16 (``mem_eff_alignment``)."""


def sdpa_backend(*, dtype: str, head_dim_qk: int, head_dim_v: int, q_heads: int, kv_heads: int, has_mask: bool,
                 enable_gqa: bool, q_len: int, kv_len: int, is_causal: bool,
                 storage_offsets: tuple[int, int, int] = (0, 0, 0), last_dim_contiguous: bool = True) -> str:
    """The SDPA kernel PyTorch 2.13 selects on an sm80/sm90 GPU for dense 4-D inputs (``select_sdp_backend`` in
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp; constraints in sdp_utils_cpp.h): flash, else
    memory-efficient, else math.

    Flash (``can_use_flash_attention``): no ``attn_mask`` (``check_for_attn_mask``); fp16 or bf16
    (``check_dtypes_low_precision``); q, k and v with the same head dim, at most 256 (``check_head_dim_size_flash``);
    ``is_causal`` only with equal query and key lengths (``check_flash_causal_non_square_seqlens``); equal head counts,
    or ``enable_gqa`` with the query heads a multiple of the key/value heads
    (``check_batch_size_and_num_heads_dense<true>``); last dim contiguous.

    Memory-efficient (``can_use_mem_efficient_attention``): masks allowed; fp16, bf16 or fp32; q and k with the same
    head dim, q and v head dims multiples of the GEMM alignment, 8 for half and 4 for fp32 on sm80+
    (``check_head_dim_size_mem_efficient``, ``minimum_gemm_alignment``); storage offsets aligned the same way
    (``check_data_ptr_alignment_mem_efficient``); equal head counts: grouped-query attention is not supported
    (``check_batch_size_and_num_heads_dense<false>``; torch 2.13's header has no MQA/GQA variant for it).

    Otherwise math (``_scaled_dot_product_attention_math``), which upcasts half inputs to fp32 and keeps the s x s
    probabilities."""
    half = dtype in ("bf16", "fp16")
    same_heads = q_heads == kv_heads
    if (not has_mask and half and head_dim_qk == head_dim_v <= FLASH_MAX_HEAD_DIM
            and (not is_causal or q_len == kv_len)
            and (same_heads or (enable_gqa and q_heads % kv_heads == 0)) and last_dim_contiguous):
        return FLASH
    alignment = 8 if half else 4
    if (head_dim_qk % alignment == 0 and head_dim_v % alignment == 0 and same_heads
            and all(offset % alignment == 0 for offset in storage_offsets)):
        return EFFICIENT
    return MATH


def flash_head_dim(head_dim: int) -> int:
    """The head dim the flash kernel runs at (and keeps its inputs and output at)."""
    return math.ceil(head_dim / FLASH_HEAD_DIM_MULTIPLE) * FLASH_HEAD_DIM_MULTIPLE


def efficient_lse_per_token(heads: int, seq: int) -> float:
    """Bytes per token of the memory-efficient kernel's padded fp32 logsumexp."""
    return 4 * heads * math.ceil(seq / EFFICIENT_LSE_MULTIPLE) * EFFICIENT_LSE_MULTIPLE / seq


def efficient_mask_width(seq: int) -> int:
    """Columns of the attention bias the memory-efficient kernel keeps (padded to a multiple of 16)."""
    return math.ceil(seq / EFFICIENT_MASK_MULTIPLE) * EFFICIENT_MASK_MULTIPLE
