"""A model of PyTorch's CUDA caching allocator, and the replay of a step's allocations through it. No torch import.

What ``nvidia-smi``, ``torch.cuda.max_memory_reserved()`` and the OOM message show is reserved memory: the segments
the caching allocator got from the driver, not the bytes the tensors hold. The allocator is deterministic given the
sequence of allocations and frees, so replaying a step's sequence gives its reserved memory, its fragmentation and
the first allocation that fails on a given card.

Every rule below follows ``c10/cuda/CUDACachingAllocator.cpp`` as of torch 2.13 (the ``DeviceCachingAllocator``
class; read at github.com/Continuous-Integrator/pytorch, a mirror of pytorch/pytorch whose allocator headers are
those installed with torch 2.13.0: ``registration_counter``, ``large_segment_size``, ``throw_on_cudamalloc_oom``,
``per_process_memory_fraction``), its constants in ``c10/core/AllocatorConfig.h`` (installed with torch, lines
16-25) and the option parser ``c10/core/AllocatorConfig.cpp`` (``AcceleratorAllocatorConfig::parseArgs``; its
error strings are in the installed ``libc10.so``). Each function names the C++ function it follows; line numbers
move between releases, the function names do not. docs/method.md §5b summarises the model.

One stream: every free returns its block to the pool at once (a single-stream program never records a block on a
second stream, so ``free`` calls ``free_block`` directly and no CUDA events are pending). Not modelled: CUDA graph
private pools and ``MemPool``s, ``backend:cudaMallocAsync`` (refused), the free-memory callbacks (none are
registered by PyTorch itself), IPC.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, NamedTuple

from .errors import ConfigError

MIB = 1 << 20
SIZE_MAX = (1 << 64) - 1
"""``std::numeric_limits<size_t>::max()``: max_split_size's default, "unlimited"."""

# c10/core/AllocatorConfig.h (torch 2.13), lines 16-25
K_SMALL_BUFFER = 2097152  # "small" allocations are packed in 2 MiB blocks
K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1048576  # largest "small" allocation is 1 MiB
K_MIN_LARGE_ALLOC = 10485760  # allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2097152  # round up large allocations to 2 MiB
K_LARGE_BUFFER = 20971520  # AcceleratorAllocatorConfig::large_segment_size_'s default (AllocatorConfig.h, line 340)
ROUNDUP_INTERVALS = 16
"""AllocatorConfig.cpp, kRoundUpPowerOfTwoIntervals: one roundup_power2_divisions entry per power of two from 1 MiB
(kRoundUpPowerOfTwoStart) to 64 GiB (kRoundUpPowerOfTwoEnd)."""

ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""AcceleratorAllocatorConfig::instance(): the first of these that is set is parsed, in this order."""

_BOOL_KEYS = frozenset({"expandable_segments", "pinned_use_background_threads", "release_lock_on_cudamalloc",
                        "release_lock_on_hipmalloc", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
                        "graph_capture_record_stream_reuse", "pinned_free_catch_all", "throw_on_cudamalloc_oom"})
_SIZE_KEYS = frozenset({"pinned_max_round_threshold_mb", "pinned_max_cached_size_mb", "pinned_reserve_segment_size_mb",
                        "pinned_num_register_threads"})
NO_DEVICE_EFFECT = frozenset({"pinned_use_background_threads", "release_lock_on_cudamalloc",
                              "release_lock_on_hipmalloc",
                              "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
                              "graph_capture_record_stream_reuse", "pinned_free_catch_all",
                              "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
                              "pinned_reserve_segment_size_mb", "pinned_num_register_threads"})
"""Options torch accepts that change nothing in the device allocator of one stream without CUDA graphs: the pinned
host allocator's, the lock released around cudaMalloc, and graph-capture stream reuse. Accepted, as torch does."""
KNOWN_KEYS = ("large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
              "roundup_power2_divisions", "expandable_segments", "per_process_memory_fraction",
              "throw_on_cudamalloc_oom", "backend", *sorted(NO_DEVICE_EFFECT))
"""AcceleratorAllocatorConfig::getMutableKeys() and CUDAAllocatorConfig::getKeys() (torch 2.13)."""


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings of ``PYTORCH_CUDA_ALLOC_CONF`` that change what the device allocator does; defaults as in
    ``AcceleratorAllocatorConfig`` (AllocatorConfig.h, lines 339-353) and ``CUDAAllocatorConfig``."""

    large_segment_size: int = K_LARGE_BUFFER
    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0
    throw_on_cudamalloc_oom: bool = False
    settings: str = ""
    """The option string these came from ("" for the defaults)."""

    @cached_property
    def rounds_power2(self) -> bool:
        """Whether any roundup_power2_divisions entry is set (else round_size is the 512-byte rounding alone)."""
        return any(self.roundup_power2_divisions)

    def divisions(self, size: int) -> int:
        """AcceleratorAllocatorConfig::roundup_power2_divisions(size): the entry of the power-of-two interval
        holding ``size``, sizes under 1 MiB taking the first and over 32 GiB the last."""
        log_size = size.bit_length() - 1
        index = log_size - 20 if log_size > 20 else 0
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]

    def describe(self) -> str:
        return self.settings or "PyTorch's defaults"


DEFAULT_CONFIG = AllocatorConfig()


def _tokens(text: str) -> list[str]:
    """ConfigTokenizer (AllocatorConfig.h, lines 35-53): ',', ':', '[' and ']' are tokens, whitespace is dropped."""
    tokens, buffer = [], ""
    for ch in text:
        if ch in ",:[]":
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(ch)
        elif not ch.isspace():
            buffer += ch
    if buffer:
        tokens.append(buffer)
    return tokens


def parse_alloc_conf(text: str, source: str = "--alloc-conf") -> AllocatorConfig:
    """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string as AcceleratorAllocatorConfig::parseArgs and
    CUDAAllocatorConfig::parseArgs do (``large_segment_size_mb`` first, since the split limits are checked against
    it); anything torch refuses raises a one-line ConfigError naming ``source``."""
    if not isinstance(text, str):
        raise ConfigError(f"{source} must be a string of key:value options, got {text!r}")
    tok = _tokens(text)

    def fail(what: str) -> ConfigError:
        return ConfigError(f"{source}: {what} (in {text!r}); accepted keys: {', '.join(KNOWN_KEYS)}")

    def at(i: int) -> str:
        if i >= len(tok):
            raise fail("the string ends where a value was expected")
        return tok[i]

    def expect(i: int, token: str) -> None:
        if at(i) != token:
            raise fail(f"expected {token!r} at {at(i)!r}")

    def size_t(i: int, key: str) -> int:
        value = at(i)
        if not value.isdigit():
            raise fail(f"{key} takes a non-negative integer, got {value!r}")
        return int(value)

    def boolean(i: int, key: str) -> bool:
        value = at(i)
        if value not in ("True", "False"):
            raise fail(f"{key} takes True or False, got {value!r}")
        return value == "True"

    def number(i: int, key: str) -> float:
        try:
            value = float(at(i))
        except ValueError:
            raise fail(f"{key} takes a number, got {at(i)!r}") from None
        if not math.isfinite(value):
            raise fail(f"{key} takes a finite number, got {at(i)!r}")
        return value

    def skip_value(i: int) -> int:  # ConfigTokenizer::skipKey
        expect(i + 1, ":")
        i += 2
        if at(i) != "[":
            return i
        while at(i) != "]":
            i += 1
        return i

    values: dict[str, Any] = {}
    large_segment = K_LARGE_BUFFER
    i = 0
    while i < len(tok):  # parseLargeSegmentSize: read first
        if tok[i] == "large_segment_size_mb":
            expect(i + 1, ":")
            mb = size_t(i + 2, "large_segment_size_mb")
            if mb <= K_MIN_LARGE_ALLOC // MIB:
                raise fail(f"large_segment_size_mb must be > {K_MIN_LARGE_ALLOC // MIB} MB, got {mb}")
            large_segment = min(mb, SIZE_MAX // MIB) * MIB
            i += 2
        i += 1
    values["large_segment_size"] = values["max_non_split_rounding_size"] = large_segment
    divisions = [0] * ROUNDUP_INTERVALS
    i = 0
    while i < len(tok):
        key = tok[i]
        if key == "large_segment_size_mb":
            i = skip_value(i)
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):  # parseMaxSplitSize, ...NonSplitRounding...
            expect(i + 1, ":")
            mb = size_t(i + 2, key)
            if mb < large_segment // MIB:
                raise fail(f"{key} too small, must be >= {large_segment // MIB}, got {mb}")
            values["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"] = (
                min(mb, SIZE_MAX // MIB) * MIB)
            i += 2
        elif key == "garbage_collection_threshold":  # parseGarbageCollectionThreshold
            expect(i + 1, ":")
            value = number(i + 2, key)
            if not 0 < value < 1:
                raise fail(f"garbage_collection_threshold must be in (0.0, 1.0), got {at(i + 2)}")
            values["garbage_collection_threshold"] = value
            i += 2
        elif key == "roundup_power2_divisions":  # parseRoundUpPower2Divisions
            expect(i + 1, ":")
            i += 2
            if at(i) == "[":
                first, last_index = True, 0
                i += 1
                while at(i) != "]":
                    bound = at(i)
                    expect(i + 1, ":")
                    value = size_t(i + 2, "a roundup_power2_divisions entry")
                    if value and value & (value - 1):
                        raise fail(f"roundup_power2_divisions: the divisions have to be a power of 2 or 0, got {value}")
                    if bound == ">":
                        divisions[last_index + 1:] = [value] * (ROUNDUP_INTERVALS - last_index - 1)
                    else:
                        boundary = size_t(i, "a roundup_power2_divisions interval")
                        if boundary == 0 or boundary & (boundary - 1):
                            raise fail(f"roundup_power2_divisions: the intervals have to be powers of 2 (MB), got "
                                       f"{bound}")
                        index = min(boundary.bit_length() - 1, ROUNDUP_INTERVALS - 1)
                        if first:
                            divisions[:index] = [value] * index
                            first = False
                        divisions[index] = value
                        last_index = index
                    i += 3
                    if at(i) != "]":
                        expect(i, ",")
                        i += 1
            else:  # one value for every interval ("kept for backwards compatibility")
                value = size_t(i, key)
                if value == 0 or value & (value - 1):
                    raise fail(f"roundup_power2_divisions: the divisions have to be a power of 2, got {value}")
                divisions = [value] * ROUNDUP_INTERVALS
        elif key == "per_process_memory_fraction":
            expect(i + 1, ":")
            value = number(i + 2, key)
            if not 0 <= value <= 1:  # setMemoryFraction: "invalid fraction ... Please set within [0, 1]"
                raise fail(f"per_process_memory_fraction must be in [0, 1], got {at(i + 2)}")
            values["per_process_memory_fraction"] = value
            i += 2
        elif key == "backend":
            expect(i + 1, ":")
            if at(i + 2) == "cudaMallocAsync":
                raise fail("backend:cudaMallocAsync (CUDA's own pool allocator) is not modelled; use backend:native")
            if at(i + 2) != "native":
                raise fail(f"unknown allocator backend {at(i + 2)!r}, options are native and cudaMallocAsync")
            i += 2
        elif key in _BOOL_KEYS:
            expect(i + 1, ":")
            flag = boolean(i + 2, key)
            if key in ("expandable_segments", "throw_on_cudamalloc_oom"):
                values[key] = flag
            i += 2
        elif key in _SIZE_KEYS:
            expect(i + 1, ":")
            size_t(i + 2, key)
            i += 2
        else:
            raise fail(f"unrecognized key {key!r}")
        if i + 1 < len(tok):
            expect(i + 1, ",")
            i += 1
        i += 1
    values["roundup_power2_divisions"] = tuple(divisions)
    return AllocatorConfig(**values, settings=text.strip())


def config_from_environment(environ: Mapping[str, str] | None = None) -> AllocatorConfig:
    """The settings a process started with ``environ`` would run with: the first of ``ENV_VARS`` that is set."""
    environ = os.environ if environ is None else environ
    for name in ENV_VARS:
        if name in environ:
            return parse_alloc_conf(environ[name], name)
    return DEFAULT_CONFIG


def round_size(size: int, config: AllocatorConfig = DEFAULT_CONFIG) -> int:
    """DeviceCachingAllocator::round_size: at least 512 bytes; a multiple of 512, or with roundup_power2_divisions
    the next of the ``divisions`` equal steps between two powers of two (roundup_power2_next_division)."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = config.divisions(size) if config.rounds_power2 else 0
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded_floor = size & ~(step - 1)
        return size if rounded_floor == size else rounded_floor + step
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int, config: AllocatorConfig = DEFAULT_CONFIG) -> int:
    """DeviceCachingAllocator::get_allocation_size: the segment a cudaMalloc gets for a rounded request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return config.large_segment_size
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class _Block:
    """struct Block: a piece of a segment, free or allocated, linked to its neighbours in the segment."""

    __slots__ = ("size", "ptr", "small", "allocated", "mapped", "prev", "next", "counter", "segment", "gc_base",
                 "requested", "label")

    def __init__(self, allocator: CachingAllocator, size: int, ptr: int, small: bool,
                 segment: _ExpandableSegment | None = None) -> None:
        self.size, self.ptr, self.small, self.segment = size, ptr, small, segment
        self.allocated, self.mapped = False, True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        allocator._counter += 1  # Block's constructor: registration_counter_global.fetch_add(1) + 1
        self.counter = allocator._counter
        self.gc_base = 0
        self.requested = 0
        self.label = ""

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


_COUNTER_BITS = 40
"""A block's place in its pool as one integer, ``size << _COUNTER_BITS | counter``: ordered as the pair (size,
registration counter), and compared without a key function (a replay makes far fewer than 2**40 blocks)."""


def _size_key(block: _Block) -> int:
    """BlockComparatorRegistrationCounter: by size, then by creation order (one stream)."""
    return block.size << _COUNTER_BITS | block.counter


class _Pool:
    """struct BlockPool: the free mapped blocks by (size, registration counter), the unmapped ones by address.
    ``keys`` holds each block's ``_size_key``, in the order of ``blocks``, for the bisections."""

    __slots__ = ("small", "blocks", "keys", "unmapped", "gc_calls")

    def __init__(self, small: bool):
        self.small = small
        self.blocks: list[_Block] = []
        self.keys: list[int] = []
        self.unmapped: list[_Block] = []
        self.gc_calls = 0  # get_free_blocks_call_count

    def insert(self, block: _Block) -> None:  # insert_into_blocks
        block.gc_base = self.gc_calls
        key = block.size << _COUNTER_BITS | block.counter  # (_size_key, inline: a replay inserts every free)
        i = bisect.bisect_right(self.keys, key)
        self.keys.insert(i, key)
        self.blocks.insert(i, block)

    def erase(self, block: _Block) -> None:
        i = bisect.bisect_left(self.keys, _size_key(block))
        assert self.blocks[i] is block
        del self.keys[i], self.blocks[i]

    def pop(self, i: int) -> _Block:
        """Take out the block at index ``i`` (get_free_block's ``pool.blocks.erase(it)``)."""
        del self.keys[i]
        return self.blocks.pop(i)

    def first_at_least(self, size: int) -> int:
        """The index of the smallest block of at least ``size`` bytes (the oldest of that size): lower_bound."""
        return bisect.bisect_left(self.keys, size << _COUNTER_BITS)

    def insert_unmapped(self, block: _Block) -> None:
        bisect.insort(self.unmapped, block, key=lambda b: b.ptr)

    def erase_unmapped(self, block: _Block) -> None:
        i = bisect.bisect_left(self.unmapped, block.ptr, key=lambda b: b.ptr)
        assert self.unmapped[i] is block
        del self.unmapped[i]


class _ExpandableSegment:
    """struct ExpandableSegment: an address range of ``pages`` pages of ``page`` bytes (2 MiB in the small pool,
    large_segment_size in the large one), mapped a page at a time."""

    def __init__(self, base: int, page: int, pages: int):
        self.base, self.page, self.pages = base, page, pages
        self.size = page * pages

    def map_range(self, ptr: int, size: int) -> tuple[int, int]:
        """ExpandableSegment::map: the whole pages covering [ptr, ptr + size)."""
        begin = (ptr - self.base) // self.page
        end = -(-(ptr + size - self.base) // self.page)
        return self.base + begin * self.page, (end - begin) * self.page

    def unmap_range(self, ptr: int, size: int) -> tuple[int, int]:
        """ExpandableSegment::unmap: the whole pages inside [ptr, ptr + size)."""
        begin = -(-(ptr - self.base) // self.page)
        end = (ptr + size - self.base) // self.page
        if begin >= end:
            return ptr, 0
        return self.base + begin * self.page, (end - begin) * self.page


class OutOfMemory(Exception):
    """The allocation fails: no cached block fits and the driver has no room, even after freeing the cache."""

    def __init__(self, requested: int, rounded: int, alloc_size: int, allocated: int, reserved: int,
                 rejected: bool = False):
        super().__init__(f"CUDA out of memory. Tried to allocate {alloc_size} bytes")
        self.requested, self.rounded, self.alloc_size = requested, rounded, alloc_size
        self.allocated, self.reserved, self.rejected = allocated, reserved, rejected


@dataclass(frozen=True)
class SegmentInfo:
    """One segment as ``torch.cuda.memory._snapshot()['segments']`` lists it (one per contiguous mapped range of an
    expandable segment): its blocks as (size, allocated)."""

    address: int
    total_size: int
    allocated_size: int
    is_large: bool
    is_expandable: bool
    blocks: tuple[tuple[int, bool], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"total_size": self.total_size, "allocated_size": self.allocated_size, "is_large": self.is_large,
                "is_expandable": self.is_expandable, "blocks": [{"size": s, "allocated": a} for s, a in self.blocks]}


class CachingAllocator:
    """DeviceCachingAllocator on one device and one stream.

    ``capacity`` is the memory cudaMalloc (or cuMemCreate) can still get (None: unlimited); ``device_total`` is
    ``cudaDeviceProp::totalGlobalMem``, which per_process_memory_fraction and the expandable segments' address
    space are measured against (default: ``capacity``, or 1 TiB)."""

    def __init__(self, config: AllocatorConfig = DEFAULT_CONFIG, capacity: int | None = None,
                 device_total: int | None = None):
        self.config = config
        self.capacity = capacity
        self.device_total = device_total if device_total is not None else (capacity or 1 << 40)
        fraction = config.per_process_memory_fraction
        # setMemoryFraction: a maximum only for a fraction under 1
        self.allowed_maximum = int(fraction * self.device_total) if fraction < 1.0 else None
        self.small, self.large = _Pool(True), _Pool(False)
        self.active: set[_Block] = set()
        self._counter = -1
        self._next_address = 1 << 32
        self.allocated_bytes = self.max_allocated_bytes = 0
        self.reserved_bytes = self.max_reserved_bytes = 0  # stats.reserved_bytes == total_allocated_memory
        self.requested_bytes = 0
        self.inactive_split_bytes = self.max_inactive_split_bytes = 0
        self.inactive_split = 0
        self.segments = 0
        self.num_alloc_retries = self.num_ooms = self.num_device_alloc = self.num_device_free = 0
        self.expandable: list[_ExpandableSegment] = []
        # malloc and get_free_block: garbage collection runs only with an allowed maximum and a threshold set
        self._collects = self.allowed_maximum is not None and config.garbage_collection_threshold > 0

    # -- public API: malloc, free, empty_cache, snapshot

    def malloc(self, orig_size: int, label: str = "") -> _Block:
        """DeviceCachingAllocator::malloc: search the pool, else garbage-collect (if set), cudaMalloc, free the
        cached oversize blocks and retry, free every cached unsplit block and retry, then fail."""
        if orig_size <= 0:
            raise ValueError("CUDACachingAllocator::allocate makes no block for 0 bytes")
        config = self.config
        size = round_size(orig_size, config)
        pool = self.small if size <= K_SMALL_SIZE else self.large  # get_pool
        expandable = config.expandable_segments
        block = self._get_free_block(pool, size, expandable)
        if block is None:
            alloc_size = allocation_size(size, config)
            if self._collects:
                self._garbage_collect_cached_blocks()
            block, rejected = self._alloc_block(pool, size, alloc_size, expandable, retry=False)
            if block is None and not rejected:
                if self._release_available_cached_blocks(pool, size):
                    block, rejected = self._alloc_block(pool, size, alloc_size, expandable, retry=False)
                if block is None:
                    self._release_cached_blocks()
                    block, rejected = self._alloc_block(pool, size, alloc_size, expandable, retry=True)
            if block is None:
                self.num_ooms += 1
                raise OutOfMemory(orig_size, size, alloc_size, self.allocated_bytes, self.reserved_bytes, rejected)
        split = self._should_split(block, size, expandable)
        block = self._alloc_found_block(block, pool, size, orig_size, split)
        block.label = label
        return block

    def free(self, block: _Block) -> None:
        """DeviceCachingAllocator::free, one stream: the block goes back to its pool at once (free_block)."""
        if not block.allocated:
            raise ValueError("block is not allocated")
        block.allocated = False
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        self.active.discard(block)
        self._free_block(block)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): release_cached_blocks."""
        self._release_cached_blocks()

    def snapshot(self) -> tuple[SegmentInfo, ...]:
        """DeviceCachingAllocator::snapshot: the segments by address, each with its blocks in address order."""
        heads = [b for b in (*self.active, *self.small.blocks, *self.large.blocks)
                 if b.prev is None or not b.prev.mapped]
        segments = []
        for head in sorted(heads, key=lambda b: b.ptr):
            blocks: list[tuple[int, bool]] = []
            b: _Block | None = head
            while b is not None and b.mapped:
                blocks.append((b.size, b.allocated))
                b = b.next
            segments.append(SegmentInfo(head.ptr, sum(s for s, _ in blocks), sum(s for s, a in blocks if a),
                                        not head.small, head.segment is not None, tuple(blocks)))
        return tuple(segments)

    def largest_inactive_split(self) -> int:
        """The largest free block of a segment that also holds allocated blocks (a split block, which
        release_cached_blocks cannot return to the driver); expandable segments excluded, as torch's
        inactive_split stat excludes them."""
        return max((b.size for pool in (self.small, self.large) for b in pool.blocks
                    if b.is_split and b.segment is None), default=0)

    def largest_free_block(self) -> int:
        """DeviceCachingAllocator::cacheInfo's largest cached block."""
        return max((b.size for pool in (self.small, self.large) for b in pool.blocks), default=0)

    def live_blocks(self) -> list[_Block]:
        return list(self.active)

    # -- DeviceCachingAllocator's private functions

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.max_reserved_bytes:
            self.max_reserved_bytes = self.reserved_bytes
        self.num_device_alloc += 1

    def _inactive_split(self, blocks: int, nbytes: int) -> None:
        self.inactive_split += blocks
        self.inactive_split_bytes += nbytes
        if self.inactive_split_bytes > self.max_inactive_split_bytes:
            self.max_inactive_split_bytes = self.inactive_split_bytes

    def _get_free_block(self, pool: _Pool, size: int, expandable: bool) -> _Block | None:
        """get_free_block: the smallest cached block of at least ``size`` (ties: the oldest); with expandable
        segments a block next to unmapped space counts as the size it can grow to; a request under max_split_size
        never takes an oversize block, and an oversize request takes one only within max_non_split_rounding_size."""
        config = self.config
        if self._collects:
            pool.gc_calls += 1
        blocks = pool.blocks
        i = pool.first_at_least(size)
        if i == len(blocks):
            return None
        if blocks[i].segment is not None:
            if expandable:
                def grows_to(b: _Block) -> int:
                    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

                while (blocks[i].segment is not None and i + 1 < len(blocks)
                       and grows_to(blocks[i + 1]) < grows_to(blocks[i])):
                    i += 1
            else:
                i += 1
                while i < len(blocks) and blocks[i].segment is not None:
                    i += 1
                if i == len(blocks):
                    return None
        block = blocks[i]
        if size < config.max_split_size and block.size >= config.max_split_size:
            return None
        if size >= config.max_split_size and block.size >= size + config.max_non_split_rounding_size:
            return None
        return pool.pop(i)

    def _should_split(self, block: _Block, size: int, expandable: bool) -> bool:
        """should_split: a small-pool or expandable block keeps a remainder of 512 bytes or more; a large block
        only a remainder above 1 MiB (kSmallSize), and only for a request under max_split_size."""
        remaining = block.size - size
        if block.small or expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.config.max_split_size and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block: _Block, pool: _Pool, size: int, orig_size: int, split: bool) -> _Block:
        """alloc_found_block: the front of the block is handed out, the remainder (the old Block, which keeps its
        registration counter) goes back to the pool."""
        already_split = block.prev is not None or block.next is not None  # (is_split)
        if split:
            remaining = block
            block = _Block(self, size, remaining.ptr, remaining.small, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            pool.insert(remaining)
            if block.segment is None:
                if already_split:
                    self._inactive_split(0, -block.size)
                else:
                    self._inactive_split(1, remaining.size)
        elif already_split and block.segment is None:
            self._inactive_split(-1, -block.size)
        block.allocated = True
        block.requested = orig_size
        self.active.add(block)
        self.allocated_bytes += block.size
        self.requested_bytes += orig_size
        if self.allocated_bytes > self.max_allocated_bytes:
            self.max_allocated_bytes = self.allocated_bytes
        return block

    def _free_block(self, block: _Block) -> None:
        """free_block: merge with the free neighbours in the segment (try_merge_blocks), back into the pool."""
        pool = self.small if block.small else self.large
        net_blocks = net_bytes = 0
        for candidate in (block.prev, block.next):
            if candidate is None or candidate.allocated:  # (what try_merge_blocks returns 0 for at once)
                continue
            subsumed = self._try_merge_blocks(block, candidate, pool)
            if subsumed:
                net_blocks -= 1
                net_bytes -= subsumed
        pool.insert(block)
        if block.prev is not None or block.next is not None:  # (is_split)
            net_blocks += 1
            net_bytes += block.size
        if block.segment is None:
            self._inactive_split(net_blocks, net_bytes)

    @staticmethod
    def _try_merge_blocks(dst: _Block, src: _Block | None, pool: _Pool) -> int:
        """try_merge_blocks: ``dst`` absorbs a free neighbour of the same mapped state; returns its size."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        dst.size += src.size
        return src.size

    def _new_address(self, size: int) -> int:
        address = self._next_address
        self._next_address += -(-size // K_ROUND_LARGE) * K_ROUND_LARGE + K_ROUND_LARGE
        return address

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, expandable: bool,
                     retry: bool) -> tuple[_Block | None, bool]:
        """alloc_block: refuse past per_process_memory_fraction (and, with throw_on_cudamalloc_oom, reject without
        the retries); then map pages of an expandable segment, or cudaMalloc a new segment of ``alloc_size``."""
        if retry:
            self.num_alloc_retries += 1
        if self.allowed_maximum is not None and self.reserved_bytes + alloc_size > self.allowed_maximum:
            return None, False
        if self.config.throw_on_cudamalloc_oom:
            limit = int(self.config.per_process_memory_fraction * self.device_total)
            if self.reserved_bytes + alloc_size > limit:
                return None, True
        if expandable:
            return self._try_allocate_expandable_block(pool, size), False
        if self.capacity is not None and self.reserved_bytes + alloc_size > self.capacity:
            return None, False  # cudaMalloc: cudaErrorMemoryAllocation
        block = _Block(self, alloc_size, self._new_address(alloc_size), pool.small)
        self.segments += 1
        self._reserve(alloc_size)
        return block, False

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks: with a max_split_size, free the smallest cached oversize block that
        covers the request, else oversize blocks from the largest down until enough is freed."""
        max_split = self.config.max_split_size
        if max_split == SIZE_MAX:
            return False
        key = max(size, max_split)
        blocks = pool.blocks
        i = pool.first_at_least(key)
        if i == len(blocks) or blocks[i].segment is not None:
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key and blocks[i].size >= max_split:
                current = blocks[i]
                first = i == 0
                if not first:
                    i -= 1
                if current.segment is None:
                    released += current.size
                    self._release_block(current, pool)
                if first:
                    break
            return released >= key
        self._release_block(blocks[i], pool)
        return True

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks: every cached block that is a whole segment goes back to the driver (release_blocks),
        and the free pages of expandable segments are unmapped."""
        for pool in (self.large, self.small):
            to_unmap = []
            for block in list(pool.blocks):
                if block.segment is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block, pool)
            for block in to_unmap:
                self._unmap_block(block, pool)
                if not block.mapped and block.prev is None and block.next is None:  # release_expandable_segment
                    pool.erase_unmapped(block)
                    assert block.segment is not None  # (to_unmap holds the expandable segments' blocks)
                    self.expandable.remove(block.segment)

    def _release_block(self, block: _Block, pool: _Pool) -> None:
        """release_block: cudaFree a whole cached segment."""
        pool.erase(block)
        self.reserved_bytes -= block.size
        self.segments -= 1
        self.num_device_free += 1

    def _unmap_block(self, block: _Block, pool: _Pool) -> None:
        """unmap_block: unmap the whole pages inside a free block of an expandable segment."""
        assert block.segment is not None  # (a block of an expandable segment)
        ptr, size = block.segment.unmap_range(block.ptr, block.size)
        if size == 0:
            return
        pool.erase(block)
        before = ptr - block.ptr
        if before > 0:
            before_free = _Block(self, before, block.ptr, block.small, block.segment)
            before_free.splice(block.prev, block)
            pool.insert(before_free)
        after = block.size - (before + size)
        if after > 0:
            after_free = _Block(self, after, ptr + size, block.small, block.segment)
            after_free.splice(block, block.next)
            pool.insert(after_free)
        block.ptr, block.size, block.mapped = ptr, size, False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        self.reserved_bytes -= size
        self.num_device_free += 1

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """find_expandable_block: the lowest address where free and unmapped blocks together hold ``size``
        (starting at a free block just before an unmapped one), else a new segment: address space for 1 1/8 of the
        device's memory, in pages of 2 MiB (small pool) or large_segment_size (large pool)."""
        def room(b: _Block | None) -> bool:
            total = 0
            while total < size and b is not None and not b.allocated:
                total += b.size
                b = b.next
            return total >= size

        for candidate in pool.unmapped:
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            if room(candidate):
                return candidate
        page = K_SMALL_BUFFER if pool.small else self.config.large_segment_size
        address_space = self.device_total + self.device_total // 8
        segment = _ExpandableSegment(0, page, -(-address_space // page))
        segment.base = self._new_address(segment.size)
        self.expandable.append(segment)
        candidate = _Block(self, segment.size, segment.base, pool.small, segment)
        candidate.mapped = False
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, block: _Block, size: int, pool: _Pool) -> bool:
        """map_block: map the pages covering the first ``size`` bytes of an unmapped block (the rest stays unmapped),
        merge with the free mapped neighbours; False where the device has no room (cuMemCreate's OOM)."""
        assert block.segment is not None  # (a block of an expandable segment)
        ptr, mapped = block.segment.map_range(block.ptr, size)
        assert ptr == block.ptr
        if mapped == 0 or (self.capacity is not None and self.reserved_bytes + mapped > self.capacity):
            return False
        pool.erase_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            remaining = _Block(self, block.size - mapped, block.ptr + mapped, block.small, block.segment)
            remaining.mapped = False
            remaining.splice(block, block.next)
            pool.insert_unmapped(remaining)
            block.size = mapped
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert(block)
        self._reserve(mapped)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """try_allocate_expandable_block: grow the segment in place, mapping pages after the candidate until it
        holds ``size`` (the rounded request, not the 20 MiB of a cudaMalloc)."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None  # (_find_expandable_block found blocks after it that hold size)
            if not self._map_block(following, min(size - candidate.size, following.size), pool):
                return None
            candidate = following
        pool.erase(candidate)
        return candidate

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collect_cached_blocks (only with a per-process memory fraction under 1, as malloc calls it only
        when allowed_memory_maximum is set): past garbage_collection_threshold of the allowed memory, cudaFree the
        unsplit cached large blocks not reused for longer than the average, until enough is freed."""
        assert self.allowed_maximum is not None  # (called only when self._collects)
        threshold = int(self.config.garbage_collection_threshold * self.allowed_maximum)
        if self.reserved_bytes <= threshold:
            return
        target, reclaimed = self.reserved_bytes - threshold, 0
        pool = self.large
        freeable = [b for b in pool.blocks if not b.is_split]
        total_age = sum(pool.gc_calls - b.gc_base for b in freeable)
        count = len(freeable)
        if count == 0:
            return
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for block in list(pool.blocks):
                age = pool.gc_calls - block.gc_base
                if not block.is_split and block.segment is None and age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block, pool)


# -- replay -----------------------------------------------------------------------------------------------------


class AllocEvent(NamedTuple):
    """One allocation (``nbytes`` > 0, the storage's bytes before rounding) or free (``nbytes`` == 0) of ``key``.

    A typed named tuple rather than a frozen dataclass: an estimate's replay makes some 7,000 of them (two steps of
    Llama-2-7B), and a tuple is made in a third of the time a frozen dataclass's ``__init__`` takes (one
    ``object.__setattr__`` per field)."""

    key: int
    nbytes: int = 0
    label: str = ""


@dataclass(frozen=True)
class AllocationLog:
    """A program's allocations and frees in order. Events before ``step_starts[0]`` make the state the steps
    start from (the model, its optimizer states); ``step_starts`` holds the index of each step's first event."""

    events: tuple[AllocEvent, ...]
    step_starts: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not self.step_starts or list(self.step_starts) != sorted(self.step_starts) or not all(
                0 <= s <= len(self.events) for s in self.step_starts):
            raise ConfigError(f"an allocation log's step starts must be ascending indices into its "
                              f"{len(self.events)} events, got {self.step_starts!r}")

    @property
    def steps(self) -> int:
        return len(self.step_starts)

    def step_events(self, step: int) -> tuple[AllocEvent, ...]:
        end = self.step_starts[step + 1] if step + 1 < self.steps else len(self.events)
        return self.events[self.step_starts[step]:end]

    def for_steps(self, steps: int = 2) -> AllocationLog:
        """This log with at least ``steps`` steps: the last step repeated (``repeat_last_step``) if it has fewer."""
        log = self
        while log.steps < steps:
            log = log.repeat_last_step()
        return log

    def from_step(self, step: int) -> AllocationLog:
        """The log as if it began at ``step`` (0-based): what is alive when that step starts, allocated in the order
        it was made, is the state before the first step; that step and the ones after it follow. A warm-up step
        whose allocations no later step repeats (a traced FSDP2 rank's first step: trace.trace_fsdp_step) is left
        out of the pools the steady state starts from."""
        if not 0 <= step < self.steps:
            raise ConfigError(f"this allocation log has steps 0 to {self.steps - 1}, not {step}")
        start = self.step_starts[step]
        alive: dict[int, AllocEvent] = {}
        for e in self.events[:start]:
            if e.nbytes:
                alive[e.key] = e
            else:
                alive.pop(e.key, None)
        setup = tuple(alive.values())
        shift = len(setup) - start
        return AllocationLog(setup + self.events[start:], tuple(s + shift for s in self.step_starts[step:]))

    def repeat_last_step(self) -> AllocationLog:
        """The log with its last step once more. The repeat allocates fresh keys; a free of a key the step found
        alive (a gradient, a state the step replaces) frees what the step left in its place: the survivors of the
        step (allocated and not freed in it) are matched by size, first allocated first, with the keys it freed
        that it had not allocated."""
        step = self.step_events(self.steps - 1)
        fresh = max((e.key for e in self.events), default=0) + 1
        made: dict[int, int] = {}  # key in the step -> its size, in allocation order
        freed_found: list[int] = []  # keys the step freed without having allocated them
        for e in step:
            if e.nbytes:
                made[e.key] = e.nbytes
            elif e.key in made:
                del made[e.key]
            else:
                freed_found.append(e.key)
        survivors: dict[int, list[int]] = {}
        for key, nbytes in made.items():
            survivors.setdefault(nbytes, []).append(key)
        sizes = self._sizes()
        carried: dict[int, int] = {}
        for key in freed_found:
            queue = survivors.get(sizes.get(key, -1))
            if queue:
                carried[key] = queue.pop(0)
        renamed: dict[int, int] = {}
        events = []
        for e in step:
            if e.nbytes:
                renamed[e.key] = fresh
                events.append(AllocEvent(fresh, e.nbytes, e.label))
                fresh += 1
            elif e.key in renamed:
                events.append(AllocEvent(renamed.pop(e.key)))
            elif e.key in carried:
                events.append(AllocEvent(carried[e.key]))
        return AllocationLog(self.events + tuple(events), self.step_starts + (len(self.events),))

    def _sizes(self) -> dict[int, int]:
        return {e.key: e.nbytes for e in self.events if e.nbytes}


@dataclass(frozen=True)
class OOMReport:
    """The first allocation that fails, and what is alive then."""

    event: int
    step: int
    """1-based; 0 for the state before the first step."""
    requested: int
    rounded: int
    alloc_size: int
    """What the OOM message says it "tried to allocate" (the segment a cudaMalloc would get)."""
    allocated: int
    reserved: int
    capacity: int
    live_blocks: int
    live_by_label: tuple[tuple[str, int], ...]
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.event, "step": self.step, "requested_bytes": self.requested,
                "rounded_bytes": self.rounded, "tried_to_allocate_bytes": self.alloc_size,
                "allocated_bytes": self.allocated, "reserved_bytes": self.reserved, "capacity_bytes": self.capacity,
                "live_blocks": self.live_blocks, "label": self.label,
                "live_by_label": {k: v for k, v in self.live_by_label}}


@dataclass(frozen=True)
class ReplayReport:
    """What ``torch.cuda.memory_stats()`` and ``torch.cuda.memory._snapshot()`` would show after the replayed
    steps. The peak is the first moment allocated memory is highest (in the last step when it reaches the same
    height, the steady state); fragmentation is reserved minus allocated then."""

    settings: str
    steps: int
    events: int
    max_allocated: int
    max_reserved: int
    peak_event: int
    peak_step: int
    reserved_at_peak: int
    max_inactive_split_bytes: int
    """torch's inactive_split_bytes.all.peak over the replay."""
    num_alloc_retries: int
    num_device_alloc: int
    num_device_free: int
    unmatched_frees: int
    """Frees of keys the log never allocated (ignored)."""
    capacity: int | None = None
    oom: OOMReport | None = None
    allocated: int = 0
    """memory_allocated() after the replay (what the steps leave alive)."""
    reserved: int = 0
    """memory_reserved() after the replay."""
    timeline: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)
    """(event, allocated, reserved) samples through the replay, at most ``TIMELINE_POINTS``."""
    at_peak: Callable[[], CachingAllocator] = field(default=lambda: CachingAllocator(), repr=False, compare=False)
    """The allocator as it is at the peak (the replay run again to ``peak_event``): called once, when the segments
    at the peak are first asked for (the JSON, --explain-reserved), so that an estimate's reserved line costs one
    pass."""

    @cached_property
    def _at_peak_figures(self) -> tuple[int, int, tuple[SegmentInfo, ...]]:
        allocator = self.at_peak()
        return allocator.largest_inactive_split(), allocator.largest_free_block(), allocator.snapshot()

    @property
    def largest_inactive_split(self) -> int:
        """At the peak: the largest free block of a partly used segment (non-expandable)."""
        return self._at_peak_figures[0]

    @property
    def largest_free_block(self) -> int:
        """At the peak: the largest cached free block."""
        return self._at_peak_figures[1]

    @property
    def segments_at_peak(self) -> tuple[SegmentInfo, ...]:
        return self._at_peak_figures[2]

    @property
    def fragmentation(self) -> int:
        return self.reserved_at_peak - self.max_allocated

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "steps": self.steps, "events": self.events,
                "max_memory_allocated_bytes": self.max_allocated, "max_memory_reserved_bytes": self.max_reserved,
                "reserved_at_peak_bytes": self.reserved_at_peak, "fragmentation_bytes": self.fragmentation,
                "peak_event": self.peak_event, "peak_step": self.peak_step,
                "largest_inactive_split_bytes": self.largest_inactive_split,
                "largest_free_block_bytes": self.largest_free_block,
                "max_inactive_split_bytes": self.max_inactive_split_bytes,
                "segments_at_peak": len(self.segments_at_peak),
                "segment_sizes_at_peak": [s.total_size for s in self.segments_at_peak],
                "num_alloc_retries": self.num_alloc_retries, "num_device_alloc": self.num_device_alloc,
                "num_device_free": self.num_device_free, "unmatched_frees": self.unmatched_frees,
                "capacity_bytes": self.capacity, "oom": self.oom.to_dict() if self.oom else None,
                "allocated_bytes": self.allocated, "reserved_bytes": self.reserved}


TIMELINE_POINTS = 2000


def _step_of(log: AllocationLog, index: int) -> int:
    return bisect.bisect_right(log.step_starts, index)


def _run(log: AllocationLog, config: AllocatorConfig, capacity: int | None, device_total: int | None,
         stop: int | None = None) -> tuple[CachingAllocator, list[int], list[int], OOMReport | None, int]:
    """Replay events [0, stop): the allocator, the allocated bytes after each event, the OOM (if any) and the
    number of frees of unknown keys."""
    allocator = CachingAllocator(config, capacity, device_total)
    live: dict[int, _Block] = {}
    after: list[int] = []
    reserved_after: list[int] = []
    oom: OOMReport | None = None
    unmatched = 0
    events = log.events if stop is None else log.events[:stop]
    malloc, free = allocator.malloc, allocator.free
    pop: Callable[[int, None], _Block | None] = live.pop
    record_allocated, record_reserved = after.append, reserved_after.append
    for index, (key, nbytes, label) in enumerate(events):
        if nbytes:
            if key in live:
                raise ConfigError(f"allocation log: key {key} allocated twice without a free (event {index})")
            try:
                live[key] = malloc(nbytes, label)
            except OutOfMemory as error:
                by_label: dict[str, int] = {}
                for held in live.values():
                    by_label[held.label] = by_label.get(held.label, 0) + held.size
                oom = OOMReport(index, _step_of(log, index), error.requested, error.rounded, error.alloc_size,
                                error.allocated, error.reserved, capacity or 0, len(live),
                                tuple(sorted(by_label.items(), key=lambda kv: -kv[1])), label)
                break
        else:
            block = pop(key, None)
            if block is None:
                unmatched += 1
            else:
                free(block)
        record_allocated(allocator.allocated_bytes)
        record_reserved(allocator.reserved_bytes)
    return allocator, after, reserved_after, oom, unmatched


def replay(log: AllocationLog, config: AllocatorConfig = DEFAULT_CONFIG, capacity: int | None = None,
           device_total: int | None = None, steps: int = 2) -> ReplayReport:
    """Replay ``log`` (its last step repeated until it has ``steps`` steps) through the caching allocator.

    The figures come from a device without a limit; with a ``capacity`` (the bytes the allocator can get on the
    card) the replay is run once more on it and ``oom`` names the first allocation that fails there."""
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
        raise ConfigError(f"allocator capacity must be a positive number of bytes, got {capacity!r}")
    log = log.for_steps(steps)
    total = device_total or capacity
    allocator, after, reserved_after, _, unmatched = _run(log, config, None, total)
    top = max(after, default=0)
    try:  # the first moment at the top in the last step, else the first over the whole replay
        peak = after.index(top, log.step_starts[-1])
    except ValueError:
        peak = after.index(top) if after else 0

    stop = peak + 1 if after else 0  # (what it keeps: the log, not this pass's allocator or lists)

    def at_peak() -> CachingAllocator:
        return _run(log, config, None, total, stop=stop)[0]

    oom = _run(log, config, capacity, device_total)[3] if capacity is not None else None
    stride = max(1, -(-len(after) // TIMELINE_POINTS))
    timeline = tuple((i, after[i], reserved_after[i]) for i in range(0, len(after), stride))
    return ReplayReport(
        settings=config.describe(), steps=log.steps, events=len(log.events),
        max_allocated=allocator.max_allocated_bytes,
        max_reserved=allocator.max_reserved_bytes, peak_event=peak, peak_step=_step_of(log, peak),
        reserved_at_peak=reserved_after[peak] if after else allocator.reserved_bytes,
        max_inactive_split_bytes=allocator.max_inactive_split_bytes, num_alloc_retries=allocator.num_alloc_retries,
        num_device_alloc=allocator.num_device_alloc, num_device_free=allocator.num_device_free,
        unmatched_frees=unmatched, capacity=capacity, oom=oom, allocated=allocator.allocated_bytes,
        reserved=allocator.reserved_bytes, timeline=timeline, at_peak=at_peak)


def max_reserved(log: AllocationLog, config: AllocatorConfig = DEFAULT_CONFIG, steps: int = 2) -> int:
    """``replay(log, config, steps=steps).max_reserved`` in one pass (a search's fit checks need nothing else)."""
    return _run(log.for_steps(steps), config, None, None)[0].max_reserved_bytes


def runs_within(log: AllocationLog, capacity: int, config: AllocatorConfig = DEFAULT_CONFIG, steps: int = 2) -> bool:
    """Whether ``steps`` steps of ``log`` run on a device where the allocator can get ``capacity`` bytes: no
    allocation fails. Not ``max_reserved(log) <= capacity``: before it raises OutOfMemoryError, the allocator frees
    its cached blocks and retries (CUDACachingAllocator.cpp, malloc: release_available_cached_blocks, then
    release_cached_blocks), so a step whose unlimited replay reserves more than the card can still run there."""
    return _run(log.for_steps(steps), config, capacity, None)[3] is None


def least_capacity(log: AllocationLog, config: AllocatorConfig = DEFAULT_CONFIG, steps: int = 2,
                   resolution: int = 64 << 20) -> int:
    """The smallest capacity (to ``resolution`` bytes) on which ``log`` runs (``runs_within``), found by bisection
    between the largest allocated bytes (nothing smaller can run) and the unlimited replay's max_memory_reserved()
    (which always runs)."""
    log = log.for_steps(steps)
    unlimited = _run(log, config, None, None)[0]
    lo, hi = unlimited.max_allocated_bytes, unlimited.max_reserved_bytes
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        if _run(log, config, mid, None)[3] is None:
            hi = mid
        else:
            lo = mid
    return hi


def log_from_sizes(sequence: Iterable[tuple[str, int, int]], step_starts: tuple[int, ...] = (0,)) -> AllocationLog:
    """An AllocationLog from ("alloc", key, nbytes) / ("free", key, 0) triples (tests, hand-written programs)."""
    events = []
    for kind, key, nbytes in sequence:
        if kind == "alloc":
            if nbytes <= 0:
                raise ConfigError(f"an allocation needs a positive size, got {nbytes!r}")
            events.append(AllocEvent(key, nbytes))
        elif kind == "free":
            events.append(AllocEvent(key))
        else:
            raise ConfigError(f"allocation log entries are 'alloc' or 'free', got {kind!r}")
    return AllocationLog(tuple(events), step_starts)


def render_lines(report: ReplayReport, traced_max_allocated: int | None, unit: str) -> list[str]:
    """The replay as text lines for the CLI."""
    from .units import format_bytes

    def b(n: int) -> str:
        return format_bytes(n, unit)

    lines = [f"caching allocator replay ({report.settings}; {report.steps} steps, {report.events:,} allocations "
             f"and frees; torch 2.13's CUDACachingAllocator):"]
    if traced_max_allocated is not None:
        lines.append(f"  traced max allocated            {b(traced_max_allocated)}")
    lines += [
        f"  replayed max_memory_allocated   {b(report.max_allocated)}",
        f"  replayed max_memory_reserved    {b(report.max_reserved)}",
        f"  fragmentation at the peak       {b(report.fragmentation)} (reserved {b(report.reserved_at_peak)} - "
        f"allocated {b(report.max_allocated)}, step {report.peak_step})",
        f"  largest inactive split          {b(report.largest_inactive_split)} (largest cached block "
        f"{b(report.largest_free_block)})",
        f"  segments at the peak            {len(report.segments_at_peak)}",
        f"  after the last step             allocated {b(report.allocated)}, reserved {b(report.reserved)}",
    ]
    if report.capacity is not None:
        if report.oom is None:
            lines.append(f"  fits the allocator's {b(report.capacity)} (no allocation fails)")
        else:
            o = report.oom
            alive = ", ".join(f"{label or 'other'} {b(n)}" for label, n in o.live_by_label[:4])
            lines.append(f"  first failing allocation on {b(report.capacity)}: event {o.event:,} (step {o.step}), "
                         f"{b(o.requested)} ({o.label or 'unlabelled'}; tried to allocate {b(o.alloc_size)}) with "
                         f"{b(o.allocated)} allocated and {b(o.reserved)} reserved; alive: {o.live_blocks:,} "
                         f"tensors, {alive}")
    return lines
