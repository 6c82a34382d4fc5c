"""Helpers that build the real transformers model from a config dict (tests only)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_config(cfg: dict):
    from transformers import AutoConfig
    from transformers.utils import logging

    logging.set_verbosity_error()
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "_name_or_path", "architectures")}
    return AutoConfig.for_model(cfg["model_type"], **fields)


def meta_model(cfg: dict):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(cfg))


def hf_num_parameters(cfg: dict) -> int:
    return sum(p.numel() for p in meta_model(cfg).parameters())
