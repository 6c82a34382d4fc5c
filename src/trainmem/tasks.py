"""What a step trains: the transformers head each ``--task`` builds, and the batch and labels its loss takes.

- ``causal-lm``: ``AutoModelForCausalLM``, ``labels = input_ids`` (transformers' ForCausalLMLoss shifts them).
- ``masked-lm``: ``AutoModelForMaskedLM`` (BERT's BertForMaskedLM, RoBERTa's, ModernBERT's): the labels are the
  ids at 15% of the positions and -100 (ignored) elsewhere, as ``DataCollatorForLanguageModeling``
  (mlm_probability=0.15) makes them. Which positions does not change the memory: the head runs on every position and
  ``CrossEntropyLoss`` reads the whole (batch*seq, vocab) logits whatever the mask (modeling_bert.py,
  BertForMaskedLM.forward); the positions are fixed here (every position p with p mod 20 < 3) so that a trace is
  reproducible. (ModernBERT with ``sparse_prediction`` runs its head on the masked positions only, a shape that
  depends on the data: fake tensors cannot run it.)
- ``seq-cls``: ``AutoModelForSequenceClassification`` with the config's ``num_labels`` (``--num-labels``): one
  integer label per sequence, cross-entropy over the classifier's logits of the pooled output
  (problem_type single_label_classification; with num_labels 1 a float label and the mean squared error).
- ``seq2seq-lm``: ``AutoModelForSeq2SeqLM`` (T5, BART): ``input_ids`` through the encoder and ``labels`` (as long
  as the input) through the decoder, which the model shifts right into its ``decoder_input_ids``.

The heads are transformers' own; nothing here imports torch at module level.
"""

from __future__ import annotations

from typing import Any

AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
                "seq-cls": "AutoModelForSequenceClassification", "seq2seq-lm": "AutoModelForSeq2SeqLM"}
MASKED_EVERY, MASKED_OF = 3, 20
"""masked-lm: positions p with p % 20 < 3 carry a label (15%, DataCollatorForLanguageModeling's mlm_probability)."""


def auto_class(task: str) -> Any:
    """transformers' Auto class that builds ``task``'s model."""
    import transformers

    return getattr(transformers, AUTO_CLASSES[task])


def has_head(task: str, model_type: str) -> bool:
    """Whether transformers maps ``model_type`` to a model of ``task``'s Auto class."""
    from transformers.models.auto import modeling_auto

    names = {"causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
             "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
             "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"}
    return model_type in getattr(modeling_auto, names[task])


def no_head_message(task: str, model_type: str, origin: str = "config") -> str:
    return (f"{origin}: transformers has no {AUTO_CLASSES[task]} for model_type {model_type!r}, so --task {task} "
            "cannot be built for it (give another --task; causal-lm is the default)")


def task_fields(task: str, num_labels: int | None) -> dict[str, Any]:
    """Config fields the task sets: ``num_labels`` for seq-cls (transformers' PretrainedConfig derives id2label)."""
    return {"num_labels": num_labels} if task == "seq-cls" and num_labels is not None else {}


def make_batch(torch: Any, task: str, vocab: int, num_labels: int, batch: int, seq: int,
               device: str = "cpu") -> dict[str, Any]:
    """The keyword arguments of one training forward of ``task`` (module docstring); ``num_labels`` is the built
    model's (seq-cls)."""
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    if task in ("causal-lm", "seq2seq-lm"):
        return {"input_ids": ids, "labels": ids}
    if task == "masked-lm":
        unlabelled = torch.arange(seq, device=device) % MASKED_OF >= MASKED_EVERY
        return {"input_ids": ids, "labels": ids.masked_fill(unlabelled, -100)}
    labels = (torch.randn(batch, device=device) if num_labels == 1 else
              torch.randint(0, num_labels, (batch,), device=device))
    return {"input_ids": ids, "labels": labels}
