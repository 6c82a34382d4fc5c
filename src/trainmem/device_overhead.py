"""What the device holds beyond PyTorch's tensors: the --cuda-overhead total as labelled lines with their sources.

- cuBLAS workspaces: ``at::cuda::getChosenWorkspaceSize`` (aten/src/ATen/cuda/CublasHandlePool.cpp,
  ``parseChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG`` is a list of ``:SIZE_KIB:COUNT`` entries summed as
  SIZE x COUNT KiB; unset, 4096 KiB x 8 = 32 MiB on Hopper (sm90), else 4096 KiB x 2 + 16 KiB x 8 (8.125 MiB).
  One workspace per (cuBLAS handle, stream) (``cublas_handle_stream_to_workspace``); handles come from a
  per-thread pool, and backward runs on the autograd engine's device thread, so a training step holds two: the
  forward thread's and backward's. cuBLASLt shares it (TORCH_CUBLASLT_UNIFIED_WORKSPACE, default on). The
  workspaces are allocated through the caching allocator (``getNewWorkspace``), so on a GPU
  ``memory_reserved()`` counts them; the trace does not see them, so they are listed here.
- the CUDA context, kernel images (lazy loading: CUDA_MODULE_LOADING=LAZY, the default since CUDA 11.7 with torch)
  and cuDNN's handle: what is left of --cuda-overhead (768 MiB by default, hardware.py), measured as nvidia-smi's
  used memory less ``memory_reserved()``; no per-version table is published, so it stays one figure.
- NCCL, with several GPUs: ``NCCL_BUFFSIZE`` (default 4 MiB, NCCL's environment-variable documentation) per
  channel and peer of each communicator, for the SIMPLE protocol; the channel count NCCL picks depends on the
  topology (``NCCL_MIN_NCHANNELS``/``NCCL_MAX_NCHANNELS``), taken here as NCCL_CHANNELS_ASSUMED, with a ring's two
  peers (send and receive). Shown apart, not in the device total: not yet checked against a multi-GPU run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .estimate import Estimate
    from .hardware import GPU


KIB, MIB = 1 << 10, 1 << 20
CUBLAS_THREADS = 2
"""Workspaces a training step holds: the forward thread's handle and the autograd device thread's."""
NCCL_BUFFSIZE_DEFAULT = 4 * MIB
NCCL_CHANNELS_ASSUMED = 16
NCCL_RING_PEERS = 2


@dataclass(frozen=True)
class OverheadLine:
    kind: str
    """cublas_workspaces, cuda_context or nccl_buffers (``label`` is for people)."""
    label: str
    bytes: int
    source: str
    in_total: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "label": self.label, "bytes": self.bytes, "source": self.source, "in_total": self.in_total}


def cublas_workspace_bytes(hopper: bool, environ: Mapping[str, str] | None = None) -> int:
    """One cuBLAS workspace (module docstring), as parseChosenWorkspaceSize reads CUBLAS_WORKSPACE_CONFIG."""
    env = os.environ if environ is None else environ
    value = env.get("CUBLAS_WORKSPACE_CONFIG")
    default = 4096 * KIB * 8 if hopper else 4096 * KIB * 2 + 16 * KIB * 8
    if not value:
        return default
    entries = re.findall(r":([0-9]+):([0-9]+)", value)
    if not entries:  # torch warns and takes the default
        return default
    return sum(int(size) * KIB * int(count) for size, count in entries)


def _hopper(gpu: GPU | None) -> bool:
    """Hopper's larger default; without a named card too (the larger of the two, and the tables of an estimate
    without --gpu stay those of one on an H100)."""
    return gpu is None or gpu.name.split("-")[0] in ("H100", "H200", "GH200", "H20", "H800")


def estimate_overhead_lines(est: Estimate, gpu: GPU | None = None) -> tuple[OverheadLine, ...]:
    """overhead_lines for an estimate: its --cuda-overhead, the GPU asked about, its GPU count."""
    gpus = est.parallel.gpus if est.parallel is not None else 1
    return overhead_lines(est.device.cuda_overhead_bytes, gpu or est.gpu, gpus)


def overhead_lines(cuda_overhead_bytes: int, gpu: GPU | None = None, gpus: int = 1,
                   environ: Mapping[str, str] | None = None) -> tuple[OverheadLine, ...]:
    """The --cuda-overhead total as labelled lines (their sum is the total), and NCCL's buffers apart."""
    workspace = cublas_workspace_bytes(_hopper(gpu), environ)
    cublas = min(CUBLAS_THREADS * workspace, cuda_overhead_bytes)
    config = (os.environ if environ is None else environ).get("CUBLAS_WORKSPACE_CONFIG")
    arch = "Hopper (sm90)" if _hopper(gpu) else "cards before Hopper"
    why = (f"CUBLAS_WORKSPACE_CONFIG={config}" if config else
           f"torch's default for {arch}, CublasHandlePool.cpp parseChosenWorkspaceSize")
    lines = [OverheadLine("cublas_workspaces", "cuBLAS workspaces", cublas,
                          f"{CUBLAS_THREADS} x {workspace / MIB:g} MiB ({why}): forward's and backward's threads"),
        OverheadLine("cuda_context", "CUDA context, kernel images, cuDNN", cuda_overhead_bytes - cublas,
                     "the rest of --cuda-overhead (nvidia-smi used less memory_reserved(), one process)")]
    if gpus > 1:
        nccl = NCCL_BUFFSIZE_DEFAULT * NCCL_CHANNELS_ASSUMED * NCCL_RING_PEERS
        lines.append(OverheadLine(
            "nccl_buffers", "NCCL buffers (one communicator; not in the total)", nccl,
            f"NCCL_BUFFSIZE 4 MiB (NCCL docs) x {NCCL_CHANNELS_ASSUMED} channels (assumed) x {NCCL_RING_PEERS} "
            "ring peers", in_total=False))
    return tuple(lines)
