"""Property tests: memory never shrinks when the model or the workload grows; nothing is negative."""

from hypothesis import given, settings, strategies as st

from trainmem.estimate import DeviceOptions
from trainmem.stepmodel import estimate_model
from trainmem.models import nominal_spec, spec_from_config
from trainmem.optimizers import OPTIMIZERS
from trainmem.recipes import RECIPES
from trainmem.settings import make_settings

recipes = st.sampled_from(sorted(RECIPES))
optimizers = st.sampled_from(sorted(OPTIMIZERS))


def llama(hidden_heads: int, layers: int, inter: int, vocab: int, kv_div: int) -> dict:
    heads = hidden_heads
    return dict(model_type="llama", hidden_size=64 * heads, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // kv_div) if heads % kv_div == 0 else heads,
                num_hidden_layers=layers, intermediate_size=inter, vocab_size=vocab)


FLAT = DeviceOptions(fragmentation=0.1)
"""Where a test compares static or allocated bytes only, the reserved memory's replay (tests/test_replay.py) is left
out: it is most of an estimate's time."""

@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 10**12), extra=st.integers(1, 10**11), recipe=recipes,
       optimizer=st.sampled_from([o for o in sorted(OPTIMIZERS) if not OPTIMIZERS[o].needs_shapes]))
def test_static_memory_grows_with_parameters(n, extra, recipe, optimizer):
    s = make_settings(recipe=recipe, optimizer=optimizer)
    small, big = estimate_model(nominal_spec(n), s), estimate_model(nominal_spec(n + extra), s)
    assert all(c.bytes >= 0 for c in small.static)
    # bitsandbytes keeps fp32 states for tensors under 4096 elements, so its states (and the total with them)
    # genuinely shrink when a tensor crosses that threshold (4095 elements: 32,760 B; 4096: 8,320 B). Every other
    # part grows.
    crosses_8bit_threshold = optimizer.endswith("8bit") and n < 4096 <= n + extra
    # a paged optimizer's states of a tensor of 1e5+ elements move to unified memory (estimate.paged_bytes)
    crosses_8bit_threshold |= OPTIMIZERS[optimizer].paged and n < 100_000 <= n + extra
    if not crosses_8bit_threshold:
        assert big.static_bytes >= small.static_bytes
    for a, b in zip(small.static, big.static):
        if not (a.name == "optimizer_states" and crosses_8bit_threshold):
            assert b.bytes >= a.bytes


@settings(max_examples=75, deadline=None)
@given(heads=st.integers(1, 64), layers=st.integers(1, 100), inter=st.integers(1, 50_000),
       vocab=st.integers(1, 300_000), kv_div=st.sampled_from([1, 2, 4, 8]), recipe=recipes, optimizer=optimizers,
       grow=st.sampled_from(["layers", "inter", "vocab"]))
def test_memory_grows_with_architecture(heads, layers, inter, vocab, kv_div, recipe, optimizer, grow):
    cfg = llama(heads, layers, inter, vocab, kv_div)
    bigger = dict(cfg, **{"layers": {"num_hidden_layers": layers + 1}, "inter": {"intermediate_size": inter + 7},
                          "vocab": {"vocab_size": vocab + 1000}}[grow])
    s = make_settings(recipe=recipe, optimizer=optimizer)
    a, b = estimate_model(spec_from_config(cfg), s, FLAT), estimate_model(spec_from_config(bigger), s, FLAT)
    assert b.model.num_parameters > a.model.num_parameters
    assert all(c.bytes >= 0 for c in a.static)
    if optimizer.endswith("8bit"):
        # A tensor that grows past 4096 elements switches from fp32 to 8-bit states (bitsandbytes'
        # min_8bit_size), so the states can shrink; everything else must still grow.
        assert all(cb.bytes >= ca.bytes for ca, cb in zip(a.static, b.static) if ca.name != "optimizer_states")
    else:
        assert b.static_bytes >= a.static_bytes


@settings(max_examples=60, deadline=None, database=None)
@given(batch=st.integers(1, 1 << 24), seq=st.integers(1, 1 << 24), accum=st.integers(1, 1 << 24), recipe=recipes,
       attention=st.sampled_from(["eager", "sdpa", "flash"]), checkpointing=st.sampled_from(["none", "full"]),
       model=st.sampled_from(["gpt2", "llama-2-7b", "mixtral-8x7b", "gemma-2-9b", "deepseek-v3", "falcon-7b"]))
def test_every_accepted_workload_gives_finite_whole_bytes(batch, seq, accum, recipe, attention, checkpointing, model):
    """Anywhere in the accepted ranges (up to settings.MAX_BATCH, MAX_SEQ, MAX_GRAD_ACCUM) the estimate is whole,
    finite bytes that do not shrink when the batch grows: no float overflow, no Infinity in the JSON."""
    import json
    import math

    from trainmem.catalog import resolve_model
    from trainmem.errors import ConfigError
    from trainmem.report import json_safe, to_dict

    spec = resolve_model(model)
    try:
        s = make_settings(batch=batch, seq=seq, grad_accum=accum, recipe=recipe, attention=attention,
                          checkpointing=checkpointing)
    except ConfigError:
        return  # (a combination the settings refuse, e.g. flash with an fp32 recipe)
    est = estimate_model(spec, s)
    json.dumps(json_safe(to_dict(est, None)), allow_nan=False)
    for phase in est.phases:
        assert isinstance(phase.allocated_bytes, int) and 0 < phase.allocated_bytes < 2**256
        assert math.isfinite(float(phase.allocated_bytes))
    if batch < 1 << 24:
        bigger = estimate_model(spec, s.at(batch + 1, seq), FLAT)  # (allocated only: no replay needed)
        assert bigger.peak.allocated_bytes >= est.peak.allocated_bytes
