"""Counting parameters by building the transformers model on the meta device.

Used for a ``model_type`` that has no analytic parser in :mod:`trainmem.models`, and by the tests that
prove the analytic counts equal what transformers builds. The meta device gives shapes without memory, so
any model size is built in about a second.
"""

from __future__ import annotations

from typing import Any

from .errors import ModelError
from .models import SUPPORTED_MODEL_TYPES, ModelSpec, ParamGroup, ParamTensor


def build_meta_model(config: dict[str, Any]):
    """The transformers causal-LM for ``config``, with its parameters on the meta device."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ModelError(
            f"model_type {config.get('model_type')!r} has no analytic parser and transformers is not installed to "
            f"count it (pip install 'trainmem[trace]'); supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # config sanity warnings are not ours to print
    fields = {k: v for k, v in config.items() if k not in ("model_type", "_name_or_path", "architectures")}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"transformers cannot build model_type {config.get('model_type')!r} as a causal LM ({first_line})"
        ) from None


def spec_by_building(config: dict[str, Any], name: str, source: str, reason: str = "") -> ModelSpec:
    """A spec without architecture whose parameter tensors are exactly those of the transformers model."""
    model = build_meta_model(config)
    tensors = tuple(ParamTensor(n, tuple(p.shape)) for n, p in model.named_parameters())
    return ModelSpec(
        name=name, model_type=str(config["model_type"]), hidden_size=int(config.get("hidden_size", 0) or 0),
        vocab_size=int(config.get("vocab_size", 0) or 0), layer_runs=(), norm="rms", norm_vectors=0,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        explicit_param_groups=(ParamGroup("all (counted by transformers on the meta device)", 1, tensors),),
        source=source,
    )
