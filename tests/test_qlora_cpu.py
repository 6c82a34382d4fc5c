"""QLoRA's one-GPU step against a real one on the CPU: bitsandbytes' 4-bit Linears (nf4, double quantization,
quantized by bitsandbytes 0.50's CPU backend) under peft's LoRA, two steps of fused AdamW on real tensors, each phase's
allocated peak under torch's MemTracker, against the estimate of the same step (lora.py's 4-bit base: the packed
data and quantization states, MatMul4Bit saving no input since bitsandbytes 0.43.2, one dequantized weight at a time).

The trace cannot run these (bitsandbytes' kernels do not run on fake tensors), so this is the check of a quantized
base's step. What a GPU's allocated counter holds and MemTracker (a dispatch mode) cannot see is added to the run's
side, as in tests/test_fsdp1.py: the quantization states (no parameter or buffer), and in forward the weight
bitsandbytes::gemm_4bit dequantizes inside its kernel. The estimate counts the dequantized weight as a layer's
largest Linear at every moment of its backward (an upper bound); the MLP here is as wide as the attention, where
that bound is exact at the layer's last moment (docs/accuracy.md)."""

import gc

import pytest

pytestmark = pytest.mark.slow

from trainmem.models import spec_from_config  # noqa: E402
from trainmem.request import estimate  # noqa: E402

CONFIG = dict(model_type="llama", hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
CASES = [("q,v", "none"), ("q,k,v,gate,up,down", "none")]
"""(Not with checkpointing yet: this real-tensor run then keeps 65,696 bytes through the step and past zero_grad over
a bf16 base too, where the fake-tensor trace of the same LoRA step keeps nothing (docs/accuracy.md): an effect of
the harness not yet explained, so checkpointed QLoRA rests on the traced LoRA matrices and the 4-bit storage.)"""
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
BATCH, SEQ = 2, 32


def _measured(targets: str, checkpointing: str) -> dict[str, int]:
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp1_ranks import quant_state_bytes, quantized_base, storage_tracker
    from trainmem.probe import enable_checkpointing

    torch.manual_seed(0)
    model = quantized_base(AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG)).to(torch.bfloat16))
    if checkpointing == "full":
        enable_checkpointing(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=[TARGETS[t] for t in targets.split(",")]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    tracker = storage_tracker()
    tracker.track_external(model, optimizer)
    peaks: dict[str, int] = {}
    for _ in range(2):  # (the second step's: the optimizer's states exist)
        x = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
        gc.collect()
        with tracker:
            loss = model(input_ids=x, labels=x).loss
            peaks["forward"] = tracker.total("peak")
        with tracker:
            loss.backward()
            del loss
            peaks["backward"] = tracker.total("peak")
        gc.collect()
        with tracker:
            optimizer.step()
            peaks["optimizer"] = tracker.total("peak")
            optimizer.zero_grad(set_to_none=True)
            peaks["between_steps"] = tracker.total()
    extra = quant_state_bytes(model)
    return {phase: peak + extra for phase, peak in peaks.items()}


@pytest.mark.parametrize("targets, checkpointing", CASES)
def test_a_qlora_step_on_the_cpu_is_the_estimate_within_3_percent(targets, checkpointing, monkeypatch):
    measured = _measured(targets, checkpointing)
    from fsdp1_ranks import as_memtracker_sees_it

    as_memtracker_sees_it(monkeypatch)
    est = estimate(spec_from_config(CONFIG), recipe="pure-bf16-bf16states", optimizer_impl="fused", batch=BATCH,
                   seq=SEQ, lora=8, lora_targets=targets, adapter_dtype="bf16", base_quant="nf4", double_quant=True,
                   checkpointing=checkpointing)
    for ph in est.phases:
        if ph.name != "load":
            ours = ph.allocated_bytes
            assert abs(ours / measured[ph.name] - 1) <= 0.03, (ph.name, ours, measured[ph.name], targets,
                                                               checkpointing)
