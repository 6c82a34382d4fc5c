"""LoRA adapters: which Linear layers peft adapts, how many parameters that adds, and what then trains.

peft (``LoraConfig``, ``get_peft_model``; peft 0.21) puts an adapter pair on each targeted Linear of
(out_features, in_features): ``lora_A`` (r, in_features) and ``lora_B`` (out_features, r), r x (in + out)
parameters; the base weight is frozen. ``target_modules`` matches module names: the short names here (q, k, v,
o, gate, up, down, lm_head) name the projection whatever the family calls it, and a short name on a fused
projection selects the fused layer (q on GPT-NeoX's ``query_key_value``), as peft selects by module name;
``all-linear`` is every Linear of the decoder but the output layer (peft's ``INCLUDE_LINEAR_LAYERS_SHORTHAND``).
peft keeps adapters in fp32 over a half-precision base (``autocast_adapter_dtype=True``), so their gradients and
optimizer states are fp32 too. Counts are checked against peft's ``get_nb_trainable_parameters`` (tests/test_lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .models import ModelSpec, ParamTensor, layer_tensors

if TYPE_CHECKING:  # (names for the annotations only)
    from .activations import ActivationEstimate, LayerActivations, Precision, Term
    from .models import Layer, ParamGroup
    from .optimizers import Optimizer
    from .recipes import Recipe
    from .settings import TrainingSettings
    from .sharding import Buffer

SHORT_NAMES = {
    "q": ("q_proj", "qkv_proj", "q_a_proj", "q_b_proj"),
    "k": ("k_proj", "qkv_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
    "v": ("v_proj", "qkv_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
    "o": ("o_proj",),
    "gate": ("mlp.gate_proj", "mlp.gate_up_proj"),
    "up": ("mlp.up_proj", "mlp.gate_up_proj", "mlp.fc1"),
    "down": ("mlp.down_proj", "mlp.fc2"),
    "lm_head": ("lm_head",),
}
"""Short target names -> trainmem's tensor names (the first one the model has, per short name)."""

MODULE_NAMES = {
    "q_proj": ("q_proj",), "k_proj": ("k_proj",), "v_proj": ("v_proj",), "o_proj": ("o_proj",),
    "qkv_proj": ("qkv_proj",), "gate_proj": ("mlp.gate_proj",), "up_proj": ("mlp.up_proj",),
    "down_proj": ("mlp.down_proj",), "gate_up_proj": ("mlp.gate_up_proj",), "lm_head": ("lm_head",),
    "q_a_proj": ("q_a_proj",), "q_b_proj": ("q_b_proj",), "kv_a_proj_with_mqa": ("kv_a_proj_with_mqa",),
    "kv_b_proj": ("kv_b_proj",),
    # GPT-2 (Conv1D layers), GPT-NeoX, Falcon, BLOOM, OPT
    "c_attn": ("qkv_proj",), "c_proj": ("o_proj", "mlp.fc2"), "c_fc": ("mlp.fc1",),
    "query_key_value": ("qkv_proj",), "dense": ("o_proj",), "dense_h_to_4h": ("mlp.fc1",),
    "dense_4h_to_h": ("mlp.fc2",), "out_proj": ("o_proj",), "fc1": ("mlp.fc1",), "fc2": ("mlp.fc2",),
    "project_in": ("project_in",), "project_out": ("project_out",),
}
"""The module names peft users write (transformers' attribute names) -> trainmem's tensor names. A name that
means different modules in different families (``dense``) maps to the one the family has."""

ADAPTER_DTYPES = ("auto", "fp32", "bf16", "fp16")

TRAIN_MODULES = {"lm_head": "head", "embed_out": "head", "embed_tokens": "embedding", "wte": "embedding",
                 "embed_in": "embedding", "word_embeddings": "embedding"}
"""``--train-modules`` names (peft's ``modules_to_save``: the token embedding, the LM head, by transformers' name in
any family) -> trainmem's role."""


@dataclass(frozen=True)
class LoraOptions:
    rank: int
    alpha: float | None = None
    """Scales the adapter's output (alpha / rank); it changes no byte. None: 2 x rank, torchtune's habit."""
    targets: tuple[str, ...] = ("q", "v")
    adapter_dtype: str = "auto"
    """auto: fp32 over a half-precision base (peft's autocast_adapter_dtype), else the base's dtype."""
    dropout: float = 0.0
    """peft's ``lora_dropout`` on each adapter's input (its output and bool mask are then what the adapter keeps)."""
    dora: bool = False
    """DoRA (peft's ``use_dora``): a trainable magnitude per output feature of each adapted Linear, and the weight
    norm of base + adapter recomputed in every forward."""
    train_modules: tuple[str, ...] = ()
    """Modules trained in full beside the adapters (peft's ``modules_to_save``): ``lm_head``, ``embed_tokens``."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= 65536:
            raise ConfigError(f"lora rank must be a whole number from 1 to 65536, got {self.rank!r}")
        if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                                       or not 0 < self.alpha < 1e6):
            raise ConfigError(f"lora alpha must be a positive number, got {self.alpha!r}")
        if not self.targets:
            raise ConfigError("lora targets are empty; give short names (q,k,v,o,gate,up,down,lm_head), module "
                              "names (q_proj, c_attn, ...) or all-linear")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        if self.adapter_dtype not in ADAPTER_DTYPES:
            raise ConfigError(f"unknown adapter dtype {self.adapter_dtype!r}; accepted: {', '.join(ADAPTER_DTYPES)}")
        for name in self.train_modules:
            if name not in TRAIN_MODULES:
                raise ConfigError(f"--train-modules {name!r} is not supported; accepted: the token embedding and the "
                                  f"LM head ({', '.join(TRAIN_MODULES)})")
        if "head" in self.trained_roles and "lm_head" in self.targets:
            raise ConfigError("the LM head is either adapted (--lora-targets lm_head) or trained in full "
                              "(--train-modules lm_head), not both")

    @property
    def trained_roles(self) -> frozenset[str]:
        """The roles (head, embedding) of the modules trained in full."""
        return frozenset(TRAIN_MODULES[name] for name in self.train_modules)


QUANTIZED_ROLES = frozenset({"attention_input", "attention_output", "mlp", "mlp_down", "shared_expert",
                             "shared_expert_gate", "router", "projection"})
"""The Linear weights bitsandbytes quantizes (transformers' BitsAndBytesConfig: every nn.Linear but the output
layer); embeddings, norms, biases and the LM head stay in the compute dtype."""


def _linear_weight(t: ParamTensor, roles: frozenset[str] = QUANTIZED_ROLES | {"head"}) -> bool:
    """A Linear's weight (a 2-D weight with a Linear's role; by default the LM head too)."""
    return t.role in roles and len(t.shape) == 2 and t.name.endswith("weight")


def _linear_weights(spec: ModelSpec) -> list[tuple[int, ParamTensor]]:
    """(repeat, weight) for every Linear weight of the model."""
    return [(g.repeat, t) for g in spec.param_groups for t in g.tensors if _linear_weight(t)]


_MOE_TARGETS = frozenset({"all-linear", "q", "k", "v", "o", "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj",
                          "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})
"""What --lora-targets accepts on a mixture-of-experts model: all-linear and the attention projections."""
_PEFT_MOE_CONVERSION = {"mixtral": "mixtral", "qwen3_moe": "qwen2_moe", "deepseek_v3": "qwen2_moe",
                        "qwen3_next": "qwen2_moe"}
"""Model types whose v4 target names peft 0.21 converts for transformers v5's fused experts
(peft/utils/transformers_weight_conversion.py, ``_MODEL_TO_CONVERSION_PATTERN``, ``_MOE_TARGET_MODULE_MAPPING``):
under all-linear the router and the experts become target parameters, and every Linear named like a v4 expert
projection (Mixtral's w1/w2/w3; elsewhere gate_proj, up_proj, down_proj, so also the shared experts' and dense
layers' MLPs) leaves target_modules. Qwen2-MoE itself is not in the table: all-linear adapts its nn.Linears only."""
_CONVERTED_LEAVES = {"mixtral": ("w1", "w2", "w3"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}


def _moe_weights(spec: ModelSpec, weights: list[tuple[int, ParamTensor]]) -> list[tuple[int, ParamTensor]]:
    """What all-linear adapts on a MoE model (``_PEFT_MOE_CONVERSION``): the nn.Linears (not the router, a custom
    module on transformers v5), or for a converted type the Linears not named like an expert projection, the
    router's weight (experts x hidden) and the experts. Each 3-D expert parameter becomes one ``ParamWrapper`` with
    lora_A (in x rank x experts) and lora_B (rank x experts x out) (peft/tuners/lora/layer.py,
    ``ParamWrapper.update_layer``), counted as the expert's Linear repeated experts times; the fused gate_up_proj
    takes rank 2r (the conversion's rank_pattern). Checked against peft's trainable counts (tests/test_lora.py)."""
    pattern = _PEFT_MOE_CONVERSION.get(spec.model_type)
    if pattern is None:
        return [(r, t) for r, t in weights if t.role != "router"]
    converted = _CONVERTED_LEAVES[pattern]
    out = [(r, t) for r, t in weights
           if t.role != "router" and t.name.removesuffix(".weight").rsplit(".", 1)[-1] not in converted]
    for g in spec.param_groups:
        for t in g.tensors:
            if t.role == "router" and len(t.shape) == 2:
                out.append((g.repeat, t))
            elif t.role in ("expert", "expert_down") and len(t.shape) == 3:
                experts, rows, cols = t.shape
                fused = 2 if t.role == "expert" else 1  # (gate_up_proj: two v4 projections, rank r each)
                out.append((g.repeat * experts * fused, ParamTensor(t.name + ".weight", (rows, cols), t.role)))
    return out


def selected_weights(spec: ModelSpec, options: LoraOptions) -> list[tuple[int, ParamTensor]]:
    """The Linear weights peft would put an adapter on, with how many times each occurs."""
    if spec.is_nominal:
        raise ConfigError("LoRA needs the model's layers: give a model config, not --params")
    if not spec.has_architecture:
        return _counted_weights(spec, options)
    weights = _linear_weights(spec)
    if spec.is_moe:
        outside = [t for t in options.targets if t not in _MOE_TARGETS]
        if outside:
            raise ConfigError(f"lora target {outside[0]!r} on a mixture-of-experts model: accepted there are "
                              "all-linear and the attention projections (q, k, v, o and their module names)")
        if spec.model_type in _PEFT_MOE_CONVERSION and "all-linear" in options.targets and \
                (options.dora or options.dropout > 0):
            raise ConfigError(f"{spec.model_type}'s experts under all-linear take peft's ParamWrapper adapters, "
                              "which peft refuses with DoRA or lora dropout: give the attention projections")
        weights = _moe_weights(spec, weights) if "all-linear" in options.targets else \
            [(r, t) for r, t in weights if t.role != "router"]
    present = {t.name.removesuffix(".weight") for _, t in weights}
    chosen: set[str] = set()
    for target in options.targets:
        if target == "all-linear":
            chosen |= {name for name in present if name != "lm_head"}
        elif target in SHORT_NAMES:
            match = next((n for n in SHORT_NAMES[target] if n in present), None)
            if match is None:
                raise ConfigError(f"lora target {target!r}: {spec.name} has no such projection")
            chosen.add(match)
            if match.startswith(("q_a_proj", "kv_a_proj")):  # MLA: the low-rank pair together
                chosen.add(match.replace("_a_proj_with_mqa", "_b_proj").replace("_a_proj", "_b_proj"))
        elif target in MODULE_NAMES:
            found = [n for n in MODULE_NAMES[target] if n in present]
            if not found:
                raise ConfigError(f"lora target {target!r}: {spec.name} ({spec.model_type}) has no module of that "
                                  "name")
            chosen |= set(found)
        else:
            raise ConfigError(f"unknown lora target {target!r}; accepted: {', '.join(SHORT_NAMES)}, all-linear, or "
                              f"module names ({', '.join(sorted(MODULE_NAMES))})")
    return [(r, t) for r, t in weights if t.name.removesuffix(".weight") in chosen]


def _counted_weights(spec: ModelSpec, options: LoraOptions) -> list[tuple[int, ParamTensor]]:
    """selected_weights on the traced path (a spec counted by transformers, meta_count.py): the 2-D weights of its
    decoder layers (a layer's Linears: its norms' weights and biases are 1-D) whose module's own name peft's
    target names (a short name's modules, e.g. q -> q_proj or qkv_proj, or any module name as the model's code
    writes it), and for all-linear every one of them; the LM head only by name (peft's all-linear leaves the output layer out,
    peft/tuners/tuners_utils.py ``_maybe_include_all_linear_layers``). Names peft would match but trainmem cannot
    tell from the tensors (3-D experts, a Conv1D outside the layers) are refused in one line by the caller's
    trace, which compares its adapters with this count (tracedstep.py)."""
    from .models import SUPPORTED_MODEL_TYPES

    if not spec.built_config:
        raise ConfigError(f"LoRA on model_type {spec.model_type!r} needs its layers: give a config (supported "
                          f"descriptions: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if options.train_modules:
        raise ConfigError("--train-modules is not available on the traced path (a model_type without a hand-written "
                          "description) yet: give the adapters alone")
    weights = [(g.repeat, t) for g in spec.param_groups if g.is_layer for t in g.tensors
               if len(t.shape) == 2 and t.name.endswith(".weight")]
    head = [(g.repeat, t) for g in spec.param_groups if not g.is_layer for t in g.tensors
            if t.name.removesuffix(".weight").rsplit(".", 1)[-1] == "lm_head" and len(t.shape) == 2]
    leaves: set[str] = set()
    for target in options.targets:
        if target == "all-linear":
            leaves |= {t.name.removesuffix(".weight").rsplit(".", 1)[-1] for _, t in weights}
        else:  # a short name's modules, or any module name as the model's code writes it (query, Wqkv, ...)
            leaves |= {name.rsplit(".", 1)[-1] for name in SHORT_NAMES.get(target, (target,))}
    chosen = [(r, t) for r, t in weights + head if t.name.removesuffix(".weight").rsplit(".", 1)[-1] in leaves]
    if not chosen:
        present = sorted({t.name.removesuffix(".weight").rsplit(".", 1)[-1] for _, t in weights})
        raise ConfigError(f"lora targets {','.join(options.targets)}: {spec.name} ({spec.model_type}) has no Linear "
                          f"of those names in its layers (it has {', '.join(present)}; or all-linear)")
    return chosen


def adapter_parameters(spec: ModelSpec, options: LoraOptions) -> int:
    """Parameters the adapters add: r x (in_features + out_features) per adapted Linear, and with DoRA its
    out_features magnitudes (peft's ``lora_magnitude_vector``)."""
    return sum(repeat * (options.rank * (t.shape[0] + t.shape[1]) + options.dora * t.shape[0])
               for repeat, t in selected_weights(spec, options))


def copy_groups(spec: ModelSpec, options: LoraOptions) -> tuple[ParamGroup, ...]:
    """The modules trained in full, as parameter groups: peft's ``ModulesToSaveWrapper`` keeps the frozen original
    and trains a copy (``copy.deepcopy``, in the base's dtype), so a tied LM head's copy is a head of its own,
    vocabulary x hidden."""
    from .models import ParamGroup

    if not options.train_modules:
        return ()
    token_embedding = next((t for g in spec.param_groups for t in g.tensors if t.role == "embedding"), None)
    if token_embedding is None:
        raise ConfigError(f"--train-modules: {spec.name} has no token embedding")
    head = tuple(t for g in spec.param_groups for t in g.tensors if t.role == "head")
    if not any(len(t.shape) == 2 for t in head):  # tied: the head's weight is the embedding (Phi keeps its bias)
        head = (token_embedding, *head)
    return tuple(ParamGroup(f"{role} (trained copy)", 1, (token_embedding,) if role == "embedding" else head)
                 for role in sorted(options.trained_roles))


def trained_copies(spec: ModelSpec, options: LoraOptions) -> dict[str, int]:
    """Parameters of each module trained in full (copy_groups), by role (head, embedding)."""
    return {g.name.split()[0]: sum(t.numel for t in g.tensors) for g in copy_groups(spec, options)}


@dataclass(frozen=True)
class Trainables:
    """What trains on a frozen base, and the optimizer's memory for it."""

    adapters: int
    adapter_bytes: int
    copies: int
    """Parameters of the modules trained in full (copy_groups), in the base's dtype, copy_bytes each."""
    copy_bytes: int
    masters: int
    """fp32 master copies (bytes)."""
    states: int
    """Optimizer states (bytes)."""
    state_bytes: int
    """Bytes per state value of the adapters."""
    stepped_values: int
    """Sum over what trains of numel x bytes per state value: foreach temporaries scale with it."""

    @property
    def trainable_bytes(self) -> int:
        return self.adapters * self.adapter_bytes + self.copies * self.copy_bytes


def trainables(spec: ModelSpec, recipe: Recipe, optimizer: Optimizer, finetune: "FineTune") -> Trainables:
    """The adapters and the trained copies with their gradients' dtype, and the optimizer's states and masters as
    the trace's step makes them (step.py): fp32 masters of everything that trains when any of it is half precision
    and the recipe keeps masters; states in the dtype of what they step (fp32 for fp32 tensors and masters)."""
    options = finetune.lora
    adapters, ab = adapter_parameters(spec, options), adapter_bytes_per_value(options, recipe.weight_bytes)
    groups = copy_groups(spec, options)
    copies, cb = sum(t.numel for g in groups for t in g.tensors), recipe.weight_bytes
    masters = 4 * (adapters + copies) if recipe.master_weights and (ab < 4 or (copies and cb < 4)) else 0

    def state_bytes(value_bytes: int) -> int:
        return 4 if value_bytes == 4 or masters else recipe.state_bytes_for(optimizer.name)

    states = optimizer.state_bytes(adapter_groups(spec, options), state_bytes(ab)) + \
        (optimizer.state_bytes(groups, state_bytes(cb)) if groups else 0)
    return Trainables(adapters, ab, copies, cb, masters, states, state_bytes(ab),
                      adapters * state_bytes(ab) + copies * state_bytes(cb))


def adapter_bytes_per_value(options: LoraOptions, base_weight_bytes: int) -> int:
    if options.adapter_dtype == "auto":
        return 4 if base_weight_bytes < 4 else base_weight_bytes
    return {"fp32": 4, "bf16": 2, "fp16": 2}[options.adapter_dtype]


BNB_KEEPS_NO_INPUT_FROM = (0, 43, 2)
"""The first bitsandbytes release whose MatMul4Bit keeps no input (FineTune.keeps_4bit_inputs)."""


@dataclass(frozen=True)
class FineTune:
    """LoRA on a frozen base, the base optionally quantized (QLoRA: nf4 with double quantization)."""

    lora: LoraOptions
    base_quant: str | None = None
    double_quant: bool = False
    bnb_version: tuple[int, ...] | None = None
    """The bitsandbytes release the run uses (None: the installed one's rules, 0.50.2); it decides what a 4-bit
    Linear keeps for backward (keeps_4bit_inputs)."""

    def __post_init__(self) -> None:
        from .quantization import QUANT_TYPES

        if self.base_quant is not None and self.base_quant not in QUANT_TYPES:
            raise ConfigError(f"unknown base quantization {self.base_quant!r}; accepted: {', '.join(QUANT_TYPES)}")
        if self.double_quant and self.base_quant not in ("nf4", "fp4"):
            raise ConfigError("--double-quant applies to a 4-bit base: give --base-quant nf4 or fp4")
        if self.bnb_version is not None and self.base_quant not in ("nf4", "fp4"):
            raise ConfigError("--bnb-version applies to a 4-bit base: give --qlora or --base-quant nf4 or fp4")

    @property
    def keeps_4bit_inputs(self) -> bool:
        """Whether each 4-bit Linear keeps its input for backward: bitsandbytes' ``MatMul4Bit.forward`` set
        ``ctx.tensors = (A, B)`` whenever an input needs a gradient until commit 9e753741 ("fix QLoRA mem bug: delete
        useless buffered activation", #1270), first released in 0.43.2 (July 2024), which sets ``(None, B)``: its
        backward needs only B for ``grad_A`` (bitsandbytes/autograd/_functions.py)."""
        return self.base_quant in ("nf4", "fp4") and self.bnb_version is not None and \
            self.bnb_version < BNB_KEEPS_NO_INPUT_FROM

    def buffers(self, spec: ModelSpec, p: Precision) -> tuple[Buffer, ...]:
        """What happens at the moments inside a layer beyond its activations.

        A quantized base: bitsandbytes' MatMul4Bit dequantizes the weight to the compute dtype for each matmul,
        forward and backward (bitsandbytes/autograd/_functions.py), one Linear at a time: the largest of a layer's.

        (DoRA's weight norm, recomputed by every forward, is modelled at each adapted Linear where it runs:
        timeline._dora_site.)"""
        from .sharding import Buffer

        out = []
        if self.base_quant in ("nf4", "fp4"):
            largest = max((t.numel for g in spec.param_groups if g.is_layer for t in g.tensors
                           if _linear_weight(t, QUANTIZED_ROLES)), default=0)
            out.append(Buffer("a dequantized base weight", p.compute * largest, "temporaries",
                              ("forward:layer", "backward:layer"), "the largest Linear of a layer, while it computes"))
        return tuple(out)

    def as_dict(self, spec: ModelSpec) -> dict[str, Any]:
        adapters = adapter_parameters(spec, self.lora)
        return {"rank": self.lora.rank, "alpha": self.lora.alpha if self.lora.alpha is not None else 2 * self.lora.rank,
                "targets": list(self.lora.targets), "adapter_dtype": self.lora.adapter_dtype,
                "dropout": self.lora.dropout, "dora": self.lora.dora,
                "train_modules": list(self.lora.train_modules),
                "trained_module_parameters": sum(trained_copies(spec, self.lora).values()),
                "base_quant": self.base_quant, "double_quant": self.double_quant,
                "adapter_parameters": adapters, "frozen_parameters": spec.num_parameters}


def base_weight_bytes(spec: ModelSpec, weight_bytes: int, finetune: FineTune) -> int:
    """The frozen base as stored: quantized Linear weights (bitsandbytes' bytes, quantization.py) or the recipe's
    dtype."""
    from .quantization import stored_bytes

    if finetune.base_quant and spec.is_moe:
        raise ConfigError("a quantized mixture-of-experts base is not modelled: bitsandbytes quantizes nn.Linear, and "
                          "transformers v5's experts are 3-D parameters and its router a module of its own")
    total = 0
    for group in spec.param_groups:
        for t in group.tensors:
            if finetune.base_quant and _linear_weight(t, QUANTIZED_ROLES):
                total += group.repeat * stored_bytes(t.shape, finetune.base_quant, finetune.double_quant)
            else:
                total += group.repeat * t.numel * weight_bytes
    return total


def adapter_groups(spec: ModelSpec, options: LoraOptions) -> tuple[ParamGroup, ...]:
    """The adapters as parameter groups (lora_A and lora_B of each adapted Linear), for the optimizer's states."""
    from .models import ParamGroup

    return tuple(ParamGroup(t.name.removesuffix(".weight") + " adapter", repeat,
                            (ParamTensor("lora_A", (options.rank, t.shape[1]), "adapter"),
                             ParamTensor("lora_B", (t.shape[0], options.rank), "adapter"))
                            + ((ParamTensor("magnitude", (t.shape[0],), "adapter"),) if options.dora else ()))
                 for repeat, t in selected_weights(spec, options))


SITE_CONSUMERS = {
    "qkv_input": ("q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "kv_a_proj_with_mqa"),
    "q_b_input": ("q_b_proj",), "kv_b_input": ("kv_b_proj",), "o_input": ("o_proj",),
    "mlp_input": ("mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj", "mlp.fc1", "mlp.gate",
                  "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert_gate"),
    "down_input": ("mlp.down_proj", "mlp.fc2"), "shared_down_input": ("mlp.shared_expert.down_proj",),
    "router_input": ("mlp.gate",), "expert_input": ("mlp.experts.gate_up_proj",), "expert_down_input": ("mlp.experts.down_proj",),
    "head_input": ("lm_head",)}
"""The Linears (trainmem's names) reading each input the activation terms tag (Term.module for the "linear_input"
and "shared_input" kinds, else Term.input_of), in every family: MLA's q_a_proj and kv_a_proj_with_mqa read the
layer's norm output, the MoE router (``mlp.gate``) and shared experts the MLP's."""
_ATTENTION_SITES = ("input_norm", "qkv_input", "o_input", "q_b_input", "kv_b_input")
_EXPERT_SITES = ("expert_input", "expert_down_input")
"""The routed experts' inputs. In bf16 a frozen expert weight keeps none (grouped_mm saves an operand for the other's
gradient only); experts in fp32 (under autocast, or the fp32 recipe: transformers' grouped_mm_experts_forward casts
to the weights' dtype) keep them as a full fine-tune does, and compute the weight gradient anyway (traced: Mixtral
amp-bf16, the gathered tokens and the product kept in fp32; integrations/moe.py's fallback saves both operands)."""
_PARALLEL_MLP_SITES = ("mlp_norm", "mlp_input")
"""In a parallel-residual layer (GPT-NeoX, Falcon) the MLP reads the layer input too: in a first layer whose input
takes no gradient, what its norm and first Linears would keep for their input's gradient is not kept."""


def activations_modelled(spec: ModelSpec, recipe: Recipe, settings: TrainingSettings,
                         finetune: FineTune | None = None) -> str | None:
    """Why the activations of this LoRA step are not modelled, or None when they are. Every family's layers, SDPA
    or eager attention, with or without the model's dropout and autocast, are (lora_activations applies the frozen
    base's rules to whatever terms the family's layer has; checked against the trace, tests/test_lora.py and
    tests/test_lora_families.py), an adapter on the LM head too: it keeps the head's input and its A output by
    the same rules (the head_input site), and the frozen head's logits and loss are a frozen head's
    (tests/test_published_effects.py). What is left is named here."""
    if settings.loss == "chunked":
        return "--loss chunked (Liger's fused loss is not modelled with LoRA)"
    if finetune is not None:
        if finetune.base_quant == "int8":
            return "an 8-bit base (LLM.int8()'s matmul buffers are not modelled yet)"
        if finetune.lora.dora and recipe.autocast:
            return "DoRA under autocast (its weight norm's dtypes under autocast are not modelled)"
        if finetune.lora.dora and finetune.lora.dropout > 0:
            return "DoRA with dropout (peft then reruns the base Linear on the dropped-out input with an fp32 copy " \
                   "of its weight, which is not modelled)"
        if finetune.keeps_4bit_inputs and recipe.autocast:
            return "bitsandbytes before 0.43.2 under autocast (the input copies its 4-bit Linears keep in the " \
                   "compute dtype are not modelled)"
        chosen = adapted_names(spec, finetune.lora)
        if not chosen & {"q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                         "kv_b_proj"}:
            return "targets without q, k or v (the first layer's attention then keeps nothing)"
    return None


_HEAD_NORM_OF = {"q_norm": "q_proj", "k_norm": "k_proj"}
"""Qwen3's and Gemma 3's per-head norms, and the projection whose output they read."""


def parameter_wrapped(spec: ModelSpec, options: LoraOptions) -> frozenset[str]:
    """The adapted weights peft adapts as parameters (``ParamWrapper``: the router and the 3-D experts of the types
    in ``_PEFT_MOE_CONVERSION`` under all-linear): ``torch.nn.utils.parametrize`` gives the module ``W + delta``
    (``_LoraParameterProxy``; the experts ``baddbmm(W, B, A)``, ``_LoraFactorsProxy``), a new tensor that takes a
    gradient, so the matmul keeps its input as a full fine-tune does and that merged weight for its input's
    gradient (peft/tuners/lora/layer.py, ``ParamWrapper._activate_lora``)."""
    return frozenset(n for n in adapted_names(spec, options) if n in ("mlp.gate", "mlp.experts.gate_up_proj",
                                                                      "mlp.experts.down_proj"))


def _site_consumers(site: str, layer: Layer) -> tuple[str, ...]:
    """SITE_CONSUMERS, and where Falcon-7B's MLP reads the attention's norm output (one norm, parallel residual)
    its first Linear at the q/k/v input too."""
    if site == "qkv_input" and layer.parallel_residual and layer.num_norms == 1:
        return SITE_CONSUMERS["qkv_input"] + SITE_CONSUMERS["mlp_input"]
    return SITE_CONSUMERS.get(site, ())


def _term_site(t: Term) -> str:
    """The Linears' site a term is an input of ("" where it is none)."""
    return t.input_of or (t.module if t.kind in ("linear_input", "shared_input") else "")


def _mlp_branch_start(la: LayerActivations) -> int:
    """The index of a layer's first MLP term (its terms up to attention_bytes_per_token are the attention's)."""
    total = 0.0
    for index, t in enumerate(la.terms):
        if total >= la.attention_bytes_per_token:
            return index
        total += t.bytes_per_token
    return len(la.terms)


def lora_activations(acts: ActivationEstimate, spec: ModelSpec, p: Precision,
                     finetune: FineTune) -> ActivationEstimate:
    """What a LoRA step keeps instead of a full fine-tune's (activations.py's terms, by their tags), the same rules
    for every family: a frozen Linear keeps no input (its weight takes no gradient; the gradient of its input needs
    only the weight), whatever layer it sits in (a fused query_key_value, GPT-2's Conv1D, an MoE's router and
    grouped experts); each adapter keeps its input, cast to the adapter's dtype when that differs (one copy per
    adapter, peft's ``_cast_input_dtype``), and its A output (rank wide); a frozen norm weight keeps no normalised
    value; the frozen embedding keeps nothing, and the first layer's input norm, whose input takes no gradient,
    nothing either (nor, in a parallel-residual layer, its MLP norm, and with a frozen MLP its whole MLP branch),
    except under checkpointing, where transformers makes the embedding's output take one. A weight adapted as a
    parameter (parameter_wrapped) takes a gradient: its input is kept as a full fine-tune keeps it, and its merged
    weight (constant bytes per layer)."""
    from dataclasses import replace

    options = finetune.lora
    chosen = adapted_names(spec, options)
    wrapped = parameter_wrapped(spec, options)
    # A trained embedding keeps its indices and makes every layer's input take a gradient (no first layer apart);
    # a trained LM head keeps its input, the final norm's output.
    embedding_trained = "embedding" in options.trained_roles
    # transformers' activation_checkpointing_enable makes the embedding's output take a gradient
    # (enable_input_require_grads, modeling_utils.py: "When using PEFT + gradient checkpointing"), so under
    # checkpointing the first layer keeps what the others keep (traced)
    inputs_take_gradient = embedding_trained or acts.checkpointing != "none"
    rules = _Rules(spec, p, finetune, chosen, wrapped, acts.compiled)

    layers = []
    for index, la in enumerate(acts.layers):
        for first, count in (((True, 1), (False, la.count - 1)) if index == 0 and not inputs_take_gradient
                             else ((False, la.count),)):
            if count == 0:
                continue
            terms, delta = rules.layer_terms(la, first)
            constant = la.constant_bytes + adapter_half_copies(spec, la.layer, options, p) + \
                _merged_weight_bytes(spec, la.layer, wrapped, p, options)
            if first and p.autocast:
                # a frozen weight's half copy (autocast caches none: the weight takes no gradient) is kept by its
                # matmul only for its input's gradient: the first layer's q, k, v inputs take none, nor in a
                # parallel-residual layer the MLP's input, nor, with the MLP frozen, anything in its branch
                constant -= p.compute * sum(t.numel for t in layer_tensors(la.layer, spec.hidden_size,
                                                                            spec.norm_vectors)
                                            if t.role in rules.first_inputs(la.layer) and _linear_weight(t))
            checkpoint_terms = la.checkpoint_terms + (rules.held_4bit_inputs(la, first) if la.checkpointed else ())
            layers.append(replace(la, count=count, terms=terms, constant_bytes=constant,
                                  attention_bytes_per_token=la.attention_bytes_per_token + delta,
                                  checkpoint_terms=checkpoint_terms))
    head, _ = rules.adapted_terms(acts.head_terms, None)
    embedding, _ = rules.adapted_terms(acts.embedding_terms, None)
    if inputs_take_gradient and not embedding_trained and spec.traits.decoder_locals in ("token_and_shared_position",
                                                                                         "opt"):
        from .activations import Term

        # The token embeddings made to take a gradient are a leaf, which autograd's AccumulateGrad node holds through
        # the step; where positions are added to them (GPT-2, GPT-BigCode, OPT) that is a tensor apart from the first layer's
        # input (traced: OPT fp32, full checkpointing, -2.1% at the loss without it)
        embedding += (Term("token embeddings (a leaf taking a gradient under checkpointing: held by autograd)",
                           p.residual * spec.hidden_size, "embedding", "leaf"),)
    return replace(acts, layers=tuple(layers), head_terms=head, embedding_terms=embedding)


def _merged_weight_bytes(spec: ModelSpec, layer: Layer, wrapped: frozenset[str], p: Precision,
                         options: LoraOptions) -> int:
    """Per layer, the merged weights parameter_wrapped's matmuls keep for their input's gradient, in the weights'
    dtype (the parametrization's output: ``baddbmm(W, ...)``, ``W + delta``), and the experts' adapter factors cast
    to that dtype where they are in another (``get_delta_factors``: ``lhs.to(param.dtype)``), which baddbmm keeps
    for each other's gradient: experts x rank x (in + out), the fused gate_up at rank 2r (traced: Mixtral
    all-linear, fp32 adapters on bf16, 335,872 bytes a layer)."""
    if not wrapped:
        return 0
    rank, total = options.rank, 0
    for t in layer_tensors(layer, spec.hidden_size, spec.norm_vectors):
        if t.name.removesuffix(".weight") not in wrapped:
            continue
        total += p.residual * t.numel
        if len(t.shape) == 3 and adapter_bytes_per_value(options, p.residual) != p.residual:
            experts, rows, cols = t.shape
            total += p.residual * experts * rank * (2 if t.role == "expert" else 1) * (rows + cols)
    return total


class _Rules:
    """The frozen base's saving rules (lora_activations) for one model and adapter set-up."""

    def __init__(self, spec: ModelSpec, p: Precision, finetune: FineTune, chosen: frozenset[str],
                 wrapped: frozenset[str], compiled: bool) -> None:
        options = finetune.lora
        self.spec, self.p, self.options, self.chosen, self.wrapped, self.compiled = \
            spec, p, options, chosen, wrapped, compiled
        self.ab = adapter_bytes_per_value(options, p.compute)
        weights = selected_weights(spec, options)
        self.out_features = {t.name.removesuffix(".weight"): t.shape[0] for _, t in weights}
        self.in_features = {t.name.removesuffix(".weight"): t.shape[1] for _, t in weights}
        self.head_trained = "head" in options.trained_roles
        self.embedding_trained = "embedding" in options.trained_roles
        self.keeps_4bit_inputs = finetune.keeps_4bit_inputs

    def mlp_frozen(self, layer: Layer) -> bool:
        return not any(c in self.chosen for c in SITE_CONSUMERS["mlp_input"] + SITE_CONSUMERS["down_input"])

    def first_inputs(self, layer: Layer) -> tuple[str, ...]:
        """The roles of the Linears whose input takes no gradient in the first layer."""
        if not layer.parallel_residual:
            return ("attention_input",)
        return ("attention_input", "mlp") + (("mlp_down",) if self.mlp_frozen(layer) else ())

    def held_4bit_inputs(self, la: LayerActivations, first: bool) -> tuple[Term, ...]:
        """Under non-reentrant checkpointing, what bitsandbytes before 0.43.2 keeps of a checkpointed layer through
        the forward: its MatMul4Bit nodes hold ``ctx.tensors = (A, B)`` as a plain attribute, which the checkpoint's
        saved-tensor hooks never see, so every 4-bit Linear's input that needs a gradient stays with the graph
        until that layer's backward (the "bug in bitsandbytes which results in high memory usage" fsdp_qlora's
        README avoids with reentrant checkpointing). One tensor per site; none without keeps_4bit_inputs."""
        from dataclasses import replace

        if not self.keeps_4bit_inputs:
            return ()
        no_gradient = ("input_norm", "qkv_input") + (_PARALLEL_MLP_SITES if la.layer.parallel_residual else ()) \
            if first else ()
        sites = {_term_site(t): t for t in la.terms if _term_site(t) and _term_site(t) not in _EXPERT_SITES}
        return tuple(replace(t, name=f"{t.name} (held by a 4-bit Linear's autograd node)", kind="", input_of="")
                     for site, t in sites.items() if site not in no_gradient)

    def layer_terms(self, la: LayerActivations, first: bool) -> tuple[tuple[Term, ...], float]:
        """A layer's terms under LoRA (``first``: the first layer, whose input takes no gradient)."""
        layer = la.layer
        no_gradient = ("input_norm", "qkv_input") + (_PARALLEL_MLP_SITES if layer.parallel_residual else ())
        terms = la.terms
        if first and layer.parallel_residual:
            if self.mlp_frozen(layer):
                # the MLP branch of the first layer reads the embedding through frozen Linears only: nothing in it
                # takes a gradient, so it keeps nothing (traced: GPT-NeoX q,v)
                terms = terms[:_mlp_branch_start(la)]
        return self.adapted_terms(terms, layer, no_gradient if first else ())

    def adapted_terms(self, terms: tuple[Term, ...], layer: Layer | None,
                      no_gradient: tuple[str, ...] = ()) -> tuple[tuple[Term, ...], float]:
        from dataclasses import replace

        chosen = self.chosen
        out, attention_delta = [], 0.0
        # where two terms tag one site, the Linear reads the later one (flash's output is kept by the kernel, its
        # contiguous copy is o_proj's input): the adapters' terms go with that one
        read = {_term_site(t): index for index, t in enumerate(terms)}
        for index, t in enumerate(terms):
            new: list[Term] = []
            site = _term_site(t)
            if t.normalised_bytes:  # (MLA's latent norms: one term with their fp32 input and rsqrt)
                t = replace(t, bytes_per_token=t.bytes_per_token - t.normalised_bytes, normalised_bytes=0.0)
            if t.kind == "normalised" or (t.kind == "input_ids" and not self.embedding_trained) or \
                    t.module in no_gradient and not site or \
                    ("input_norm" in no_gradient and t.module in _HEAD_NORM_OF and _HEAD_NORM_OF[t.module] not in chosen):
                pass  # dropped (q_norm / k_norm of a frozen projection whose input takes no gradient: nothing)
            elif site:
                consumers = _site_consumers(site, layer) if layer is not None else SITE_CONSUMERS.get(site, ())
                adapted = [c for c in consumers if c in chosen and c not in self.wrapped]
                width = self.in_features[adapted[0]] if adapted else 0
                if t.kind == "shared_input" or (site == "head_input" and self.head_trained) or \
                        any(c in self.wrapped for c in consumers) or (site in _EXPERT_SITES and self.p.experts == 4):
                    # kept by another op whatever the Linear does, by the trained LM head, or by a Linear whose
                    # weight takes a gradient (parameter_wrapped)
                    new.append(t)
                elif self.keeps_4bit_inputs and layer is not None and site not in no_gradient and \
                        site not in _EXPERT_SITES:
                    # a 4-bit Linear of bitsandbytes before 0.43.2 keeps its input whenever it needs a gradient
                    # (MatMul4Bit: ctx.tensors = (A, B); FineTune.keeps_4bit_inputs); the LM head is not quantized
                    new.append(t)
                elif t.input_share < 1:  # the rest of the term is kept by another op
                    new.append(replace(t, bytes_per_token=t.bytes_per_token * (1 - t.input_share)))
                if adapted and read[site] == index:
                    new += self._adapter_terms(t, site, adapted, width, site in no_gradient, new)
            else:
                new.append(t)
            if t.module in _ATTENTION_SITES or site in _ATTENTION_SITES or \
                    ("input_norm" in no_gradient and t.module == "input_norm"):
                attention_delta += sum(n.bytes_per_token for n in new) - t.bytes_per_token
            out += new
        return tuple(out), attention_delta

    def _adapter_terms(self, t: Term, site: str, adapted: list[str], width: int, no_gradient: bool,
                       kept: list[Term]) -> list[Term]:
        """What the adapters on a site's Linears keep: their inputs (copies, dropped-out inputs, masks) and their A
        outputs, and with DoRA both outputs."""
        from .activations import MASK, Term

        p, options, ab = self.p, self.options, self.ab
        new: list[Term] = []
        if p.autocast:
            # under autocast lora_A casts its input to half itself, one copy per adapter (peft's _cast_input_dtype
            # finds it already in the adapter's fp32), and keeps it; with lora dropout the dropout keeps its bool
            # mask too where its input takes a gradient (traced)
            mask = (0 if no_gradient else MASK) if options.dropout > 0 else 0
            new.append(Term(f"{t.name}: adapters' half input copies (autocast)"
                            f"{' and dropout masks' if mask else ''} x{len(adapted)}",
                            len(adapted) * (p.compute + mask) * width, t.module, "adapter_input"))
        elif options.dropout > 0:
            # each adapter keeps its dropped-out input, and the dropout its bool mask where its input takes a
            # gradient (not the first layer's q/k/v input: nothing before it trains)
            mask = 0 if no_gradient else MASK
            new.append(Term(f"{t.name}: adapters' dropped-out inputs and masks x{len(adapted)}",
                            len(adapted) * (ab + mask) * width, t.module, "adapter_input"))
        elif ab != p.compute:
            # a compiled layer casts the shared input once (the graph's common subexpression; traced)
            copies = 1 if self.compiled else len(adapted)
            new.append(Term(f"{t.name}: adapters' {ab * 8}-bit input copies x{copies}",
                            copies * ab * width, t.module, "adapter_input"))
        elif not kept:
            new.append(t)  # the adapters read the tensor itself
        new.append(Term(f"LoRA A outputs x{len(adapted)}",
                        len(adapted) * (p.compute if p.autocast else ab) * options.rank, t.module,
                        "adapter_output"))
        if options.dora:
            # (magnitude / norm - 1) x base output and (magnitude / norm) x B output keep both outputs
            width_out = sum(self.out_features[c] for c in adapted)
            new.append(Term(f"DoRA's base and adapter outputs x{len(adapted)}",
                            (p.compute + ab) * width_out, t.module, "adapter_output"))
        return new


def adapter_half_copies(spec: ModelSpec, layer: Layer, options: LoraOptions, p: Precision) -> int:
    """Bytes of autocast's half copies of one layer's fp32 adapter weights (lora_A and lora_B of each adapted
    Linear, rank x (in + out) values): autocast casts every fp32 weight that takes a gradient once and caches the
    copy until its region ends, and the matmuls keep them for their inputs' gradients (traced: 245,760 bytes of
    the forward peak of a 3-layer Llama with hidden 128 and all-linear rank 16). 0 without autocast or with half
    adapters."""
    if not p.autocast or adapter_bytes_per_value(options, p.compute) == p.compute:
        return 0
    chosen = adapted_names(spec, options)
    return sum(p.compute * options.rank * (t.shape[0] + t.shape[1])
               for t in layer_tensors(layer, spec.hidden_size, spec.norm_vectors)
               if len(t.shape) == 2 and t.name.removesuffix(".weight") in chosen)


def adapted_names(spec: ModelSpec, options: LoraOptions) -> frozenset[str]:
    """trainmem's names of the Linears that carry an adapter (``q_proj``, ``mlp.down_proj``, ...)."""
    return frozenset(t.name.removesuffix(".weight") for _, t in selected_weights(spec, options))
