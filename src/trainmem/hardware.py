"""GPUs and what the CUDA runtime takes beyond what PyTorch allocates.

``memory_mib`` is the total the driver reports (``nvidia-smi --query-gpu=memory.total``, ``rocm-smi`` for the
MI300X), which is what a job can use; it is a little under the spec sheet's figure (ECC, firmware reservations).
Where no driver figure was at hand (``memory_source == "data sheet"``), the data sheet's own figure in its own unit
(GB = 10**9 bytes where it says GB) is used: a lower bound of what the driver reports for the cards here.
``--gpu-memory`` (:func:`custom_gpu`) sets any other figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import ConfigError

MIB = 2**20
GB = 10**9


@dataclass(frozen=True)
class GPU:
    name: str
    memory_mib: int
    bf16: bool | None
    """Native bf16 support (compute capability 8.0+ on NVIDIA); None for a custom card (``--gpu-memory`` alone)."""
    spec_sheet: str
    exact_bytes: int | None = None
    """The memory in bytes where it is not a whole number of MiB (a data sheet's GB, ``--gpu-memory``)."""
    memory_source: str = "driver"
    """``driver`` (nvidia-smi / rocm-smi total), ``data sheet``, or ``--gpu-memory`` (the user's figure)."""

    @property
    def memory_bytes(self) -> int:
        return self.exact_bytes if self.exact_bytes is not None else self.memory_mib * MIB


def _sheet(name: str, gigabytes: int, bf16: bool, spec_sheet: str) -> GPU:
    """A card whose memory is the data sheet's figure in GB (10**9 bytes): a lower bound of what its driver
    reports (the 48 GB RTX A6000's nvidia-smi total is 49140 MiB, 51.5e9 bytes)."""
    return GPU(name, gigabytes * GB // MIB, bf16, spec_sheet, gigabytes * GB, "data sheet")


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
        # Added from data sheets (issue 24). nvidia-smi totals where one was published: RTX A6000 49140 MiB
        # (github.com/noonghunna/club-3090 issue 1047), H100 NVL 95830 MiB (github.com/NVIDIA/gpu-admin-tools
        # issue 4); the others are the sheet's GB.
        GPU("RTX-A6000", 49140, True, "48 GB GDDR6 with ECC (NVIDIA RTX A6000 data sheet)"),
        _sheet("A40", 48, True, "48 GB GDDR6 with ECC (NVIDIA A40 data sheet)"),
        _sheet("L40", 48, True, "48 GB GDDR6 with ECC (NVIDIA L40 data sheet)"),
        _sheet("H100-PCIe", 80, True, "80 GB HBM2e (NVIDIA H100 Tensor Core GPU data sheet, PCIe)"),
        GPU("H100-NVL", 95830, True, "94 GB HBM3 (NVIDIA H100 Tensor Core GPU data sheet, H100 NVL)"),
        _sheet("MI250X", 64, True, "128 GB HBM2e per module (AMD Instinct MI250X data sheet): two GCDs of 64 GB, "
                                   "each its own device to ROCm and PyTorch, so one process has 64 GB"),
        _sheet("Gaudi-2", 96, True, "96 GB HBM2E (Intel Gaudi 2 AI accelerator data sheet, HL-225)"),
        _sheet("Gaudi-3", 128, True, "128 GB HBM2e (Intel Gaudi 3 AI accelerator white paper, HL-325L)"),
    )
}

ALIASES: dict[str, str] = {"h100": "H100-80GB", "h100-sxm": "H100-80GB", "h100-sxm5": "H100-80GB",
                           "a6000": "RTX-A6000"}
"""Short names: "H100" is the SXM5 card (H100-80GB), as before the PCIe and NVL cards were listed."""

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
    "H100-PCIe": Throughput(756.5, 300, 64, "NVIDIA H100 Tensor Core GPU data sheet (PCIe): BF16 1,513 TFLOPS with "
                            "sparsity (756.5 dense), NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s"),
    "H100-NVL": Throughput(835.5, 300, 64, "NVIDIA H100 Tensor Core GPU data sheet (H100 NVL): BF16 1,671 TFLOPS with "
                           "sparsity (835.5 dense), NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s"),
    "RTX-A6000": Throughput(154.8, 56.25, 32, "NVIDIA RTX A6000 data sheet: tensor 309.7 TFLOPS with sparsity (154.8 "
                            "dense FP16/BF16); NVLink bridge 112.5 GB/s bidirectional, PCIe Gen4 x16"),
    "A40": Throughput(149.7, 56.25, 32, "NVIDIA A40 data sheet: BF16 tensor 149.7 TFLOPS (299.4 with sparsity); "
                      "NVLink bridge 112.5 GB/s bidirectional, PCIe Gen4 x16 64 GB/s"),
    "L40": Throughput(181.05, 32, 32, "NVIDIA L40 data sheet: BF16 tensor 181.05 TFLOPS (362.1 with sparsity); no "
                      "NVLink, PCIe Gen4 x16 64 GB/s"),
}
"""Figures for the GPUs whose sheets give them; the plan refuses the others (A10G, RTX-5090, MI250X, the Gaudi
cards, a custom card) in one line."""

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
    if key in ALIASES:
        return GPUS[ALIASES[key]]
    for gpu in GPUS.values():
        if gpu.name.lower() == key or gpu.name.lower().replace("-", "") == key.replace("-", ""):
            return gpu
    prefixed = [g for g in GPUS.values() if g.name.lower().startswith(key)]
    if len(prefixed) == 1:  # "H100" -> H100-80GB; "A100" stays ambiguous
        return prefixed[0]
    import difflib  # (only for the message)

    close = [g.name for g in prefixed] or difflib.get_close_matches(name.upper(), list(GPUS), n=2)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise ConfigError(f"unknown GPU {name!r}{hint}; accepted: {', '.join(GPUS)}")


def custom_gpu(memory_bytes: int, base: GPU | None = None, label: str | None = None) -> GPU:
    """A GPU of ``memory_bytes`` (``--gpu-memory``): ``base``'s card with that memory ("H100-80GB (70 GiB)"), or a
    custom card ("custom 48 GiB") whose bf16 support is unknown. ``label`` is how the size is shown."""
    from .units import format_bytes

    if label is None:
        label = f"{memory_bytes // 2**30:,} GiB" if memory_bytes % 2**30 == 0 else format_bytes(memory_bytes, "GiB")
    if base is not None:
        return replace(base, name=f"{base.name} ({label})", memory_mib=memory_bytes // MIB, exact_bytes=memory_bytes,
                       memory_source="--gpu-memory",
                       spec_sheet=f"{base.spec_sheet}; memory set to {label} by --gpu-memory")
    return GPU(f"custom {label}", memory_bytes // MIB, None, f"custom card of {label} (--gpu-memory)", memory_bytes,
               "--gpu-memory")


def round_allocation(nbytes: int) -> int:
    """What the CUDA caching allocator hands out for one request: a multiple of 512 bytes
    (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize)."""
    return -(-nbytes // 512) * 512 if nbytes else 0
