"""The caching allocator model against what c10/cuda/CUDACachingAllocator.cpp (torch 2.13) does.

Each case replays a short sequence whose outcome the C++ source fixes; the expected figures are worked out by hand
from the functions each test names (DeviceCachingAllocator's ``malloc``, ``get_free_block``, ``should_split``,
``get_allocation_size``, ``free_block``, ...), never by running the model. The option parser is checked against
AllocatorConfig.cpp and its test (c10/test/core/AllocatorConfig_test.cpp's ``allocator_config_test``)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmem.allocator import (CachingAllocator, OutOfMemory, config_from_environment, log_from_sizes,
                                parse_alloc_conf, replay, round_size)
from trainmem.errors import ConfigError

MIB = 1 << 20


def _segments(allocator):
    return [[(size, used) for size, used in s.blocks] for s in allocator.snapshot()]


def test_two_9_mib_requests_split_one_20_mib_segment():
    """get_allocation_size: a request under kMinLargeAlloc (10 MiB) gets a kLargeBuffer (20 MiB) segment;
    should_split (large pool): the remainder is kept when above kSmallSize (1 MiB): 11 MiB after the first, 2 MiB
    after the second; get_free_block finds the 11 MiB remainder for the second request."""
    a = CachingAllocator()
    a.malloc(9 * MIB)
    a.malloc(9 * MIB)
    assert a.reserved_bytes == 20 * MIB and a.allocated_bytes == 18 * MIB
    assert _segments(a) == [[(9 * MIB, True), (9 * MIB, True), (2 * MIB, False)]]
    assert a.inactive_split_bytes == 2 * MIB and a.largest_inactive_split() == 2 * MIB


def test_the_1_mib_boundary_between_the_small_and_the_large_pool():
    """get_pool: a rounded size <= kSmallSize (1 MiB) is small: a 2 MiB segment (kSmallBuffer) that two 1 MiB
    requests share (should_split, small pool: a remainder >= 512 bytes is kept); one byte more rounds to
    1 MiB + 512 (round_size), a large request, which gets a 20 MiB segment."""
    a = CachingAllocator()
    a.malloc(MIB)
    a.malloc(MIB)
    assert a.reserved_bytes == 2 * MIB and len(a.snapshot()) == 1 and not a.snapshot()[0].is_large
    block = a.malloc(MIB + 1)
    assert block.size == MIB + 512 and a.reserved_bytes == 22 * MIB
    assert [s.is_large for s in a.snapshot()] == [False, True]


def test_an_oversize_block_is_not_split():
    """With max_split_size_mb:40, should_split refuses to split for a request >= max_split_size: 45 MiB takes the
    whole cached 50 MiB block (get_free_block allows an oversize block within max_non_split_rounding_size, 20 MiB
    by default), while 30 MiB (under max_split_size) may not take the oversize block and gets its own segment."""
    a = CachingAllocator(parse_alloc_conf("max_split_size_mb:40"))
    a.free(a.malloc(50 * MIB))
    b = a.malloc(45 * MIB)
    assert b.size == 50 * MIB and a.allocated_bytes == 50 * MIB and a.reserved_bytes == 50 * MIB
    assert _segments(a) == [[(50 * MIB, True)]]
    a.free(b)
    a.malloc(30 * MIB)
    assert a.reserved_bytes == 80 * MIB and sorted(s.total_size for s in a.snapshot()) == [30 * MIB, 50 * MIB]


def test_max_split_size_changes_what_a_cached_block_serves():
    """The same sequence without max_split_size: the 30 MiB request splits the cached 50 MiB block (the remainder,
    20 MiB, is over 1 MiB), so nothing new is reserved. And the rounding limit: with max_split_size_mb:20 a 25 MiB
    request may not take a 50 MiB block (50 >= 25 + 20), so it gets a 26 MiB segment (rounded to kRoundLarge)."""
    a = CachingAllocator()
    a.free(a.malloc(50 * MIB))
    a.malloc(30 * MIB)
    assert a.reserved_bytes == 50 * MIB and _segments(a) == [[(30 * MIB, True), (20 * MIB, False)]]
    b = CachingAllocator(parse_alloc_conf("max_split_size_mb:20"))
    b.free(b.malloc(50 * MIB))
    b.malloc(25 * MIB)
    assert b.reserved_bytes == 76 * MIB and sorted(s.total_size for s in b.snapshot()) == [26 * MIB, 50 * MIB]


def test_a_freed_block_coalesces_with_its_free_neighbours():
    """free_block merges with the previous and the next block when they are free (try_merge_blocks): freeing the
    middle of three 4 MiB blocks after the other two leaves the 20 MiB segment whole again, no inactive split,
    and release_cached_blocks (empty_cache) returns it to the driver."""
    a = CachingAllocator()
    x, y, z = (a.malloc(4 * MIB) for _ in range(3))
    a.free(x)
    a.free(z)
    assert _segments(a) == [[(4 * MIB, False), (4 * MIB, True), (12 * MIB, False)]]
    assert a.inactive_split_bytes == 16 * MIB
    a.free(y)
    assert _segments(a) == [[(20 * MIB, False)]] and a.inactive_split_bytes == 0
    a.empty_cache()
    assert a.reserved_bytes == 0 and a.snapshot() == ()


def test_expandable_segments_grow_in_place():
    """expandable_segments:True: alloc_block maps pages of one segment (try_allocate_expandable_block; 20 MiB pages
    in the large pool, ExpandableSegment's segment_size_): 9 MiB maps one page and is split (should_split keeps
    remainders >= 512 bytes); 15 MiB does not fit the 11 MiB left, so find_expandable_block starts at that free
    block and map_block maps one more page after it, merging: one segment of 40 MiB. Without expandable segments
    the 15 MiB request (>= 10 MiB) gets its own 16 MiB segment."""
    a = CachingAllocator(parse_alloc_conf("expandable_segments:True"))
    a.malloc(9 * MIB)
    assert a.reserved_bytes == 20 * MIB
    a.malloc(15 * MIB)
    assert a.reserved_bytes == 40 * MIB
    assert _segments(a) == [[(9 * MIB, True), (15 * MIB, True), (16 * MIB, False)]]
    assert a.snapshot()[0].is_expandable and a.largest_inactive_split() == 0  # torch's stat excludes them
    b = CachingAllocator()
    b.malloc(9 * MIB)
    b.malloc(15 * MIB)
    assert b.reserved_bytes == 36 * MIB and len(b.snapshot()) == 2


def test_expandable_segments_unmap_free_pages_on_retry():
    """When mapping more pages fails, release_cached_blocks unmaps the whole free pages of expandable segments
    (unmap_block) and the retry maps them again where they are needed. On 60 MiB: 30 MiB then 9 MiB map two
    20 MiB pages; with the 30 MiB freed, 35 MiB needs two more pages after the 1 MiB left at the end (80 MiB > 60);
    the retry unmaps the free first page and maps the two at the end."""
    a = CachingAllocator(parse_alloc_conf("expandable_segments:True"), capacity=60 * MIB)
    first = a.malloc(30 * MIB)
    a.malloc(9 * MIB)
    a.free(first)
    assert a.reserved_bytes == 40 * MIB
    a.malloc(35 * MIB)
    assert a.reserved_bytes == 60 * MIB and a.num_alloc_retries == 1
    assert _segments(a) == [[(10 * MIB, False), (9 * MIB, True), (35 * MIB, True), (6 * MIB, False)]]
    with pytest.raises(OutOfMemory):
        CachingAllocator(parse_alloc_conf("expandable_segments:True"), capacity=40 * MIB).malloc(41 * MIB)


def test_roundup_power2_divisions():
    """round_size with roundup_power2_divisions:4: sizes up to 512 x 4 bytes keep the 512-byte rounding; above,
    roundup_power2_next_division rounds up to the next quarter between two powers of two (5 MiB + 1 -> 6 MiB); a
    power of two stays. The list form sets intervals by their lower power of two in MB, '>' the rest."""
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200, four) == 1536 and round_size(1200) == 1536
    assert round_size(5 * MIB + 1, four) == 6 * MIB and round_size(5 * MIB + 1) == 5 * MIB + 512
    assert round_size(4 * MIB, four) == 4 * MIB and round_size(1_300_000, four) == 1_310_720
    listed = parse_alloc_conf("roundup_power2_divisions:[256:8,>:2]")
    assert round_size(100 * MIB + 1, listed) == 104 * MIB  # below 256 MB: the first entry's 8 divisions
    assert round_size(300 * MIB, listed) == 320 * MIB  # [256 MB, 512 MB): 8 divisions of 256 MiB
    assert round_size(600 * MIB, listed) == 768 * MIB  # above: 2 divisions of 512 MiB
    a = CachingAllocator(four)
    assert a.malloc(5 * MIB + 1).size == 6 * MIB


def test_the_option_parser_follows_torch_s_own_test():
    """AllocatorConfig_test.cpp's allocator_config_test string, with the values torch's test expects."""
    config = parse_alloc_conf("max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,"
                              "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],expandable_segments:True,"
                              "pinned_use_background_threads:True")
    assert config.max_split_size == 40 * MIB and config.max_non_split_rounding_size == 30 * MIB
    assert config.garbage_collection_threshold == 0.5 and config.expandable_segments
    assert [config.divisions(n * MIB) for n in (32, 64, 128, 256, 512, 1024, 2048)] == [8, 8, 2, 4, 2, 4, 1]
    assert parse_alloc_conf("large_segment_size_mb:64").large_segment_size == 64 * MIB
    assert parse_alloc_conf("").max_split_size == (1 << 64) - 1


@pytest.mark.parametrize("text, words", [
    ("max_split_size_mb:10", "max_split_size_mb too small, must be >= 20"),
    ("large_segment_size_mb:64,max_split_size_mb:40", "must be >= 64"),
    ("large_segment_size_mb:10", "must be > 10 MB"),
    ("garbage_collection_threshold:1.5", "(0.0, 1.0)"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[100:4]", "powers of 2"),
    ("expandable_segments:yes", "True or False"),
    ("expandable_segment:True", "unrecognized key 'expandable_segment'"),
    ("backend:cudaMallocAsync", "not modelled"),
    ("per_process_memory_fraction:2", "[0, 1]"),
    ("max_split_size_mb:-5", "non-negative integer"),
    ("max_split_size_mb", "ends where a value was expected"),
])
def test_bad_options_are_one_line(text, words):
    with pytest.raises(ConfigError) as error:
        parse_alloc_conf(text, "--alloc-conf")
    message = str(error.value)
    assert words in message and "\n" not in message and message.startswith("--alloc-conf")


def test_the_environment_variables_in_torch_s_order():
    """AcceleratorAllocatorConfig::instance(): PYTORCH_CUDA_ALLOC_CONF first, then PYTORCH_ALLOC_CONF."""
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert config_from_environment(both).expandable_segments
    assert not config_from_environment({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}).expandable_segments
    assert config_from_environment({}).settings == ""
    with pytest.raises(ConfigError, match="^PYTORCH_ALLOC_CONF"):
        config_from_environment({"PYTORCH_ALLOC_CONF": "bogus:1"})


def test_out_of_memory_frees_the_cache_and_retries():
    """malloc: when cudaMalloc fails, release_cached_blocks frees every cached unsplit segment and alloc_block
    retries (num_alloc_retries); only if that fails too is it an OOM, whose message names alloc_size."""
    a = CachingAllocator(capacity=40 * MIB)
    a.free(a.malloc(15 * MIB))  # a cached 16 MiB segment
    a.malloc(30 * MIB)  # 16 + 30 > 40: the cached segment is released, then the retry succeeds
    assert a.reserved_bytes == 30 * MIB and a.num_alloc_retries == 1 and a.num_device_free == 1
    b = CachingAllocator(capacity=40 * MIB)
    b.malloc(15 * MIB)
    with pytest.raises(OutOfMemory) as error:
        b.malloc(30 * MIB)
    assert error.value.alloc_size == 30 * MIB and error.value.reserved == 16 * MIB and b.num_ooms == 1


def test_garbage_collection_needs_a_memory_fraction():
    """garbage_collect_cached_blocks runs only when a per-process memory fraction sets allowed_memory_maximum;
    past the threshold it frees the cached unsplit large blocks of at least the average age: the two cached
    30 MiB segments go before the 40 MiB one is made. Without a fraction, the threshold does nothing."""
    def run(conf):
        a = CachingAllocator(parse_alloc_conf(conf), device_total=200 * MIB)
        x, y = a.malloc(30 * MIB), a.malloc(30 * MIB)
        a.free(x)
        a.free(y)
        a.malloc(40 * MIB)
        return a.reserved_bytes

    assert run("garbage_collection_threshold:0.5,per_process_memory_fraction:0.5") == 40 * MIB
    assert run("garbage_collection_threshold:0.5") == 100 * MIB


def test_replay_reports_the_peak_and_the_first_failing_allocation():
    """Two steps of: a 9 MiB activation, a 9 MiB temporary freed, a 15 MiB temporary, all freed. Step 1 reserves a
    20 MiB segment (both 9 MiB fit) and a 16 MiB one, which the 15 MiB request takes whole (should_split: a 1 MiB
    remainder is not above kSmallSize). Step 2 reuses them, best fit first (get_free_block): the first 9 MiB goes
    into the cached 16 MiB segment, the 15 MiB into the 20 MiB one, split, so step 2 peaks 1 MiB lower and the peak
    is step 1's. On 30 MiB the 15 MiB request is the first that fails (16 MiB segment, 22 MiB reserved)."""
    step = [("alloc", 1, 9 * MIB), ("alloc", 2, 9 * MIB), ("free", 2, 0), ("alloc", 3, 15 * MIB),
            ("free", 3, 0), ("free", 1, 0)]
    log = log_from_sizes([("alloc", 0, 512)] + step, step_starts=(1,))
    report = replay(log, capacity=30 * MIB)
    assert report.steps == 2 and report.events == 13
    assert report.max_allocated == 25 * MIB + 512 and report.max_reserved == 38 * MIB  # + the small pool's 2 MiB
    assert report.peak_step == 1 and report.reserved_at_peak == 38 * MIB
    assert report.allocated == 512 and report.reserved == 38 * MIB  # everything but key 0 freed, nothing released
    assert report.fragmentation == 13 * MIB - 512 and len(report.segments_at_peak) == 3
    oom = report.oom
    assert oom is not None and oom.step == 1 and oom.requested == 15 * MIB and oom.alloc_size == 16 * MIB
    assert oom.reserved == 22 * MIB and oom.allocated == 9 * MIB + 512 and oom.live_blocks == 2
    assert replay(log, capacity=40 * MIB).oom is None


def test_a_repeated_step_frees_what_the_previous_one_left():
    """A step that replaces a state it found (frees key 0, allocates key 5 of the same size, kept): the repeat
    frees key 5's block, so the second step ends with what the first ended with."""
    log = log_from_sizes([("alloc", 0, 4 * MIB), ("alloc", 1, MIB), ("free", 0, 0), ("alloc", 5, 4 * MIB),
                          ("free", 1, 0)], step_starts=(1,))
    doubled = log.for_steps(2)
    assert doubled.steps == 2 and len(doubled.events) == 9
    a = CachingAllocator()
    live = {}
    for e in doubled.events:
        if e.nbytes:
            live[e.key] = a.malloc(e.nbytes)
        else:
            a.free(live.pop(e.key))
    assert a.allocated_bytes == 4 * MIB and len(live) == 1


def test_a_log_from_its_second_step_starts_from_what_is_alive_then():
    """from_step(1): what the first step left alive (key 0, and key 3 the first step made) is the state before the
    steps, in the order it was made; key 1, made and freed in the first step, is gone; the second step follows."""
    log = log_from_sizes([("alloc", 0, 4 * MIB), ("alloc", 1, MIB), ("alloc", 3, 2 * MIB), ("free", 1, 0),
                          ("alloc", 4, 3 * MIB), ("free", 4, 0)], step_starts=(1, 4))
    later = log.from_step(1)
    assert later.steps == 1 and later.step_starts == (2,)
    assert [(e.key, e.nbytes) for e in later.events] == [(0, 4 * MIB), (3, 2 * MIB), (4, 3 * MIB), (4, 0)]
    assert replay(later, steps=2).max_allocated == 9 * MIB  # (the repeat: 4 + 2 MiB alive, 3 MiB made and freed)
    with pytest.raises(ConfigError, match="steps 0 to 1, not 2"):
        log.from_step(2)


_SIZES = st.one_of(st.integers(1, 4096), st.integers(4096, 2 * MIB), st.integers(2 * MIB, 30 * MIB),
                   st.integers(30 * MIB, 120 * MIB))
_CONFIGS = ["", "expandable_segments:True", "max_split_size_mb:40", "roundup_power2_divisions:4",
            "max_split_size_mb:20,max_non_split_rounding_mb:40,expandable_segments:False"]


@settings(max_examples=60, deadline=None)
@given(conf=st.sampled_from(_CONFIGS),
       ops=st.lists(st.tuples(st.booleans(), _SIZES, st.integers(0, 10**6)), min_size=1, max_size=60))
def test_allocated_counts_the_live_blocks_and_everything_freed_coalesces(conf, ops):
    """For any sequence: allocated is the sum of the live blocks, each at least its rounded request and above it
    only by what should_split does not cut off (nothing in the small pool or an expandable segment, at most 1 MiB
    for a large request under max_split_size, less than max_non_split_rounding_size above it); reserved covers
    allocated and is the sum of the snapshot's segments; freeing everything leaves every segment (every mapped
    range) one free block, with no inactive split."""
    config = parse_alloc_conf(conf)
    a = CachingAllocator(config)
    live = []
    for allocate, size, pick in ops:
        if allocate or not live:
            live.append((a.malloc(size), size))
        else:
            block, _ = live.pop(pick % len(live))
            a.free(block)
        assert a.allocated_bytes == sum(b.size for b, _ in live)
        assert a.requested_bytes == sum(n for _, n in live)
        for block, n in live:
            rounded = round_size(n, config)
            slack = block.size - rounded
            if rounded <= MIB or config.expandable_segments:
                assert slack == 0
            elif rounded < config.max_split_size:
                assert 0 <= slack <= MIB
            else:
                assert 0 <= slack < config.max_non_split_rounding_size
        assert a.reserved_bytes >= a.allocated_bytes
        assert a.reserved_bytes == sum(s.total_size for s in a.snapshot())
    for block, _ in live:
        a.free(block)
    assert a.allocated_bytes == 0 and a.inactive_split_bytes == 0
    assert all(len(s.blocks) == 1 and not s.blocks[0][1] for s in a.snapshot())
    a.empty_cache()
    assert a.reserved_bytes == 0


# -- the traced step through the allocator (needs torch and transformers) ----------------------------------------

_TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=211, max_position_embeddings=64)


@pytest.fixture(scope="module")
def recorded():
    pytest.importorskip("transformers")
    from trainmem.models import spec_from_config
    from trainmem.settings import TrainingSettings
    from trainmem.trace import trace_step

    settings_ = TrainingSettings(batch=1, seq=16, recipe="mixed-bf16")
    return (trace_step(_TINY, settings_, spec_from_config(_TINY)),
            trace_step(_TINY, settings_, spec_from_config(_TINY), record_allocations=True))


def test_recording_the_allocations_changes_no_phase_and_replays_the_traced_peak(recorded):
    """The recorded trace (warm-up step under trackers too) has the same phases as the plain one, records two
    steps after the model's state, and its replay's max_memory_allocated is the traced peak: the allocator counts
    the same 512-byte-rounded storages MemTracker does (no request here is large enough to leave a remainder)."""
    plain, traced = recorded
    assert [p.allocated_bytes for p in traced.phases] == [p.allocated_bytes for p in plain.phases]
    log = traced.allocations
    assert log.steps == 2 and log.step_starts[0] > 0
    assert {e.label for e in log.events[:log.step_starts[0]]} >= {"parameters"}
    assert "optimizer_states" in {e.label for e in log.step_events(0)}  # the warm-up creates the states
    report = replay(log)
    assert report.unmatched_frees == 0 and report.max_allocated == traced.peak.allocated_bytes
    assert report.max_reserved >= report.max_allocated and report.max_reserved % (2 * MIB) == 0


def test_trace_allocator_command(run_cli, recorded, monkeypatch, tmp_path):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps(_TINY))
    args = ("trace", str(config), "--seq", "16", "--recipe", "mixed-bf16", "--allocator")
    jsonschema = pytest.importorskip("jsonschema")
    from trainmem.report import json_schema

    code, out, _ = run_cli(*args, "--alloc-conf", "expandable_segments:True", "--json")
    document = json.loads(out)
    assert not list(jsonschema.Draft202012Validator(json_schema()).iter_errors(document))
    doc = document["trace"]["allocator"]
    assert code == 0 and doc["settings"] == "expandable_segments:True" and doc["steps"] == 2
    assert doc["max_memory_allocated_bytes"] == doc["traced_max_allocated_bytes"] == recorded[0].peak.allocated_bytes
    assert doc["oom"] is None and doc["capacity_bytes"] is None
    # L4 (23,034 MiB) less 23,033 MiB of CUDA overhead leaves 1 MiB: the first parameter's 2 MiB segment fails
    code, out, _ = run_cli(*args, "--gpu", "L4", "--cuda-overhead", "23033", "--units", "MiB")
    assert code == 0 and "replayed max_memory_reserved" in out
    assert "first failing allocation on 1.00 MiB: event 0 (step 0)" in out
    assert "(parameters; tried to allocate 2.00" in out
    for extra, words in ((("--alloc-conf", "max_split_size_mb:1"), "--alloc-conf: max_split_size_mb too small"),
                         (("--gpus", "2", "--tp", "2", "--recipe", "fp32"), "not with --tp yet")):
        code, _, err = run_cli(*args, *extra)
        assert code == 2 and words in err and err.strip().count("\n") == 0
    code, _, err = run_cli("trace", str(config), "--alloc-conf", "expandable_segments:True")
    assert code == 2 and "give --allocator too" in err
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:maybe")
    code, _, err = run_cli(*args)
    assert code == 2 and "PYTORCH_CUDA_ALLOC_CONF: expandable_segments takes True or False" in err


def test_trace_allocator_on_an_fsdp2_rank(run_cli, tmp_path):
    """trace --allocator --gpus 2 --fsdp full records the rank's own allocations (the sharded parameters as the
    state before the steps) and replays its second step twice: the replayed max_memory_allocated is the traced
    rank's peak, and the sharded parameters are labelled as parameters, not "other"."""
    import json

    pytest.importorskip("transformers")
    from trainmem.models import spec_from_config
    from trainmem.settings import TrainingSettings
    from trainmem.sharding import Parallel
    from trainmem.trace import trace_fsdp_step

    traced = trace_fsdp_step(_TINY, TrainingSettings(batch=1, seq=16, recipe="mixed-bf16"),
                             Parallel(gpus=2, fsdp="full"), spec_from_config(_TINY), record_allocations=True)
    log = traced.allocations
    assert log.steps == 1 and "parameters" in {e.label for e in log.events[:log.step_starts[0]]}
    assert "other" not in {e.label for e in log.events}
    report = replay(log, steps=2)
    assert report.unmatched_frees == 0 and report.max_allocated == traced.peak.allocated_bytes
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_TINY))
    code, out, _ = run_cli("trace", str(config), "--seq", "16", "--recipe", "mixed-bf16", "--gpus", "2", "--fsdp",
                           "full", "--allocator", "--json")
    doc = json.loads(out)["trace"]["allocator"]
    assert code == 0 and doc["steps"] == 2 and doc["max_memory_allocated_bytes"] == traced.peak.allocated_bytes


def test_the_recorder_follows_memtracker_s_storages_and_resizes():
    """trace.py's _AllocationRecorder under _recording: a storage is allocated when MemTracker first makes its
    _WeakRefInfo (once, however many trackers see it), a resize_ is a new allocation then the free of the old
    size (as a CUDA storage resize copies into a new block), and a storage is freed when it dies."""
    torch = pytest.importorskip("torch")
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainmem.trace import _AllocationRecorder, _recording

    recorder = _AllocationRecorder()
    with _recording(recorder):
        t = torch.zeros(256)  # 1 KiB
        for _ in range(2):
            MemTracker().track_external(t)
        tracker = MemTracker()
        tracker.track_external(t)
        with tracker:
            u = t * 2
            t.untyped_storage().resize_(2048)
            del u
    log = recorder.log()
    assert [(e.key, e.nbytes) for e in log.events] == [(0, 1024), (1, 1024), (2, 2048), (0, 0), (1, 0)]
    assert log.events[1].label == "activations"
    del t
    assert len(recorder.log().events) == 5  # after log(), nothing more is recorded


def test_the_cuda_benchmark_compares_reserved_memory():
    """benchmarks/cuda_accuracy.py's reserved table (it runs only on a GPU): a snapshot's segments are counted as
    torch.cuda.memory._snapshot() lists them, and each row shows the replay's and the flat factor's error."""
    import importlib.util
    from pathlib import Path

    from trainmem.request import estimate
    from trainmem.measure import Measurement, PhasePeak

    path = Path(__file__).parent.parent / "benchmarks" / "cuda_accuracy.py"
    spec = importlib.util.spec_from_file_location("cuda_accuracy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    snapshot = {"segments": [
        {"total_size": 20 * MIB, "allocated_size": 18 * MIB, "blocks": [
            {"size": 9 * MIB, "state": "active_allocated"}, {"size": 9 * MIB, "state": "active_allocated"},
            {"size": 2 * MIB, "state": "inactive"}]},
        {"total_size": 2 * MIB, "allocated_size": 0, "blocks": [{"size": 2 * MIB, "state": "inactive"}]}]}
    summary = bench.snapshot_summary(snapshot)
    assert summary == {"segments": 2, "reserved": 22 * MIB, "allocated": 18 * MIB, "sizes": [2 * MIB, 20 * MIB],
                       "largest_inactive_split": 2 * MIB}
    report = replay(log_from_sizes([("alloc", 1, 9 * MIB), ("alloc", 2, 9 * MIB)]), steps=1)
    assert bench.replay_summary(report) == {"segments": 1, "reserved": 20 * MIB, "allocated": 18 * MIB,
                                            "sizes": [20 * MIB], "largest_inactive_split": 2 * MIB}
    est = estimate("gpt2", recipe="amp-bf16", batch=8, seq=1024)
    measured = Measurement("cuda", [PhasePeak("forward", 18 * MIB, 25 * MIB)])  # the replay is 20% under
    section = bench.cuda_section([], "NVIDIA H200", "2.13.0", "2026-12-01",
                                 [("gpt2", dict(batch=8), measured, est, summary, report, "PyTorch's defaults")])
    row = next(line for line in section.splitlines() if line.startswith("| gpt2 | batch=8 | PyTorch's defaults |"))
    assert "| 0.024 GiB | 0.020 GiB | -20.00% |" in row and row.endswith("| 2 / 1 |")


@settings(max_examples=60, deadline=None)
@given(conf=st.sampled_from(_CONFIGS + ["garbage_collection_threshold:0.6,per_process_memory_fraction:0.8",
                                        "expandable_segments:True,roundup_power2_divisions:[64:4,>:2]"]),
       capacity_mib=st.integers(8, 256),
       ops=st.lists(st.tuples(st.booleans(), _SIZES, st.integers(0, 10**6)), min_size=1, max_size=60))
def test_on_a_full_device_reserved_never_passes_the_capacity(conf, capacity_mib, ops):
    """With a capacity, an allocation either succeeds or raises OutOfMemory after the cache was freed (malloc's
    retries, release_cached_blocks, unmap_block); reserved memory never passes the capacity, allocated stays the
    sum of the live blocks, and after an OOM every cached segment that holds no live block has been returned."""
    a = CachingAllocator(parse_alloc_conf(conf), capacity=capacity_mib * MIB)
    live = []
    for allocate, size, pick in ops:
        if allocate or not live:
            try:
                live.append(a.malloc(size))
            except OutOfMemory as error:
                assert error.rounded + a.reserved_bytes > 0
                assert all(any(used for _, used in s.blocks) for s in a.snapshot() if not s.is_expandable)
        else:
            a.free(live.pop(pick % len(live)))
        assert a.reserved_bytes <= a.capacity and a.allocated_bytes == sum(b.size for b in live)
        assert a.reserved_bytes == sum(s.total_size for s in a.snapshot())


def test_bad_allocation_logs_are_one_line():
    with pytest.raises(ConfigError, match="step starts must be ascending"):
        log_from_sizes([("alloc", 1, 512)], step_starts=(1, 0))
    with pytest.raises(ConfigError, match="'alloc' or 'free'"):
        log_from_sizes([("malloc", 1, 512)])
    with pytest.raises(ConfigError, match="positive size"):
        log_from_sizes([("alloc", 1, 0)])
    with pytest.raises(ConfigError, match="allocated twice"):
        replay(log_from_sizes([("alloc", 1, 512), ("alloc", 1, 512)]), steps=1)
    with pytest.raises(ConfigError, match="capacity"):
        replay(log_from_sizes([("alloc", 1, 512)]), capacity=-1)
    assert replay(log_from_sizes([("free", 7, 0)]), steps=1).unmatched_frees == 1


def test_equal_blocks_go_oldest_first_not_lowest_address_first():
    """The pool orders free blocks by size, then registration counter (BlockComparatorRegistrationCounter; the
    counter is given in Block's constructor). A split hands out a new Block at the front and keeps the old one as
    the remainder (alloc_found_block), so after 4 MiB and 12 MiB from one segment, freeing the 4 MiB block leaves two
    free 4 MiB blocks: the front one is newer. The next 4 MiB request takes the older one at the end."""
    a = CachingAllocator()
    front = a.malloc(4 * MIB)
    a.malloc(12 * MIB)
    a.free(front)
    a.malloc(4 * MIB)
    assert _segments(a) == [[(4 * MIB, False), (12 * MIB, True), (4 * MIB, True)]]


def test_with_max_split_size_an_oom_first_frees_cached_oversize_blocks():
    """release_available_cached_blocks (only with a max_split_size): a cached 90 MiB oversize block cannot serve
    60 MiB (90 >= 60 + max_non_split_rounding_size, 20 MiB: get_free_block) and cudaMalloc has no room beside it on
    120 MiB, so the smallest oversize block covering the request is freed and alloc_block succeeds without the
    retry; with only a cached 50 MiB block, it is freed but does not cover the request, so the retry
    (release_cached_blocks, then alloc_block once more) makes the allocation."""
    a = CachingAllocator(parse_alloc_conf("max_split_size_mb:40"), capacity=120 * MIB)
    a.free(a.malloc(90 * MIB))
    a.malloc(60 * MIB)
    assert a.reserved_bytes == 60 * MIB and a.num_device_free == 1 and a.num_alloc_retries == 0
    b = CachingAllocator(parse_alloc_conf("max_split_size_mb:40"), capacity=100 * MIB)
    b.free(b.malloc(50 * MIB))
    b.malloc(60 * MIB)
    assert b.reserved_bytes == 60 * MIB and b.num_device_free == 1 and b.num_alloc_retries == 1


def test_a_step_runs_on_less_than_its_unlimited_max_reserved():
    """DeviceCachingAllocator::malloc: when a block cannot be allocated, release_available_cached_blocks and then
    release_cached_blocks free the cached segments and the allocation is retried before OutOfMemoryError. A freed
    16 MiB segment (a 15 MiB request rounded to 2 MiB) and a later 30 MiB request reserve 46 MiB without a limit,
    yet run in 32 MiB; not in 29 MiB, where the 30 MiB request alone does not fit."""
    from trainmem.allocator import least_capacity, max_reserved, runs_within

    mib = 1 << 20
    log = log_from_sizes([("alloc", 1, 15 * mib), ("free", 1, 0), ("alloc", 2, 30 * mib), ("free", 2, 0)])
    assert max_reserved(log, steps=1) == 46 * mib
    assert runs_within(log, 32 * mib, steps=1)
    assert not runs_within(log, 29 * mib, steps=1)
    assert 30 * mib <= least_capacity(log, steps=1, resolution=mib) <= 31 * mib
