"""measure's CPU path (the allocator's own events) against the trace, track() around a user's loop, and the
CUDA path's phase logic with a stand-in for torch.cuda."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # every test here traces a model or runs real steps

from scaled import SCALED  # noqa: E402
from trainmem.measure import PHASES, _CudaRecorder, measure_steps, track  # noqa: E402
from trainmem.models import spec_from_config  # noqa: E402
from trainmem.settings import make_settings  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402

CASES = [("Llama-2-7B", dict(recipe="fp32")), ("Llama-3-8B", dict(recipe="mixed-bf16")),
         ("GPT-2", dict(recipe="amp-bf16", optimizer="sgd")),
         # Checkpointed: no KV cache, so transformers runs its packed-sequence check, which the trace must answer
         # as this real run does (no dense mask, k and v not repeated), and the recompute runs in backward.
         ("Llama-3-8B", dict(recipe="amp-bf16", optimizer="sgd", checkpointing="full")),
         ("Mixtral-8x7B", dict(recipe="pure-bf16")), ("GPT-2", dict(recipe="fp32", dropout=0.1, attention="eager"))]
IDS = [f"{c[0]}-{c[1]['recipe']}-{c[1].get('checkpointing', 'none')}-{c[1].get('attention', 'sdpa')}" for c in CASES]


@pytest.mark.parametrize("family, kw", CASES, ids=IDS)
def test_a_real_cpu_step_holds_exactly_the_tensors_the_trace_counts(family, kw):
    """The same step on real CPU tensors and on fake ones, tracked the same way: every phase and category agrees to
    the byte. This compares tensors only (never the CPU kernels' own scratch buffers, which depend on the
    processor), so it holds on any machine."""
    cfg = SCALED[family]
    s = make_settings(batch=2, seq=64, **({"dropout": 0.0} | kw))
    real = trace_step(cfg, s, spec_from_config(cfg), round_to_cuda=False, emulate="cpu", fake=False)
    fake = trace_step(cfg, s, spec_from_config(cfg), round_to_cuda=False, emulate="cpu")
    assert [p.by_category() for p in real.phases] == [p.by_category() for p in fake.phases]


@pytest.mark.parametrize("family, kw", CASES[:4], ids=IDS[:4])
def test_the_cpu_allocator_sees_at_least_the_tensors(family, kw):
    """``measure --device cpu`` reads the allocator's own events, which are the step's tensors plus whatever the
    CPU kernels allocate for themselves (oneDNN's packed matmul operands, the flash-attention backward's per-thread
    buffers) and, with checkpointing, the CPU RNG state each checkpoint keeps (host memory on a GPU too). Those
    extras depend on the processor, so only their sign is asserted: each phase's allocator peak covers the traced
    tensors, less at most 2 x 512 bytes where the trace sizes GPT-2's position ids differently."""
    cfg = SCALED[family]
    s = make_settings(batch=2, seq=64, dropout=0.0, **kw)
    measured = measure_steps(cfg, s, "cpu")
    traced = trace_step(cfg, s, spec_from_config(cfg), round_to_cuda=False, emulate="cpu")
    assert [p.name for p in measured.phases] == list(PHASES) == [p.name for p in traced.phases]
    for m, t in zip(measured.phases, traced.phases):
        assert m.allocated_bytes >= t.allocated_bytes - 2 * 512, m.name


def test_track_around_a_plain_loop():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(64, 256)
    params = sum(p.numel() * 4 for p in model.parameters())
    with track(model, opt) as t:
        for _ in range(2):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    peaks = {p.name: p.allocated_bytes for p in t.report().phases}
    assert set(peaks) == {"load", "forward", "backward", "optimizer", "between_steps"}
    assert peaks["load"] == params  # nothing else exists before the first step
    # The step holds weights, gradients, two AdamW states and foreach's sqrt buffer: 5 x the parameters.
    assert peaks["optimizer"] >= 5 * params
    # Weights and two states (gradients released), plus AdamW's 4-byte step counters, one per tensor.
    assert peaks["between_steps"] == pytest.approx(3 * params, abs=8 * 4 + 4)
    assert peaks["forward"] > params


class _FakeCuda:
    """Stands in for torch.cuda: a scripted allocation trace with peak counters."""

    def __init__(self):
        self.allocated = self.peak = 0

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def synchronize(self, device=None):
        pass

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.allocated

    def max_memory_allocated(self, device=None):
        return self.peak

    def max_memory_reserved(self, device=None):
        return self.peak + 2**20


def test_cuda_recorder_resets_the_peak_at_each_phase():
    fake = _FakeCuda()

    class FakeTorch:
        cuda = fake

    rec = _CudaRecorder(FakeTorch, "cuda:0")
    fake.alloc(100)  # weights
    rec.start()
    rec.switch("forward")
    fake.alloc(50); fake.alloc(-20)  # noqa: E702
    rec.switch("backward")
    fake.alloc(40); fake.alloc(-70)  # noqa: E702
    rec.switch("optimizer")
    fake.alloc(10); fake.alloc(-10)  # noqa: E702
    rec.switch("between_steps")
    peaks = {p.name: (p.allocated_bytes, p.reserved_bytes) for p in rec.finish()}
    assert peaks == {"load": (100, 100 + 2**20), "forward": (150, 150 + 2**20), "backward": (170, 170 + 2**20),
                     "optimizer": (110, 110 + 2**20), "between_steps": (100, 100 + 2**20)}


def test_measure_cli_cpu_json_and_bad_device(run_cli, tmp_path):
    cfg = dict(SCALED["Llama-2-7B"], model_type="llama")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run_cli("measure", str(path), "--batch", "2", "--seq", "32", "--recipe", "fp32", "--device",
                             "cpu", "--dropout", "0", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["engine"] == "measure" and doc["device"] == "cpu"
    assert [p["name"] for p in doc["phases"]] == list(PHASES)
    for p in doc["phases"]:
        assert p["estimate_allocated_bytes"] == pytest.approx(p["allocated_bytes"], rel=0.03)
    if not torch.cuda.is_available():
        code, _, err = run_cli("measure", str(path), "--device", "cuda", "--seq", "32")
        assert code == 2 and err.startswith("trainmem: error: measure failed on cuda") and err.count("\n") == 1


def test_the_default_recipe_becomes_fp32_on_a_cpu_without_bf16_and_each_step_is_reported(run_cli, tmp_path,
                                                                                          monkeypatch):
    """Issue 24: `measure gpt2 ... --device cpu` ran 19.5 minutes with no output on a CPU without native bf16."""
    from trainmem import measure

    monkeypatch.setattr(measure, "cpu_bf16_native", lambda: False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
                                "vocab_size": 211}))
    code, out, err = run_cli("measure", str(path), "--batch", "2", "--seq", "32", "--device", "cpu", "--dropout",
                             "0", "--steps", "3", "--json")
    assert code == 0, err
    doc = json.loads(out)  # the progress went to stderr
    assert doc["settings"]["recipe"] == "fp32"
    lines = [line for line in err.splitlines() if line.startswith("measure:")]
    assert lines[0].startswith("measure: measuring --recipe fp32 instead of the default mixed-bf16")
    assert lines[1].startswith("measure: building ") and ", fp32, batch 2 x seq 32" in lines[1]
    assert lines[2].startswith("measure: built in")
    assert [line.split(" (")[0] for line in lines[3:]] == [f"measure: step {i} of 3" for i in (1, 1, 2, 2, 3, 3)]
    assert lines[-1].startswith("measure: step 3 of 3 (measured) done in")
    for p in doc["phases"]:
        assert p["estimate_allocated_bytes"] == pytest.approx(p["allocated_bytes"], rel=0.03)


def test_trainer_callback_inside_a_real_trainer(tmp_path):
    """The callback inside transformers' Trainer (2 steps of a scaled-down Llama on the CPU, foreach AdamW, no
    gradient clipping) measures the same phases as the trace of that step, to within the Trainer's own few-byte
    tensors (its loss accumulator)."""
    from transformers import Trainer, TrainingArguments

    from trainmem.stepmodel import estimate_model
    from trainmem.measure import trainer_callback
    from trainmem.probe import build_model
    from trainmem.recipes import get_recipe

    cfg = SCALED["Llama-2-7B"]
    settings = make_settings(batch=2, seq=64, recipe="fp32", optimizer="adamw", dropout=0.0)
    model = build_model(cfg, get_recipe("fp32"), "sdpa", 0.0)
    ids = torch.randint(0, cfg["vocab_size"], (8, 64))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                             max_grad_norm=0.0, use_cpu=True, report_to="none", save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    callback = trainer_callback()
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback],
            optimizers=(optimizer, None)).train()

    assert len(callback.steps) == 3
    measured = {p.name: p.allocated_bytes for p in callback.report().phases}
    traced = {p.name: p.allocated_bytes for p in trace_step(cfg, settings, spec_from_config(cfg),
                                                             round_to_cuda=False, emulate="cpu").phases}
    assert set(measured) == set(PHASES)
    for phase in PHASES:  # measured 2026-11-29: within 12 bytes in every phase
        assert abs(measured[phase] - traced[phase]) <= 512, phase
    rows = callback.report().compare(estimate_model(spec_from_config(cfg), settings))
    assert [r["phase"] for r in rows] == list(PHASES)
    assert all(abs(r["error"]) < 0.03 for r in rows)


def test_measure_runs_a_lora_step(run_cli, tmp_path):
    """measure builds peft's LoRA step for real (the trace's model, on real tensors): its tensors are the fake
    trace's to the byte, the CPU allocator's peaks cover them, and the CLI reports it beside the LoRA estimate;
    a quantized base, whose kernels measure does not drive, is refused in one line."""
    pytest.importorskip("peft")
    from trainmem.lora import FineTune, LoraOptions

    cfg = SCALED["Llama-2-7B"]
    s = make_settings(batch=2, seq=64, recipe="fp32", dropout=0.0, checkpointing="full")
    finetune = FineTune(LoraOptions(8, targets=("all-linear",)))
    spec = spec_from_config(cfg)
    real = trace_step(cfg, s, spec, round_to_cuda=False, emulate="cpu", fake=False, finetune=finetune)
    fake = trace_step(cfg, s, spec, round_to_cuda=False, emulate="cpu", finetune=finetune)
    assert [p.by_category() for p in real.phases] == [p.by_category() for p in fake.phases]
    measured = measure_steps(cfg, s, "cpu", finetune=finetune)
    for m, t in zip(measured.phases, fake.phases):
        assert m.allocated_bytes >= t.allocated_bytes - 2 * 512, m.name
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(cfg, model_type="llama")))
    code, out, err = run_cli("measure", str(path), "--batch", "2", "--seq", "32", "--recipe", "fp32", "--device",
                             "cpu", "--dropout", "0", "--lora", "8", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [p["name"] for p in doc["phases"]] == list(PHASES)
    assert all(p["estimate_allocated_bytes"] for p in doc["phases"]) and doc["finetune"]["rank"] == 8
    code, _, err = run_cli("measure", str(path), "--device", "cpu", "--lora", "8", "--qlora")
    assert code == 2 and "full-precision base" in err and err.count("\n") == 1
