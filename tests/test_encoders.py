"""--task: encoders (masked LM, sequence classification) and encoder-decoders (seq2seq LM) on the traced path.

Each head's parameters are transformers' own (built on the meta device, pooler and classifier included); each
extrapolated step is compared with a full trace of the same step (trace.trace_step: the transformers model under
FakeTensorMode, every allocation counted); bad task flags are one line, exit 2."""

import json

import pytest

pytest.importorskip("transformers")

from trainmem import recorded  # noqa: E402
from trainmem.meta_count import spec_by_building  # noqa: E402
from trainmem.settings import make_settings  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402

BERT = {"model_type": "bert", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 2, "vocab_size": 97, "max_position_embeddings": 32}
ROBERTA = {**BERT, "model_type": "roberta", "pad_token_id": 1}
T5 = {"model_type": "t5", "d_model": 32, "d_ff": 64, "num_heads": 2, "d_kv": 16, "num_layers": 4,
      "num_decoder_layers": 4, "vocab_size": 97, "decoder_start_token_id": 0, "pad_token_id": 0}
"""4 encoder and 4 decoder layers: each stack's first layer holds the relative position bias (a prefix of one), so
each is traced at 2 and 3 layers (the other at 2) and extrapolated by two periods."""
SETTINGS = dict(batch=1, seq=8, recipe="fp32")


def _within_one_percent(extrapolated, full):
    for a, b in zip(extrapolated, full, strict=True):
        assert a.name == b.name
        assert abs(a.allocated_bytes - b.allocated_bytes) <= 0.01 * b.allocated_bytes, (a, b)


def test_the_heads_parameters_are_those_transformers_builds():
    """seq-cls adds BERT's pooler (h x h + h) and a num_labels-row classifier to the encoder; masked-lm its
    prediction head (a dense h x h, a LayerNorm, the decoder's bias; the decoder's weight is the tied embedding),
    counted against the base model with no head (BertModel without its pooler)."""
    import torch
    from transformers import AutoConfig, AutoModel

    with torch.device("meta"):
        base = AutoModel.from_config(AutoConfig.for_model("bert", **{k: v for k, v in BERT.items()
                                                                      if k != "model_type"}),
                                     add_pooling_layer=False)
    encoder = sum(p.numel() for p in base.parameters())
    h, v = BERT["hidden_size"], BERT["vocab_size"]
    classifier = spec_by_building(BERT, "bert", "", task="seq-cls", num_labels=5)
    assert classifier.num_parameters == encoder + (h * h + h) + (h * 5 + 5)
    masked = spec_by_building(BERT, "bert", "", task="masked-lm")
    assert masked.num_parameters == encoder + (h * h + h) + 2 * h + v


def test_roberta_classifies_with_its_own_head_not_a_pooler():
    """RobertaForSequenceClassification: no pooler; its RobertaClassificationHead (a dense h x h, then an
    h x num_labels out_proj) on the first token."""
    import torch
    from transformers import AutoConfig, AutoModel

    with torch.device("meta"):
        base = AutoModel.from_config(AutoConfig.for_model("roberta", **{k: v for k, v in ROBERTA.items()
                                                                         if k != "model_type"}),
                                     add_pooling_layer=False)
    h = ROBERTA["hidden_size"]
    spec = spec_by_building(ROBERTA, "roberta", "", task="seq-cls", num_labels=3)
    assert spec.num_parameters == sum(p.numel() for p in base.parameters()) + (h * h + h) + (h * 3 + 3)
    names = {t.name for group in spec.explicit_param_groups for t in group.tensors}
    assert names >= {"classifier.dense.weight", "classifier.out_proj.weight"}


@pytest.mark.parametrize("config, task", [(BERT, "masked-lm")])
def test_an_encoder_extrapolated_over_its_layers_matches_the_full_trace(config, task):
    """(RoBERTa, ModernBERT and bert-large: docs/accuracy.md, each byte for byte; one here for CI's time.)"""
    settings = make_settings(task=task, **SETTINGS)
    spec = spec_by_building(config, "tiny", "", task=task)
    traced = recorded.recorded_phases(config, settings, spec, progress=False)  # (cached: the CLI test reads it)
    assert traced.plan.counts == (2, 3)  # (so that the real count, 4, is extrapolated)
    _within_one_percent(traced.phases, trace_step(config, settings, spec).phases)


def test_an_encoder_decoder_extrapolates_its_encoder_and_its_decoder_apart():
    settings = make_settings(task="seq2seq-lm", **SETTINGS)
    spec = spec_by_building(T5, "tiny-t5", "", task="seq2seq-lm")
    phases, encoder, decoder = recorded.record_seq2seq(T5, settings, spec, progress=False)
    assert (encoder.counts, decoder.counts) == ((2, 3), (2, 3))
    assert (encoder.periods_added, decoder.periods_added) == (2, 2)
    _within_one_percent(phases, trace_step(T5, settings, spec).phases)


def test_estimate_answers_a_masked_lm_peak_on_the_traced_path(run_cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BERT))
    code, out, err = run_cli("estimate", str(path), "--task", "masked-lm", "--seq", "8", "--recipe", "fp32",
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["activation_source"] == "traced" and doc["settings"]["task"] == "masked-lm"
    assert doc["model"]["parameters"] == spec_by_building(BERT, "x", "", task="masked-lm").num_parameters
    jsonschema = pytest.importorskip("jsonschema")
    from trainmem.report import json_schema

    jsonschema.Draft202012Validator(json_schema()).validate(doc)


@pytest.mark.parametrize("args, message", [
    (("--task", "mlm"), "unknown task 'mlm'; accepted: causal-lm, masked-lm, seq-cls, seq2seq-lm"),
    (("--num-labels", "3"), "--num-labels sizes the classifier of --task seq-cls"),
    (("--task", "masked-lm", "--compile"), "--compile applies to causal LMs only"),
    (("--task", "masked-lm", "--lora", "8"), "without --lora"),
])
def test_bad_task_flags_are_one_line(run_cli, args, message):
    code, out, err = run_cli("estimate", "gpt2", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_task_without_a_head_for_the_model_type_is_one_line(run_cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(T5))
    code, out, err = run_cli("estimate", str(path), "--task", "seq-cls", "--num-labels", "0")
    assert code == 2 and "num-labels must be a positive integer" in err
    code, out, err = run_cli("estimate", "gpt2", "--task", "seq2seq-lm")
    assert code == 2 and "no AutoModelForSeq2SeqLM for model_type 'gpt2'" in err
    assert len(err.strip().splitlines()) == 1, err
