"""trainmem's per-GPU estimate of model-parallel layouts beside Megatron-LM's theoretical memory report.

Megatron's figures follow megatron/training/theoretical_memory_usage.py (NVIDIA/Megatron-LM, commit 00caa53):
weights and optimizer = the most loaded shard's parameters ((layers / pp + embedding) / tp, plus the output layer
when untied and pp = 1) x (6 + 12 / dp) bytes with the distributed optimizer (bf16 weights, fp32 main gradients,
fp32 master and Adam states sharded over dp); activations = Korthikanti et al.'s Table 2 with sequence parallelism
and selective recompute, s b h (18 + 4 ffn / h) per layer, all layers on the first stage (pp micro-batches in
flight, x (1 + (pp - 1) / (pp v)) interleaved), the embedding's input and dropout, and with pp = 1 the output
layer's input and the loss, divided by tp. Without sequence parallelism: s b h (10 + 24 / tp) per layer, x 1.05.

trainmem's side is the same layout with the recipe Megatron runs (bf16 compute, fp32 main gradients:
mixed-bf16-fp32grads), ZeRO-1 for the distributed optimizer, SDPA's flash kernel (what selective recompute leaves),
no dropout, micro-batch 1. Prints one row per layout, in GiB. docs/accuracy.md records the output and explains
each difference.

    python benchmarks/megatron_compare.py
"""

from __future__ import annotations

import math

from trainmem.catalog import catalog_spec
from trainmem.stepmodel import estimate_model
from trainmem.settings import make_settings
from trainmem.sharding import Parallel

GIB = 2**30

LAYOUTS = [  # (model, gpus, tp, sp, pp, virtual stages, micro-batches)
    ("llama-3-8b", 8, 2, True, 1, 1, 0),
    ("llama-3-8b", 8, 4, True, 1, 1, 0),
    ("llama-3-8b", 16, 8, True, 1, 1, 0),
    ("llama-3-8b", 8, 4, False, 1, 1, 0),
    ("llama-3-8b", 16, 2, True, 4, 1, 8),
    ("llama-3-8b", 16, 2, True, 4, 2, 8),
    ("llama-3-70b", 64, 8, True, 4, 1, 16),
    ("llama-3-70b", 128, 8, True, 8, 1, 16),
]
SEQ = 4096


def megatron(spec, gpus: int, tp: int, sp: bool, pp: int, virtual: int, micro: int, seq: int) -> tuple[float, float]:
    """(weights and optimizer, activations) in bytes, as Megatron's report computes them."""
    layer, _ = spec.layer_runs[0]
    h, ffn, layers = spec.hidden_size, layer.mlp.intermediate_size, spec.num_layers
    heads, groups, head_dim = layer.attention.num_heads, layer.attention.num_kv_heads, layer.attention.head_dim
    vocab = math.ceil(spec.vocab_size / (128 * tp)) * 128 * tp  # make-vocab-size-divisible-by 128, times tp
    dp = gpus // (tp * pp)
    attention = 2 * h * h * (1 + groups / heads) * (heads * head_dim / h)
    per_layer = 2 * h * (ffn * 3 / 2 + 1) + attention  # SwiGLU, RMSNorm
    block = per_layer * layers + h
    embedding = h * vocab
    shard = (block / pp + embedding) / tp
    if not spec.tied_embeddings and pp == 1:
        shard += embedding / tp
    weights_and_optimizer = shard * (6 + 12 / dp)
    b = 1
    if sp:
        acts = seq * b * h * (18 + 4 * ffn / h) * layers
    else:
        acts = seq * b * h * (10 + 24 / tp) * layers
    acts += 8 * seq * b * pp + seq * b * h * pp
    if virtual > 1:
        acts *= 1 + (pp - 1) / (pp * virtual)
    elif pp > 1:
        acts *= min(1, micro / pp)
    if sp:
        if pp == 1:
            acts += seq * b * h * 4 * (1 + vocab / h)
        acts /= tp
    else:
        if pp == 1:
            acts += (seq * b * vocab / tp + seq * b * h) * 2
        acts *= 1.05
    return weights_and_optimizer, acts


def main() -> None:
    print(f"{'layout':34s} {'Megatron w+opt':>14s} {'trainmem static':>15s} {'Megatron acts':>13s} "
          f"{'trainmem acts':>13s} {'ratio':>5s} {'B/token/layer M':>15s} {'trainmem':>8s} {'trainmem peak':>13s}")
    for name, gpus, tp, sp, pp, virtual, micro in LAYOUTS:
        spec = catalog_spec(name)
        parallel = Parallel(gpus=gpus, tp=tp, sp=sp, pp=pp, zero=1,
                            pp_schedule="interleaved" if virtual > 1 else "1f1b", virtual_stages=virtual,
                            micro_batches=micro)
        settings = make_settings(recipe="mixed-bf16-fp32grads", batch=1, seq=SEQ, dropout=0.0)
        est = estimate_model(spec, settings, parallel=parallel)
        # Megatron reports the first stage (its activations) with the most loaded shard's weights
        first = est.per_rank[0].estimate
        w_opt, acts = megatron(spec, gpus, tp, sp, pp, virtual, micro, SEQ)
        label = f"{name} tp{tp}{'+sp' if sp else ''} pp{pp}{f' v{virtual}' if virtual > 1 else ''} dp{gpus // (tp * pp)}"
        h, ffn = spec.hidden_size, spec.layer_runs[0][0].mlp.intermediate_size
        megatron_layer = h * ((18 + 4 * ffn / h) / tp if sp else 10 + 24 / tp)
        layer = first.activations.layers[0].bytes_per_token
        print(f"{label:34s} {w_opt / GIB:14.2f} {first.static_bytes / GIB:15.2f} {acts / GIB:13.2f} "
              f"{first.activation_bytes / GIB:13.2f} {first.activation_bytes / acts:5.2f} {megatron_layer:15,.0f} "
              f"{layer:8,.0f} {est.peak.allocated_bytes / GIB:13.2f}")


if __name__ == "__main__":
    main()
