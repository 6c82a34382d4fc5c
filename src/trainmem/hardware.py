"""GPUs and what the CUDA runtime takes beyond what PyTorch allocates.

``memory_mib`` is the total the driver reports (``nvidia-smi --query-gpu=memory.total``, ``rocm-smi`` for the
MI300X), which is what a job can use; it is a little under the spec sheet's figure (ECC, firmware reservations).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from .errors import ConfigError

MIB = 2**20


@dataclass(frozen=True)
class GPU:
    name: str
    memory_mib: int
    bf16: bool
    """Native bf16 support (compute capability 8.0+ on NVIDIA)."""
    spec_sheet: str

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("RTX-3090", 24576, True, "24 GB GDDR6X"),
        GPU("RTX-4090", 24564, True, "24 GB GDDR6X"),
        GPU("RTX-5090", 32607, True, "32 GB GDDR7"),
        GPU("A10G", 23028, True, "24 GB GDDR6"),
        GPU("L4", 23034, True, "24 GB GDDR6"),
        GPU("L40S", 46068, True, "48 GB GDDR6"),
        GPU("A100-40GB", 40960, True, "40 GB HBM2"),
        GPU("A100-80GB", 81920, True, "80 GB HBM2e"),
        GPU("H100-80GB", 81559, True, "80 GB HBM3"),
        GPU("H200", 143771, True, "141 GB HBM3e"),
        GPU("B200", 183359, True, "180 GB HBM3e"),
        GPU("MI300X", 196592, True, "192 GB HBM3"),
        GPU("V100-32GB", 32768, False, "32 GB HBM2"),
        GPU("T4", 15360, False, "16 GB GDDR6"),
    )
}

DEFAULT_CUDA_OVERHEAD_MIB = 768
"""CUDA context, cuBLAS/cuDNN workspaces and kernel images: the gap between nvidia-smi's "used" and
torch.cuda.memory_reserved() for a single-GPU training process (a few hundred MiB for the context with lazy
module loading, plus workspaces). NCCL adds more under data parallelism. Override with --cuda-overhead."""

DEFAULT_FRAGMENTATION = 0.10
"""Fraction of the step's dynamic memory (activations, gradients as they appear, temporaries) that the caching
allocator holds on top of the allocated peak: blocks split and cached between allocations of different sizes."""


def get_gpu(name: str) -> GPU:
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    for gpu in GPUS.values():
        if gpu.name.lower() == key or gpu.name.lower().replace("-", "") == key.replace("-", ""):
            return gpu
    prefixed = [g for g in GPUS.values() if g.name.lower().startswith(key)]
    if len(prefixed) == 1:  # "H100" -> H100-80GB; "A100" stays ambiguous
        return prefixed[0]
    close = [g.name for g in prefixed] or difflib.get_close_matches(name.upper(), list(GPUS), n=2)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise ConfigError(f"unknown GPU {name!r}{hint}; accepted: {', '.join(GPUS)}")


def round_allocation(nbytes: int) -> int:
    """What the CUDA caching allocator hands out for one request: a multiple of 512 bytes
    (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize)."""
    return -(-nbytes // 512) * 512 if nbytes else 0
