"""Activation memory: the tensors a training forward pass saves for backward, term by term.

Every term below is one tensor that a transformers module's forward creates and an autograd node keeps,
with its size in bytes per token (per element of batch x sequence). The terms follow the module code of
``transformers/models/<family>/modeling_<family>.py`` (5.x) and the autograd formulas of
``torch/csrc/autograd/FunctionsManual.cpp`` / ``tools/autograd/derivatives.yaml`` (which inputs or outputs each
op saves); ``tests/test_activations.py`` checks the per-layer totals against what PyTorch actually saves
(``torch.autograd.graph.saved_tensors_hooks``) for scaled-down configs of each family. docs/method.md writes the
per-layer sums in closed form and compares them with Korthikanti et al. (2022).

Conventions: ``h`` hidden size, ``a`` query heads, ``kv`` key/value heads, ``d`` head dim, ``I`` MLP width,
``s`` sequence length, ``V`` vocabulary. ``c`` is the byte size of the compute dtype (matmul outputs), ``r`` of
the residual stream (fp32 under autocast, else the weights' dtype). A tensor that several ops save counts once.
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import MLP, Attention, Layer, ModelSpec, MoE
from .recipes import DTYPE_BYTES, Recipe
from .settings import TrainingSettings

FP32 = 4
INDEX = 8  # int64 indices (embedding input, routing indices, labels)
MASK = 1  # torch.bool dropout masks


@dataclass(frozen=True)
class Term:
    """One saved tensor (or a group of identical ones), in bytes per token."""

    name: str
    bytes_per_token: float


@dataclass(frozen=True)
class Precision:
    """The byte sizes an activation formula needs, derived from the recipe."""

    compute: int
    """Matmul outputs (bf16/fp16 under autocast or half weights, else fp32)."""
    residual: int
    """The residual stream and norm outputs: fp32 under autocast (weights are fp32), else the weights' dtype."""
    autocast: bool

    @property
    def experts(self) -> int:
        """Routed experts (transformers' grouped_mm): not an autocast op, so they run in the weights' dtype."""
        return self.residual if self.autocast else self.compute

    @classmethod
    def of(cls, recipe: Recipe) -> "Precision":
        compute = DTYPE_BYTES[recipe.compute]
        residual = DTYPE_BYTES[recipe.weights]
        return cls(compute=compute, residual=residual, autocast=recipe.autocast)


@dataclass(frozen=True)
class LayerActivations:
    """Saved tensors of one decoder layer (all ``count`` identical layers of a run save the same)."""

    layer: Layer
    count: int
    terms: tuple[Term, ...]
    constant_bytes: int
    """Batch-independent bytes per layer: the half copies of its Linear weights that autocast makes and
    backward keeps, and Gemma's fp32 ``1 + weight`` of each RMSNorm."""
    checkpoint_terms: tuple[Term, ...]
    """What a checkpointed layer keeps instead of ``terms`` (its input)."""

    @property
    def bytes_per_token(self) -> float:
        return sum(t.bytes_per_token for t in self.terms)


# --------------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------------


def _norm_terms(spec: ModelSpec, width: int, p: Precision, label: str, input_bytes: int) -> list[Term]:
    """What a norm saves of its own (its output is saved by whoever consumes it).

    RMSNorm (LlamaRMSNorm): ``x.to(float32)`` kept by ``pow`` (4 B even when x is already fp32, then it is x
    itself), ``rsqrt`` (4 B per row), and the normalised value cast back to the input dtype, kept by the
    multiplication with the weight. Gemma's variant keeps the fp32 normalised value instead.
    LayerNorm (``native_layer_norm``): its input, mean and rstd (fp32 per row on CUDA).
    """
    if spec.norm == "layer":
        return [Term(f"{label}: input", input_bytes * width), Term(f"{label}: mean, rstd", 2 * FP32)]
    normed = FP32 if spec.model_type.startswith("gemma") else input_bytes
    return [
        Term(f"{label}: input in fp32", FP32 * width),
        Term(f"{label}: rsqrt", FP32),
        Term(f"{label}: normalised", normed * width),
    ]


def _linear_inputs(p: Precision, width: int, consumers: int, label: str, input_bytes: int) -> list[Term]:
    """The input a Linear keeps for its weight gradient.

    Without autocast the consumers share the tensor they read. Under autocast each Linear casts an fp32 input
    to half precision itself (activations are not in autocast's cast cache), so each keeps its own copy.
    """
    if p.autocast and input_bytes == FP32:
        return [Term(f"{label}: half copy per Linear x{consumers}", consumers * p.compute * width)]
    return [Term(f"{label}", input_bytes * width)]


def _attention_terms(att: Attention, h: int, s: int, p: Precision, kernel: str, dropout: float,
                     rotary: bool, fused_qkv_storage: bool, gemma_norm: bool = False,
                     softmax_fp32: bool = True, batch: int = 2, use_cache_copies: bool = False) -> list[Term]:
    a, kv, d, dv, c = att.num_heads, att.num_kv_heads, att.head_dim, att.v_head_dim, p.compute
    terms: list[Term] = []
    if att.kind == "mla":
        return _mla_terms(att, h, s, p, kernel)
    if att.qk_norm:
        # Qwen3/Gemma3 q_norm and k_norm: RMSNorm over each head, input = projection output (compute dtype);
        # Gemma's RMSNorm keeps its normalised value in fp32.
        normed = FP32 if gemma_norm else c
        for name, heads in (("q_norm", a), ("k_norm", kv)):
            terms += [Term(f"{name}: input in fp32", FP32 * heads * d), Term(f"{name}: rsqrt", FP32 * heads),
                      Term(f"{name}: normalised", normed * heads * d)]
    # eager_attention_forward repeats k and v to every query head (repeat_kv: expand + reshape) and its
    # matmuls keep the copies, not the originals; SDPA takes the kv heads as they are (enable_gqa). With one
    # kv head and one sequence the expanded tensor reshapes without a copy.
    kv_kept = a if kernel == "eager" and not (kv == 1 and batch == 1) else kv
    if fused_qkv_storage and not rotary:
        # GPT-2 / BLOOM: q, k and v are views of one projection output; its storage is what is kept, unless
        # eager's batched matmul must copy q (batch > 1), which then keeps the copy instead.
        terms.append(Term("q, k, v (one fused projection output)", c * (a * d + 2 * kv * d)))
        if use_cache_copies and (kernel != "eager" or batch == 1):
            # use_cache=True (the config default; gradient checkpointing turns it off): DynamicLayer.update
            # torch.cat's k and v into the cache and attention keeps those copies, while q keeps the fused
            # projection output alive.
            terms.append(Term("k, v copied into the KV cache (use_cache)", c * kv * (d + dv)))
    else:
        repeated = " repeated to every head" if kv_kept != kv else ""
        terms.append(Term("q" + (" after rotary" if rotary else ""), c * a * d))
        terms.append(Term("k" + (" after rotary" if rotary else "") + repeated, c * kv_kept * d))
        terms.append(Term("v" + repeated, c * kv_kept * dv))
    if kernel == "eager":
        # Softmax in fp32 kept for its backward, cast back to the compute dtype and kept by the matmul
        # with v, the dropout mask, and the transposed output copied contiguous for o_proj.
        if softmax_fp32:
            terms.append(Term("softmax probabilities (fp32)", FP32 * a * s))
        if c != FP32 or dropout > 0 or not softmax_fp32:
            terms.append(Term("probabilities in compute dtype (matmul with v)", c * a * s))
        if dropout > 0:
            terms.append(Term("attention dropout mask", MASK * a * s))
        terms.append(Term("attention output, contiguous (o_proj input)", c * a * dv))
    else:
        # SDPA (flash / memory-efficient kernels on CUDA, the flash CPU kernel): output and logsumexp.
        # The output's memory is laid out (b, s, a, d), so o_proj reads it without a copy.
        terms.append(Term("attention output (o_proj input)", c * a * dv))
        terms.append(Term("softmax logsumexp (fp32)", FP32 * a))
    return terms


def _mla_terms(att: Attention, h: int, s: int, p: Precision, kernel: str) -> list[Term]:
    """DeepSeek-V3 multi-head latent attention (modeling_deepseek_v3.py, DeepseekV3Attention)."""
    a, c, rope, dv = att.num_heads, p.compute, att.qk_rope_head_dim, att.v_head_dim
    qk = att.head_dim
    terms = []
    if att.q_lora_rank:
        q = att.q_lora_rank
        terms += [Term("q_a_proj output -> q_a_layernorm (fp32, rsqrt, normalised)", FP32 * q + FP32 + c * q),
                  Term("q_a_layernorm output (q_b_proj input)", c * q)]
    kvr = att.kv_lora_rank
    terms += [
        Term("kv_a_layernorm (fp32, rsqrt, normalised)", FP32 * kvr + FP32 + c * kvr),
        Term("kv_a_layernorm output (kv_b_proj input)", c * kvr),
        Term("q, k after rotary (cat of nope and rope parts)", c * 2 * a * qk),
        Term("v (padded to the q/k head dim for SDPA)", c * a * max(qk, dv) if kernel != "eager" else c * a * dv),
        Term("attention output (o_proj input)", c * a * dv),
        Term("softmax logsumexp (fp32)", FP32 * a),
        Term("rotary inputs (k_pe, q_pe)", c * (a + 1) * rope),
    ]
    return terms


def _mlp_terms(mlp: MLP, p: Precision) -> list[Term]:
    c, i = p.compute, mlp.intermediate_size
    act = mlp.activation
    if mlp.gated:
        # gate and up outputs (kept by the activation and the product), the activation output, the product
        # (down_proj's input). A fused gate_up_proj keeps one 2I-wide output: the same bytes.
        return [Term("gate, up projections", 2 * c * i), Term(f"{act}(gate)", c * i),
                Term("gate*up (down_proj input)", c * i)]
    if act == "relu":
        # relu keeps its output only, which is also fc2's input (OPT).
        return [Term("relu output (fc2 input)", c * i)]
    if act == "gelu_new":
        # NewGELUActivation is written in Python: x, tanh(...), 0.5*x and 1+tanh(...) are kept.
        return [Term("fc1 output", c * i), Term("gelu_new intermediates (tanh, 0.5*x, 1+tanh)", 3 * c * i),
                Term("gelu output (fc2 input)", c * i)]
    return [Term("fc1 output", c * i), Term(f"{act} output (fc2 input)", c * i)]


def _moe_terms(moe: MoE, h: int, p: Precision) -> list[Term]:
    """Routed experts in transformers 5: the router (MixtralTopKRouter and kin) and the default
    ``grouped_mm`` experts path (integrations/moe.py, grouped_mm_experts_forward). grouped_mm is not an
    autocast op and casts its input to the weights' dtype, so under autocast the experts run in fp32."""
    e, k, i = moe.num_experts, moe.top_k, moe.expert_intermediate_size
    w = p.experts
    terms = [
        Term("router softmax (fp32)", FP32 * e),
        Term("top-k indices, weights and their sum", k * (INDEX + FP32) + FP32),
        Term("routing bookkeeping per (token, expert) pair (3 int64 indices, 1 fp32 weight)", k * (3 * INDEX + FP32)),
        Term("tokens gathered per selected expert", k * w * h),
        Term("expert gate_up outputs", k * 2 * w * i),
        Term("expert activation and product", k * 2 * w * i),
        Term("expert outputs (weighted by the router)", k * w * h),
    ]
    if moe.shared_intermediate_size:
        shared = MLP(moe.shared_intermediate_size, True, moe.activation)
        terms += [Term(f"shared expert: {t.name}", t.bytes_per_token) for t in _mlp_terms(shared, p)]
    return terms


# --------------------------------------------------------------------------------------------------------
# One layer
# --------------------------------------------------------------------------------------------------------


def _uses_rotary(spec: ModelSpec) -> bool:
    return spec.position_table_rows == 0 and spec.model_type not in ("bloom",)


def _hidden_dropout_sites(spec: ModelSpec, layer: Layer) -> int:
    """Residual dropouts per layer (each keeps a bool mask): GPT-2, OPT, Phi-3, NeoX, BLOOM: 2; Falcon: 1-2."""
    if spec.model_type == "falcon":
        return 1 if layer.parallel_residual else 2
    if spec.model_type in ("gpt2", "opt", "phi3", "gpt_neox", "bloom"):
        return 2
    return 0


def layer_activations(spec: ModelSpec, layer: Layer, count: int, recipe: Recipe,
                      settings: TrainingSettings) -> LayerActivations:
    p = Precision.of(recipe)
    h, s = spec.hidden_size, settings.seq
    r = p.residual
    att = layer.attention
    attn_dropout = spec.dropout.attention if settings.dropout is None else settings.dropout
    hidden_dropout = spec.dropout.hidden if settings.dropout is None else settings.dropout
    kernel = settings.attention
    terms: list[Term] = []

    # --- attention block: pre-norm, its output read by the q/k/v projections -----------------------------
    terms += _norm_terms(spec, h, p, "input norm", r)
    # Linears reading the input norm's output: one fused qkv; q/k/v; MLA's q_a_proj and kv_a_proj_with_mqa.
    qkv_consumers = 1 if att.fused_qkv else 2 if att.kind == "mla" else 3
    terms += _linear_inputs(p, h, qkv_consumers, "input norm output (q/k/v projections' input)", r)
    gemma = spec.model_type.startswith("gemma")
    # GPT-2's and Falcon's own eager attention take the softmax in the compute dtype (autocast still runs
    # softmax in fp32); the others upcast to fp32 explicitly.
    softmax_fp32 = p.autocast or spec.model_type not in ("gpt2", "falcon")
    terms += _attention_terms(att, h, s, p, kernel, attn_dropout, _uses_rotary(spec), att.fused_qkv,
                              gemma_norm=gemma, softmax_fp32=softmax_fp32, batch=settings.batch,
                              use_cache_copies=spec.model_type == "gpt2" and settings.checkpointing == "none")
    if kernel != "eager" and spec.model_type in ("gpt_neox", "phi3"):
        # Partial-rotary models build q with torch.cat, so q is laid out (b, a, s, d); SDPA's output follows
        # q's layout (flash: empty_like(q)), and transpose(1, 2).contiguous() copies it for o_proj.
        terms.append(Term("attention output copied contiguous (o_proj input)", p.compute * att.num_heads * att.v_head_dim))
    if kernel == "eager" and spec.model_type == "gemma2":
        # attn_logit_softcapping: scores / cap -> tanh -> * cap; tanh keeps its output.
        terms.append(Term("attention softcapping tanh output", p.compute * att.num_heads * s))

    # --- MLP block: its norm (if it has its own), then the MLP's input ------------------------------------
    if layer.moe:  # the router, and the shared expert's gate and up projections
        mlp_consumers = 1 + (2 if layer.moe.shared_intermediate_size else 0)
    else:
        mlp_consumers = 2 if (layer.mlp and layer.mlp.gated and not layer.mlp.fused_gate_up) else 1
    if gemma and layer.num_norms == 4:
        # Gemma 2/3 sandwich norms: post_attention_layernorm on the attention output (before the residual
        # add), pre_feedforward_layernorm, and post_feedforward_layernorm on the MLP output.
        terms += _norm_terms(spec, h, p, "post-attention norm", p.compute)
        terms += _norm_terms(spec, h, p, "pre-feedforward norm", r)
        terms += _norm_terms(spec, h, p, "post-feedforward norm", p.compute)
    elif layer.parallel_residual and layer.num_norms == 1:
        pass  # Falcon-7B: the MLP reads the same norm output as attention
    elif layer.parallel_residual:
        # GPT-NeoX's post_attention_layernorm and Falcon's ln_mlp read the layer input, which the first norm
        # already keeps: only their statistics are new.
        terms += _norm_terms(spec, h, p, "MLP norm", r)[1:]
    else:
        terms += _norm_terms(spec, h, p, "post-attention norm", r)
    if layer.parallel_residual and layer.num_norms == 1:
        if p.autocast:  # the shared fp32 norm output is cast again by each MLP Linear
            terms += _linear_inputs(p, h, mlp_consumers, "input norm output (MLP input)", r)
    else:
        terms += _linear_inputs(p, h, mlp_consumers, "MLP norm output (MLP input)", r)
    terms += _mlp_terms(layer.mlp, p) if layer.mlp else _moe_terms(layer.moe, h, p)  # type: ignore[arg-type]
    sites = _hidden_dropout_sites(spec, layer)
    if hidden_dropout > 0 and sites:
        terms.append(Term(f"residual dropout masks x{sites}", sites * MASK * h))

    constant = 0
    if p.autocast:
        from .models import layer_tensors

        matmul_weights = sum(t.numel for t in layer_tensors(layer, h, spec.norm_vectors) if len(t.shape) == 2)
        constant += p.compute * matmul_weights
    if gemma:  # GemmaRMSNorm multiplies by (1 + weight.float()), a new fp32 vector kept by the product
        constant += FP32 * h * layer.num_norms
        if att.qk_norm:
            constant += FP32 * 2 * att.head_dim
    checkpoint = (Term("layer input (checkpoint)", r * h),)
    return LayerActivations(layer, count, tuple(terms), constant, checkpoint)


# --------------------------------------------------------------------------------------------------------
# The whole model: embedding, layers, head and loss
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationEstimate:
    """Everything the forward pass of one micro-batch keeps for backward, and the logits around the loss."""

    tokens: int
    """batch x seq of the micro-batch."""
    layers: tuple[LayerActivations, ...]
    embedding_terms: tuple[Term, ...]
    head_terms: tuple[Term, ...]
    """Final norm, LM head input, loss: per token."""
    constant_terms: tuple[Term, ...]
    """Bytes independent of the batch: rotary tables, autocast weight copies of the head and routers."""
    logits_bytes: int
    """The logits tensor the model returns (compute dtype), alive from the LM head to the end of backward's
    start when the caller keeps the output object."""
    loss_transient_bytes: int
    """Working memory of the loss on top of what is saved: fp32 upcast of the logits during forward."""
    checkpointing: str
    kv_cache_bytes: int = 0
    """Held by the KV cache the model returns (use_cache=True, the config default) but not saved for backward:
    under autocast the cache keeps each layer's fp32 rotated keys while attention keeps their bf16 casts. Alive
    until the output object is dropped, so it counts at the forward peak only."""

    def layer_saved_bytes(self, layer: LayerActivations) -> int:
        if self.checkpointing == "full":
            return int(sum(t.bytes_per_token for t in layer.checkpoint_terms) * self.tokens)
        return int(layer.bytes_per_token * self.tokens) + layer.constant_bytes

    @property
    def layers_bytes(self) -> int:
        return sum(self.layer_saved_bytes(la) * la.count for la in self.layers)

    @property
    def embedding_bytes(self) -> int:
        return int(sum(t.bytes_per_token for t in self.embedding_terms) * self.tokens)

    @property
    def head_bytes(self) -> int:
        return int(sum(t.bytes_per_token for t in self.head_terms) * self.tokens)

    @property
    def constant_bytes(self) -> int:
        return int(sum(t.bytes_per_token for t in self.constant_terms))

    @property
    def saved_bytes(self) -> int:
        """Saved for backward at the end of the forward pass (what saved_tensors_hooks would see)."""
        return self.layers_bytes + self.embedding_bytes + self.head_bytes + self.constant_bytes

    @property
    def recompute_bytes(self) -> int:
        """With full checkpointing, one layer's activations exist again while it is recomputed in backward."""
        if self.checkpointing != "full":
            return 0
        return max(int(la.bytes_per_token * self.tokens) + la.constant_bytes for la in self.layers)


SDPA_UNSUPPORTED = ("gemma2", "bloom")
"""transformers 5 has no SDPA path for these: attn_implementation='sdpa' falls back to eager."""


def effective_kernel(spec: ModelSpec, kernel: str) -> str:
    if kernel == "sdpa" and spec.model_type in SDPA_UNSUPPORTED:
        return "eager"
    return kernel


def estimate_activations(spec: ModelSpec, recipe: Recipe, settings: TrainingSettings) -> ActivationEstimate:
    """Saved activations of one micro-batch of ``settings.batch`` x ``settings.seq`` tokens."""
    from dataclasses import replace

    settings = replace(settings, attention=effective_kernel(spec, settings.attention))
    p = Precision.of(recipe)
    h, v, s = spec.hidden_size, spec.vocab_size, settings.seq
    tokens = settings.batch * s
    layers = tuple(layer_activations(spec, layer, count, recipe, settings) for layer, count in spec.layer_runs)
    emb_dropout = spec.dropout.embedding if settings.dropout is None else settings.dropout

    embedding = [Term("input_ids (embedding backward)", INDEX)]
    constant: list[Term] = []
    if spec.model_type == "opt":
        embedding.append(Term("position ids", INDEX))
    if spec.model_type == "gpt2":
        constant.append(Term("position ids", INDEX * s))
    if spec.embedding_norm:
        embedding += _norm_terms(spec, h, p, "embedding norm", p.residual)
    if emb_dropout > 0 and spec.model_type in ("gpt2", "phi3"):
        embedding.append(Term("embedding dropout mask", MASK * h))
    if _uses_rotary(spec) and spec.layer_runs:
        att = spec.layer_runs[0][0].attention
        rot = att.qk_rope_head_dim if att.kind == "mla" else att.head_dim
        if spec.model_type == "gpt_neox":
            rot = int(att.head_dim * 0.25)
        # cos and sin, (1, 1, s, rotary dim) in the residual dtype, shared by every layer.
        constant.append(Term("rotary cos, sin", 2 * p.residual * s * rot))

    if settings.checkpointing == "full" and settings.attention == "eager" and spec.has_architecture:
        # Eager attention adds a dense (batch, 1, s, s) causal mask in the hidden states' dtype. Checkpointed
        # layers receive it as a keyword argument, which the checkpoint keeps for the recompute, so it lives
        # until the first layer's backward (traced); without checkpointing it dies with the forward.
        constant.append(Term("causal mask kept for the recompute (eager attention)", p.residual * settings.batch * s * s))

    head = _norm_terms(spec, h, p, "final norm", p.residual) if spec.final_norm and spec.norm_vectors else []
    if spec.model_type.startswith("gemma"):
        constant.append(Term("final norm (1 + weight) in fp32", FP32 * h))
    head += _linear_inputs(p, h, 1, "final norm output (LM head input)", p.residual)
    if spec.model_type == "gemma2":
        head.append(Term("final logit softcapping tanh output", p.compute * v))
    if settings.loss == "chunked":
        # Liger-Kernel's fused linear cross-entropy: the gradient of the hidden states is computed chunk by
        # chunk in the forward pass and kept; the logits never exist whole.
        head += [Term("gradient of the LM head input (computed in forward)", p.compute * h)]
        logits_bytes = 0
        loss_transient = 0
    else:
        # transformers' ForCausalLMLoss: logits.float(), then cross_entropy = log_softmax + nll_loss. log_softmax
        # keeps its fp32 output, nll_loss the shifted labels.
        head += [Term("log_softmax output (fp32)", FP32 * v), Term("shifted labels (int64)", INDEX)]
        logits_bytes = p.compute * v * tokens
        loss_transient = (FP32 * v * tokens) if p.compute != FP32 else 0
    constant.append(Term("loss total_weight", FP32))
    if p.autocast:
        head_weight = spec.vocab_size * (spec.embedding_dim or h)
        constant.append(Term("autocast copy of the LM head weight", p.compute * head_weight))
    kv_cache = 0
    if p.autocast and settings.checkpointing == "none" and _uses_rotary(spec) and spec.has_architecture:
        # DynamicLayer.update torch.cat's the rotated keys, which are fp32 under autocast (cos/sin follow the fp32
        # hidden states), into the cache; SDPA then casts them to bf16 and keeps only the cast.
        kv_cache = sum(FP32 * layer.attention.num_kv_heads * layer.attention.head_dim * tokens * count
                       for layer, count in spec.layer_runs if layer.attention.kind == "mha")
    return ActivationEstimate(
        tokens=tokens, layers=layers, embedding_terms=tuple(embedding), head_terms=tuple(head),
        constant_terms=tuple(constant), logits_bytes=logits_bytes, loss_transient_bytes=loss_transient,
        checkpointing=settings.checkpointing, kv_cache_bytes=kv_cache,
    )
