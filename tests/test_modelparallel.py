"""Tensor, sequence, pipeline, context and expert parallelism (modelparallel.py): the per-rank estimate against
PyTorch's DTensor tensor parallelism traced on one rank, against the transformers sub-model a pipeline stage holds,
and the layouts a model cannot be split into."""

import json

import pytest

from trainmem.catalog import catalog_config, catalog_spec
from trainmem.errors import ConfigError
from trainmem.request import estimate
from trainmem.stepmodel import estimate_model
from trainmem.modelparallel import in_flight_chunks, stage_spec, tensor_parallel_spec
from trainmem.models import spec_from_config
from trainmem.settings import make_settings
from trainmem.sharding import Parallel

TOLERANCE = 0.03
"""The issue's bar: each traced phase within 3% of the estimate."""


def _tiny_llama(layers: int = 2, vocab: int = 512) -> dict:
    """Llama-3.2-1B's layer shapes, two layers, a small vocabulary, untied (a tied pair parallelized as two
    modules becomes two tensors in the trace)."""
    return dict(catalog_config("llama-3.2-1b"), num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=False)


@pytest.mark.parametrize("tp,sp,recipe,seq,vocab", [
    (2, False, "pure-bf16-bf16states", 1024, 512),
    (2, True, "pure-bf16-bf16states", 1024, 512),
    (4, True, "pure-bf16-bf16states", 512, 32000),  # (the vocabulary-parallel loss and embedding gradient count)
    (2, True, "fp32", 512, 512),
    (4, False, "fp32", 512, 32000),
])
def test_tensor_parallel_rank_matches_its_dtensor_trace(tp, sp, recipe, seq, vocab):
    """One rank of torchtitan's Llama plan (ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down, the vocabulary-
    parallel embedding and head, SequenceParallel norms, loss_parallel) traced under FakeTensorMode and the fake
    process group."""
    from trainmem.trace import trace_tp_step

    config = _tiny_llama(vocab=vocab)
    spec = spec_from_config(config)
    settings = make_settings(recipe=recipe, batch=2, seq=seq, dropout=0.0)
    parallel = Parallel(gpus=tp, tp=tp, sp=sp)
    est = estimate_model(spec, settings, parallel=parallel)
    traced = trace_tp_step(config, settings, parallel, spec)
    # the rank's shards (the trace rounds each tensor to CUDA's 512-byte blocks)
    assert abs(est.phases[0].parameters - traced.phases[0].parameters) <= 512 * 32
    for e, t in zip(est.phases, traced.phases, strict=True):
        assert e.name == t.name
        assert abs(e.allocated_bytes / t.allocated_bytes - 1) <= TOLERANCE, (e, t)
    # the activations themselves, not only the totals the static memory dominates
    for name in ("forward", "backward"):
        e = next(p for p in est.phases if p.name == name)
        t = next(p for p in traced.phases if p.name == name)
        dynamic = lambda p: p.gradients + p.activations + p.temporaries  # noqa: E731
        assert abs(dynamic(e) / dynamic(t) - 1) <= 0.06, (name, e, t)


def test_sequence_parallel_splits_norms_not_the_gathered_linear_inputs():
    spec = catalog_spec("llama-3-8b")
    settings = make_settings(recipe="pure-bf16", seq=4096)
    plain, split = (estimate_model(spec, settings, parallel=Parallel(gpus=4, tp=4, sp=sp)).activations
                    for sp in (False, True))
    terms = lambda acts: {t.name: t.bytes_per_token for t in acts.layers[0].terms}  # noqa: E731
    a, b = terms(plain), terms(split)
    assert b["input norm: rsqrt"] == a["input norm: rsqrt"] / 4
    assert b["input norm output (q/k/v projections' input)"] == a["input norm output (q/k/v projections' input)"]
    assert b["gate, up projections"] == a["gate, up projections"]
    assert split.layers[0].checkpoint_terms[0].bytes_per_token == plain.layers[0].checkpoint_terms[0].bytes_per_token / 4


def test_tensor_parallel_rank_holds_its_share_of_each_tensor():
    spec = catalog_spec("llama-3-8b")  # 32 heads, 8 kv heads, 14336 wide MLP, 128256 vocabulary, untied
    rank = tensor_parallel_spec(spec, Parallel(gpus=8, tp=8))
    h, layers = 4096, 32
    per_layer = (h * 4096 + 2 * h * 1024 + 4096 * h) // 8 + 3 * h * 14336 // 8 + 2 * h  # attention, MLP, 2 norms
    assert rank.num_parameters == layers * per_layer + 2 * (128256 // 8) * h + h  # embedding, head, final norm


def test_pipeline_stages_hold_their_layers_and_the_ends():
    spec = catalog_spec("llama-3.2-1b")  # 16 layers, tied embeddings
    parallel = Parallel(gpus=4, pp=4)
    stages = [stage_spec(spec, parallel, s) for s in range(4)]
    assert [s.num_layers for s in stages] == [4, 4, 4, 4]
    embedding = spec.vocab_size * spec.hidden_size
    layer = next(g.numel_each for g in spec.param_groups if g.name.startswith("layers"))
    assert stages[0].num_parameters == embedding + 4 * layer
    assert stages[1].num_parameters == 4 * layer
    # the last stage: its own copy of the tied embedding as the LM head (Megatron), and the final norm
    assert stages[3].num_parameters == 4 * layer + spec.hidden_size + embedding


@pytest.mark.parametrize("pp,virtual,micro", [(4, 1, 8), (4, 1, 2), (4, 2, 8), (8, 4, 16), (2, 2, 4)])
def test_in_flight_activations_follow_megatron(pp, virtual, micro):
    """1F1B: min(P - s, M) micro-batches on stage s. Interleaved: the first stage holds L (1 + (P - 1) / (P V))
    layers' worth when M >= P (megatron/training/theoretical_memory_usage.py's penalty), from the schedule's
    warm-up count."""
    parallel = Parallel(gpus=pp, pp=pp, pp_schedule="interleaved" if virtual > 1 else "1f1b",
                        virtual_stages=virtual, micro_batches=micro)
    layers = pp * virtual * 4
    per_chunk = layers // (pp * virtual)
    first = in_flight_chunks(parallel, 0) * per_chunk
    if virtual == 1:
        assert [in_flight_chunks(parallel, s) for s in range(pp)] == [min(pp - s, micro) for s in range(pp)]
    else:
        assert first == layers * (1 + (pp - 1) / (pp * virtual))
    assert all(in_flight_chunks(parallel, s) >= in_flight_chunks(parallel, s + 1) for s in range(pp - 1))


def test_first_stage_keeps_the_activations_of_its_micro_batches_in_flight():
    spec = catalog_spec("llama-3-8b")
    settings = make_settings(recipe="mixed-bf16", seq=4096, checkpointing="none")
    est = estimate_model(spec, settings, parallel=Parallel(gpus=4, pp=4))
    roles = {r.name: r for r in est.per_rank}
    assert set(roles) == {"first stage", "middle stages", "last stage"}
    first, last = roles["first stage"].estimate, roles["last stage"].estimate
    one_micro = first.activations.layers_bytes + first.activations.embedding_bytes
    assert first.in_flight_bytes == 3 * one_micro  # 4 in flight, one of them the step's own
    assert last.in_flight_bytes == 0 and last.activations.logits_bytes > 0 and first.activations.logits_bytes == 0
    forward = next(p for p in first.phases if p.name == "forward")
    alone = estimate_model(stage_spec(spec, Parallel(gpus=4, pp=4), 0),
                           make_settings(recipe="mixed-bf16", seq=4096, grad_accum=4))
    assert forward.activations == next(p for p in alone.phases if p.name == "forward").activations + 3 * one_micro


def test_a_middle_stage_matches_the_transformers_layers_it_holds():
    """A pipeline stage traced as the sub-model it holds: a LlamaModel of its layers, no embedding (the previous
    stage's hidden states come in), no final norm or head (the hidden states go out, their gradient comes back)."""
    import torch
    from torch.distributed._tools import mem_tracker

    from trainmem import trace as T
    from trainmem.probe import build_model
    from trainmem.recipes import get_recipe

    config = dict(_tiny_llama(layers=2))
    settings = make_settings(recipe="pure-bf16-bf16states", batch=2, seq=512, dropout=0.0)
    parallel = Parallel(gpus=3, pp=3, micro_batches=1)  # (one micro-batch in flight: the step alone)
    middle = stage_spec(spec_from_config(dict(config, num_hidden_layers=6)), parallel, 1)
    est = estimate_model(middle, settings)
    with T._cuda_block_sizes(True), T.fake_gpu():
        model = build_model(config, get_recipe(settings.recipe), "sdpa", 0.0).model
        model.embed_tokens = None
        model.norm = torch.nn.Identity()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        incoming = torch.randn(2, 512, config["hidden_size"], dtype=torch.bfloat16)

        def micro_batch():
            hidden = incoming.detach().requires_grad_()
            out = model(inputs_embeds=hidden, use_cache=False).last_hidden_state
            out.backward(torch.ones_like(out))

        micro_batch()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker = mem_tracker.MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            micro_batch()
        snaps = tracker.memory_tracking[model].snapshots
        fw = T._device_snapshot(snaps[mem_tracker._ModState.PEAK_FW][-1])
        bw = T._device_snapshot(snaps[mem_tracker._ModState.PEAK_BW][-1])
    for name, traced in (("forward", fw), ("backward", bw)):
        phase = next(p for p in est.phases if p.name == name)
        traced_phase = T._phase(name, "peak", traced)
        # (the incoming hidden states and their gradient belong to the pipeline runtime: one h-wide tensor each)
        assert abs(phase.allocated_bytes / traced_phase.allocated_bytes - 1) <= TOLERANCE, (phase, traced_phase)


def test_expert_parallel_splits_the_routed_experts_only():
    spec = catalog_spec("mixtral-8x7b")
    whole = tensor_parallel_spec(spec, Parallel(gpus=1))
    split = tensor_parallel_spec(spec, Parallel(gpus=4, ep=4))
    moe = spec.layer_runs[0][0].moe
    expert = 3 * spec.hidden_size * moe.expert_intermediate_size
    assert whole.num_parameters - split.num_parameters == spec.num_layers * (moe.num_experts - 2) * expert
    router = [t for g in split.param_groups for t in g.tensors if t.role == "router"]
    assert router[0].shape == (moe.num_experts, spec.hidden_size)  # the router stays whole


def test_context_parallel_splits_the_sequence_and_keeps_the_gathered_keys_and_values():
    spec = catalog_spec("llama-3-8b")
    settings = make_settings(recipe="pure-bf16", seq=8192)
    one = estimate_model(spec, settings, parallel=Parallel(gpus=2, tp=2))
    two = estimate_model(spec, settings, parallel=Parallel(gpus=4, tp=2, cp=2))
    assert two.activations.tokens == one.activations.tokens // 2
    gathered = [t for t in two.activations.layers[0].terms if "context-parallel" in t.name]
    att = spec.layer_runs[0][0].attention
    # one other rank's keys and values, bf16, the rank's 4 kv heads
    assert gathered[0].bytes_per_token == 2 * 2 * (att.num_kv_heads // 2) * att.head_dim
    assert two.activation_bytes < one.activation_bytes


@pytest.mark.parametrize("args,message", [
    (("--gpus", "3", "--tp", "3"), "--tp 3 must divide the attention heads (32)"),
    (("--gpus", "16", "--tp", "16"), "--tp 16 must divide the key/value heads (8)"),
    (("--gpus", "5", "--pp", "5"), "the 32 layers must split evenly"),
    (("--gpus", "6", "--tp", "4"), "--gpus 6 is not a multiple of tp x pp x cp"),
    (("--gpus", "2", "--cp", "2", "--seq", "2047"), "--cp 2 must divide the sequence length"),
    (("--sp",), "--sp splits the sequence across the tensor-parallel ranks"),
    (("--gpus", "8", "--ep", "2"), "--ep 2 splits routed experts"),
    (("--tp", "-2"), "--tp must be a whole number"),
    (("--gpus", "4", "--pp", "2", "--virtual-stages", "2"), "interleaved schedule runs --virtual-stages"),
    (("--gpus", "4", "--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "3"),
     "multiple of --pp 2"),
    (("--micro-batches", "4"), "describe a pipeline"),
    (("--gpus", "2", "--tp", "2", "--lora", "8"), "LoRA with --tp is not modelled yet"),
    (("--gpus", "4", "--pp", "2", "--grad-accum", "3"), "are the gradient accumulation"),
    (("--gpus", "2", "--tp", "2", "--zero", "3"), "needs more than one GPU to shard across"),
])
def test_impossible_layouts_get_one_line(run_cli, args, message):
    code, out, err = run_cli("estimate", "llama-3-8b", *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_experts_not_divisible_and_params_only(run_cli):
    code, _, err = run_cli("estimate", "mixtral-8x7b", "--gpus", "3", "--ep", "3")
    assert code == 2 and "--ep 3 must divide the routed experts (8)" in err
    code, _, err = run_cli("estimate", "--params", "7e9", "--gpus", "2", "--tp", "2")
    assert code == 2 and "give a model config" in err


def test_json_has_per_rank_and_the_top_figures_are_the_most_loaded(run_cli):
    code, out, _ = run_cli("estimate", "llama-3-70b", "--gpus", "64", "--tp", "8", "--sp", "--pp", "4", "--zero", "1",
                           "--seq", "4096", "--checkpointing", "full", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["parallel"]["tp"] == 8 and doc["parallel"]["data_parallel"] == 2
    roles = doc["per_rank"]
    assert [r["role"] for r in roles] == ["first stage", "middle stages", "last stage"]
    top = max(roles, key=lambda r: r["peak"]["allocated_bytes"])
    assert doc["peak"]["allocated_bytes"] == top["peak"]["allocated_bytes"]
    assert roles[0]["in_flight_chunks"] == 4 and roles[-1]["in_flight_chunks"] == 1


def test_api_takes_the_same_layout():
    est = estimate("llama-3-8b", gpus=16, tp=4, sp=True, pp=2, recipe="mixed-bf16", seq=4096)
    assert len(est.per_rank) == 2 and est.parallel.data_parallel == 2
    with pytest.raises(ConfigError, match="must divide the attention heads"):
        estimate("llama-3-8b", gpus=3, tp=3)


def test_more_tensor_parallelism_never_needs_more_memory_per_gpu():
    spec = catalog_spec("llama-3-70b")
    settings = make_settings(recipe="mixed-bf16", seq=4096, checkpointing="full")
    peaks = [estimate_model(spec, settings, parallel=Parallel(gpus=t, tp=t, sp=t > 1)).peak.allocated_bytes
             for t in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True)


def test_expert_parallel_ranks_shard_their_experts_over_the_expert_data_parallel_group():
    """Mixtral's 8 experts on 32 GPUs: fully_shard alone splits each (8, 2i, h) tensor on dim 0, one padded row per
    rank (4x the experts' share); with EP 8 each rank holds one expert, sharded over the 4 ranks that hold it (on
    dim 1, torchtitan's shard_placement_fn): together 1/32 of every expert tensor, as ZeRO-3's flat partition."""
    spec = catalog_spec("mixtral-8x7b")
    settings = make_settings(recipe="pure-bf16", seq=4096)
    weights = lambda **kw: estimate_model(spec, settings, parallel=Parallel(gpus=32, **kw)).static[0].bytes  # noqa: E731
    moe = spec.layer_runs[0][0].moe
    experts = spec.num_layers * moe.num_experts * 3 * spec.hidden_size * moe.expert_intermediate_size
    dense = spec.num_parameters - experts
    assert weights(fsdp="full", ep=8) == pytest.approx(2 * (dense + experts) / 32, rel=1e-3)
    assert weights(fsdp="full") == pytest.approx(2 * (dense / 32 + experts / 8), rel=1e-3)
    assert weights(zero=3, ep=8) == pytest.approx(weights(zero=3), rel=1e-3)


def test_expert_parallel_adds_the_all_to_all_buffers_to_forward_and_backward():
    spec = catalog_spec("mixtral-8x7b")
    settings = make_settings(recipe="pure-bf16", seq=2048, batch=2)
    plain = estimate_model(spec, settings, parallel=Parallel(gpus=8, fsdp="full"))
    split = estimate_model(spec, settings, parallel=Parallel(gpus=8, fsdp="full", ep=8))
    buffers = 2 * 2 * 2 * 2048 * spec.hidden_size * 2  # sent and received, top-2 copies of 2 x 2048 tokens, bf16
    rank = split.per_rank[0].estimate
    alone = estimate_model(rank.rank_model, settings, parallel=Parallel(gpus=8, fsdp="full", experts_split=8))
    for name in ("forward", "backward"):
        with_buffers = next(p for p in split.phases if p.name == name)
        without = next(p for p in alone.phases if p.name == name)
        assert with_buffers.temporaries - without.temporaries == buffers
    assert split.static_bytes == plain.static_bytes  # 8 experts over 8 ranks: one each, either way


def test_pipeline_stages_hold_torch_pipelinings_receive_buffers(monkeypatch):
    """torch.distributed.pipelining allocates a receive buffer per micro-batch for the activations (every stage but
    the first) and for the gradients (every stage but the last), one micro-batch's hidden states each (1/T of the
    tokens with SP) in the residual dtype, kept in every phase but load; DeepSpeed's pipeline engine adds none."""
    from trainmem.modelparallel import LayoutStep

    spec = catalog_spec("llama-3-8b")
    settings = make_settings(recipe="mixed-bf16", seq=4096, batch=2)
    hidden = 2 * 4096 // 2 * spec.hidden_size * 2  # 2 sequences, 1/2 of the tokens (SP over TP 2), bf16

    def roles(**engine):
        est = estimate_model(spec, settings, parallel=Parallel(gpus=16, tp=2, sp=True, pp=4, micro_batches=8,
                                                               **engine))
        return {r.name: {p.name: p for p in r.estimate.phases} for r in est.per_rank}

    titan, deepspeed = roles(fsdp="full"), roles(zero=1)
    monkeypatch.setattr(LayoutStep, "_receive_buffers", lambda *args: 0)
    titan_without, deepspeed_without = roles(fsdp="full"), roles(zero=1)
    for role, buffers in (("first stage", 8), ("middle stages", 16), ("last stage", 8)):
        for phase in ("forward", "backward", "optimizer", "between_steps"):
            assert titan[role][phase].temporaries - titan_without[role][phase].temporaries == buffers * hidden, \
                (role, phase)
        assert titan[role]["load"] == titan_without[role]["load"]
        assert deepspeed[role] == deepspeed_without[role]
