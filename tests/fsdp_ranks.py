"""Real FSDP2 on CPU processes (gloo): what each rank holds for parameters, gradients and AdamW states after one step.

Run as ``python tests/fsdp_ranks.py WORLD RECIPE CONFIG_JSON [LORA_JSON]``; prints one JSON line per rank. With
LORA_JSON ({"r": 4, "target_modules": [...]}, peft's LoraConfig keys) the model is peft's LoRA model on a frozen
base in the recipe's weights (bf16 for mixed-bf16, fp32 adapters), sharded with no MixedPrecisionPolicy as
torchtune's LoRA recipes do. Used by
tests/test_sharding.py (a subprocess, so the process group and its workers never touch pytest's process).
"""

import json
import os
import socket
import sys
import tempfile


def _rank(rank, world, recipe, config, port, out, lora=None):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    policy = MixedPrecisionPolicy()
    if lora is not None:
        import peft

        if recipe != "fp32":
            model = model.to(torch.bfloat16)
        model = peft.get_peft_model(model, peft.LoraConfig(**lora))
        recipe = "lora"
    layers = model.get_base_model().model.layers if lora is not None else model.model.layers
    if recipe == "mixed-bf16":  # fp32 shards (the masters), bf16 compute, fp32 reduction: torchtitan's default
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif recipe == "pure-bf16-bf16states":
        model = model.to(torch.bfloat16)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, config["vocab_size"], (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def nbytes(t):
        return local(t).numel() * local(t).element_size()

    row = {"rank": rank,
           "parameters": sum(local(p).untyped_storage().nbytes() for p in model.parameters()),
           "gradients": sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)}
    optimizer.step()
    row["optimizer_states"] = sum(nbytes(v) for s in optimizer.state.values() for k, v in s.items()
                                  if torch.is_tensor(v) and k != "step")
    with open(f"{out}.{rank}", "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    world, recipe, config = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    lora = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_rank, args=(world, recipe, config, port, out, lora), nprocs=world)
        for rank in range(world):
            print(open(f"{out}.{rank}").read())


if __name__ == "__main__":
    main()
