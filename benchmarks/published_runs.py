"""trainmem against the peak-memory figures that torchtune, litgpt, torchtitan and Answer.AI's fsdp_qlora published
for real GPU runs (docs/accuracy.md, "Published GPU runs").

Each row is one published figure: where it is (repository, file, commit), the trainmem command that states every
setting the source gives, the figure as published, and which counter it is. The estimate compared is the same
counter: trainmem's peak is ``torch.cuda.max_memory_allocated()`` (allocated); torchtune's "active" peak
(``memory_stats()["active_bytes.all.peak"]``) is the allocated peak within the allocator's 512-byte rounding, so it is
compared with the allocated peak too; ``max_memory_reserved()`` with trainmem's reserved figure; nvidia-smi with the
device total (reserved plus the CUDA context). A row that trainmem refuses, or answers without a peak, says why.
A row whose source leaves a setting that moves memory unstated (the dataset's row lengths, a changed setting the
table does not name) is marked "partly specified" and left out of the median.

    python benchmarks/published_runs.py            # the markdown table and the median error
    python benchmarks/published_runs.py --check docs/accuracy.md   # exit 1 if the docs' table is not this one

Runs in process through trainmem's CLI (no torch, no GPU); about 1 s for every row together.
"""

from __future__ import annotations

import contextlib
import enum
import io
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).parent
CONFIGS = HERE / "configs"  # architecture fields of models outside trainmem's catalog (sources in README.md there)
GIB, GB, MIB = 2**30, 10**9, 2**20
UNIT_NAMES = {GIB: "GiB", GB: "GB", MIB: "MiB"}
BEGIN, END = "<!-- published-runs:begin -->", "<!-- published-runs:end -->"


class Metric(enum.Enum):
    """The counter a published figure reads; each is compared with the estimate's figure for that counter."""
    ALLOCATED = "allocated"      # torch.cuda.max_memory_allocated()
    ACTIVE = "active"            # memory_stats()["active_bytes.all.peak"]: allocated, rounded to 512-byte blocks
    RESERVED = "reserved"        # torch.cuda.max_memory_reserved()
    NVIDIA_SMI = "nvidia-smi"    # the device's used memory: reserved + CUDA context


ESTIMATE_FIELD = {Metric.ALLOCATED: "allocated_bytes", Metric.ACTIVE: "allocated_bytes",
                  Metric.RESERVED: "reserved_bytes", Metric.NVIDIA_SMI: "device_bytes"}


class Source(enum.Enum):
    TORCHTUNE = "torchtune"
    LITGPT = "litgpt"
    TORCHTITAN = "torchtitan"
    FSDP_QLORA = "fsdp_qlora"
    TRANSFORMERS = "transformers"
    PEFT = "peft"


@dataclass(frozen=True)
class Row:
    source: Source
    where: str                 # file@commit in the source's repository
    setup: str                 # the published row, in the source's words
    args: tuple[str, ...]      # `trainmem estimate` arguments
    published: float
    unit: int                  # GIB, GB or MIB: the unit the figure is published in
    metric: Metric
    specified: bool = True     # every setting that moves memory is published
    remark: str = ""
    unsupported: str = ""      # a setting trainmem has no flag for: not run


def _a(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# -- torchtune ------------------------------------------------------------------------------------------------------
TT_README = "pytorch/torchtune README.md@30b8519e8 (Memory and training speed)"
TT_FLAGS = "pytorch/torchtune README.md@1814feb17 (Optimization flags)"
TT_LORA = "pytorch/torchtune docs/source/tutorials/lora_finetune.rst@ff594c231"
TT_QLORA = "pytorch/torchtune docs/source/tutorials/qlora_finetune.rst@0914d5cfb"
# torchtune trains bf16 parameters and its AdamW keeps bf16 states; its LoRA adapters are bf16 (the model's dtype);
# the README's table: batch 2, packed to 2,048 tokens, compile on; the configs: chunked-output CE, checkpointing on.
TT8 = ("llama-3.1-8b --recipe pure-bf16-bf16states --batch 2 --seq 2048 --checkpointing full --loss chunked-output"
       " --compile")
TT8_LORA = TT8 + " --lora 8 --lora-alpha 16 --lora-targets q,v --adapter-dtype bf16"
TT8_QLORA = TT8 + " --qlora --lora 8 --lora-alpha 16 --lora-targets q,k,v,o,gate,up,down --adapter-dtype bf16"
TT3 = "llama-3.2-3b --recipe pure-bf16-bf16states --batch 2 --seq 4096 --optimizer-impl fused"
TT3_ALL = TT3 + " --compile --loss chunked-output --checkpointing full"
TT3_LORA = (TT3_ALL + " --offload-activations --lora 64 --lora-alpha 128 --lora-targets q,v,o,gate,up,down"
            " --adapter-dtype bf16")
TT7 = "llama-2-7b --recipe pure-bf16-bf16states --batch 2 --seq 512 --checkpointing full --adapter-dtype bf16"
UNPACKED = ("alpaca-cleaned unpacked, cut at max_seq_len 512 (the dataset's default then): the peak batch is taken "
            "as full length")
TORCHTUNE = [
    Row(Source.TORCHTUNE, TT_README, "Llama 3.1 8B full, 1x 4090",
        _a(TT8 + " --optimizer paged-adamw-8bit --optimizer-in-backward"), 18.9, GIB, Metric.ACTIVE,
        remark="8B_full_single_device: PagedAdamW8bit, optimizer_in_bwd; the table names no counter (the flags "
               "table beside it is active)"),
    Row(Source.TORCHTUNE, TT_README, "Llama 3.1 8B full, 1x A6000",
        _a(TT8 + " --optimizer paged-adamw-8bit --optimizer-in-backward"), 37.4, GIB, Metric.ACTIVE, specified=False,
        remark="the A6000 row differs from the 4090 row in settings the README does not state"),
    Row(Source.TORCHTUNE, TT_README, "Llama 3.1 8B LoRA, 1x 4090", _a(TT8_LORA), 16.2, GIB, Metric.ACTIVE,
        remark="8B_lora_single_device: q,v rank 8, AdamW; the compiled loss counted as inductor runs it "
               "(compiled_loss.py); above by 0.94 GiB, not explained yet"),
    Row(Source.TORCHTUNE, TT_README, "Llama 3.1 8B LoRA, 1x A6000", _a(TT8_LORA), 30.3, GIB, Metric.ACTIVE,
        specified=False, remark="the A6000 row differs from the 4090 row in settings the README does not state"),
    Row(Source.TORCHTUNE, TT_README, "Llama 3.1 8B QLoRA, 1x 4090", _a(TT8_QLORA), 7.4, GIB, Metric.ACTIVE,
        remark="8B_qlora_single_device: q,k,v,output_proj + MLP rank 8; torchao's NF4 (64-value blocks, "
               "quantized scales) counted as bitsandbytes' nf4 with double quantization"),
    Row(Source.TORCHTUNE, TT_README, "Llama 3.1 70B full, 8x A100 (CPU offload, fused optimizer)",
        _a("llama-3.1-70b --recipe pure-bf16-bf16states --batch 2 --seq 2048 --checkpointing full --loss "
           "chunked-output --compile --gpus 8 --fsdp full --offload optimizer+params --optimizer-impl fused "
           "--fsdp-embedding-groups"),
        13.9, GIB, Metric.ACTIVE,
        remark="70B_full: FSDP2, fsdp_cpu_offload; its custom_sharded_layers ['tok_embeddings', 'output'] makes "
               "the embedding and the head FSDP groups of their own, resharded after forward "
               "(--fsdp-embedding-groups)"),
    Row(Source.TORCHTUNE, TT_README, "Llama 3.1 70B LoRA, 8x A100",
        _a("llama-3.1-70b --recipe pure-bf16-bf16states --batch 2 --seq 2048 --checkpointing full --loss "
           "chunked-output --compile --gpus 8 --fsdp full --lora 16 --lora-alpha 32 --lora-targets q,k,v "
           "--adapter-dtype bf16"), 27.6, GIB, Metric.ACTIVE,
        remark="70B_lora: q,k,v rank 16, FSDP2"),
    Row(Source.TORCHTUNE, TT_README, "Llama 3.1 405B QLoRA, 8x A100",
        _a("llama-3.1-405b --recipe pure-bf16-bf16states --batch 2 --seq 2048 --checkpointing full --compile --gpus 8 "
           "--fsdp full --qlora --lora 16 --lora-alpha 32 --lora-targets q,k,v,o,gate,up,down --adapter-dtype bf16"),
        44.8, GIB, Metric.ACTIVE,
        remark="405B_qlora: plain CrossEntropyLoss, batch_size 1 in the config (the README says 2 for every "
               "row); published as \"44.8 GB\", read as torchtune's GiB; above: the per-GPU nf4 weights come "
               "out 30.44 GiB where the single-GPU static state over 8 is 25.7 GiB, and the root group "
               "(embedding and head, 7.83 GiB) is held gathered"),
    Row(Source.TORCHTUNE, TT_FLAGS, "Llama 3.2 3B full, A100: baseline (unpacked)", _a(TT3), 25.5, GIB,
        Metric.ACTIVE, specified=False, unsupported="the unpacked dataset's row lengths are not published"),
    Row(Source.TORCHTUNE, TT_FLAGS, "+ packed dataset", _a(TT3), 60.0, GIB, Metric.ACTIVE,
        remark="fused AdamW, plain CE, no checkpointing"),
    Row(Source.TORCHTUNE, TT_FLAGS, "+ compile", _a(TT3 + " --compile"), 51.0, GIB, Metric.ACTIVE),
    Row(Source.TORCHTUNE, TT_FLAGS, "+ chunked cross-entropy", _a(TT3 + " --compile --loss chunked-output"), 42.9,
        GIB, Metric.ACTIVE),
    Row(Source.TORCHTUNE, TT_FLAGS, "+ activation checkpointing", _a(TT3_ALL), 24.9, GIB, Metric.ACTIVE),
    Row(Source.TORCHTUNE, TT_FLAGS, "+ optimizer step in backward", _a(TT3_ALL + " --optimizer-in-backward"), 23.1,
        GIB, Metric.ACTIVE),
    Row(Source.TORCHTUNE, TT_FLAGS, "+ activation offloading",
        _a(TT3_ALL + " --optimizer-in-backward --offload-activations"), 21.8, GIB, Metric.ACTIVE),
    Row(Source.TORCHTUNE, TT_FLAGS, "+ 8-bit AdamW",
        _a(TT3_ALL + " --optimizer-in-backward --offload-activations --optimizer adamw-8bit"), 17.6, GIB,
        Metric.ACTIVE, specified=False,
        remark="which 8-bit AdamW is not said: the tutorial offers torchao's AdamW8bit and bitsandbytes' "
               "PagedAdamW8bit (the config's); paged states are unified memory that the active counter does not "
               "see, so the figure points at a non-paged one; about 2 GiB above the estimate, the size of fp32 "
               "copies of the 394M-value tied embedding's two states, which torchao's step dequantizes"),
    Row(Source.TORCHTUNE, TT_FLAGS, "LoRA (no optimizer in backward, AdamW)", _a(TT3_LORA), 8.5, GIB, Metric.ACTIVE,
        remark="3B_lora_single_device: q,v,output_proj + MLP, rank 64; the README's reproduce command; above "
               "by 0.38 GiB, as QLoRA"),
    Row(Source.TORCHTUNE, TT_FLAGS, "QLoRA", _a(TT3_LORA + " --qlora"), 4.6, GIB, Metric.ACTIVE,
        remark="torchao's NF4 counted as bitsandbytes' nf4 with double quantization"),
    Row(Source.TORCHTUNE, TT_LORA, "Llama 2 7B LoRA, q,v rank 8", _a(TT7 + " --lora 8 --lora-targets q,v"), 15.57,
        GB, Metric.RESERVED, specified=False,
        remark=UNPACKED + "; the counter is reserved (qlora_finetune.rst quotes the same 15.57 GB as reserved)"),
    Row(Source.TORCHTUNE, TT_LORA, "Llama 2 7B LoRA, all layers rank 8",
        _a(TT7 + " --lora 8 --lora-targets q,k,v,o,gate,up,down,lm_head"), 15.87, GB, Metric.RESERVED,
        specified=False, remark=UNPACKED),
    Row(Source.TORCHTUNE, TT_LORA, "Llama 2 7B LoRA, q,v rank 64", _a(TT7 + " --lora 64 --lora-targets q,v"),
        15.86, GB, Metric.RESERVED, specified=False, remark=UNPACKED),
    Row(Source.TORCHTUNE, TT_LORA, "Llama 2 7B LoRA, all layers rank 64",
        _a(TT7 + " --lora 64 --lora-targets q,k,v,o,gate,up,down,lm_head"), 17.04, GB, Metric.RESERVED,
        specified=False, remark=UNPACKED),
    Row(Source.TORCHTUNE, TT_QLORA, "Llama 2 7B QLoRA (q,k,v,o + MLP rank 8)",
        _a(TT7 + " --qlora --lora 8 --lora-targets q,k,v,o,gate,up,down"), 9.29, GB, Metric.RESERVED,
        specified=False, remark=UNPACKED + "; the same page gives 9.13 GB reserved after model init, about "
                                          "twice the nf4 base: the load's bf16 weights stay reserved by the caching "
                                          "allocator after quantization, which the reserved estimate does not keep"),
]

# -- litgpt ---------------------------------------------------------------------------------------------------------
LG = "Lightning-AI/litgpt tutorials/resource-tables.md@8641822 (lit-gpt, Oct 2023, 1x/2x/4x A100-40GB)"
# finetune/lora.py at 8641822: bf16-true (bf16 weights, adapters and AdamW states), LoRA on q,v rank 8, alpha 16,
# dropout 0.05; the first step runs the longest training example (get_batch(longest_seq_ix)), so the peak is at that
# length: phi-1.5 1,044, StableLM 1,034, Llama 2 1,304 tokens; the head runs in 128-token chunks
# (lm_head_chunk_size=128) into chunked_cross_entropy; "Memory used" is max_memory_allocated() / 1e9.
# Several GPUs: Fabric's FSDPStrategy (full shard, activation checkpointing on every Block).
LG_LORA = "--recipe pure-bf16-bf16states --lora 8 --lora-alpha 16 --lora-dropout 0.05 --lora-targets q,v " \
          "--adapter-dtype bf16 --loss chunked-output"
PHI, STABLELM = str(CONFIGS / "phi-1_5.json"), str(CONFIGS / "stablelm-base-alpha-3b.json")
LG_MODELS = {"phi-1.5": (PHI, 1044), "StableLM Alpha 3B": (STABLELM, 1034), "Llama 2 7B": ("llama-2-7b", 1304),
             "Llama 2 13B": ("llama-2-13b", 1304)}
LG_BNB = "0.41"  # requirements-all.txt@8641822: bitsandbytes unpinned, Oct 2023: the 0.41 releases
LG_REMARK = "lit-gpt's own model code; its 128-token head chunks mapped to torchtune's 8-slice chunked loss"
LG_FSDP_REMARK = ("FSDP1 as lit-gpt ran it (--fsdp-version 1): finetune/lora.py@0cc02afa wraps each Block "
                  "(auto_wrap_policy={Block}), Fabric 2.1's FSDPStrategy sets use_orig_params=True "
                  "(fabric/strategies/fsdp.py@71aed751, __init__), so the frozen base and the LoRA matrices share "
                  "one FlatParameter whose gradient is the whole Block's (torch fsdp/_wrap_utils.py warns so); the "
                  "128 / devices / micro-batch accumulation steps run in fabric.no_backward_sync, i.e. FSDP1's "
                  "no_sync, which keeps every unit's unsharded gradient (FullyShardedDataParallel.no_sync "
                  "docstring): the whole model's bf16 gradient on each rank, about 25 GB for 13B")
LG_FSDP1 = " --fsdp-version 1 --fsdp-use-orig-params"


def _litgpt(model: str, quant: str, batch: int, gb: float, gpus: int = 1) -> Row:
    path, seq = LG_MODELS[model]
    quant_flags = {"None": "", "bnb.nf4": " --base-quant nf4", "bnb.nf4-dq": " --qlora"}[quant] + \
        (f" --bnb-version {LG_BNB}" if quant != "None" else "")
    # (finetune/lora.py: batch_size = 128 / devices, gradient_accumulation_iters = batch_size // micro_batch_size)
    layout = (f" --gpus {gpus} --fsdp full --checkpointing full{LG_FSDP1} --fsdp-no-sync "
              f"--grad-accum {128 // gpus // batch}" if gpus > 1 else "")
    args = _a(f"{path} {LG_LORA} --batch {batch} --seq {seq}{quant_flags}{layout}")
    where = f"{gpus}x A100" + (", FSDP" if gpus > 1 else "")
    if gpus > 1:
        return Row(Source.LITGPT, LG, f"{model} LoRA, {quant}, micro-batch {batch}, {where}", args, gb, GB,
                   Metric.ALLOCATED, remark=LG_FSDP_REMARK)
    remark = LG_REMARK + ("; PagedAdamW pages no state under 1e5 values (every adapter's); bitsandbytes 0.41 "
                          "(the release of the time; MatMul4Bit keeps each 4-bit Linear's input)"
                          if quant != "None" else "")
    return Row(Source.LITGPT, LG, f"{model} LoRA, {quant}, micro-batch {batch}, {where}", args, gb, GB,
               Metric.ALLOCATED, remark=remark)


def _adapter(model: str, quant: str, gb: float, v2: bool) -> Row:
    path, seq = LG_MODELS[model]
    return Row(Source.LITGPT, LG, f"{model} LLaMA-Adapter{' v2' if v2 else ''}, {quant}, micro-batch 1",
               _a(f"{path} --recipe pure-bf16-bf16states --seq {seq}"), gb, GB, Metric.ALLOCATED,
               unsupported="LLaMA-Adapter (litgpt finetune_adapter) is not a trainmem method")


LITGPT = [
    _litgpt("phi-1.5", "None", 1, 4.82), _litgpt("phi-1.5", "bnb.nf4", 1, 3.78),
    _litgpt("phi-1.5", "bnb.nf4-dq", 1, 3.72), _litgpt("phi-1.5", "None", 2, 6.76),
    _litgpt("phi-1.5", "None", 4, 10.68),
    _litgpt("StableLM Alpha 3B", "None", 1, 9.69), _litgpt("StableLM Alpha 3B", "bnb.nf4", 1, 6.35),
    _litgpt("StableLM Alpha 3B", "bnb.nf4-dq", 1, 6.19), _litgpt("StableLM Alpha 3B", "None", 2, 12.10),
    _litgpt("StableLM Alpha 3B", "None", 4, 16.92),
    _litgpt("Llama 2 7B", "None", 1, 21.30), _litgpt("Llama 2 7B", "bnb.nf4", 1, 14.14),
    _litgpt("Llama 2 7B", "bnb.nf4-dq", 1, 13.84), _litgpt("Llama 2 7B", "None", 2, 29.07),
    _litgpt("Llama 2 13B", "None", 1, 38.12), _litgpt("Llama 2 13B", "bnb.nf4", 1, 23.14),
    _litgpt("Llama 2 13B", "bnb.nf4-dq", 1, 22.55),
    _litgpt("phi-1.5", "None", 1, 4.86, 2), _litgpt("phi-1.5", "None", 2, 5.05, 2),
    _litgpt("phi-1.5", "None", 4, 5.88, 2),
    _litgpt("StableLM Alpha 3B", "None", 1, 12.75, 2), _litgpt("StableLM Alpha 3B", "None", 2, 12.94, 2),
    _litgpt("StableLM Alpha 3B", "None", 4, 13.45, 2),
    _litgpt("Llama 2 7B", "None", 1, 22.18, 2), _litgpt("Llama 2 7B", "None", 2, 22.47, 2),
    _litgpt("Llama 2 7B", "None", 4, 23.39, 2), _litgpt("Llama 2 13B", "None", 1, 35.57, 4),
    _adapter("StableLM Alpha 3B", "None", 9.10, False), _adapter("StableLM Alpha 3B", "bnb.nf4", 5.65, False),
    _adapter("StableLM Alpha 3B", "bnb.nf4-dq", 5.48, False), _adapter("Llama 2 7B", "None", 19.98, False),
    _adapter("Llama 2 7B", "bnb.nf4", 12.68, False), _adapter("Llama 2 7B", "bnb.nf4-dq", 12.38, False),
    _adapter("StableLM Alpha 3B", "None", 10.71, True), _adapter("StableLM Alpha 3B", "bnb.nf4", 7.41, True),
    _adapter("StableLM Alpha 3B", "bnb.nf4-dq", 7.25, True), _adapter("Llama 2 7B", "None", 25.51, True),
    _adapter("Llama 2 7B", "bnb.nf4", 18.30, True), _adapter("Llama 2 7B", "bnb.nf4-dq", 17.98, True),
]

# litgpt's config hub (config_hub/finetune/README.md@00af8b0d, Sep 2024, A10G 24 GB): each row runs its YAML there
# (bf16-true, Alpaca2k cut at max_seq_length 512, the YAML's micro-batch and LoRA switches, AdamW; bnb.nf4 rows
# with bitsandbytes' PagedAdamW, which pages no state under 1e5 values). The LoRA/QLoRA rows' "4xA10G" twins are the
# same devices: 1 runs (equal figures) and are left out, as are the OOM rows. "Peak memory" is litgpt.utils'
# max_memory_allocated() / 1e9. Full fine-tunes on several GPUs use Fabric's FSDPStrategy (full shard,
# checkpointing every Block); their loss is chunked_cross_entropy over the whole bf16 logits. litgpt (model.py at
# 00af8b0d) never ties the head to the embedding: a tied Hub checkpoint (Llama 3.2, Gemma) is trained with its head
# copied, so those rows use the "-untied" configs.
LGH = "Lightning-AI/litgpt config_hub/finetune/README.md@00af8b0d (A10G)"
LGH_BNB = "0.42.0"  # pyproject.toml@00af8b0d (and at every commit of the table since Apr 2024): bitsandbytes==0.42.0
LLAMA_TARGETS = {"query": "q", "key": "k", "value": "v", "projection": "o", "mlp": "gate,up,down", "head": "lm_head"}
PHI_TARGETS = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "projection": "dense", "mlp": "fc1,fc2",
               "head": "lm_head"}
HUB_MODELS = {  # config name: (trainmem model, LoRA target names)
    "falcon-7b": ("falcon-7b", LLAMA_TARGETS), "gemma-2b": (str(CONFIGS / "gemma-2b-untied.json"), LLAMA_TARGETS),
    "gemma-7b": (str(CONFIGS / "gemma-7b-untied.json"), LLAMA_TARGETS),
    "gemma2-2b": (str(CONFIGS / "gemma-2-2b-untied.json"), LLAMA_TARGETS),
    "gemma2-9b": (str(CONFIGS / "gemma-2-9b-untied.json"), LLAMA_TARGETS), "llama-2-7b": ("llama-2-7b", LLAMA_TARGETS),
    "llama-3-8b": ("llama-3-8b", LLAMA_TARGETS), "llama-3.1-8b": ("llama-3.1-8b", LLAMA_TARGETS),
    "llama-3.2-1B": (str(CONFIGS / "Llama-3.2-1B-untied.json"), LLAMA_TARGETS),
    "llama-3.2-3B": (str(CONFIGS / "Llama-3.2-3B-untied.json"), LLAMA_TARGETS),
    "mistral-7b-v0.2": (MISTRAL2_PATH := str(CONFIGS / "Mistral-7B-v0.2.json"), LLAMA_TARGETS),
    "mistral-7b": ("mistral-7b", LLAMA_TARGETS), "phi-2": (str(CONFIGS / "phi-2.json"), PHI_TARGETS),
    "phi-3": ("phi-3-mini-4k", LLAMA_TARGETS), "stablelm-base-alpha-3b": (STABLELM, LLAMA_TARGETS),
    "tiny-llama": (str(CONFIGS / "TinyLlama-1.1B.json"), LLAMA_TARGETS),
}
QLORA_REMARK = ("bitsandbytes 0.42.0 (litgpt's pin): its MatMul4Bit keeps each frozen 4-bit Linear's input for "
                "backward (ctx.tensors = (A, B))")
FABRIC_FSDP_REMARK = ("Fabric's FSDP1 (--fsdp-version 1: flat parameters per Block, the embedding and head in the "
                      "root unit, use_orig_params=True); litgpt/finetune/full.py@00af8b0d runs the accumulation "
                      "steps (global_batch_size 8 over micro-batch x devices) in fabric.no_backward_sync, i.e. "
                      "FSDP1's no_sync (--fsdp-no-sync), which holds each unit's unsharded gradient (the whole "
                      "model's, not a shard) until the sync; not modelled: the full state-dict checkpoint of model "
                      "and optimizer that state_dict_type='full' gathers every save_interval steps")
BELOW_STATES = ("partly specified: below the run's own model states (bf16 weights, gradients and AdamW's two bf16 "
                "states are 8 bytes per parameter), so the run was not the YAML's plain AdamW step as listed")


def _hub(config: str, gb: float, batch: int, rank: int = 0, alpha: int = 16, dropout: float = 0.05,
         switches: str = "", quant: bool = False, gpus: int = 1, remark: str = "", specified: bool = True) -> Row:
    """One config-hub row; ``switches`` the YAML's lora_* switches that are true (query,value,...)."""
    model, names = HUB_MODELS[config]
    args = f"{model} --recipe pure-bf16-bf16states --batch {batch} --seq 512 --loss chunked-output"
    if rank:
        targets = ",".join(names[s] for s in switches.split(","))
        args += (f" --lora {rank} --lora-alpha {alpha} --lora-dropout {dropout} --lora-targets {targets}"
                 " --adapter-dtype bf16" + (f" --base-quant nf4 --bnb-version {LGH_BNB}" if quant else ""))
    if gpus > 1:
        accum = 8 // (batch * gpus)  # full.yaml's global_batch_size 8 (gradient_accumulation_iters in full.py)
        args += f" --gpus {gpus} --fsdp full --checkpointing full{LG_FSDP1}" + \
            (f" --fsdp-no-sync --grad-accum {accum}" if accum > 1 else "")
    kind = "full" if not rank else "qlora" if quant else "lora"
    setup = f"{config}/{kind}.yaml, micro-batch {batch}, {gpus}x A10G"
    if quant:
        remark = remark or QLORA_REMARK
    elif gpus > 1:
        remark = remark or FABRIC_FSDP_REMARK
    elif not rank:
        remark = remark or "lit-gpt's own model code (fused qkv, its RoPE), not transformers'"
    return Row(Source.LITGPT, LGH, setup, _a(args), gb, GB, Metric.ALLOCATED, specified=specified, remark=remark)


QV, ALL = "query,value", "query,key,value,projection,mlp,head"
LITGPT_HUB = [
    _hub("falcon-7b", 16.69, 1, 32, switches=QV), _hub("falcon-7b", 9.44, 1, 32, switches=QV, quant=True),
    _hub("gemma-2b", 17.43, 1, gpus=4), _hub("gemma-2b", 12.62, 2, 8, dropout=0.1, switches=ALL),
    _hub("gemma-2b", 11.58, 2, 16, dropout=0.1, switches=ALL, quant=True),
    _hub("gemma-7b", 17.18, 1, 16, dropout=0.1, switches=ALL, quant=True),
    _hub("gemma2-2b", 14.31, 2, 8, dropout=0.1, switches=ALL),
    _hub("gemma2-2b", 13.52, 2, 16, dropout=0.1, switches=ALL, quant=True),
    _hub("gemma2-9b", 20.92, 1, 16, dropout=0.1, switches=ALL, quant=True),
    _hub("llama-2-7b", 19.77, 2, 32, switches=QV), _hub("llama-2-7b", 13.68, 2, 32, switches=QV, quant=True),
    _hub("llama-3-8b", 19.73, 1, 32, switches=QV), _hub("llama-3-8b", 17.41, 2, 32, switches=QV, quant=True),
    _hub("llama-3.1-8b", 19.73, 1, 32, switches=QV), _hub("llama-3.1-8b", 17.41, 2, 32, switches=QV, quant=True),
    _hub("llama-3.2-1B", 8.70, 4, remark=BELOW_STATES, specified=False),
    _hub("llama-3.2-1B", 4.49, 1, 32, switches=QV), _hub("llama-3.2-1B", 5.53, 2, 32, switches=QV, quant=True),
    _hub("llama-3.2-3B", 16.51, 4, remark=BELOW_STATES, specified=False),
    _hub("llama-3.2-3B", 9.67, 1, 32, switches=QV), _hub("llama-3.2-3B", 10.30, 2, 32, switches=QV, quant=True),
    _hub("mistral-7b-v0.2", 20.66, 2, 32, switches=QV),
    _hub("mistral-7b-v0.2", 14.29, 2, 32, switches=QV, quant=True),
    _hub("mistral-7b", 20.66, 2, 32, switches=QV), _hub("mistral-7b", 14.29, 2, 32, switches=QV, quant=True),
    _hub("phi-2", 14.44, 4, gpus=2), _hub("phi-2", 13.98, 4, 8, switches=ALL),
    _hub("phi-2", 14.27, 4, 8, switches=ALL, quant=True),
    _hub("phi-3", 17.01, 4, remark=BELOW_STATES, specified=False), _hub("phi-3", 19.75, 4, 8, switches=ALL),
    _hub("phi-3", 19.13, 4, 8, switches=ALL, quant=True),
    _hub("stablelm-base-alpha-3b", 21.23, 1, gpus=2), _hub("stablelm-base-alpha-3b", 8.58, 1, 32, switches=QV),
    _hub("stablelm-base-alpha-3b", 5.24, 1, 32, switches=QV, quant=True),
    _hub("tiny-llama", 14.10, 4), _hub("tiny-llama", 13.50, 8, 32, switches=ALL),
    _hub("tiny-llama", 16.24, 8, 32, switches=ALL, quant=True),
]

# -- transformers' docs ----------------------------------------------------------------------------------------------
HF = "huggingface/transformers docs/source/en/perf_train_gpu_one.mdx@0016acf7 (2022, one V100 16 GB)"
# bert-large-uncased as AutoModelForSequenceClassification, Trainer, 512 random 512-token rows; "GPU memory
# occupied" is pynvml's used memory // 1024**2 (nvidia-smi's figure, MiB), which the page measures as 1,343 MiB for
# the CUDA context and kernels alone: that is the --cuda-overhead given. Trainer's default optimizer then was
# transformers' own AdamW (two fp32 states); fp16=True is autocast over fp32 weights with a GradScaler. BERT had
# no SDPA path then (transformers added it in 4.41): eager attention, whose probabilities and dropout are saved.
# transformers' AdamW steps one parameter at a time (no multi-tensor buffers): --optimizer-impl fused is the
# implementation trainmem has with no parameter-sized step temporaries.
BERT = str(CONFIGS / "bert-large-uncased.json")
CLASSIFIER = ("a 2-way sequence classifier (pooler and a 2-row head): --task seq-cls, the traced path's "
              "BertForSequenceClassification")


def _hf(setup: str, flags: str, mib: float) -> Row:
    impl = "" if "adafactor" in flags else " --optimizer-impl fused"  # trainmem's Adafactor has one implementation
    args = _a(f"{BERT} --task seq-cls --seq 512 --attention eager --cuda-overhead 1343{impl} {flags}")
    return Row(Source.TRANSFORMERS, HF, setup, args, mib, MIB, Metric.NVIDIA_SMI, specified=False,
               remark=CLASSIFIER)


TRANSFORMERS = [
    _hf("bert-large, batch 4, fp32 AdamW", "--recipe fp32 --batch 4", 14949),
    _hf("batch 1 x accumulation 4", "--recipe fp32 --batch 1 --grad-accum 4", 8681),
    _hf("+ gradient checkpointing", "--recipe fp32 --batch 1 --grad-accum 4 --checkpointing full", 6775),
    _hf("batch 4, fp16", "--recipe amp-fp16 --batch 4", 13939),
    _hf("batch 1 x 4, checkpointing, fp16", "--recipe amp-fp16 --batch 1 --grad-accum 4 --checkpointing full", 7275),
    _hf("batch 4, Adafactor", "--recipe fp32 --batch 4 --optimizer adafactor", 12295),
    _hf("batch 1 x 4, checkpointing, fp16, Adafactor",
        "--recipe amp-fp16 --batch 1 --grad-accum 4 --checkpointing full --optimizer adafactor", 4847),
    _hf("batch 4, bitsandbytes Adam8bit", "--recipe fp32 --batch 4 --optimizer adamw-8bit", 13085),
    _hf("batch 1 x 4, checkpointing, fp16, Adam8bit",
        "--recipe amp-fp16 --batch 1 --grad-accum 4 --checkpointing full --optimizer adamw-8bit", 5363),
]

# -- peft's docs -------------------------------------------------------------------------------------------------------
PEFT_FSDP = "huggingface/peft docs/source/accelerate/fsdp.md@5d602fd"
PEFT_DS = "huggingface/peft docs/source/accelerate/deepspeed.md@5d602fd"
# examples/sft/train.py through Trainer + TRL: Llama-2-70B, packed to 2,048 tokens, flash attention 2, gradient
# checkpointing, LoRA rank 8, alpha 16, dropout 0.1 on all-linear (peft's fp32 adapters); accelerate's
# mixed_precision bf16. Without quantization the model loads in fp32 (dtype=quant_storage_dtype or torch.float32),
# which FSDP1's MixedPrecision computes in bf16 (trainmem's mixed-bf16); QLoRA is nf4 with nested quantization
# stored as bf16. The pages give "memory consumed per GPU" without naming the counter; the LoRA sections' figures are
# GPU-memory screenshots (the device's used memory), so all are compared with the device total.
PEFT70 = ("llama-2-70b --seq 2048 --attention flash --checkpointing full --lora 8 --lora-alpha 16 --lora-dropout 0.1"
          " --lora-targets all-linear")
PEFT_COUNTER = "the counter is not named: the device's used memory assumed"
PEFT = [
    Row(Source.PEFT, PEFT_FSDP, "Llama-2-70B LoRA, 8x H100, FSDP, batch 8",
        _a(PEFT70 + " --recipe mixed-bf16 --batch 8 --gpus 8 --fsdp full"), 80, GB, Metric.NVIDIA_SMI,
        specified=False, remark="published as a range, \"72-80 GB (90-98%)\", read off a screenshot; the top is "
                                "taken"),
    Row(Source.PEFT, PEFT_FSDP, "Llama-2-70B QLoRA, 2 GPUs, FSDP + CPU offload, batch 2",
        _a(PEFT70 + " --recipe pure-bf16 --qlora --batch 2 --gpus 2 --fsdp full --offload optimizer+params"), 19.6,
        GB, Metric.NVIDIA_SMI, remark=PEFT_COUNTER),
    Row(Source.PEFT, PEFT_FSDP, "Llama-2-70B QLoRA, 2 GPUs, FSDP, batch 2",
        _a(PEFT70 + " --recipe pure-bf16 --qlora --batch 2 --gpus 2 --fsdp full"), 35.6, GB, Metric.NVIDIA_SMI,
        remark=PEFT_COUNTER),
    Row(Source.PEFT, PEFT_DS, "Llama-2-70B LoRA, 8x H100, ZeRO-3, batch 8",
        _a(PEFT70 + " --recipe mixed-bf16 --batch 8 --gpus 8 --zero 3"), 64, GB, Metric.NVIDIA_SMI,
        remark="\"64 GB (80%)\" off a screenshot; DeepSpeed's bf16 mode casts the model to bf16, fp32 "
               "masters for the adapters only"),
    Row(Source.PEFT, PEFT_DS, "Llama-2-70B QLoRA, 2x A100-40GB, ZeRO-3, batch 2",
        _a(PEFT70 + " --recipe pure-bf16 --qlora --batch 2 --gpus 2 --zero 3"), 36.6, GB, Metric.NVIDIA_SMI,
        remark=PEFT_COUNTER),
]

# -- torchtitan -----------------------------------------------------------------------------------------------------
TI = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md@b5bcd76 (torchtitan 9dec370, 96 GB H100s)"
TI_TRAINY = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md@b5bcd76"
# torchtitan 9dec370 logs "memory: {max_reserved_gib}" (train.py); llama3_8b.toml: seq_len 8192, AdamW (foreach:
# optimizer.fused defaults to false), FSDP2 with MixedPrecisionPolicy(bf16 params, fp32 reduce), selective AC with
# selective_ac_option = 'op' (per-op SAC, not every-second-layer).
TI8 = "llama-3.1-8b --recipe mixed-bf16 --optimizer-impl foreach --batch 2 --seq 8192 --fsdp full --checkpointing op"
FLOAT8 = "Float8 linears (torchao's float8 training) are not modelled"


def _titan(setup: str, args: str, gib: float, unsupported: str = "", where: str = TI) -> Row:
    return Row(Source.TORCHTITAN, where, setup, _a(args), gib, GIB, Metric.RESERVED, unsupported=unsupported,
               remark="torchtitan's per-op SAC asked for as `--checkpointing op`" if "op" in args.split() else "")


TORCHTITAN = [
    _titan("8B, 8 GPUs, FSDP, batch 2, op SAC", TI8 + " --gpus 8", 82.4),
    _titan("8B, 8 GPUs, FSDP + compile", TI8 + " --gpus 8 --compile", 77.0),
    _titan("8B, 8 GPUs, FSDP + compile + Float8", TI8 + " --gpus 8 --compile", 76.8, FLOAT8),
    _titan("8B, 128 GPUs, FSDP, batch 2, op SAC", TI8 + " --gpus 128", 67.0),
    _titan("8B, 128 GPUs, FSDP + compile", TI8 + " --gpus 128 --compile", 62.0),
    _titan("8B, 128 GPUs, FSDP + compile + Float8", TI8 + " --gpus 128 --compile", 61.8, FLOAT8),
    *[_titan(f"8B, FSDP {8 // cp} x CP {cp}, seq {32768 * cp}, compile + Float8, full AC",
             f"llama-3.1-8b --recipe mixed-bf16 --optimizer-impl foreach --batch 1 --seq {32768 * cp} --gpus 8 "
             f"--fsdp full --cp {cp} --checkpointing full --compile", gib, FLOAT8)
      for cp, gib in ((1, 83.9), (2, 84.2), (4, 84.0), (8, 84.5))],
    *[_titan(f"70B, 256 GPUs, FSDP 32 x TP 8, batch 16, full AC, compile + Float8{s}",
             "llama-3.1-70b --recipe mixed-bf16 --optimizer-impl foreach --batch 16 --seq 8192 --gpus 256 "
             "--fsdp full --tp 8 --checkpointing full --compile", gib, FLOAT8)
      for s, gib in (("", 71.9), (" + AsyncTP", 67.6))],
    *[_titan(f"405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, {sched}, batch 32, full AC, compile + Float8",
             f"llama-3.1-405b --recipe mixed-bf16 --optimizer-impl foreach --batch 32 --seq 8192 --gpus 512 "
             f"--fsdp full --tp 8 --pp 8 --pp-schedule {flag} --checkpointing full --compile", gib, FLOAT8)
      for sched, flag, gib in (("1F1B", "1f1b", 82.5), ("interleaved 1F1B", "interleaved", 72.7))],
    *[_titan(f"405B, 512 GPUs, FSDP {8 // cp} x CP {cp} x TP 8 x PP 8, seq {32768 * cp}, batch 8, Float8",
             f"llama-3.1-405b --recipe mixed-bf16 --optimizer-impl foreach --batch 8 --seq {32768 * cp} --gpus 512 "
             f"--fsdp full --tp 8 --pp 8 --cp {cp} --checkpointing full --compile", gib, FLOAT8)
      for cp, gib in ((1, 75.3), (2, 75.9), (4, 77.1), (8, 84.9))],
    *[_titan(f"8B, {n} nodes of 8 H200, FSDP, batch 2, op SAC, compile + Float8",
             f"llama-3.1-8b --recipe mixed-bf16 --optimizer-impl foreach --batch 2 --seq 8192 --gpus {8 * n} "
             "--fsdp full --checkpointing op --compile", gib, FLOAT8, TI_TRAINY)
      for n, gib in ((4, 47.96), (8, 46.97))],
]

# -- fsdp_qlora -----------------------------------------------------------------------------------------------------
FQ = "AnswerDotAI/fsdp_qlora benchmarks_03_2024.md@05ed9f2 (2x 3090 / 2x 4090)"
# train.py at 05ed9f2: dummy dataset (every row context_length tokens), precision bf16 (bf16 base; peft's adapters
# stay fp32, FSDP1 MixedPrecision(param_dtype=bf16) computes them in bf16), LoRA rank 64, alpha 16, dropout 0.1 on
# k,q,v,up,down,gate ("all"), AdamW, FSDP1 full_shard (ddp = NO_SHARD), reentrant checkpointing on; qlora is
# bitsandbytes' Linear4bit nf4 (compress_statistics on) stored as bf16; the tables are max_memory_reserved (the note
# under the LoRA table: "peak reserved memory ... peak allocated memory is 8.28 GiB vs 9.16 GiB").
FQ_BASE = "--recipe pure-bf16 --lora 64 --lora-alpha 16 --lora-dropout 0.1 --lora-targets q,k,v,gate,up,down " \
          "--checkpointing full --gpus 2"
YI, MISTRAL2 = str(CONFIGS / "Yi-34B.json"), MISTRAL2_PATH


def _fq(model: str, name: str, qlora: bool, batch: int, seq: int, gib: float, offload: bool = False,
        ddp: bool = False, metric: Metric = Metric.RESERVED) -> Row:
    shard = "no-shard" if ddp else "full"
    fsdp1 = not offload  # (FSDP1's CPUOffload is not modelled: those rows are FSDP2's)
    args = f"{model} {FQ_BASE} --fsdp {shard} --batch {batch} --seq {seq}" + (" --qlora" if qlora else "") + \
        (" --offload optimizer+params" if offload else "") + (" --fsdp-version 1" if fsdp1 else "")
    setup = (f"{name} {'QLoRA' if qlora else 'LoRA'}, batch {batch}, context {seq}" + (", CPU offload" if offload
             else "") + (", DDP" if ddp else ""))
    remark = ("FSDP1 as train.py runs it (" + ("NO_SHARD, " if ddp else "") + "use_orig_params=False: the adapters "
              "wrapped apart, the 4-bit base stored as bf16)" if fsdp1 else "FSDP1 (LoRA layers wrapped apart, "
              "use_orig_params=False) asked for as FSDP2 (FSDP1's CPUOffload is not modelled)")
    if metric is Metric.RESERVED:
        remark += ("; reserved: the two runs published with both counters hold 12-24% over their allocated peak, "
                   "more than the flat fraction trainmem's reserved adds")
    if qlora:
        remark += ("; bitsandbytes >= 0.43.0 (README) of Feb-Mar 2024, whose MatMul4Bit kept each 4-bit Linear's "
                   "input: under the benchmarks' --reentrant_checkpointing True only in a layer's recompute (not "
                   "modelled: trainmem's checkpointing is non-reentrant, where those inputs would stay through the "
                   "forward)")
    if offload:
        remark += "; FSDP1's CPUOffload(offload_params=True), not FSDP2's CPUOffloadPolicy"
    return Row(Source.FSDP_QLORA, FQ, setup, _a(args), gib, GIB, metric, remark=remark)


FSDP_QLORA = [
    _fq("llama-2-7b", "Llama-2 7B", True, 1, 512, 4.98), _fq("llama-2-7b", "Llama-2 7B", True, 1, 2048, 5.21),
    _fq("llama-2-7b", "Llama-2 7B", False, 1, 512, 10.24), _fq("llama-2-7b", "Llama-2 7B", False, 1, 2048, 10.22),
    _fq("llama-2-7b", "Llama-2 7B", False, 1, 512, 8.28, metric=Metric.ALLOCATED),
    _fq("llama-2-7b", "Llama-2 7B", False, 1, 2048, 9.16, metric=Metric.ALLOCATED),
    _fq("llama-2-7b", "Llama-2 7B", True, 4, 2048, 11.22), _fq("llama-2-7b", "Llama-2 7B", True, 10, 2048, 20.97),
    _fq("llama-2-7b", "Llama-2 7B", False, 4, 2048, 16.14), _fq("llama-2-7b", "Llama-2 7B", False, 6, 2048, 21.35),
    _fq("llama-2-7b", "Llama-2 7B", True, 8, 2048, 20.94, ddp=True),
    _fq("llama-2-7b", "Llama-2 7B", False, 4, 2048, 22.04, ddp=True),
    _fq("llama-2-7b", "Llama-2 7B", False, 10, 2048, 22.69, offload=True),
    _fq("llama-2-7b", "Llama-2 7B", True, 12, 2048, 22.38, offload=True),
    _fq(YI, "Yi 34B", True, 2, 2048, 23.05), _fq(YI, "Yi 34B", True, 4, 2048, 22.98, offload=True),
    _fq("llama-2-70b", "Llama-2 70B", True, 2, 2048, 14.92, offload=True),
    _fq(MISTRAL2, "Mistral 7B v0.2", True, 12, 2048, 22.54, offload=True),
    _fq(MISTRAL2, "Mistral 7B v0.2", True, 1, 24576, 22.54, offload=True),
]

ROWS: list[Row] = [*TORCHTUNE, *LITGPT, *LITGPT_HUB, *TORCHTITAN, *FSDP_QLORA, *TRANSFORMERS, *PEFT]


@dataclass(frozen=True)
class Result:
    row: Row
    estimate_bytes: int | None
    reason: str  # why there is no estimate

    @property
    def error(self) -> float | None:
        if self.estimate_bytes is None:
            return None
        return self.estimate_bytes / (self.row.published * self.row.unit) - 1


def run(row: Row) -> Result:
    """The row's estimate through trainmem's CLI in process (the command the table prints is the one run)."""
    if row.unsupported:
        return Result(row, None, row.unsupported)
    from trainmem.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["estimate", *row.args, "--json"])
    if code not in (0, 1):
        return Result(row, None, err.getvalue().strip().splitlines()[-1].removeprefix("trainmem: error: "))
    doc = json.loads(out.getvalue())
    if doc["peak"] is None:
        missing = [n for n in doc["notes"] if n.startswith("not modelled")] or doc["notes"]
        return Result(row, None, "no peak: " + missing[0].split(" (")[0])
    return Result(row, doc["peak"][ESTIMATE_FIELD[row.metric]], "")


def _command(row: Row) -> str:
    args = [a.replace(str(HERE.parent) + "/", "") for a in row.args]
    return "`trainmem estimate " + " ".join(args) + "`"


def _figure(value: float, unit: int) -> str:
    return f"{value:,.0f} MiB" if unit == MIB else f"{value:.2f} {UNIT_NAMES[unit]}"


def table(results: list[Result]) -> str:
    lines = ["| # | source | set-up | command | published | metric | trainmem | error | remark |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        row = r.row
        if r.estimate_bytes is None:
            est, error = "-", f"not expressible: {r.reason}"
        else:
            est, error = _figure(r.estimate_bytes / row.unit, row.unit), f"{r.error:+.1%}"
        remark = "; ".join(x for x in ("" if row.specified else "partly specified", row.remark) if x)
        lines.append(f"| {i} | {row.source.value} | {row.setup} | {_command(row)} | "
                     f"{_figure(row.published, row.unit)} | {row.metric.value} | {est} | {error} | {remark} |")
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    counts = {s: sum(r.row.source is s for r in results) for s in Source}
    scored = [abs(r.error) for r in results if r.error is not None and r.row.specified]
    expressible = sum(r.error is not None for r in results)
    text = (f"{len(results)} published figures ({', '.join(f'{s.value} {n}' for s, n in counts.items())}); "
            f"{expressible} expressible, {len(scored)} of them fully specified")
    if scored:
        text += (f": median absolute error {statistics.median(scored):.1%}, worst {max(scored):.1%}, "
                 f"{sum(e <= 0.05 for e in scored)} within 5%, {sum(e <= 0.10 for e in scored)} within 10%")
    return text + "."


def flat_reserved(row: Row) -> Result:
    """The row's reserved figure under the flat factor trainmem used before the allocator replay (allocated + 10%
    of the dynamic memory: ``--fragmentation 0.1``)."""
    return Result(row, run(replace(row, args=(*row.args, "--fragmentation", "0.1"))).estimate_bytes, "")


def reserved_table(results: list[Result]) -> str:
    """The published max_memory_reserved() figures: the replayed reserved (what the table above compares) beside
    the flat factor, each with its error, and how often the replay is the closer of the two."""
    lines = ["| # | set-up | published | allocated | replayed reserved | flat factor | closer |",
             "|---|---|---|---|---|---|---|"]
    replayed, flat, closer = [], [], 0
    for i, r in enumerate(results, 1):
        if r.row.metric is not Metric.RESERVED or r.estimate_bytes is None:
            continue
        f = flat_reserved(r.row)
        allocated = run(replace(r.row, metric=Metric.ALLOCATED)).estimate_bytes
        assert f.error is not None and r.error is not None and allocated is not None
        if r.row.specified:
            replayed.append(abs(r.error))
            flat.append(abs(f.error))
            closer += abs(r.error) < abs(f.error)
        unit = r.row.unit
        lines.append(f"| {i} | {r.row.setup}{'' if r.row.specified else ' (partly specified)'} | "
                     f"{_figure(r.row.published, unit)} | {_figure(allocated / unit, unit)} | "
                     f"{_figure(r.estimate_bytes / unit, unit)} ({r.error:+.1%}) | "
                     f"{_figure(f.estimate_bytes / unit, unit)} ({f.error:+.1%}) | "
                     f"{'replay' if abs(r.error) < abs(f.error) else 'flat'} |")
    text = "\n".join(lines)
    if replayed:
        text += (f"\n\nReserved figures fully specified: {len(replayed)}; the replay is closer on {closer}; median "
                 f"absolute error {statistics.median(replayed):.1%} replayed, {statistics.median(flat):.1%} flat.")
    return text


def block() -> str:
    results = [run(row) for row in ROWS]
    return f"{BEGIN}\n{table(results)}\n\n{summary(results)}\n\n{reserved_table(results)}\n{END}"


def docs_block(path: Path) -> str:
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        sys.exit(0 if docs_block(Path(sys.argv[2])) == block() else 1)
    print(block())
