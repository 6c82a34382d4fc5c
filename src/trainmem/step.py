"""One real training step of a transformers model under a precision recipe: what trace and measure both run.

The model is built from its config in the recipe's weight dtype; recipes with fp32 master weights get an fp32
copy of every parameter that the optimizer updates (the half gradients are copied to fp32 first, the masters
copied back after); ``pure-bf16`` gets AdamW with fp32 states and no master copy; autocast recipes run forward
and loss under ``torch.autocast``. Needs torch and transformers.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Callable

from .errors import ConfigError
from .optimizers import TRACEABLE_OPTIMIZERS
from .recipes import get_recipe
from .settings import OFFLOAD_MIN_BYTES, OUTPUT_CHUNKS, TrainingSettings
from .probe import enable_checkpointing as enable_checkpointing  # (with the model building it belongs to; re-exported)

if TYPE_CHECKING:
    from .lora import FineTune
    from .models import ModelSpec


class Fp32StateAdamW:
    """AdamW keeping fp32 states for half-precision parameters, with no master copy (the pure-bf16 recipe,
    as torchao's and DeepSpeed's bf16-without-master optimizers do). foreach-style: one fp32
    parameter-sized temporary (the denominator) at a time, like torch's _multi_tensor_adamw."""

    def __init__(self, torch: Any, params: list[Any], lr: float = 1e-5, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, fused: bool = False) -> None:
        self.torch, self.params, self.lr, self.betas, self.eps, self.wd = torch, params, lr, betas, eps, weight_decay
        self.fused = fused
        """Update tensor by tensor (a fused kernel's footprint: no parameter-sized temporary)."""
        self.state: dict[Any, dict[str, Any]] = {}
        self.param_groups = [{"params": params}]

    def step(self) -> None:
        torch = self.torch
        params = [p for p in self.params if p.grad is not None]
        if not self.state:
            self.state = {p: {"exp_avg": torch.zeros_like(p, dtype=torch.float32),
                              "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)} for p in params}
        groups = [params] if not self.fused else [[p] for p in params]
        for group in groups:
            self._update(group)

    def _update(self, params: list[Any]) -> None:
        torch = self.torch
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        grads = [p.grad for p in params]
        with torch.no_grad():
            torch._foreach_mul_(params, 1 - self.lr * self.wd)
            torch._foreach_mul_(exp_avgs, self.betas[0])
            torch._foreach_add_(exp_avgs, grads, alpha=1 - self.betas[0])
            torch._foreach_mul_(exp_avg_sqs, self.betas[1])
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - self.betas[1])
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denom, self.eps)
            torch._foreach_reciprocal_(denom)
            torch._foreach_mul_(denom, exp_avgs)
            for p, update in zip(params, denom):
                p.add_(update, alpha=-self.lr)
            del denom

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


class MuonWithAdamW:
    """trainmem's ``muon``: ``torch.optim.Muon`` (its defaults: momentum 0.95, nesterov, 5 Newton-Schulz steps;
    one tensor at a time, torch/optim/_muon.py ``_single_tensor_muon``) for the 2-D weights of the decoder layers,
    and ``torch.optim.AdamW`` (foreach) for the rest (embeddings, LM head, norms, biases, 3-D expert weights), the
    two stepped one after the other as torch's Muon docstring shows. ``parts`` are the torch optimizers, which
    MemTracker tracks; ``state`` and ``param_groups`` are theirs together."""

    def __init__(self, torch: Any, params: list[Any], is_matrix: list[bool], fused: bool = False) -> None:
        matrices = [p for p, matrix in zip(params, is_matrix) if matrix]
        rest = [p for p, matrix in zip(params, is_matrix) if not matrix]
        self.parts: list[Any] = []
        if matrices:
            self.parts.append(torch.optim.Muon(matrices, lr=0.02))
        if rest:
            self.parts.append(torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.01, foreach=not fused,
                                                fused=fused or None))

    @property
    def state(self) -> dict[Any, Any]:
        return {p: st for part in self.parts for p, st in part.state.items()}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for part in self.parts for g in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """The hook runs once, before the first part steps (trainmem.track's phase marker)."""
        return self.parts[0].register_step_pre_hook(lambda optimizer, args, kwargs: hook(self, args, kwargs))


def decoder_layer_parameters(model: Any) -> set[int]:
    """The ids of the parameters inside the decoder layers of ``model`` (a transformers causal LM or peft's)."""
    from .probe import decoder_layers

    return {id(p) for layer in decoder_layers(causal_lm(model)) for p in layer.parameters()}


def muon_matrices(layer_params: set[int], params: list[Any]) -> list[bool]:
    """Which of ``params`` trainmem's ``muon`` gives to torch.optim.Muon: the 2-D parameters of the decoder layers
    (what ``ParamGroup.is_layer`` and a 2-D shape select in the estimate, optimizers.py)."""
    return [id(p) in layer_params and p.ndim == 2 for p in params]


def make_optimizer(torch: Any, name: str, params: list[Any], fused: bool, fp32_states_for_half: bool = False,
                   is_matrix: list[bool] | None = None) -> Any:
    """The torch optimizer of ``name`` over ``params``; ``is_matrix`` (muon) marks those torch.optim.Muon updates."""
    if name == "muon":
        return MuonWithAdamW(torch, params, is_matrix if is_matrix is not None else [False] * len(params), fused)
    if name in ("adamw", "adam") and fp32_states_for_half:
        return Fp32StateAdamW(torch, params, weight_decay=0.01 if name == "adamw" else 0.0, fused=fused)
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(params, lr=1e-5, foreach=not fused, fused=fused or None)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=not fused, fused=fused or None)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=not fused, fused=fused or None)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-3, foreach=True)
    raise _not_traceable(name)


def _not_traceable(optimizer: str) -> ConfigError:
    return ConfigError(f"trace and measure support the optimizers {', '.join(TRACEABLE_OPTIMIZERS)}, "
                       f"not {optimizer!r}")


def check_runnable(settings: TrainingSettings, device: str = "cpu") -> None:
    """Refuse, before any work (no torch import), what trace and measure cannot run."""
    if settings.loss == "chunked":
        raise ConfigError("trace and measure run transformers' loss or torchtune's (--loss chunked-output); "
                          "--loss chunked (Liger) is estimate-only")
    if settings.compile and settings.checkpointing == "full":
        raise ConfigError("trace and measure do not run --compile with --checkpointing full yet (a compiled layer "
                          "inside transformers' checkpoint kept more than eager in the trace); drop one of them")
    if settings.attention == "flash" and not str(device).startswith("cuda"):
        raise ConfigError("--attention flash (flash_attention_2) needs the flash-attn package and a GPU; on the "
                          "CPU and in trace use eager or sdpa (whose flash kernel the trace emulates)")
    if settings.optimizer not in TRACEABLE_OPTIMIZERS:
        raise _not_traceable(settings.optimizer)


COMPILE_BACKEND = "aot_eager_decomp_partition"


def vocab_size(config: dict[str, Any], model: Any) -> int:
    """The range of the batch's token ids: the config's ``vocab_size``, else the built model's language config's
    (a multimodal config keeps it in ``text_config``; a config that leaves it out gets its class's default)."""
    from .meta_count import text_config

    if config.get("vocab_size") is not None:
        return int(config["vocab_size"])
    return int(text_config(causal_lm(model).config).vocab_size)


def causal_lm(model: Any) -> Any:
    """The transformers causal LM itself, also when peft wraps it."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def chunked_output_model(torch: Any, model: Any, compile_loss: bool = False) -> Any:
    """The model with torchtune's loss: the decoder's last hidden state is cut into OUTPUT_CHUNKS slices along
    the sequence, the LM head runs on each (all slices' logits kept in a list, torchtune's
    ``TransformerDecoder.chunked_output``), then ``CEWithChunkedOutputLoss`` upcasts one slice at a time to fp32 for
    ``cross_entropy(reduction="sum")`` and divides the sum by the token count. No KV cache, as in torchtune."""
    from transformers.modeling_outputs import CausalLMOutput

    from .compiled_loss import cross_entropy_sum, slice_loss as compiled_slice_loss

    base = causal_lm(model)

    # torchtune's compile_loss compiles compute_cross_entropy with inductor
    slice_loss: Callable[[Any, Any], Any] = (compiled_slice_loss(torch) if compile_loss else
                                             lambda logits, target: cross_entropy_sum(torch, logits, target))

    class ChunkedOutputLoss(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, labels: Any) -> Any:
            hidden = base.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
            head = base.get_output_embeddings()
            logits = [head(chunk) for chunk in hidden.tensor_split(OUTPUT_CHUNKS, dim=1)]
            del hidden
            targets = [chunk.reshape(-1) for chunk in labels.tensor_split(OUTPUT_CHUNKS, dim=1)]
            total = 0.0
            for logits_chunk, target in zip(logits, targets):
                total = total + slice_loss(logits_chunk.reshape(-1, logits_chunk.size(-1)), target)
            del logits
            return CausalLMOutput(loss=total / (labels != -100).sum())  # a pytree: MemTracker hooks its backward

    return ChunkedOutputLoss()


class TrainingStep:
    """The model, optimizer and batch of one set-up; ``forward_backward()`` then ``step()`` is one step."""

    def __init__(self, config: dict[str, Any], settings: TrainingSettings, device: str = "cpu",
                 spec: ModelSpec | None = None, finetune: FineTune | None = None) -> None:
        import torch

        from .activations import effective_kernel
        from .models import UnsupportedModelType, spec_from_config
        from .probe import build_lora_model, build_model

        self.torch = torch
        self.recipe = recipe = get_recipe(settings.recipe)
        self.settings = settings
        check_runnable(settings, device)
        if spec is None:
            try:
                spec = spec_from_config(config)
            except UnsupportedModelType:  # (counted by transformers: the traced path's models)
                from .meta_count import spec_by_building

                spec = spec_by_building(config, "config", "", task=settings.task, num_labels=settings.num_labels)
        kernel = effective_kernel(spec, settings.attention)
        kernel = "flash_attention_2" if kernel == "flash" else kernel
        self.finetune = finetune
        # Built directly on the device (no .to(), which FakeTensorMode cannot apply to parameters).
        with torch.device(device):
            self.model = (build_lora_model(config, recipe, kernel, settings.dropout, finetune, spec) if finetune
                          else build_model(config, recipe, kernel, settings.dropout, settings.task,
                                           settings.num_labels))
        self.num_labels = int(getattr(causal_lm(self.model).config, "num_labels", 0) or 0)
        self.recomputing = False
        """True while a checkpointed layer's forward is being recomputed inside backward."""
        if settings.compile:
            torch._dynamo.reset()  # a fresh cache per model: dynamo stops compiling a code object after 8 variants
        if settings.checkpointing != "none" and settings.compile:
            self._compile_checkpointed_layers()
        elif settings.checkpointing != "none":
            from .settings import SELECTIVE_EVERY

            enable_checkpointing(self.model, SELECTIVE_EVERY if settings.checkpointing == "selective" else 1,
                                 op_sac=settings.checkpointing == "op")
            self._mark_recomputes()
        elif settings.compile:
            self._compile_layers()
        self.offloaded_bytes = self.offloaded_peak_bytes = 0
        """--offload-activations: bytes in host memory now, and the most at once."""
        if settings.offload_activations:
            self._offload_decoder_activations()
        layer_params = decoder_layer_parameters(self.model)
        if settings.loss == "chunked-output":
            self.model = chunked_output_model(torch, self.model, compile_loss=settings.compile)
        # Zero-element parameters (DeepSeek-V3's shared experts with n_shared_experts 0) hold no memory, and
        # torch.optim.Adafactor divides by their size.
        self.params = [p for p in self.model.parameters() if p.requires_grad and p.numel() > 0]
        half_trainables = any(p.dtype != torch.float32 for p in self.params)
        self.masters = ([p.detach().float().requires_grad_(True) for p in self.params]
                        if recipe.master_weights and (finetune is None or half_trainables) else None)
        self.main_grads = None
        if recipe.gradients == "fp32" and recipe.weights != "fp32" and finetune is None:
            # Megatron-LM's main_grad: a persistent fp32 buffer per parameter; each half gradient is added into it
            # as soon as backward has produced it, then freed (DistributedDataParallel's grad accumulation hooks).
            self.main_grads = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
            for p, main in zip(self.params, self.main_grads):
                p.register_post_accumulate_grad_hook(lambda param, main=main: self._accumulate_main_grad(param, main))
        fp32_states = (recipe.optimizer_states == "fp32" and recipe.weights != "fp32" and self.masters is None
                       and half_trainables)
        # muon: torch.optim.Muon for the base's 2-D decoder-layer weights; LoRA's adapters and trained copies go to
        # AdamW, as the estimate counts them (lora.adapter_groups and copy_groups are not decoder-layer groups)
        is_matrix = (muon_matrices(layer_params, self.params) if settings.optimizer == "muon" and finetune is None
                     else None)
        if settings.optimizer_in_backward:
            # one optimizer per parameter, stepped by the parameter's post-accumulate hook, which then frees its
            # gradient (torchtune's optimizer_in_bwd); step() has nothing left to do
            self.optimizers: dict[Any, Any] | None = {
                p: make_optimizer(torch, settings.optimizer, [p], settings.fused_optimizer, fp32_states,
                                  None if is_matrix is None else [is_matrix[i]])
                for i, p in enumerate(self.params)}
            for p, opt in self.optimizers.items():
                p.register_post_accumulate_grad_hook(lambda param, opt=opt: self._step_in_backward(opt))
            self.optimizer: Any = None
        else:
            self.optimizers = None
            self.optimizer = make_optimizer(torch, settings.optimizer, self.masters or self.params,
                                            settings.fused_optimizer, fp32_states, is_matrix)
        from .tasks import make_batch

        self.inputs = make_batch(torch, settings.task, vocab_size(config, self.model), self.num_labels, settings.batch,
                                 settings.seq, device)
        self.ids = self.inputs["input_ids"]
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.compute)
        self.autocast_device = torch.device(device).type
        self.autocast_dtype = half if recipe.autocast else None

    def _offload_decoder_activations(self) -> None:
        """torchtune's OffloadActivations around the decoder (its output layer and loss stay on the device): a
        saved-tensor hook moves each saved tensor of 1 KiB or more that is not a parameter to host memory and
        backward copies it back when it needs it. Here the device copy is dropped and an empty tensor of the same
        layout is made when backward unpacks it: the device memory of a synchronous offload (torchtune's stream
        version also keeps a tensor in flight each way); ``offloaded_peak_bytes`` records the host side."""
        torch = self.torch
        decoder = causal_lm(self.model).get_decoder()

        # Host bytes count each tensor once however often it is saved (an RMSNorm's fp32 input is saved by pow
        # and by the product; torchtune's hook copies it twice). A tensor is known by its id while it is alive.
        saved_by_id: dict[int, list[Any]] = {}  # id -> [weakref to the tensor, saves not yet brought back, bytes]

        def pack(tensor: Any) -> Any:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes < OFFLOAD_MIN_BYTES or isinstance(tensor, torch.nn.Parameter):
                return tensor
            entry = saved_by_id.get(id(tensor))
            if entry is None or entry[0]() is not tensor:
                entry = saved_by_id[id(tensor)] = [weakref.ref(tensor), 0, nbytes]
                self.offloaded_bytes += nbytes
                self.offloaded_peak_bytes = max(self.offloaded_peak_bytes, self.offloaded_bytes)
            entry[1] += 1
            return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, entry)

        def unpack(packed: Any) -> Any:
            if isinstance(packed, torch.Tensor):
                return packed
            shape, stride, dtype, device, entry = packed
            entry[1] -= 1
            if entry[1] == 0:
                self.offloaded_bytes -= entry[2]
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)

        hooks: list[Any] = []

        def enter(module: Any, args: Any) -> None:
            saved_by_id.clear()  # a forward's tensors are saved within it
            hooks.append(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            hooks[-1].__enter__()

        def leave(module: Any, args: Any, output: Any) -> None:
            hooks.pop().__exit__(None, None, None)

        decoder.register_forward_pre_hook(enter)
        decoder.register_forward_hook(leave, always_call=True)

    def _compile_layers(self) -> None:
        """torch.compile every decoder layer as torchtune's ``compile_model`` does, with the
        ``aot_eager_decomp_partition`` backend: AOTAutograd's min-cut partitioner decides what each layer saves
        for backward, and the partitioned graphs run op by op, so a memory tracker sees the tensors a compiled
        step keeps."""
        from .probe import decoder_layers

        for layer in decoder_layers(causal_lm(self.model)):
            layer.compile(backend=COMPILE_BACKEND)

    def _compile_checkpointed_layers(self) -> None:
        """torchtitan's order (torchtitan/models/llama3/infra/parallelize.py: ``apply_ac`` on every block, then
        ``apply_compile``, ``torch.compile(transformer_block, fullgraph=True)`` on each): each checkpointed layer's
        forward runs inside a non-reentrant ``torch.utils.checkpoint`` (``--checkpointing op``: torchtitan's
        policy, opsac.context_fn; ``selective``: layers 0, 2, 4, ... whole), and the compiled region is the
        checkpoint itself. Dynamo turns the checkpoint into ``tag_activation_checkpoint``, which tags every node of
        the region with the policy's answer (torch/_higher_order_ops/wrap.py, ``tag_activation_checkpoint_impl``;
        plain checkpointing answers PREFER_RECOMPUTE for every op) and the min-cut partitioner honours the tags
        (torch/_functorch/partitioners.py, ``must_recompute``, ``should_ban_recomputation``). The recompute runs
        inside the compiled backward graph, so there is no recompute marker (``recomputing`` stays False)."""
        from torch.utils.checkpoint import checkpoint

        from .opsac import context_fn
        from .probe import decoder_layers
        from .settings import SELECTIVE_EVERY

        # no KV cache, as transformers turns it off under its own checkpointing (and torchtitan's model has none)
        causal_lm(self.model).config.use_cache = False
        op = self.settings.checkpointing == "op"
        every = SELECTIVE_EVERY if self.settings.checkpointing == "selective" else 1
        kwargs: dict[str, Any] = dict(use_reentrant=False)
        if op:
            kwargs.update(context_fn=context_fn, preserve_rng_state=False)
        for index, layer in enumerate(decoder_layers(causal_lm(self.model))):
            if index % every == 0:
                # (a function of ours, not a partial of checkpoint: dynamo starts at the first frame outside torch)
                def checkpointed(*args: Any, _forward: Any = layer.forward, **kw: Any) -> Any:
                    return checkpoint(_forward, *args, **kwargs, **kw)
                layer.forward = checkpointed
            layer.compile(backend=COMPILE_BACKEND, fullgraph=True)

    def _mark_recomputes(self) -> None:
        """Wrap each layer's checkpoint function so that ``self.recomputing`` tells when its forward runs again in
        backward. (MemTracker's own marker starts at the first submodule hook inside the recompute, so it misses
        the layer's own ops such as the residual adds, and it stays set after an early-stopped recompute.)"""
        torch = self.torch

        def marked(checkpoint_func: Any) -> Callable[..., Any]:
            def checkpoint_with_marker(function: Any, *args: Any, **kwargs: Any) -> Any:
                def body(*a: Any, **k: Any) -> Any:
                    if torch._C._current_graph_task_id() == -1:  # the first forward, not the recompute
                        return function(*a, **k)
                    self.recomputing = True
                    try:
                        return function(*a, **k)
                    finally:  # also when the recompute stops early (torch.utils.checkpoint's early stop)
                        self.recomputing = False
                return checkpoint_func(body, *args, **kwargs)
            return checkpoint_with_marker

        for module in self.model.modules():
            if getattr(module, "_gradient_checkpointing_func", None) is not None:
                module._gradient_checkpointing_func = marked(module._gradient_checkpointing_func)

    @staticmethod
    def _step_in_backward(optimizer: Any) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @staticmethod
    def _accumulate_main_grad(param: Any, main: Any) -> None:
        main.add_(param.grad)
        param.grad = None

    def micro_batch(self) -> None:
        """Forward, loss and backward of one micro-batch (gradients accumulate into ``.grad``)."""
        torch = self.torch
        ctx = (torch.autocast(self.autocast_device, dtype=self.autocast_dtype) if self.autocast_dtype
               else contextlib.nullcontext())
        with ctx:
            loss = self.model(**self.inputs).loss
        loss.backward()
        del loss

    def forward_backward(self) -> None:
        for _ in range(self.settings.grad_accum):
            self.micro_batch()

    def step(self, on_optimizer_start: Callable[[], None] | None = None) -> None:
        """optimizer.step() and zero_grad(set_to_none=True); ``on_optimizer_start`` runs first (phase markers),
        before the fp32 copies of the gradients that master-weight recipes make."""
        if on_optimizer_start is not None:
            on_optimizer_start()
        if self.optimizers is not None:
            return  # every parameter was stepped, and its gradient freed, in backward
        if self.masters is not None:
            for i, (m, p) in enumerate(zip(self.masters, self.params)):
                # (a parameter the forward never used, such as an encoder-decoder's encoder trained as a decoder,
                # has no gradient: torch's optimizers skip it, as they skip the half parameter itself)
                m.grad = (self.main_grads[i] if self.main_grads is not None
                          else None if p.grad is None else p.grad.float())
        self.optimizer.step()
        if self.masters is not None:
            with self.torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    p.copy_(m)
                    m.grad = None
            self.model.zero_grad(set_to_none=True)  # the half gradients; the optimizer's own are the masters'
        if self.main_grads is not None:
            for main in self.main_grads:
                main.zero_()  # kept for the next step, like Megatron's grad buffer
        self.optimizer.zero_grad(set_to_none=True)

    def tracked_objects(self) -> list[Any]:
        """What MemTracker must know about: the model, the optimizer (or its state tensors), the masters."""
        optimizers = list(self.optimizers.values()) if self.optimizers is not None else [self.optimizer]
        states = []
        for optimizer in (part for opt in optimizers for part in getattr(opt, "parts", (opt,))):
            if isinstance(optimizer, self.torch.optim.Optimizer):
                states.append(optimizer)
            else:
                states += [t for st in optimizer.state.values() for t in st.values()]
        return [self.model, *states, *(self.masters or [])]

    def frozen_parameters(self) -> list[Any]:
        """Parameters that take no gradient (a LoRA base): MemTracker must not hook them."""
        return [p for p in self.model.parameters() if not p.requires_grad]
