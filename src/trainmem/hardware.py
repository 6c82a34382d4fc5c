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

@dataclass(frozen=True)
class Throughput:
    """What ``trainmem plan``'s time model needs of a GPU, from its vendor's data sheet (``source``)."""

    dense_tflops: float
    """Peak dense bf16 tensor TFLOPS (fp16 with fp32 accumulation where the GPU has no bf16), no sparsity."""
    link_gbps: float
    """GPU-to-GPU bandwidth inside a node, GB/s in one direction: half the sheet's bidirectional NVLink (or
    Infinity Fabric) figure, or the PCIe link's where the GPUs talk over PCIe."""
    host_gbps: float
    """GPU-to-host bandwidth, GB/s in one direction (the PCIe link: 16 GB/s Gen3, 32 Gen4, 64 Gen5 x16)."""
    source: str


_A100 = Throughput(312, 300, 32, "NVIDIA A100 Tensor Core GPU data sheet (SXM): BF16 312 TFLOPS, NVLink 600 GB/s")
"""Both A100 sizes: the sheet gives one set of figures."""

THROUGHPUT: dict[str, Throughput] = {
    "A100-40GB": _A100,
    "A100-80GB": _A100,
    "H100-80GB": Throughput(989.4, 450, 64, "NVIDIA H100 Tensor Core GPU data sheet (SXM5): BF16 1,979 TFLOPS with "
                            "sparsity (989.4 dense), NVLink 900 GB/s, PCIe Gen5 128 GB/s"),
    "H200": Throughput(989.4, 450, 64, "NVIDIA H200 Tensor Core GPU data sheet (SXM): BF16 1,979 TFLOPS with sparsity, "
                       "NVLink 900 GB/s, PCIe Gen5 128 GB/s"),
    "B200": Throughput(2250, 900, 64, "NVIDIA HGX B200 data sheet: FP16/BF16 36 PFLOPS with sparsity per 8 GPUs "
                       "(2.25 PFLOPS dense per GPU), NVLink 1.8 TB/s per GPU"),
    "MI300X": Throughput(1307.4, 448, 64, "AMD Instinct MI300X data sheet: BF16 1,307.4 TFLOPS dense, Infinity Fabric "
                         "896 GB/s peak aggregate, PCIe Gen5 x16"),
    "L40S": Throughput(362.05, 32, 32, "NVIDIA L40S data sheet: BF16 733 TFLOPS with sparsity (362 dense); no NVLink, "
                       "PCIe Gen4 x16 64 GB/s"),
    "L4": Throughput(121, 32, 32, "NVIDIA L4 data sheet: BF16 242 TFLOPS with sparsity (121 dense); PCIe Gen4 x16"),
    "RTX-4090": Throughput(165.2, 32, 32, "NVIDIA Ada Lovelace architecture whitepaper: RTX 4090 FP16/BF16 tensor "
                           "165.2 TFLOPS with FP32 accumulate (dense); no NVLink, PCIe Gen4 x16"),
    "RTX-3090": Throughput(71, 56.25, 32, "NVIDIA Ampere GA102 whitepaper: RTX 3090 FP16 tensor 71 TFLOPS with FP32 "
                           "accumulate (dense); NVLink bridge 112.5 GB/s, PCIe Gen4 x16"),
    "V100-32GB": Throughput(125, 150, 16, "NVIDIA V100 data sheet (SXM2): 125 tensor TFLOPS (fp16), NVLink 300 GB/s, "
                            "PCIe Gen3"),
    "T4": Throughput(65, 16, 16, "NVIDIA T4 data sheet: 65 FP16 tensor TFLOPS (mixed precision); PCIe Gen3 x16"),
}
"""Figures for the GPUs whose sheets give them; the plan refuses the others (A10G, RTX-5090) in one line."""

DEFAULT_INTER_NODE_GBPS = 50.0
"""Node-to-node bandwidth per GPU, GB/s one way: one 400 Gb/s InfiniBand NDR (or 400 GbE) NIC per GPU, as in DGX
H100 and HGX nodes (NVIDIA DGX H100 user guide: 8 x ConnectX-7 400 Gb/s for compute). --inter-node-gbps sets it."""

DEFAULT_HOST_MEMORY_GIB = 2048
"""Host memory per node for offloaded states (DGX H100: 2 TB). --host-memory-gib sets it."""


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
