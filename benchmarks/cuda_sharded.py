"""Measure one node's per-GPU peaks under FSDP2 and DeepSpeed ZeRO-2/3 against trainmem's per-GPU estimate.

For a machine with two or more GPUs (nothing here runs on the CPU). Launch with torchrun, one process per GPU:

    torchrun --nproc-per-node 8 benchmarks/cuda_sharded.py            # FSDP2, and ZeRO-2/3 if deepspeed imports

Each case builds the model for real (random weights), runs two steps and measures the second:
``torch.cuda.max_memory_allocated()`` reset at each phase boundary (forward, backward, optimizer step) on every
rank; rank 0 gathers the ranks' peaks and prints, per phase, the largest rank's peak beside the estimate for one
GPU of the same layout (``trainmem.estimate(..., gpus=N, fsdp=... | zero=...)``). The printed table is what
docs/accuracy.md's "Many GPUs" section should gain, dated and naming the GPU.
"""

import json
import os
import sys

CASES = [
    ("llama-3.2-1b", dict(recipe="mixed-bf16", batch=2, seq=2048)),
    ("llama-3.2-1b", dict(recipe="mixed-bf16", batch=4, seq=2048, checkpointing="full")),
    ("qwen2.5-0.5b", dict(recipe="mixed-bf16", batch=4, seq=2048)),
]
ENGINES = [dict(fsdp="full"), dict(zero=2), dict(zero=3)]
PHASES = ("forward", "backward", "optimizer")


def _fsdp_model(torch, config, settings, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainmem.probe import build_model
    from trainmem.recipes import get_recipe
    from trainmem.step import enable_checkpointing

    with torch.device("cuda"):
        model = build_model(config, get_recipe("fp32"), settings.attention, 0.0)
    if settings.checkpointing == "full":
        enable_checkpointing(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    return model, optimizer.step, optimizer.zero_grad, lambda loss: loss.backward()


def _deepspeed_model(torch, config, settings, stage):
    import deepspeed

    from trainmem.probe import build_model
    from trainmem.recipes import get_recipe
    from trainmem.step import enable_checkpointing

    with torch.device("cuda"):
        model = build_model(config, get_recipe("mixed-bf16"), settings.attention, 0.0)
    if settings.checkpointing == "full":
        enable_checkpointing(model)
    ds_config = {"train_micro_batch_size_per_gpu": settings.batch, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": stage},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine, engine.step, lambda **_: None, engine.backward


def _measure(torch, model, step, zero_grad, backward, ids) -> dict[str, int]:
    peaks = {}
    for _ in range(2):  # the second step is measured (the optimizer states exist)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        peaks["forward"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        backward(loss)
        del loss
        torch.cuda.synchronize()
        peaks["backward"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks["optimizer"] = torch.cuda.max_memory_allocated()
    return peaks


def main() -> int:
    import torch
    import torch.distributed as dist

    import trainmem
    from trainmem.catalog import catalog_config
    from trainmem.settings import make_settings

    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        print("run under torchrun on a machine with GPUs: torchrun --nproc-per-node N benchmarks/cuda_sharded.py",
              file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    try:
        import deepspeed  # noqa: F401
        engines = ENGINES
    except ImportError:
        engines = [e for e in ENGINES if "fsdp" in e]
    if rank == 0:
        print(f"{torch.cuda.get_device_name()}, {world} GPUs, torch {torch.__version__}")
        print("| model | settings | engine | phase | largest rank's peak (GiB) | estimate (GiB) | error |")
        print("|---|---|---|---|---|---|---|")
    for name, kw in CASES:
        config = catalog_config(name)
        settings = make_settings(dropout=0.0, **kw)
        for engine in engines:
            ids = torch.randint(0, int(config["vocab_size"]), (settings.batch, settings.seq), device="cuda")
            built = None
            try:
                built = (_fsdp_model(torch, config, settings, world) if "fsdp" in engine
                         else _deepspeed_model(torch, config, settings, engine["zero"]))
                peaks = _measure(torch, *built, ids)
            except torch.OutOfMemoryError:
                peaks = {}
            del built
            torch.cuda.empty_cache()
            gathered = [None] * world
            dist.all_gather_object(gathered, peaks)
            if rank == 0:
                est = trainmem.estimate(name, gpus=world, optimizer_impl="foreach", dropout=0.0, **kw, **engine)
                estimated = {p.name: p.allocated_bytes for p in est.phases}
                label = "FSDP2 full" if "fsdp" in engine else f"ZeRO-{engine['zero']}"
                for phase in PHASES:
                    values = [g[phase] for g in gathered if g]
                    if len(values) < world:
                        print(f"| {name} | {json.dumps(kw)} | {label} | {phase} | out of memory | | |")
                        continue
                    measured, e = max(values), estimated[phase]
                    print(f"| {name} | {json.dumps(kw)} | {label} | {phase} | {measured / 2**30:.3f} | "
                          f"{e / 2**30:.3f} | {(e - measured) / measured:+.2%} |", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
