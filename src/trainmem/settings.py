"""The training set-up a user asks about, validated once at the edge, then passed around frozen.

A stdlib frozen dataclass rather than a pydantic model: building a pydantic schema costs ~100 ms at import,
a fifth of the time ``trainmem estimate`` may take end to end. The checks are few and each error names the
field, the value and what is accepted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import ConfigError
from .optimizers import get_optimizer
from .recipes import get_recipe

ATTENTION_KERNELS = ("eager", "sdpa", "flash")
CHECKPOINTING = ("none", "selective", "op", "full")
SELECTIVE_EVERY = 2
"""--checkpointing selective checkpoints every second decoder layer (0, 2, 4, ...): torchtitan's selective
activation checkpointing with its default ``selective_ac_option = "2"`` (torchtitan/distributed/
activation_checkpoint.py, ``_apply_layer_sac``), not Megatron's recompute of the attention core, which flash
attention already leaves nothing to save for. --checkpointing op is torchtitan's per-op selective checkpointing
(``selective_ac_option = "op"``) of every decoder layer: opsac.py."""
LOSSES = ("standard", "chunked", "chunked-output")
OFFLOAD_MIN_BYTES = 1024
"""torchtune's OffloadActivations min_offload_size: smaller saved tensors stay on the device."""
OUTPUT_CHUNKS = 8
"""torchtune's CEWithChunkedOutputLoss default (num_output_chunks), which the model's output layer follows."""
OPTIMIZER_IMPLS = ("auto", "foreach", "fused")
TASKS = ("causal-lm", "masked-lm", "seq-cls", "seq2seq-lm")
"""What the model is trained to do, i.e. which transformers head and loss the step runs (tasks.py): causal-lm
(AutoModelForCausalLM, next-token cross-entropy), masked-lm (AutoModelForMaskedLM, cross-entropy over the masked
positions), seq-cls (AutoModelForSequenceClassification, cross-entropy over the pooled output's num_labels logits)
and seq2seq-lm (AutoModelForSeq2SeqLM, the labels through the decoder)."""
MAX_LABELS = 1 << 20
MAX_BATCH = 1 << 24
MAX_SEQ = 1 << 24
MAX_GRAD_ACCUM = 1 << 24
"""The largest micro-batch, sequence and accumulation accepted: 16,777,216, what --max-batch and --max-seq search up
to (planner.MAX_SEARCH) and far past any run (the longest contexts are 10M tokens), so that a typo such as 10**400
is refused in one line instead of overflowing a float deep in the estimate."""
MAX_SWEEP_CELLS = 1024
"""The most estimates one sweep makes (batches x sequences x layouts): a 1,024-row table is past reading, and the
time a sweep takes stays a few seconds."""
_BOUNDS = {"batch": MAX_BATCH, "seq": MAX_SEQ, "grad_accum": MAX_GRAD_ACCUM}


@dataclass(frozen=True)
class TrainingSettings:
    """What is trained how. Every field has a default, so ``TrainingSettings()`` is a valid set-up."""

    recipe: str = "mixed-bf16"
    """Precision recipe (``trainmem recipes`` lists them)."""
    optimizer: str = "adamw"
    """Optimizer whose states are counted."""
    batch: int = 1
    """Micro-batch size per GPU."""
    seq: int = 2048
    """Sequence length in tokens."""
    grad_accum: int = 1
    """Gradient accumulation steps (gradients then live across micro-batches)."""
    attention: str = "sdpa"
    """Attention kernel: eager (materialises the s x s scores), sdpa (transformers' default) or flash."""
    checkpointing: str = "none"
    """Activation checkpointing: none, selective (every second decoder layer, torchtitan's layer SAC), op
    (torchtitan's per-op SAC of every layer: opsac.py) or full (transformers' gradient_checkpointing_enable: every
    decoder layer)."""
    dropout: float | None = None
    """Dropout probability override; None keeps the config's."""
    loss: str = "standard"
    """Cross-entropy: standard (transformers' ForCausalLMLoss on the whole logits), chunked (Liger-Kernel's fused
    linear cross-entropy: the logits never exist whole) or chunked-output (torchtune's CEWithChunkedOutputLoss: the
    LM head runs on 8 slices of the sequence and each slice's logits are upcast to fp32 on their own)."""
    activation_k: float | None = None
    """Use the seed article's rule of thumb b*s*h*L*k*2 bytes instead of the architecture model."""
    optimizer_impl: str = "auto"
    """foreach (torch's default on CUDA: one parameter-sized temporary), fused (no temporaries; AdamW, Adam, SGD and
    the bitsandbytes optimizers have one), or auto: fused for the mixed-* recipes where the optimizer has a fused
    implementation (DeepSpeed's FusedAdam), foreach otherwise."""
    optimizer_in_backward: bool = False
    """Step each parameter as soon as backward has made its gradient, then free it (torchtune's
    ``optimizer_in_bwd``, through ``register_post_accumulate_grad_hook``): the gradients never exist together."""
    compile: bool = False
    """torch.compile each decoder layer (and torchtune's per-slice loss): AOTAutograd's min-cut partitioner
    decides what a layer saves, keeping fewer tensors than eager where elementwise chains can be recomputed."""
    offload_activations: bool = False
    """Move what backward keeps to host memory as it is saved and bring it back when backward needs it
    (torchtune's OffloadActivations, a saved-tensor hook); the host bytes are reported."""
    task: str = "causal-lm"
    """The head and loss trained (TASKS); anything but causal-lm runs on the traced path (recorded.py)."""
    num_labels: int | None = None
    """seq-cls: the classifier's outputs (None keeps the config's num_labels, transformers' default 2)."""

    @property
    def fused_optimizer(self) -> bool:
        if self.optimizer_impl == "auto":
            return self.recipe.startswith("mixed") and get_optimizer(self.optimizer).fused_available
        return self.optimizer_impl == "fused"

    def __post_init__(self) -> None:
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"{name} must be a string, got {type(value).__name__} {value!r}")
        for name in ("dropout", "activation_k"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        get_recipe(self.recipe)
        get_optimizer(self.optimizer)
        for name in ("batch", "seq", "grad_accum"):
            _check_positive(name, getattr(self, name))
        for name, accepted in (("attention", ATTENTION_KERNELS), ("checkpointing", CHECKPOINTING), ("loss", LOSSES),
                               ("optimizer_impl", OPTIMIZER_IMPLS)):
            if getattr(self, name) not in accepted:
                raise ConfigError(f"unknown {name} {getattr(self, name)!r}; accepted: {', '.join(accepted)}")
        if self.optimizer_impl == "fused" and not get_optimizer(self.optimizer).fused_available:
            raise ConfigError(f"optimizer {self.optimizer!r} has no fused implementation; use --optimizer-impl "
                              "foreach or auto")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.activation_k is not None and not 0 < self.activation_k <= 10_000:  # (NaN and infinity fail too)
            raise ConfigError(f"activation-k must be a positive number up to 10000, got {self.activation_k!r}")
        if not isinstance(self.optimizer_in_backward, bool):
            raise ConfigError(f"optimizer_in_backward must be true or false, got {self.optimizer_in_backward!r}")
        for name in ("compile", "offload_activations"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_task(self)
        if self.activation_k is not None and (self.compile or self.offload_activations or self.loss != "standard"):
            raise ConfigError("--activation-k replaces the activation model with one number; --compile, "
                              "--offload-activations and --loss change what that model computes: give one or the "
                              "other")
        if self.checkpointing in ("selective", "op") and get_recipe(self.recipe).autocast:
            raise ConfigError(f"checkpointing {self.checkpointing!r} is modelled for recipes without autocast (fp32, "
                              "mixed-*, pure-*): autocast's cast cache under a part-checkpointed model is not; give "
                              "--checkpointing full or none")
        if self.checkpointing == "selective" and self.compile:
            # (plain checkpointing under compile recomputes the SDPA kernel, a random op: its functionalised RNG
            # state cannot be traced on fake tensors, so the estimate would go unchecked)
            raise ConfigError("checkpointing 'selective' with --compile is not modelled; with --compile give "
                              "--checkpointing op, full or none")
        if self.offload_activations and self.checkpointing != "full":
            raise ConfigError("--offload-activations is modelled with --checkpointing full (torchtune: it should be "
                              "used alongside activation checkpointing)")
        if self.optimizer_in_backward:
            recipe = get_recipe(self.recipe)
            if self.grad_accum > 1:
                raise ConfigError("--optimizer-in-backward steps every micro-batch: it does not go with --grad-accum "
                                  "(torchtune refuses the pair too)")
            if recipe.master_weights or recipe.persistent_gradients:
                raise ConfigError(f"--optimizer-in-backward is modelled for recipes without fp32 master weights "
                                  f"(fp32, amp-*, pure-bf16*); got {self.recipe!r}")

    def at(self, batch: int, seq: int) -> "TrainingSettings":
        """These settings at another micro-batch and sequence length, without validating again what was validated
        when they were made (a search asks for thousands)."""
        _check_positive("batch", batch)
        _check_positive("seq", seq)
        moved = object.__new__(TrainingSettings)
        moved.__dict__.update(self.__dict__, batch=batch, seq=seq)
        return moved

    @property
    def activation_key(self) -> tuple[Any, ...]:
        """What the activations depend on: every field but the optimizer's, the recipe's name (its dtypes are the
        caller's to add) and the accumulation steps."""
        return tuple(getattr(self, name) for name in _ACTIVATION_FIELDS)

    @property
    def step_key(self) -> tuple[Any, ...]:
        """What a compiled step depends on (stepmodel.compile_step): every field but the batch and the sequence
        length, with the accumulation steps counted only as one or more than one."""
        return tuple(min(value, 2) if name == "grad_accum" else value for name, value in self.__dict__.items()
                     if name not in ("batch", "seq"))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in _ADDED_IN_SCHEMA_2:  # keys added after schema 2's first documents appear when they are set
            if out[name] == _DEFAULTS[name]:
                del out[name]
        return out


def _check_task(s: TrainingSettings) -> None:
    """The task, its number of labels, and the switches the traced step of another head does not run."""
    if not isinstance(s.task, str) or s.task not in TASKS:
        raise ConfigError(f"unknown task {short_repr(s.task)}; accepted: {', '.join(TASKS)}")
    if s.num_labels is not None:
        if s.task != "seq-cls":
            raise ConfigError(f"num-labels sizes the classifier of --task seq-cls; task {s.task!r} has none")
        if isinstance(s.num_labels, bool) or not isinstance(s.num_labels, int) or not 0 < s.num_labels <= MAX_LABELS:
            raise ConfigError(f"num-labels must be a positive integer, got {short_repr(s.num_labels)} "
                              f"(accepted: 1 to {MAX_LABELS:,})")
    if s.task == "causal-lm":
        return
    unrun = [flag for flag, on in (("--activation-k", s.activation_k is not None), ("--compile", s.compile),
                                   ("--offload-activations", s.offload_activations),
                                   (f"--loss {s.loss}", s.loss != "standard"),
                                   (f"--checkpointing {s.checkpointing}", s.checkpointing in ("selective", "op"))) if on]
    if unrun:
        raise ConfigError(f"--task {s.task} is traced with transformers' own head and loss; {', '.join(unrun)} "
                          "applies to causal LMs only (drop it, or give --task causal-lm)")


def _check_positive(name: str, value: Any) -> None:
    largest = _BOUNDS[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= largest:
        raise ConfigError(f"{name} must be a positive integer, got {short_repr(value)} (accepted: 1 to {largest:,})")


def short_repr(value: Any, limit: int = 24) -> str:
    """``repr(value)``, shortened when long (a 400-digit number prints its first digits and its length), so an error
    stays one readable line."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{text[:8]}...({len(text.lstrip('-'))} digits)"
    return f"{text[:limit]}...({len(text)} characters)"


def check_grid(batches: Any, seqs: Any, layouts: int = 1, names: tuple[str, str] = ("batches", "seqs")) -> None:
    """A sweep's axes: non-empty lists of positive integers in the settings' bounds, at most MAX_SWEEP_CELLS
    estimates in all (``layouts`` of them per batch and sequence)."""
    for name, values, largest in ((names[0], batches, MAX_BATCH), (names[1], seqs, MAX_SEQ)):
        if not isinstance(values, (list, tuple)) or not values or any(
                isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= largest for v in values):
            shown = short_repr(values, 60) if not isinstance(values, (list, tuple)) else \
                next((short_repr(v) for v in values if isinstance(v, bool) or not isinstance(v, int)
                      or not 0 < v <= largest), "[]")
            raise ConfigError(f"{name} must be a non-empty list of integers from 1 to {largest:,}, got {shown}")
    cells = len(batches) * len(seqs) * max(1, layouts)
    if cells > MAX_SWEEP_CELLS:
        per = f" x {layouts} layouts" if layouts > 1 else ""
        raise ConfigError(f"{names[0]} and {names[1]} make a sweep of {len(batches)} x {len(seqs)}{per} = {cells:,} "
                          f"estimates; at most {MAX_SWEEP_CELLS:,} are made at once: give fewer values")


_FIELDS = {f.name for f in fields(TrainingSettings)}
_DEFAULTS = {f.name: f.default for f in fields(TrainingSettings)}
_ACTIVATION_FIELDS = tuple(sorted(_FIELDS - {"recipe", "optimizer", "optimizer_impl", "optimizer_in_backward",
                                             "grad_accum"}))
_ADDED_IN_SCHEMA_2 = ("optimizer_in_backward", "compile", "offload_activations", "task", "num_labels")
_TEXT_FIELDS = ("recipe", "optimizer", "attention", "checkpointing", "loss", "optimizer_impl", "task")


def make_settings(**values: Any) -> TrainingSettings:
    """Settings from keyword values; None means "the default". Unknown names are rejected."""
    unknown = set(values) - _FIELDS
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(sorted(unknown))}; accepted: {', '.join(sorted(_FIELDS))}")
    return TrainingSettings(**{k: v for k, v in values.items() if v is not None})
