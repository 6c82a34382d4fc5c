"""--checkpointing op: torchtitan's per-op selective activation checkpointing, as data in one place.

torchtitan's ``selective_ac_option = "op"`` (torchtitan/parallelisms/parallelize_llama.py at 9dec370, 2024-12-26, the
commit of its benchmarks/llama3_h100_202412_torchtitan.md runs: lines 214-223 ``_save_list``, 226-283
``_apply_ac_to_transformer_block``; the same at 4d88a8a, lines 241-303)
wraps every TransformerBlock in ``ptd_checkpoint_wrapper(module, context_fn=selective_checkpointing_context_fn,
preserve_rng_state=False)`` (non-reentrant ``torch.utils.checkpoint``), whose context is
``create_selective_checkpoint_contexts(_custom_policy)`` with a fresh ``meta = defaultdict(int)`` per call. The
policy saves the output of every op in ``_save_list`` (aten.mm, the flash and memory-efficient SDPA kernels,
_c10d_functional.reduce_scatter_tensor, aten.abs and aten.max for float8) except every second aten.mm of the block's
forward (``meta["forward_mm_count"] % 2 == 0`` recomputes), and recomputes everything else in backward.

What that keeps of one decoder layer until its backward: its input (the checkpoint's argument) and the outputs of
the saved ops, which SAC's caching dispatch mode holds (torch/utils/checkpoint.py, _CachingTorchDispatchMode) until
the recompute takes them back. In transformers' Llama-like layer nn.Linear on a 3-D input without a bias runs
aten.mm on the 2-D view (aten/src/ATen/native/Linear.cpp: matmul folds the batch), with a bias aten.addmm, which is
not in ``_save_list`` and not counted. So Llama's q, k, v, o, gate, up, down count 1..7: q, v, gate and down are
saved; Qwen2 (q/k/v biased) saves o and up. The recompute replays the layer's forward, the saved ops' outputs taken
from the cache instead of run again, so in backward the layer holds what full checkpointing recreates.

No torch import at module level: the estimate reads the data, the traced step asks :func:`context_fn`.
"""

from __future__ import annotations

from typing import Any, Callable

SAVED_ATEN_OPS = ("mm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention", "abs",
                  "max")
"""torchtitan's ``_save_list`` (parallelize_llama.py at 9dec370, lines 214-223), the aten part. (Today's
torchtitan/distributed/activation_checkpoint.py, ``_get_default_save_ops``, saves every compute-intensive op of the
partitioner's list, aten.addmm and aten.bmm too, and aten.linear: not what those runs ran.)"""
SAVED_C10D_OPS = ("reduce_scatter_tensor",)
"""The rest of ``_save_list``: torch.ops._c10d_functional.reduce_scatter_tensor (sequence parallelism's)."""
COUNTED_OP = "mm"
"""The op whose every second call (2nd, 4th, ... of a layer's forward) is recomputed rather than saved."""
SDPA_KERNELS = ("flash", "efficient")
"""The attention kernels (kernels.sdpa_backend's names) whose outputs ``_save_list`` names."""


def projection_order(layer: Any) -> tuple[tuple[str, int | None, bool], ...]:
    """(name, output width, runs aten.mm) of a Llama-like layer's Linears in the order its forward calls them
    (LlamaAttention: q, k, v, o; LlamaMLP: ``down(act(gate(x)) * up(x))``, gate before up)."""
    att, mlp = layer.attention, layer.mlp
    return (("q_proj", att.num_heads * att.head_dim, not att.qkv_bias),
            ("k_proj", att.num_kv_heads * att.head_dim, not att.qkv_bias),
            ("v_proj", att.num_kv_heads * att.v_head_dim, not att.qkv_bias),
            ("o_proj", None, not att.o_bias),
            ("gate_proj", mlp.intermediate_size, not mlp.bias),
            ("up_proj", mlp.intermediate_size, not mlp.bias),
            ("down_proj", None, not mlp.bias))


def saved_projections(layer: Any, hidden: int) -> tuple[tuple[str, int], ...]:
    """(name, output width) of the Linears whose aten.mm output the policy saves: the 1st, 3rd, 5th, ... mm."""
    saved, count = [], 0
    for name, width, is_mm in projection_order(layer):
        if not is_mm:
            continue  # aten.addmm: neither in _save_list nor counted
        count += 1
        if count % 2:
            saved.append((name, hidden if width is None else width))
    return tuple(saved)


def policy(torch: Any) -> Callable[..., Any]:
    """torchtitan's ``_custom_policy`` with its per-call counter (``selective_checkpointing_context_fn``)."""
    from torch.utils.checkpoint import CheckpointPolicy

    save = {getattr(torch.ops.aten, name).default for name in SAVED_ATEN_OPS}
    save |= {getattr(torch.ops._c10d_functional, name).default for name in SAVED_C10D_OPS}
    counted = getattr(torch.ops.aten, COUNTED_OP).default
    meta = {"forward": 0, "recompute": 0}

    def custom_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == counted:
            meta[mode] += 1
        to_save = func in save and not (func == counted and meta[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return custom_policy


def context_fn() -> Any:
    """The ``context_fn`` torchtitan passes to the checkpoint: a fresh policy (and counter) per layer call."""
    import torch
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(policy(torch))
