"""Counting parameters by building the transformers model on the meta device.

Used for a ``model_type`` that has no analytic parser in :mod:`trainmem.models`, and by the tests that
prove the analytic counts equal what transformers builds. The meta device gives shapes without memory, so
any model size is built in about a second.

The config is a user's file handed to transformers, whose config classes and modules raise whatever a hostile value
makes them raise (a strict-dataclass validation error, a negative dimension, an overflow, a division by zero) or
build for as long as the layer count says. So the sizes are checked first (:func:`check_buildable`: whole numbers,
not negative, at most MAX_BUILT_LAYERS layers and MAX_BUILT_EXPERTS experts), and anything transformers still raises
while building becomes one line.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

from .errors import ModelError, TrainmemError
from .models import SUPPORTED_MODEL_TYPES, ModelSpec, ParamGroup, ParamTensor, model_type_of

MAX_BUILT_LAYERS = 1024
"""The most decoder layers built on the meta device: building costs about 3 ms a layer (GPT-J, this machine: 1,000
layers in 3.3 s), so 100,000 layers would take minutes; the deepest real models have under 200."""
MAX_BUILT_EXPERTS = 4096
"""The most experts per layer built (the widest real MoE models have 384)."""
MAX_BUILT_SIZE = 2**31
"""The largest size or count in a config counted this way, as models.py bounds the analytic configs."""
_INT64 = 2**63
_SIZE_KEY = re.compile(r"^(num|n)_|(_size|_dim|_layers?|_heads?|_experts?|_positions|_rank|_ctx|_embd|_embed|_inner)$"
                       r"|^max_position_embeddings$")
_NOT_A_SIZE = re.compile(r"(_ids?|_token|_tokens)$|^(use|output|return|is|add|tie)_|(^|_)(auto|adjust)_")
"""Config keys holding a size or a count (hidden_size, n_layer, num_experts, head_dim, q_lora_rank, n_positions, ...),
and the ones that look like it but are not (token ids, flags: LFM2's block_auto_adjust_ff_dim, true by default)."""
_STANDARD = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
"""Sizes every transformers causal-LM config answers under these names (its attribute_map turns GPT-J's n_layer,
n_embd and n_head into them): each at least 1."""


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _check_size(origin: str, key: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        shown = repr(value)[:40] if isinstance(value, (float, str)) else _json_type(value)
        raise ModelError(f"{origin}: config field {key!r} is {shown}; it must be an integer")
    largest = (MAX_BUILT_LAYERS if re.search(r"layers?$", key) and "window" not in key
               else MAX_BUILT_EXPERTS if re.search(r"experts?$", key) and "per_tok" not in key else MAX_BUILT_SIZE)
    if not 0 <= value <= largest:
        shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:8]}...({len(str(value).lstrip('-'))} digits)"
        raise ModelError(f"{origin}: config field {key!r} is {shown}; accepted: 0 to {largest:,} (for a model "
                         "built with transformers: a model_type without an analytic parser, or trace, measure and "
                         "precision-check)")


def _walk(origin: str, value: Any, where: str, depth: int = 0) -> None:
    """Every integer in the config fits 64 bits (transformers and torch convert them to C integers); every size-like
    field is a whole number in range."""
    if depth > 20:
        raise ModelError(f"{origin}: config nested more than 20 levels deep at {where!r}")
    if isinstance(value, dict):
        sizes_here = depth == 0 or where == "text_config"  # (not rope_scaling's mscale_all_dim, a float)
        for key, inner in value.items():
            if sizes_here and _SIZE_KEY.search(key) and not _NOT_A_SIZE.search(key) and not isinstance(
                    inner, (list, dict)):
                _check_size(origin, key, inner)
            _walk(origin, inner, key, depth + 1)
    elif isinstance(value, list):
        for inner in value:
            _walk(origin, inner, where, depth + 1)
    elif isinstance(value, int) and not isinstance(value, bool) and not -_INT64 <= value < _INT64:
        raise ModelError(f"{origin}: config field {where!r} holds an integer of {len(str(abs(value)))} digits; "
                         "at most 64 bits are accepted")


def check_buildable(config: dict[str, Any], origin: str = "config") -> str:
    """Refuse, in one line, a config that transformers would fail on or spend minutes building: returns its
    model_type. Runs without transformers (cheap, before anything is imported)."""
    if not isinstance(config, dict):
        raise ModelError(f"{origin}: a config must be a JSON object, got {_json_type(config)}")
    model_type = model_type_of(config, origin)
    _walk(origin, config, "config")
    return model_type


def _one_line(exc: BaseException) -> str:
    text = " ".join(part.strip() for part in str(exc).strip().splitlines() if part.strip())
    return (text or type(exc).__name__)[:200]


def build_meta_model(config: dict[str, Any], origin: str = "config", task: str = "causal-lm",
                     num_labels: int | None = None) -> Any:
    """The transformers model of ``task`` (tasks.py: a causal LM by default) for ``config``, with its parameters on
    the meta device."""
    from .tasks import AUTO_CLASSES, auto_class, has_head, no_head_message, task_fields

    model_type = check_buildable(config, origin)
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ModelError(
            f"model_type {model_type!r} has no analytic parser and transformers is not installed to "
            f"count it (pip install 'trainmem[trace]'); supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # config sanity warnings are not ours to print
    fields = {k: v for k, v in config.items() if k not in ("model_type", "_name_or_path", "architectures")}
    fields.update(task_fields(task, num_labels))
    # transformers' config classes and modules raise whatever a hostile value makes them raise (huggingface_hub's
    # StrictDataclassFieldValidationError for a wrong type, RuntimeError for a negative dimension, OverflowError,
    # ZeroDivisionError for zero heads, ...): each is the config's fault, so each is one line here.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        import difflib

        close = difflib.get_close_matches(model_type, [*SUPPORTED_MODEL_TYPES, *CONFIG_MAPPING_NAMES], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ModelError(f"{origin}: unknown model_type {model_type!r}{hint}: neither trainmem's parsers "
                         f"({', '.join(SUPPORTED_MODEL_TYPES)}) nor transformers know it")
    if task != "causal-lm" and not has_head(task, model_type):
        raise ModelError(no_head_message(task, model_type, origin))
    try:
        with warnings.catch_warnings():  # (its deprecation notes, e.g. on rope_scaling, are not the user's error)
            warnings.simplefilter("ignore")
            hf_config = AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 (see above)
        raise ModelError(f"{origin}: transformers cannot read this model_type {model_type!r} config "
                         f"({_one_line(exc)})") from None
    language = text_config(hf_config)
    for key in _STANDARD:
        value = getattr(language, key, None)
        if value is not None:
            _check_size(origin, key, value)
            if value < 1:
                raise ModelError(f"{origin}: config field {key!r} is {value}; it must be a positive integer")
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (AutoModelForCausalLM if task == "causal-lm" else auto_class(task)).from_config(hf_config)
    except TrainmemError:
        raise
    except Exception as exc:  # noqa: BLE001 (see above)
        what = "a causal LM" if task == "causal-lm" else AUTO_CLASSES[task]
        raise ModelError(
            f"{origin}: transformers cannot build model_type {model_type!r} as {what} ({_one_line(exc)})"
        ) from None


def text_config(hf_config: Any) -> Any:
    """The language model's config of a transformers config (a multimodal config's ``text_config``; a text model's
    own)."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def _check_rope(origin: str, value: Any, where: str = "rope_parameters") -> None:
    """RoPE's numbers as transformers keeps them (``config.rope_parameters``, one dict or one per layer type): its
    config class takes them unchecked, so a string rope_theta would only fail in the first forward."""
    if isinstance(value, dict):
        for key, inner in value.items():
            if key in ("rope_type", "type"):
                if not isinstance(inner, str):
                    raise ModelError(f"{origin}: {where}.{key} is {_json_type(inner)}; it must be a string such as "
                                     "'default' or 'llama3'")
            else:
                _check_rope(origin, inner, f"{where}.{key}")
    elif isinstance(value, list):
        for inner in value:
            _check_rope(origin, inner, where)
    elif value is not None and not isinstance(value, bool):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or (
                where.endswith(("rope_theta", "factor")) and value <= 0):
            shown = repr(value)[:40] if isinstance(value, (int, float, str)) else _json_type(value)
            raise ModelError(f"{origin}: {where} is {shown}; it must be a finite number" +
                             (" above 0" if where.endswith(("rope_theta", "factor")) else ""))


def check_transformers_config(config: dict[str, Any], origin: str = "config") -> None:
    """For the commands that build the model with transformers (trace, measure, precision-check): refuse in one line
    a config the analytic parser accepts but transformers cannot build or run, because of a field the estimate does
    not read (a string layer_norm_epsilon, a pad_token_id past the vocabulary, a string rope_theta). Builds it on the
    meta device (no memory); needs transformers, whose absence the CLI reports as a missing extra."""
    import torch  # noqa: F401 (a ModuleNotFoundError here names the extra to install)
    import transformers  # noqa: F401

    model = build_meta_model(config, origin)
    _check_rope(origin, getattr(model.config, "rope_parameters", None))


def spec_by_building(config: dict[str, Any], name: str, source: str, reason: str = "", task: str = "causal-lm",
                     num_labels: int | None = None) -> ModelSpec:
    """A spec without architecture whose parameter tensors are exactly those of the transformers model of ``task``
    (its head: BERT's pooler and classifier for seq-cls, its MLM head for masked-lm). The count is kept on disk
    (diskcache.py, keyed by the config, the task and the library versions), so the next estimate of the same
    config imports neither torch nor transformers."""
    from .diskcache import cache_path, canonical_config, read_cached, write_cached

    check_buildable(config, source or name or "config")
    key: dict[str, Any] = {"config": canonical_config(config)}
    if task != "causal-lm":  # (the causal LM's entries keep the key they had)
        key |= {"task": task, "num_labels": num_labels}
    path = cache_path("params", key)
    counted = read_cached(path)
    if not (counted and isinstance(counted.get("tensors"), list) and "layer_list" in counted):
        counted = _count_by_building(config, source or name or "config", task, num_labels)
        write_cached(path, counted)
    return ModelSpec(
        name=name, model_type=str(config["model_type"]), hidden_size=int(counted["hidden_size"]),
        vocab_size=int(counted["vocab_size"]), layer_runs=(), norm="rms", norm_vectors=0,
        tied_embeddings=bool(counted["tied"]),
        explicit_param_groups=_grouped(counted["tensors"], counted["layer_list"]),
        source=source, built_config=canonical_config(config),
    )


def decoder_layers(model: Any, layers: int) -> Any:
    """The model's ModuleList of ``layers`` decoder layers (the longest one of that length), or None."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    return max(lists, key=lambda m: sum(1 for _ in m.modules()), default=None)


def _grouped(tensors: list[list[Any]], layer_list: str) -> tuple[ParamGroup, ...]:
    """The counted tensors as parameter groups: each run of alike decoder layers (the tensors under
    ``layer_list``.i, where the model has such a list) one group with a repeat, as FSDP2 wraps each layer
    (sharding.py), and the rest (embedding, final norm, LM head: FSDP2's root) one group."""
    layers: dict[int, list[ParamTensor]] = {}
    root: list[ParamTensor] = []
    for name, shape in tensors:
        index, _, rest = name[len(layer_list) + 1:].partition(".") if layer_list else ("", "", "")
        if layer_list and name.startswith(layer_list + ".") and index.isdigit():
            layers.setdefault(int(index), []).append(ParamTensor(rest, tuple(shape)))
        else:
            root.append(ParamTensor(name, tuple(shape)))
    groups: list[ParamGroup] = []
    for index in sorted(layers):
        kind = tuple(layers[index])
        if groups and groups[-1].tensors == kind:
            last = groups[-1]
            groups[-1] = ParamGroup(f"{layer_list}.{index - last.repeat}-{index}", last.repeat + 1, kind, True)
        else:
            groups.append(ParamGroup(f"{layer_list}.{index}", 1, kind, True))
    if root:
        groups.append(ParamGroup("the rest (counted by transformers on the meta device)", 1, tuple(root)))
    return tuple(groups)


def _count_by_building(config: dict[str, Any], origin: str, task: str = "causal-lm",
                       num_labels: int | None = None) -> dict[str, Any]:
    """The parameter tensors of the model of ``task`` built on the meta device, the path of its decoder layers' list
    ("" where it has none) and the sizes the spec keeps."""
    model = build_meta_model(config, origin, task, num_labels)
    tensors = [[n, list(p.shape)] for n, p in model.named_parameters()]
    if not tensors:
        raise ModelError(f"{origin}: transformers built model_type {config['model_type']!r} without parameters")
    language = text_config(model.config)
    count = getattr(language, "num_hidden_layers", None)
    found = decoder_layers(model, count) if isinstance(count, int) and count > 0 else None
    layer_list = next((n for n, m in model.named_modules() if m is found), "") if found is not None else ""
    return {"tensors": tensors, "layer_list": layer_list, "hidden_size": int(getattr(language, "hidden_size", 0) or 0),
            "vocab_size": int(getattr(language, "vocab_size", 0) or 0),
            "tied": bool(getattr(model.config, "tie_word_embeddings", False))}
