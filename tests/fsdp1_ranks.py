"""Real FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) on CPU processes (gloo): what each rank allocates in
each phase of a gradient-accumulated step, under torch's MemTracker.

Run as ``python tests/fsdp1_ranks.py WORLD SETUPS_JSON``; prints one JSON line per rank, a list of runs, one per setup.
A setup's keys: ``config`` (AutoConfig.for_model keys of a Llama), ``lora`` (peft's LoraConfig keys, or null: full
fine-tuning; without ``use_orig_params`` the adapters are wrapped apart), ``qlora`` (the decoder layers' Linears
4-bit, their packed data stored as bf16: fsdp_qlora's base), ``strategy`` ("full", "grad-op" or "no-shard"), ``use_orig_params``,
``checkpointing`` (every layer, torch's non-reentrant checkpoint wrapper inside its unit, as Fabric's
activation_checkpointing_policy applies it), ``accum`` (micro-batches; all but the last in ``no_sync()`` where
``no_sync``, as Fabric's ``no_backward_sync`` runs them), ``batch``, ``seq``. The model is bf16 throughout (lit-gpt's
bf16-true), each decoder layer an FSDP unit (ModuleWrapPolicy), the root unit the rest, fused AdamW over what trains
(no step temporaries: trainmem's ``--optimizer-impl fused``). Two steps run; a run holds the second's phases (the
optimizer's states exist, as in a steady step): each phase is a ``with tracker:`` block of its own (MemTracker resets
its peak on entry), so a run holds every micro-batch's forward and backward peak, the step's, and the bytes after
zero_grad; and each unit's FlatParameter as FlatParamHandle laid it out. Used by tests/test_fsdp1.py (a subprocess,
so the process group never touches pytest's process). The collector runs before each micro-batch and the step: once,
under pytest, a unit-sized tensor of the synced backward outlived it until Python's collector ran (a reference
cycle), which a GPU run's counter would see as well, as chance has it; the estimate models the step without it.
"""

import contextlib
import gc
import json
import os
import socket
import sys
import tempfile
import warnings


def storage_tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        """Storages only: MemTracker's module hooks register gradient hooks that FSDP1's frozen views refuse."""

        def _pre_fw_hook(self, *a):
            pass

        def _post_fw_hook(self, *a):
            pass

        def _pre_bw_hook(self, *a):
            pass

        def _post_bw_hook(self, *a):
            pass

        def total(self, kind="current"):
            return sum(snap["Total"] for snap in self.get_tracker_snapshot(kind).values())

    return Tracker()


def quantized_base(model):
    """Every Linear of the decoder layers as bitsandbytes' 4-bit nf4 Linear with double quantization and its packed
    data stored as bf16 (bnb_4bit_quant_storage, as fsdp_qlora sets it so that FSDP1 can flatten it with the norms),
    quantized on the CPU."""
    import bitsandbytes as bnb
    import torch

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=torch.bfloat16, quant_type="nf4",
                                              quant_storage=torch.bfloat16, compress_statistics=True)
                quantized.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                                     quant_storage=torch.bfloat16, compress_statistics=True,
                                                     module=quantized)
                setattr(parent, name, quantized.to("cpu"))
    return model


def _wrap_policy(setup):
    """One unit per decoder layer (ModuleWrapPolicy, lit-gpt's); LoRA without use_orig_params: each trained leaf
    module a unit of its own as well (peft's fsdp_auto_wrap_policy, fsdp_qlora's get_wrapping_policy)."""
    import functools

    from torch.distributed.fsdp.wrap import (ModuleWrapPolicy, _or_policy, lambda_auto_wrap_policy,
                                             transformer_auto_wrap_policy)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if not setup.get("lora") or setup["use_orig_params"]:
        return ModuleWrapPolicy({LlamaDecoderLayer})

    def trained_leaf(module):
        return (not list(module.children()) and getattr(module, "weight", None) is not None
                and module.weight.requires_grad)

    return functools.partial(_or_policy, policies=[
        functools.partial(lambda_auto_wrap_policy, lambda_fn=trained_leaf),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})])


def _model(setup):
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**setup["config"])).to(torch.bfloat16)
    if setup.get("qlora"):
        model = quantized_base(model)
    if setup.get("lora"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(**setup["lora"]))
        for p in model.parameters():  # bf16 adapters: FSDP1 flattens one dtype per unit
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    strategy = {"full": ShardingStrategy.FULL_SHARD, "grad-op": ShardingStrategy.SHARD_GRAD_OP,
                "no-shard": ShardingStrategy.NO_SHARD}[setup["strategy"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # _wrap_utils' warning on mixed requires_grad under use_orig_params
        model = FSDP(model, auto_wrap_policy=_wrap_policy(setup), sharding_strategy=strategy,
                     use_orig_params=setup["use_orig_params"], device_id=torch.device("cpu"), limit_all_gathers=True)
    if setup.get("checkpointing"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    return model


def _settle(tracker, rounds: int = 200) -> None:
    """Collect and wait (at most ``rounds`` x 10 ms) until the tracked bytes stay the same three times running."""
    import time

    last, same = None, 0
    for _ in range(rounds):
        gc.collect()
        now = tracker.total()
        same = same + 1 if now == last else 0
        if same >= 3:
            return
        last = now
        time.sleep(0.01)


def _run(setup):
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _model(setup)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    tracker = storage_tracker()
    tracker.track_external(model, optimizer)
    phases: list = []
    for _ in range(2):
        phases = []
        for i in range(setup["accum"]):
            gc.collect()
            x = torch.randint(0, setup["config"]["vocab_size"], (setup["batch"], setup["seq"]))
            last = i == setup["accum"] - 1
            with model.no_sync() if setup.get("no_sync") and not last else contextlib.nullcontext():
                with tracker:
                    loss = model(input_ids=x, labels=x).loss
                    phases.append({"phase": "forward", "peak": tracker.total("peak")})
                with tracker:
                    loss.backward()
                    del loss
                    phases.append({"phase": "backward", "peak": tracker.total("peak")})
        # (every rank's collectives finished, their buffers released, before the optimizer's peak is measured: CI
        # runs under load twice measured 131,404 and 131,448 bytes more here on one rank, the root unit's padded
        # flat gradient, which gloo's reduce-scatter copies and its work object releases from its own thread
        # later; so the tracked bytes must have settled first)
        torch.distributed.barrier()
        _settle(tracker)
        with tracker:
            optimizer.step()
            phases.append({"phase": "optimizer", "peak": tracker.total("peak")})
            optimizer.zero_grad(set_to_none=True)
            phases.append({"phase": "between_steps", "peak": tracker.total()})
    flat = [{"numel": h.flat_param._unpadded_unsharded_size.numel(), "shard": h.flat_param._sharded_size.numel(),
             "trains": h.flat_param.requires_grad}
            for h in (m._handle for m in FSDP.fsdp_modules(model)) if h is not None]
    return {"phases": phases, "flat_params": flat, "quant_state_bytes": quant_state_bytes(model)}


def as_memtracker_sees_it(monkeypatch):
    """The estimate without forward's dequantized weight, which bitsandbytes::gemm_4bit makes and frees inside its
    kernel, where MemTracker's dispatch mode does not see it (backward's is an op of its own, which it sees)."""
    from dataclasses import replace

    from trainmem.lora import FineTune

    buffers = FineTune.buffers

    def seen(self, spec, p):
        made = buffers(self, spec, p)
        # (FineTune.buffers' only one is the dequantized weight: another would need its own rule here)
        assert len(made) == 1, made
        return tuple(replace(b, phases=tuple(x for x in b.phases if not x.startswith("forward"))) for b in made)

    monkeypatch.setattr(FineTune, "buffers", seen)


def quant_state_bytes(model):
    """The bytes of the 4-bit weights' quantization states (absmax, the nested constants, the code), which are no
    parameter or buffer, so MemTracker's view of the model leaves them out (a GPU's allocated memory holds them)."""
    seen, total = set(), 0

    def add(tensor):
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for module in model.modules():
        state = getattr(module, "quant_state", None)
        while state is not None:
            for name in ("absmax", "code", "offset"):
                value = getattr(state, name, None)
                if value is not None and hasattr(value, "untyped_storage"):
                    add(value)
            state = getattr(state, "state2", None)
    return total


def _rank(rank, world, setups, port, out):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    runs = [_run(setup) for setup in setups]
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": rank, "runs": runs}, f)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    world, setups = int(sys.argv[1]), json.loads(sys.argv[2])
    # imported once here and forked into the ranks (spawning would import torch, transformers and peft in each)
    import peft  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    if any(setup.get("qlora") for setup in setups):
        import bitsandbytes  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from torch.distributed._tools import mem_tracker  # noqa: F401

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.start_processes(_rank, args=(world, setups, port, out), nprocs=world, start_method="fork")
        for rank in range(world):
            print(open(f"{out}.{rank}").read())


if __name__ == "__main__":
    main()
