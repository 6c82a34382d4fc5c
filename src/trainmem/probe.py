"""What PyTorch actually saves for backward, per decoder layer, in a real forward of a transformers model.

Runs one training-mode forward (and the loss) of the model built from a config, on the CPU, with
``torch.autograd.graph.saved_tensors_hooks`` recording every tensor an autograd node keeps. Tensors are
counted once per storage (q, k and v views of one projection output are one allocation) and parameters are
left out (they are weights, not activations). Each storage is attributed to the decoder layer that was
running when it was first saved. This is the ground truth the activation formulas are tested against.

Needs torch and transformers (the ``trace`` extra).
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from .recipes import Recipe, get_recipe

if TYPE_CHECKING:
    from .lora import FineTune, LoraOptions
    from .models import ModelSpec


@dataclass(frozen=True)
class SavedTensor:
    where: str
    """'embedding', 'layer N' or 'head' (final norm, LM head and loss)."""
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


def decoder_layers(model: Any) -> list[Any]:
    """The list of decoder layers of a transformers causal LM, whatever the family calls it."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers", "transformer.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return list(obj)
    # Any other causal LM (BERT-like decoders' encoder.layer, MPT's transformer.blocks, Mamba's backbone.layers):
    # the ModuleList of as many modules as the config has layers, else the longest one.
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None) if config is not None else None
    matching = [m for m in lists if len(m) == layers] or lists
    if matching:
        return list(max(matching, key=lambda m: len(list(m))))
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def build_model(config: dict[str, Any], recipe: Recipe, attention: str = "sdpa", dropout: float | None = None,
                task: str = "causal-lm", num_labels: int | None = None) -> Any:
    """The transformers model of ``task`` (tasks.py; a causal LM by default) in ``recipe``'s weight dtype, in
    training mode, its tensors made in the active mode (fake under FakeTensorMode)."""
    import torch
    from transformers import AutoConfig
    from transformers.utils import logging

    from .tasks import auto_class, task_fields

    logging.set_verbosity_error()
    # torch_dtype/dtype in a config would override the recipe's dtype in from_config.
    skip = ("model_type", "_name_or_path", "architectures", "torch_dtype", "dtype")
    fields = {k: v for k, v in config.items() if k not in skip}
    if dropout is not None:
        # every dropout probability the described families' configs have (models.py reads the same keys:
        # Starcoder2Config's residual_dropout and embedding_dropout too), so that --dropout P runs what it estimates
        for key in ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "dropout",
                    "residual_dropout", "embedding_dropout"):
            fields[key] = dropout
    fields.update(task_fields(task, num_labels))
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    model_class = auto_class(task)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[recipe.weights]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # model.to(dtype) would work too here, but not under FakeTensorMode
    try:
        with _trunc_normal_without_data_checks(torch), _conversions_by_replacement(torch):
            model = _from_config(model_class, hf_config, attention, dtype)
    finally:
        torch.set_default_dtype(previous)
    model.train()
    return model


def _from_config(model_class: Any, hf_config: Any, attention: str, dtype: Any) -> Any:
    try:
        return model_class.from_config(hf_config, attn_implementation=attention, dtype=dtype)
    except ValueError as exc:  # no SDPA path (Gemma 2, BLOOM): transformers' own default is eager
        if attention != "sdpa" or "scaled_dot_product_attention" not in str(exc):
            raise
        return model_class.from_config(hf_config, attn_implementation="eager", dtype=dtype)


def _under_fake_mode() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def _conversions_by_replacement(torch: Any) -> Iterator[None]:
    """Under FakeTensorMode, ``Module.to(dtype)`` in a model's ``__init__`` (DeepSeek-V4's fp32 norms, a Conv1d moved
    to fp32) fails: ``Module._apply`` swaps a fake parameter with its converted copy (torch/nn/modules/module.py,
    ``torch.utils.swap_tensors``), and the fake mode holds a weakref to every fake tensor, which a swap refuses.
    While a model is built on fake tensors, a conversion replaces the module's parameter and buffer entries with the
    converted tensors instead (what ``__future__.set_overwrite_module_params_on_conversion`` does for real tensors;
    nothing else holds the new parameters yet)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not _under_fake_mode():
        yield
        return
    module_class = torch.nn.Module
    original = module_class._apply

    def _apply(self: Any, fn: Any, recurse: bool = True) -> Any:
        if not any(isinstance(t, FakeTensor) for t in (*self._parameters.values(), *self._buffers.values())):
            return original(self, fn, recurse)
        if recurse:
            for child in self.children():
                child._apply(fn)
        for key, param in self._parameters.items():
            if param is not None:
                with torch.no_grad():
                    applied = fn(param)
                if applied is not param:
                    self._parameters[key] = torch.nn.Parameter(applied, requires_grad=param.requires_grad)
        for key, buffer in self._buffers.items():
            if buffer is not None:
                self._buffers[key] = fn(buffer)
        return self

    module_class._apply = _apply
    try:
        yield
    finally:
        module_class._apply = original


@contextlib.contextmanager
def _trunc_normal_without_data_checks(torch: Any) -> Iterator[None]:
    """Under FakeTensorMode, ``torch.nn.init.trunc_normal_`` (torch/nn/init.py, ``_no_grad_trunc_normal_``) asks
    ``mask.any()`` of its samples, which fake tensors cannot answer (ModernBERT initialises every weight with it):
    while a model is built on fake tensors, the initialisation draws a normal sample clamped to [a, b] in place, the
    same tensor with no new storage kept (the values of fake tensors are never read)."""
    if not _under_fake_mode():
        yield
        return
    from transformers import initialization

    def clamped_normal(tensor: Any, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                       generator: Any = None) -> Any:
        with torch.no_grad():
            return tensor.normal_(mean, std).clamp_(a, b)

    originals = (torch.nn.init.trunc_normal_, initialization.TORCH_INIT_FUNCTIONS.get("trunc_normal_"))
    torch.nn.init.trunc_normal_ = clamped_normal
    initialization.TORCH_INIT_FUNCTIONS["trunc_normal_"] = clamped_normal
    try:
        yield
    finally:
        torch.nn.init.trunc_normal_ = originals[0]
        if originals[1] is not None:
            initialization.TORCH_INIT_FUNCTIONS["trunc_normal_"] = originals[1]


FAMILY_MODULE_PATHS = {
    "gpt2": {"qkv_proj": r"attn\.c_attn", "o_proj": r"attn\.c_proj", "mlp.fc1": r"mlp\.c_fc",
             "mlp.fc2": r"mlp\.c_proj"},
    "opt": {"o_proj": r"self_attn\.out_proj", "mlp.fc1": r"fc1", "mlp.fc2": r"fc2"},
    # GPT-NeoX (attention.*), Falcon and BLOOM (self_attention.*): the fused query_key_value, dense, and the MLP's
    # dense_h_to_4h, dense_4h_to_h (modeling_gpt_neox.py, modeling_falcon.py, modeling_bloom.py)
    **{family: {"qkv_proj": r"query_key_value", "o_proj": r"(?:attention|self_attention)\.dense",
                "mlp.fc1": r"dense_h_to_4h", "mlp.fc2": r"dense_4h_to_h"} for family in ("gpt_neox", "falcon", "bloom")},
}
"""Where a family's modules differ from trainmem's names (lora.MODULE_NAMES read the other way): the path inside a
decoder layer, for a peft target regex (GPT-2's c_proj names both attention's output and the MLP's)."""


def peft_target_modules(spec: ModelSpec | None, lora: LoraOptions) -> list[str] | str:
    """peft's ``target_modules`` for trainmem's targets: the module names of the Linears lora.py selects (a regex
    over full module paths for the families whose module names differ from trainmem's)."""
    from .lora import adapted_names

    if tuple(lora.targets) == ("all-linear",):
        return "all-linear"
    assert spec is not None  # (named targets are selected from the spec)
    paths = FAMILY_MODULE_PATHS.get(spec.model_type)
    if paths:
        alternatives = sorted(paths.get(name, re.escape(name.rsplit(".", 1)[-1])) for name in adapted_names(spec, lora))
        return r".*\.(?:" + "|".join(alternatives) + ")$"
    return sorted({name.rsplit(".", 1)[-1] for name in adapted_names(spec, lora)})


def build_lora_model(config: dict[str, Any], recipe: Recipe, attention: str, dropout: float | None,
                     finetune: FineTune, spec: ModelSpec | None) -> Any:
    """The model with peft's LoRA adapters, its tensors created in the active mode (fake under FakeTensorMode).

    peft cannot wrap a model whose parameters are fake tensors (its ``Module.to`` swaps tensors that FakeTensorMode
    holds weak references to), so the model and its adapters are built on the meta device outside any mode, then
    each parameter and buffer is replaced by a new tensor of the same shape, dtype and ``requires_grad``, a tensor
    shared by two modules (tied embeddings) staying one tensor."""
    import peft
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    lora = finetune.lora
    with unset_fake_temporarily(), torch.device("meta"):
        model = build_model(config, recipe, attention, dropout)
        adapter_dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        names = {id(module): name for name, module in model.named_modules()}
        roles = {"embedding": model.get_input_embeddings(), "head": model.get_output_embeddings()}
        modules_to_save = [names[id(roles[role])].rsplit(".", 1)[-1] for role in sorted(lora.trained_roles)]
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha or 2 * lora.rank, lora_dropout=lora.dropout,
            target_modules=peft_target_modules(spec, lora), use_dora=lora.dora,
            modules_to_save=modules_to_save or None), autocast_adapter_dtype=lora.adapter_dtype == "auto")
        if adapter_dtype[lora.adapter_dtype] is not None:
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.data = param.data.to(adapter_dtype[lora.adapter_dtype])
    if lora.dora:
        _dora_weight_without_module_calls(model)
    made: dict[int, Any] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in list(store.items()):
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    new = torch.empty(tensor.shape, dtype=tensor.dtype)
                    if not new.is_meta and new.is_floating_point():
                        new.normal_(0, 0.02)
                    made[id(tensor)] = (torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
                                        if isinstance(tensor, torch.nn.Parameter) else new)
                store[name] = made[id(tensor)]
    model.train()
    return model


def _dora_weight_without_module_calls(model: Any) -> None:
    """peft's DoRA computes B @ A each forward by calling the adapter modules on an identity matrix
    (``DoraLinearLayer.get_lora_weight``) and keeps only a detached norm of it. Under MemTracker, whose module hooks
    register gradient hooks on every module output, that discarded graph (and its in_features^2 identity) lives on
    in a reference cycle until the garbage collector runs, where a plain run frees it when the forward returns.
    The same ops are run here through ``F.linear``, which no module hook sees."""
    import torch
    from peft.tuners.lora.dora import DoraLinearLayer

    def lora_weight(lora_A: Any, lora_B: Any, adapter_name: Any = None) -> Any:
        eye = torch.eye(lora_A.weight.shape[1], device=lora_A.weight.device, dtype=lora_A.weight.dtype)
        return torch.nn.functional.linear(torch.nn.functional.linear(eye, lora_A.weight), lora_B.weight).T

    for module in model.modules():
        if isinstance(module, DoraLinearLayer):
            module.get_lora_weight = lora_weight


def enable_checkpointing(model: Any, every: int = 1, op_sac: bool = False) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, or with ``every`` = N of layers 0, N, 2N, ...
    (torchtitan's layer-selective checkpointing: transformers' GradientCheckpointingLayer checks its own
    ``gradient_checkpointing``, so the others are switched back off). transformers renamed
    ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable`` in 5.x and deprecated the old name.
    ``op_sac``: torchtitan's per-op selective checkpointing of every layer (opsac.context_fn), with its
    ``preserve_rng_state=False``."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if op_sac:
        from .opsac import context_fn

        kwargs.update(context_fn=context_fn, preserve_rng_state=False)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if every > 1:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        layers: Any = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
        for index, layer in enumerate(layers):
            if index % every:
                layer.gradient_checkpointing = False


def saved_tensors(config: dict[str, Any], recipe: str | Recipe = "fp32", batch: int = 2, seq: int = 16,
                  attention: str = "sdpa", dropout: float | None = None, seed: int = 0,
                  checkpointing: bool = False, emulate: str = "cuda") -> list[SavedTensor]:
    """Every tensor saved for backward in one forward + loss, attributed to where it was first saved.

    ``emulate="cuda"`` (the default) runs on fake tensors with CUDA's autocast policy, SDPA kernel and dropout
    (:mod:`trainmem.cuda_emulation`), which is what a GPU saves; ``emulate="cpu"`` runs real CPU tensors."""
    import torch

    from .cuda_emulation import fake_gpu

    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    torch.manual_seed(seed)
    with fake_gpu() if emulate == "cuda" else contextlib.nullcontext():
        model = build_model(config, recipe, attention, dropout)
        if checkpointing:  # what survives the forward is what the checkpoint keeps: each layer's inputs
            enable_checkpointing(model)
        param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
        where = ["embedding"]
        for index, layer in enumerate(decoder_layers(model)):
            layer.register_forward_pre_hook(lambda m, a, i=index: where.__setitem__(0, f"layer {i}"))
            layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "head"))
        seen: dict[int, SavedTensor] = {}
        keep_alive: list[Any] = []

        def pack(t: Any) -> Any:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return t
            key = storage._cdata
            if key not in param_storages and key not in seen and storage.nbytes():
                seen[key] = SavedTensor(where[0], tuple(t.shape), str(t.dtype).replace("torch.", ""), storage.nbytes())
                keep_alive.append(t)  # a freed storage's address could be reused by a later tensor
            return t

        vocab = config.get("vocab_size")
        ids = torch.randint(0, vocab, (batch, seq))
        autocast = (torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[recipe.compute])
                    if recipe.autocast else contextlib.nullcontext())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            model(input_ids=ids, labels=ids)
    return list(seen.values())


def saved_bytes_by_place(tensors: list[SavedTensor]) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for t in tensors:
        totals[t.where] += t.nbytes
    return dict(totals)
