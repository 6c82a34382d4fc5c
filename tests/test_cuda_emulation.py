"""The trace runs what a CUDA GPU runs: each SDPA selection rule (kernels.sdpa_backend, PyTorch's sdp_utils.cpp) is
pinned by a case that passes it and one that fails it, and CUDA's autocast policy is checked op by op against
what the CPU's own autocast does (PyTorch's "Autocast Op Reference": softmax, layer_norm, pow, exp, the losses in
fp32 on CUDA; in the input's dtype on the CPU)."""

import pytest

from trainmem.kernels import EFFICIENT, FLASH, MATH, sdpa_backend

BASE = dict(dtype="bf16", head_dim_qk=64, head_dim_v=64, q_heads=8, kv_heads=8, has_mask=False, enable_gqa=False,
            q_len=128, kv_len=128, is_causal=True)


@pytest.mark.parametrize("change, expected", [
    ({}, FLASH),                                            # every flash constraint holds
    ({"has_mask": True}, EFFICIENT),                        # check_for_attn_mask: flash takes no mask
    ({"dtype": "fp32"}, EFFICIENT),                         # check_dtypes_low_precision: flash is half only
    ({"dtype": "fp16"}, FLASH),
    ({"head_dim_qk": 256, "head_dim_v": 256}, FLASH),       # check_head_dim_size_flash: at most 256
    ({"head_dim_qk": 264, "head_dim_v": 264}, EFFICIENT),
    ({"head_dim_qk": 192, "head_dim_v": 128}, EFFICIENT),   # flash needs equal q/k and v head dims (MLA)
    ({"q_len": 1, "kv_len": 128}, EFFICIENT),               # causal flash needs a square q x k
    ({"q_len": 1, "kv_len": 128, "is_causal": False}, FLASH),
    ({"kv_heads": 2}, MATH),                                # GQA without enable_gqa: neither fused kernel
    ({"kv_heads": 2, "enable_gqa": True}, FLASH),           # check_batch_size_and_num_heads_dense<true>
    ({"kv_heads": 2, "enable_gqa": True, "has_mask": True}, MATH),  # efficient has no GQA variant in 2.13
    ({"has_mask": True, "head_dim_qk": 100, "head_dim_v": 100}, MATH),  # efficient: multiple of 8 for half
    ({"has_mask": True, "head_dim_qk": 36, "head_dim_v": 36, "dtype": "fp32"}, EFFICIENT),  # 4 for fp32
    ({"has_mask": True, "head_dim_qk": 34, "head_dim_v": 34, "dtype": "fp32"}, MATH),
    ({"has_mask": True, "storage_offsets": (0, 4, 0)}, MATH),  # check_data_ptr_alignment_mem_efficient
    ({"last_dim_contiguous": False}, EFFICIENT),
])
def test_sdpa_selection_rules(change, expected):
    assert sdpa_backend(**{**BASE, **change}) == expected


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("op, args, cuda_dtype", [
    ("softmax", lambda x, w: (torch.softmax(x, -1),), torch.float32),
    ("log_softmax", lambda x, w: (torch.log_softmax(x, -1),), torch.float32),
    ("layer_norm", lambda x, w: (torch.nn.functional.layer_norm(x, (x.shape[-1],)),), torch.float32),
    ("pow", lambda x, w: (torch.pow(x, 3),), torch.float32),
    ("exp", lambda x, w: (torch.exp(x),), torch.float32),
    ("rsqrt", lambda x, w: (torch.rsqrt(x),), torch.float32),
    ("matmul", lambda x, w: (x @ w,), torch.bfloat16),
    ("linear", lambda x, w: (torch.nn.functional.linear(x, w),), torch.bfloat16),
])
def test_autocast_follows_cuda_lists(op, args, cuda_dtype):
    from trainmem.cuda_emulation import cuda_autocast_policy

    x, w = torch.randn(4, 8, dtype=torch.float32), torch.randn(8, 8)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        (out,) = args(x.bfloat16() if cuda_dtype == torch.float32 else x, w)
    assert out.dtype == cuda_dtype
    # Outside the emulation the CPU's own lists apply again (a bf16 softmax stays bf16 on the CPU).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (plain,) = args(x.bfloat16() if cuda_dtype == torch.float32 else x, w)
    if op in ("softmax", "exp", "pow"):
        assert plain.dtype == torch.bfloat16


@pytest.mark.slow
def test_gpt2_amp_trace_keeps_fp32_probabilities_as_a_gpu_does():
    """GPT-2 eager under amp-bf16: CUDA's autocast runs softmax in fp32, so the probabilities the matmul with v
    reads are fp32 (the CPU's autocast would keep them bf16); the traced peak is within 3% of the estimate."""
    pytest.importorskip("transformers")
    from trainmem.cuda_emulation import cuda_autocast_policy
    from trainmem.validate import matrix_config, run_row, scale_down

    x = torch.randn(2, 4, 16, 16).bfloat16()
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(x, -1).dtype == torch.float32
    row = run_row(scale_down(matrix_config("gpt2")), "gpt2", "amp-bf16", "none", 2, 64, "sgd", dropout=0.1,
                  attention="eager")
    assert row.within_tolerance, row.worst_phase
