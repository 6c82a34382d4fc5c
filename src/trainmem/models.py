"""Model specs: a Hugging Face ``config.json`` turned into the architecture trainmem reasons about.

A :class:`ModelSpec` is a frozen description of a decoder-only transformer: its embedding, runs of
identical decoder layers (:class:`Layer`), the final norm and the LM head. From it come the exact list of
parameter tensors (:func:`parameter_groups`), hence the parameter count, which must equal
``sum(p.numel() for p in model.parameters())`` of the ``transformers`` model built from the same config
(``tests/test_models.py`` checks this on the meta device for every supported ``model_type``).

Each ``_parse_<family>`` function maps one family's config fields onto the spec, applying the same defaults
as that family's ``transformers/models/<family>/configuration_<family>.py`` for fields a config leaves out,
and the same module structure as its ``modeling_<family>.py``. Fields without a sane default (hidden size,
layer count, head count, vocabulary) are required: a config missing one is rejected with its name rather than
silently filled in with some 7B model's value.

No torch, no transformers: this module is imported by ``trainmem estimate``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, TypeVar

from .config_defaults import CONFIG_DEFAULTS, Derived, default_for
from .errors import ModelError

# --------------------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attention:
    """Self-attention of one decoder layer."""

    kind: Literal["mha", "mla"]
    num_heads: int
    num_kv_heads: int
    """Key/value heads: equal to num_heads for MHA, fewer for GQA, 1 for MQA."""
    head_dim: int
    """Query/key width per head (for MLA: qk_nope_head_dim + qk_rope_head_dim)."""
    v_head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    fused_qkv: bool = False
    """One ``query_key_value`` Linear instead of three (GPT-2, GPT-NeoX, Falcon, BLOOM, Phi-3)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head (Qwen3, Gemma 3)."""
    qk_norm_width: Literal["head", "projection", "head_weights"] = "head"
    """What q_norm and k_norm normalise: each head with one head_dim-wide weight (Qwen3, Gemma 3), the whole q and
    k projection outputs (OLMo-2's Olmo2Attention: ``q_norm = Olmo2RMSNorm(num_heads * head_dim)``), or each head
    with a weight per head (Cohere's ``CohereLayerNorm(hidden_size=(num_heads, head_dim))``)."""
    qk_layer_norm: bool = False
    """q_norm and k_norm are LayerNorms (a weight and a bias over head_dim) rather than RMSNorms (Phi's
    ``q_layernorm = nn.LayerNorm(hidden_size // num_attention_heads)`` with ``qk_layernorm``)."""
    clip_qkv: bool = False
    """q, k and v are clamped in place after their projections (OLMo's ``clip_qkv``: ``query_states.clamp_(...)``),
    and autograd keeps a copy of each projection output from before the clamp for its backward."""
    rotary_dim: int = 0
    """Head dims rotated by RoPE (0: no rotary embedding; less than head_dim: partial rotary, GPT-NeoX/Phi-3)."""
    kv_broadcast: bool = False
    """Keys and values are broadcast to every query head before attention (Falcon's new decoder architecture)."""
    logit_softcap: float | None = None
    """Gemma 2/3's ``attn_logit_softcapping``: eager attention squashes the scores with cap * tanh(scores / cap)."""
    sinks: bool = False
    """A learned logit per head (``sinks``, one parameter vector of num_heads) that eager attention appends to every
    row of the scores before the softmax and drops after it (modeling_gpt_oss.py, eager_attention_forward)."""
    # Multi-head latent attention (DeepSeek-V2/V3): low-rank query and compressed key/value.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0


@dataclass(frozen=True)
class MLP:
    """Dense feed-forward block."""

    intermediate_size: int
    gated: bool
    """SwiGLU/GeGLU (gate, up, down) rather than a plain two-Linear MLP."""
    activation: str
    bias: bool = False
    fused_gate_up: bool = False
    """Gate and up projections stored as one ``gate_up_proj`` (Phi-3)."""


@dataclass(frozen=True)
class MoE:
    """Mixture-of-experts feed-forward block (routed experts plus optional shared experts)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    activation: str
    shared_intermediate_size: int = 0
    """Width of the always-on shared expert MLP (0 when there is none)."""
    shared_expert_gate: bool = False
    """Qwen2-MoE's sigmoid gate (a Linear hidden->1) on the shared expert."""
    router: Literal["softmax", "sigmoid_grouped", "topk_softmax"] = "softmax"
    """softmax over all experts then top-k (Mixtral, Qwen-MoE), DeepSeek-V3's sigmoid scores with group-limited
    top-k (DeepseekV3TopkRouter), or top-k of the logits then a softmax over the k values in the logits' dtype
    (GptOssTopKRouter)."""
    normalize_top_k: bool = True
    """Top-k weights divided by their sum (Mixtral always; ``norm_topk_prob`` elsewhere)."""
    weights_in_compute_dtype: bool = False
    """The routing weights are cast to the router logits' dtype (Qwen-MoE); else they stay fp32."""
    groups: int = 1
    """DeepSeek-V3's expert groups (``n_group``) and the groups each token may use (``topk_group``)."""
    top_groups: int = 1
    shared_always_built: bool = False
    """DeepSeek-V3 builds its shared-expert MLP whatever ``n_shared_experts`` is: with 0 it is zero wide, yet under
    autocast its gate and up projections still cast their input to half."""
    bias: bool = False
    """The router and the experts' projections have biases (GptOssTopKRouter.bias, GptOssExperts.gate_up_proj_bias
    and down_proj_bias), and the expert weights are stored transposed, (experts, in, out)."""
    gate: Literal["act_times_up", "clamped_swiglu"] = "act_times_up"
    """How an expert turns its gate_up output into the down projection's input: ``act(gate) * up`` of the two halves
    (integrations/moe.py, _default_apply_gate), or GPT-OSS's interleaved gate and up, clamped, ``(up + 1) * gate *
    sigmoid(alpha * gate)`` (modeling_gpt_oss.py, GptOssExperts._apply_gate)."""
    expert_shards: int = 1
    """Expert parallelism: the routed experts are split across this many ranks (each holds num_experts / shards);
    the router stays whole (modelparallel.py)."""

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.expert_shards


@dataclass(frozen=True)
class Layer:
    """One decoder layer. ``mlp`` xor ``moe`` is set."""

    attention: Attention
    mlp: MLP | None
    moe: MoE | None
    num_norms: int
    """Norm modules in the layer (2 for pre-norm, 4 for Gemma 2/3's sandwich norms, 1 for Falcon-7B)."""
    parallel_residual: bool = False
    """Attention and MLP read the same input (GPT-NeoX, Falcon): no norm between them is saved twice."""
    sliding_window: int | None = None
    """Tokens a query attends back to in this layer (Mistral, Gemma 2/3 local layers, Qwen with
    use_sliding_window); None for full causal attention."""

    @property
    def dense_mlp(self) -> MLP:
        """``mlp``, where the caller has established that the layer is dense (not MoE)."""
        assert self.mlp is not None, "the MLP of an MoE layer asked for"
        return self.mlp

    @property
    def moe_block(self) -> MoE:
        """``moe``, where the caller has established that the layer is MoE."""
        assert self.moe is not None, "the MoE block of a dense layer asked for"
        return self.moe


@dataclass(frozen=True)
class Dropout:
    """Dropout probabilities from the config; trainmem's activations need to know which masks exist."""

    attention: float = 0.0
    hidden: float = 0.0
    """Residual/hidden dropout after attention and MLP outputs."""
    embedding: float = 0.0


ROLES = ("embedding", "position_embedding", "projection", "input_norm", "norm", "attention_input",
         "attention_output", "mlp", "mlp_down", "router", "expert", "expert_down", "shared_expert",
         "shared_expert_gate", "head", "adapter")
"""What a parameter tensor is, which the timeline reads instead of its name: the input norm is a layer's first;
attention_input covers q, k, v (fused or not) and MLA's low-rank projections; mlp_down and expert_down are the
dense and routed experts' down projections; a shared expert's tensors are shared_expert whatever their place."""
MLP_ROLES = frozenset({"mlp", "mlp_down", "router", "expert", "expert_down", "shared_expert", "shared_expert_gate"})
"""The roles of a layer's MLP or MoE block."""


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor, shaped as in the transformers module."""

    name: str
    shape: tuple[int, ...]
    role: str = ""
    """One of ROLES; "" for a tensor counted by transformers (meta_count.py), whose role is not known."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamGroup:
    """A set of parameter tensors that appears ``repeat`` times (one per identical layer)."""

    name: str
    """For people (``--explain``, the JSON); what a group is lives in ``is_layer``."""
    repeat: int
    tensors: tuple[ParamTensor, ...]
    is_layer: bool = False
    """A run of decoder layers (FSDP2 wraps each one; a QLoRA base dequantizes one Linear of it at a time)."""

    @property
    def numel_each(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def numel(self) -> int:
        return self.repeat * self.numel_each


@dataclass(frozen=True)
class FamilyTraits:
    """How a family's transformers modules differ where the memory formulas care, as typed fields. Filled per
    ``model_type`` by the parser (FAMILY_TRAITS below); the formulas read these, never the ``model_type``. The
    defaults are the Llama modules (modeling_llama.py), which most families copy."""

    block: Literal["standard", "bloom", "falcon"] = "standard"
    """The attention and decoder-layer code the formulas follow: Llama-style, BloomAttention (fused q/k/v, ALiBi
    scores kept in locals), or FalconAttention/FalconDecoderLayer (its own attention terms, ``attention_output``
    held through the MLP, ``dropout_add``)."""
    eager_attention: Literal["llama", "gpt2", "fp32_scores"] = "llama"
    """Which ``eager_attention_forward``: Llama's upcasts the softmax to fp32 and drops out probabilities cast to q's
    dtype, returning them; GPT-2's computes it in the scores' dtype, casts to v's and holds its output in the block;
    GPT-J's (modeling_gptj.py) casts q and k to fp32 for the scores' matmul (``query.to(torch.float32)``: fp32
    copies the matmul keeps, unless autocast casts them back to half), takes the softmax of the fp32 scores and
    casts the probabilities to v's dtype before the dropout."""
    rms_norm_fp32_plus_one: bool = False
    """Gemma's RMSNorm: keeps the fp32 normalised value and multiplies by ``1 + weight.float()`` (a kept fp32
    vector)."""
    sdpa_supported: bool = True
    """Whether transformers 5 has an SDPA path (Gemma 2 and BLOOM fall back to eager)."""
    sdpa_mask_always: bool = False
    """Whether SDPA is always handed a materialised mask (Falcon: ``allow_is_causal_skip=False``)."""
    q_built_by_cat: bool = False
    """Partial rotary builds q with ``torch.cat``, laid out (b, a, s, d) (GPT-NeoX, Phi-3)."""
    fused_qkv_layout: Literal["", "per_head", "blocks"] = ""
    """How a rotary family's fused q/k/v output is split: per head (GPT-NeoX: q, k, v of each head together) or
    in q, k, v blocks (Phi-3); "" where there is no such split."""
    hidden_dropout: Literal["none", "per_block", "per_residual_add", "after_mlp"] = "none"
    """Residual dropouts: none; after attention and after the MLP (GPT-2, OPT, Phi-3, GPT-NeoX, BLOOM); one per
    residual add (Falcon: one with parallel attention, two without); or on the MLP output only (StableLM)."""
    embedding_dropout: bool = False
    """The base model drops out the embeddings (GPT2Model ``drop``, GPTNeoXModel ``emb_dropout``)."""
    bias_after_matmul: bool = False
    """FalconLinear adds its bias after an autocast matmul, so a biased Linear's output is fp32 under autocast."""
    weight_casts_cached: bool = True
    """Autocast caches each Linear's half weight copy; FalconLinear casts the view ``weight.T``, which is not cached."""
    position_ids: Literal["none", "per_token", "per_sequence"] = "none"
    """Position ids the embedding keeps: OPT's per token (int64), GPT-2's one row shared by the batch."""
    rotary_tables: int = 1
    """Pairs of rotary cos/sin tables the base model builds (Gemma 3: one for local layers, one for global)."""
    decoder_locals: Literal["none", "token_and_shared_position", "opt", "dropped_embeddings"] = "none"
    """What the base model's forward holds in locals through its layer loop (ActivationEstimate.decoder_locals_bytes):
    GPT-2's and GPT-BigCode's token embeddings and their position embeddings, one row shared by the batch; OPT's,
    with its position mask and ids; GPT-NeoX's and GPT-J's undropped embeddings beside the dropped ones."""
    mlp_applies_dropout: bool = False
    """The MLP module drops its own output out before returning (GPT2MLP, Starcoder2MLP, GPTBigCodeMLP), so the
    decoder layer's local holding the MLP norm's output is alive while the dropout writes its copy."""
    mlp_inline: bool = False
    """The decoder layer runs its MLP's Linears itself (OPTDecoderLayer: ``hidden_states = self.fc1(...)``), so the
    MLP norm's output is no longer held once the first Linear has run."""
    eager_masks_always_built: frozenset[bool] = frozenset()
    """Eager masks the base model builds whatever its layers use (True: sliding, False: full)."""
    norm_placement: Literal["pre", "post"] = "pre"
    """Where a layer's two norms sit: before attention and before the MLP (Llama), or on the attention output and
    on the MLP output, each before its residual add, with no norm before either block (OLMo-2's
    Olmo2DecoderLayer: ``post_attention_layernorm`` and ``post_feedforward_layernorm``)."""
    norm_after_residual: bool = False
    """Each norm reads the residual sum and its output is the next block's input (OPTDecoderLayer with
    ``do_layer_norm_before: false``: ``hidden_states = self.self_attn_layer_norm(residual + hidden_states)``), so
    attention reads the layer input itself: no norm output beside it (a config switch, set by the parser)."""
    rotary_tables_fp32: bool = False
    """The rotary embedding returns its cos and sin tables in fp32, not cast to the hidden states' dtype
    (Olmo2RotaryEmbedding, Olmo3RotaryEmbedding and Ernie4_5RotaryEmbedding end ``return cos, sin``; Llama's and
    Cohere's return ``cos.to(dtype=x.dtype)``)."""
    rotary_tables_without_rotary: bool = False
    """The base model builds its rotary cos and sin, at the full head dim, even where its attention applies no
    rotary (FalconModel.forward calls ``self.rotary_emb`` with ALiBi too and hands the tables to every layer)."""
    rotary_in_input_dtype: bool = False
    """apply_rotary_pos_emb casts the rotated q and k back to q's dtype (OLMo-2: ``q_embed.to(q_type)``; Cohere
    rotates in fp32 and casts back), so under autocast they are half, not fp32 as Llama's (whose tables follow
    the fp32 hidden states)."""
    rotary_float_copies: bool = False
    """apply_rotary_pos_emb starts with ``q = q.float()`` and ``k = k.float()`` (Cohere, Cohere 2): half q and k are
    copied to fp32, held for the call beside the caller's, and rotated in fp32 (``torch.stack`` of fp32 halves)."""
    rotary_half_copied: bool = False
    """apply_rotary_pos_emb rotates q's half dtype and copies it to fp32 before the product with sin
    (Ernie4_5's ``rotate_half(q).float() * sin``): both the half and the fp32 rotated copy are alive then."""
    rotary_split_locals: bool = False
    """Partial rotary on separate q and k projections whose attention forward keeps, as locals until it returns,
    the rotated parts (``query_rot, key_rot = apply_rotary_pos_emb(...)``) and the passed parts, views that hold
    the whole q_proj and k_proj outputs, beside q and k joined by ``torch.cat`` (PhiAttention, StableLmAttention)."""
    attention_output_held: bool = False
    """The decoder layer keeps the attention's output in a local of its own through the MLP, beside the residual
    sum made from it (StableLmDecoderLayer: ``residual = residual + self_attn_output``, then the MLP), so it is
    alive while the down projection writes its output, in the forward and at a checkpointed layer's recompute."""
    residual_branches_scaled: bool = False
    """The block adds each branch's output times a Python scalar to the residual (GraniteDecoderLayer's
    ``residual + hidden_states * self.residual_multiplier``, even at 1.0): the product saves nothing, but its
    backward makes a new gradient of the branch's output, alive through the branch's last Linear's backward."""
    residual_first_in_parallel_sum: bool = False
    """A parallel block's output sum starts with the residual (CohereDecoderLayer's ``residual +
    hidden_states_attention + hidden_states_mlp``, StableLmDecoderLayer's ``residual + self_attn_output +
    mlp_output``), so its partial sum is in the residual's dtype; PhiDecoderLayer and GPTNeoXLayer add the residual
    last (``attn_outputs + feed_forward_hidden_states + residual``): the partial sum of two outputs."""
    norm_centred_twice: bool = False
    """CohereLayerNorm computes ``hidden_states - mean`` twice (once for the variance, once to normalise), and
    ``pow`` and the product with the rsqrt each keep theirs: one more fp32 input-wide tensor than an RMSNorm."""
    attention_dropout: bool = True
    """Whether attention drops out its probabilities with the config's (or --dropout's) rate; Ernie4_5Attention sets
    ``self.attention_dropout = 0.0`` whatever the config holds, so nothing is dropped there."""
    rotary_tables_per_layer: bool = False
    """apply_rotary_pos_emb builds each layer's own cos and sin from the model's tables
    (``cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)``, the interleaved pairs of GLM-4 and ERNIE 4.5),
    and the products keep those for backward: the model's tables then live only through the layer loop (and, under
    checkpointing, as the checkpoints' arguments)."""
    rotary_tables_split: bool = False
    """The model's rotary table is one ``sincos`` (1, s, rotary dim) tensor split into sin and cos halves, each
    rotary dim / 2 wide (GPTJRotaryEmbedding: ``torch.split(sincos, sincos.shape[-1] // 2, dim=-1)``), not a
    cos and a sin of rotary dim each (Llama); each layer repeat_interleaves them to full width
    (rotary_tables_per_layer) once for k and once more for q (GPTJAttention calls ``apply_rotary_pos_emb`` on each),
    so the products keep two such pairs."""
    rotary_tables_half: bool = False
    """The model's cos and sin are of the frequencies themselves, rotary dim / 2 wide (GptOssRotaryEmbedding:
    ``emb = freqs``, where Llama's is ``torch.cat((freqs, freqs), dim=-1)``), which the attention multiplies with
    the two halves of q and k (modeling_gpt_oss.py, _apply_rotary_emb)."""
    layer_norm_upcast: bool = False
    """The LayerNorm normalises an fp32 copy of its input and casts its output back (OlmoLayerNorm:
    ``F.layer_norm(hidden_states.to(dtype=torch.float32), ...).to(orig_dtype)``), so it keeps that fp32 copy, not
    the layer input itself, where the hidden states are half."""
    rms_norm_fp32_product: bool = False
    """The RMSNorm multiplies its weight by the fp32 normalised value and casts the product back
    (Olmo2RMSNorm: ``(self.weight * hidden_states).to(input_dtype)``), so the kept normalised value is fp32, as
    Gemma's, without Gemma's ``1 + weight.float()`` vector."""

    @property
    def attention_reads_layer_input(self) -> bool:
        """No norm before attention: its q/k/v projections read the layer input itself (OLMo-2's post-norms, OPT's
        norms after the residual adds)."""
        return self.norm_placement == "post" or self.norm_after_residual


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as trainmem sees it. Build one with :func:`spec_from_config`."""

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    layer_runs: tuple[tuple[Layer, int], ...]
    """Consecutive runs of identical decoder layers, as (layer, count)."""
    norm: Literal["rms", "layer"]
    norm_vectors: int
    """Parameter vectors per norm module: 1 for RMSNorm, 2 for LayerNorm (weight and bias), 0 if not affine."""
    tied_embeddings: bool
    max_position_embeddings: int = 0
    """The longest sequence the model was built for (0: no limit, ALiBi)."""
    rope_extension: str | None = None
    """The RoPE scaling type (linear, dynamic, yarn, llama3, ...) that lets it run longer; None for plain RoPE."""
    position_table_rows: int = 0
    """Rows of a learned absolute position table (GPT-2: n_positions; OPT: max_position_embeddings + 2)."""
    embedding_dim: int = 0
    """Width of the token embedding if it differs from hidden_size (OPT's word_embed_proj_dim), else 0."""
    embedding_norm: bool = False
    """A LayerNorm right after the embedding (BLOOM)."""
    final_norm: bool = True
    head_bias: bool = False
    """The LM head has a bias (Phi's ``lm_head = nn.Linear(hidden_size, vocab_size, bias=True)``), kept when the
    weight is tied."""
    final_logit_softcap: float | None = None
    """Gemma 2/3's ``final_logit_softcapping`` on the LM head's output (one more tanh output kept, V wide)."""
    dropout: Dropout = field(default_factory=Dropout)
    traits: FamilyTraits = field(default_factory=FamilyTraits)
    """How its family's modules differ from Llama's where memory is concerned."""
    source: str = ""
    """Where the config came from: a catalog name, a file path or a Hub repo id."""
    explicit_param_groups: tuple[ParamGroup, ...] = ()
    """Parameter tensors given directly instead of derived from layer_runs: a model counted by building it
    with transformers (unknown model_type) or a nominal size (``--params 7e9``). Such a spec has no
    architecture, so activations cannot be derived from it."""
    # One rank's share of a model-parallel layout (modelparallel.py builds these; a whole model has the defaults).
    sliding_mask_window: int | None = None
    """The window of a sliding mask the base model builds whatever its layers use (Qwen2MoeModel.forward builds
    ``create_sliding_window_causal_mask`` always, with ``config.sliding_window``, which configuration_qwen2_moe.py
    sets to 0 without ``use_sliding_window``); None: built only where a layer slides."""
    has_embedding: bool = True
    """False on a pipeline stage after the first: no token embedding, its input is the previous stage's output."""
    has_head: bool = True
    """False on a pipeline stage before the last: no final norm, LM head, logits or loss; its output is sent on."""
    sequence_shards: int = 1
    """Sequence parallelism (Korthikanti et al. 2022) over this many tensor-parallel ranks: the norms, residual
    dropouts and layer inputs keep 1/T of the sequence."""
    context_shards: int = 1
    """Context parallelism: each rank holds 1/C of the sequence and gathers the others' keys and values."""
    vocab_shards: int = 1
    """Tensor parallelism over the vocabulary: vocab_size is this rank's ceil(V / T) rows of the embedding and the
    LM head, and the loss is the vocabulary-parallel one (PyTorch's ``loss_parallel``)."""
    buffer_bytes: int = 0
    """Bytes of the buffers the model registers whose dtype the recipe does not change, held from load on like the
    weights: GPT-J's sinusoidal ``embed_positions``, n_positions x rotary_dim in fp32 (modeling_gptj.py
    create_sinusoidal_positions ends in ``.float()`` products, so a bf16 default dtype still builds it fp32), and
    GPT-BigCode's causal ``bias``, n_positions x n_positions booleans (GPTBigCodeModel, ``torch.tril(torch.ones(...,
    dtype=torch.bool))``), which its forward no longer reads. Llama's ``inv_freq`` (head_dim / 2 elements) is too
    small to count."""
    built_config: str = field(default="", repr=False)
    """The config (JSON, sorted keys) a spec counted by transformers was built from: what the traced path
    (recorded.py) traces for its activations. Empty for every other spec."""

    def __hash__(self) -> int:
        # Kept once computed: a spec keys a search's caches thousands of times, and hashing its layers each time
        # costs as much as the lookups (the dataclass would rehash every field). Not pickled (__getstate__): string
        # hashes differ between processes.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))
        return cached

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    @property
    def projects_embeddings(self) -> bool:
        """OPT's word_embed_proj_dim: project_in and project_out between the embedding width and hidden_size."""
        return bool(self.embedding_dim)

    @property
    def position_limit(self) -> int | None:
        """The longest sequence the model takes: ``max_position_embeddings``, unless RoPE scaling extends it or
        there is none (ALiBi)."""
        if self.max_position_embeddings and not self.rope_extension:
            return self.max_position_embeddings
        return None

    @property
    def final_norm_runs(self) -> bool:
        """Whether a final norm's activations are counted: one with parameters, or OLMo's OlmoLayerNorm, which has
        none (layer_norm_upcast). (OPT without elementwise affine is counted without its final norm, as before.)"""
        return self.final_norm and bool(self.norm_vectors or self.traits.layer_norm_upcast)

    @property
    def is_nominal(self) -> bool:
        """Known only by its parameter count (``--params``)."""
        return self.model_type == "nominal"

    @property
    def has_architecture(self) -> bool:
        return bool(self.layer_runs)

    @property
    def num_layers(self) -> int:
        return sum(count for _, count in self.layer_runs)

    @property
    def layers(self) -> list[Layer]:
        """Every decoder layer in order (layer_runs expanded)."""
        return [layer for layer, count in self.layer_runs for _ in range(count)]

    @property
    def is_moe(self) -> bool:
        return any(layer.moe is not None for layer, _ in self.layer_runs)

    @cached_property
    def param_groups(self) -> tuple[ParamGroup, ...]:
        return self.explicit_param_groups or parameter_groups(self)

    @cached_property
    def num_parameters(self) -> int:
        return sum(g.numel for g in self.param_groups)

    @cached_property
    def num_active_parameters(self) -> int:
        """Parameters one token passes through: the total less the routed experts it is not sent to."""
        inactive = 0
        for layer, count in self.layer_runs:
            if layer.moe is not None:
                per_expert = _expert_numel(layer.moe, self.hidden_size)
                inactive += count * (layer.moe.num_experts - layer.moe.top_k) * per_expert
        return self.num_parameters - inactive

    @cached_property
    def largest_layer_parameters(self) -> int:
        """The largest module a sharded run gathers at once: one decoder layer, the embedding or the head."""
        return max(g.numel_each for g in self.param_groups)


# --------------------------------------------------------------------------------------------------------
# Parameter tensors from the spec (mirrors the transformers modules' nn.Linear / nn.Embedding shapes)
# --------------------------------------------------------------------------------------------------------


def _linear(name: str, in_features: int, out_features: int, bias: bool, role: str) -> list[ParamTensor]:
    tensors = [ParamTensor(f"{name}.weight", (out_features, in_features), role)]
    if bias:
        tensors.append(ParamTensor(f"{name}.bias", (out_features,), role))
    return tensors


def _norm(name: str, width: int, vectors: int, role: str = "norm") -> list[ParamTensor]:
    return [ParamTensor(f"{name}.{part}", (width,), role) for part in ("weight", "bias")[:vectors]]


def _attention_tensors(att: Attention, hidden: int) -> list[ParamTensor]:
    h, a, kv, d, dv = hidden, att.num_heads, att.num_kv_heads, att.head_dim, att.v_head_dim
    out: list[ParamTensor] = []
    if att.kind == "mla":
        # transformers/models/deepseek_v3/modeling_deepseek_v3.py, DeepseekV3Attention
        if att.q_lora_rank:
            out += _linear("q_a_proj", h, att.q_lora_rank, att.qkv_bias, "attention_input")
            out += _norm("q_a_layernorm", att.q_lora_rank, 1)
            out += _linear("q_b_proj", att.q_lora_rank, a * d, False, "attention_input")
        else:
            out += _linear("q_proj", h, a * d, False, "attention_input")
        out += _linear("kv_a_proj_with_mqa", h, att.kv_lora_rank + att.qk_rope_head_dim, att.qkv_bias,
                       "attention_input")
        out += _norm("kv_a_layernorm", att.kv_lora_rank, 1)
        nope = d - att.qk_rope_head_dim
        out += _linear("kv_b_proj", att.kv_lora_rank, a * (nope + dv), False, "attention_input")
        out += _linear("o_proj", a * dv, h, att.o_bias, "attention_output")
        return out
    if att.fused_qkv:
        out += _linear("qkv_proj", h, a * d + kv * d + kv * dv, att.qkv_bias, "attention_input")
    else:
        out += _linear("q_proj", h, a * d, att.qkv_bias, "attention_input")
        out += _linear("k_proj", h, kv * d, att.qkv_bias, "attention_input")
        out += _linear("v_proj", h, kv * dv, att.qkv_bias, "attention_input")
    out += _linear("o_proj", a * dv, h, att.o_bias, "attention_output")
    if att.sinks:  # (GptOssAttention.sinks: nn.Parameter(torch.empty(num_attention_heads)))
        out.append(ParamTensor("sinks", (a,), "attention_input"))
    if att.qk_norm and att.qk_norm_width == "projection":
        out += _norm("q_norm", a * d, 1) + _norm("k_norm", kv * d, 1)
    elif att.qk_norm and att.qk_norm_width == "head_weights":
        out += [ParamTensor("q_norm.weight", (a, d), "norm"), ParamTensor("k_norm.weight", (kv, d), "norm")]
    elif att.qk_norm:
        vectors = 2 if att.qk_layer_norm else 1
        out += _norm("q_norm", d, vectors) + _norm("k_norm", d, vectors)
    return out


def _mlp_tensors(mlp: MLP, hidden: int, prefix: str = "mlp", roles: tuple[str, str] = ("mlp", "mlp_down")
                 ) -> list[ParamTensor]:
    h, i = hidden, mlp.intermediate_size
    up_role, down_role = roles
    if not mlp.gated:
        return _linear(f"{prefix}.fc1", h, i, mlp.bias, up_role) + _linear(f"{prefix}.fc2", i, h, mlp.bias, down_role)
    if mlp.fused_gate_up:
        up = _linear(f"{prefix}.gate_up_proj", h, 2 * i, mlp.bias, up_role)
    else:
        up = (_linear(f"{prefix}.gate_proj", h, i, mlp.bias, up_role)
              + _linear(f"{prefix}.up_proj", h, i, mlp.bias, up_role))
    return up + _linear(f"{prefix}.down_proj", i, h, mlp.bias, down_role)


def _expert_numel(moe: MoE, hidden: int) -> int:
    i = moe.expert_intermediate_size
    return 3 * hidden * i + ((2 * i + hidden) if moe.bias else 0)


def _moe_tensors(moe: MoE, hidden: int) -> list[ParamTensor]:
    h, e, i = hidden, moe.local_experts, moe.expert_intermediate_size
    if moe.bias:  # modeling_gpt_oss.py: GptOssTopKRouter (weight, bias), GptOssExperts (transposed, with biases)
        return [
            ParamTensor("mlp.router.weight", (moe.num_experts, h), "router"),
            ParamTensor("mlp.router.bias", (moe.num_experts,), "router"),
            ParamTensor("mlp.experts.gate_up_proj", (e, h, 2 * i), "expert"),
            ParamTensor("mlp.experts.gate_up_proj_bias", (e, 2 * i), "expert"),
            ParamTensor("mlp.experts.down_proj", (e, i, h), "expert_down"),
            ParamTensor("mlp.experts.down_proj_bias", (e, h), "expert_down"),
        ]
    # transformers 5 stores the routed experts as two 3-D tensors (MixtralExperts and friends).
    out = [
        ParamTensor("mlp.gate.weight", (moe.num_experts, h), "router"),
        ParamTensor("mlp.experts.gate_up_proj", (e, 2 * i, h), "expert"),
        ParamTensor("mlp.experts.down_proj", (e, h, i), "expert_down"),
    ]
    if moe.shared_intermediate_size:
        shared = MLP(moe.shared_intermediate_size, gated=True, activation=moe.activation)
        out += _mlp_tensors(shared, h, prefix="mlp.shared_expert", roles=("shared_expert", "shared_expert"))
    if moe.shared_expert_gate:
        out += _linear("mlp.shared_expert_gate", h, 1, False, "shared_expert_gate")
    return out


def layer_tensors(layer: Layer, hidden: int, norm_vectors: int) -> list[ParamTensor]:
    """Parameter tensors of one decoder layer."""
    tensors = _attention_tensors(layer.attention, hidden)
    tensors += _mlp_tensors(layer.mlp, hidden) if layer.mlp else _moe_tensors(layer.moe, hidden)  # type: ignore[arg-type]
    for n in range(layer.num_norms):
        tensors += _norm(f"norm{n}", hidden, norm_vectors, "input_norm" if n == 0 else "norm")
    return tensors


def parameter_groups(spec: ModelSpec) -> tuple[ParamGroup, ...]:
    """Every parameter tensor of the model, grouped: embedding, each run of layers, final norm, LM head."""
    h = spec.hidden_size
    emb_dim = spec.embedding_dim or h
    embed = [ParamTensor("embed_tokens.weight", (spec.vocab_size, emb_dim), "embedding")]
    if spec.position_table_rows:
        embed.append(ParamTensor("embed_positions.weight", (spec.position_table_rows, h), "position_embedding"))
    if spec.embedding_norm:
        embed += _norm("embedding_norm", h, spec.norm_vectors)
    if emb_dim != h:  # OPT-350m style projections between embedding width and model width
        embed += _linear("project_in", emb_dim, h, False, "projection") + _linear("project_out", h, emb_dim, False,
                                                                                  "projection")
    groups = [ParamGroup("embedding", 1, tuple(embed))] if spec.has_embedding else []
    first = 0
    for layer, count in spec.layer_runs:
        kind = "moe" if layer.moe else "dense"
        label = f"layers[{first}:{first + count}] ({kind})"
        groups.append(ParamGroup(label, count, tuple(layer_tensors(layer, h, spec.norm_vectors)), is_layer=True))
        first += count
    if not spec.has_head:
        return tuple(groups)
    if spec.final_norm and spec.norm_vectors:
        groups.append(ParamGroup("final_norm", 1, tuple(_norm("norm", h, spec.norm_vectors))))
    head = [ParamTensor("lm_head.bias", (spec.vocab_size,), "head")] if spec.head_bias else []
    if not spec.tied_embeddings or not spec.has_embedding:  # (a last pipeline stage holds its own copy)
        head.insert(0, ParamTensor("lm_head.weight", (spec.vocab_size, emb_dim), "head"))
    if head:
        groups.append(ParamGroup("lm_head", 1, tuple(head)))
    return tuple(groups)


# --------------------------------------------------------------------------------------------------------
# Config parsing, one function per family
# --------------------------------------------------------------------------------------------------------


_SIZES = frozenset({
    "hidden_size", "n_embd", "n_embed", "num_attention_heads", "n_head", "num_hidden_layers", "n_layer", "vocab_size",
    "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "moe_intermediate_size", "head_dim",
    "num_key_value_heads", "num_kv_heads", "kv_lora_rank", "q_lora_rank", "v_head_dim", "qk_rope_head_dim",
    "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "n_positions",
    "max_position_embeddings", "word_embed_proj_dim", "n_group", "topk_group", "sliding_window_pattern",
})
"""Config fields that count something a model has at least one of: zero or less is rejected."""

_COUNTS = _SIZES | frozenset({
    "qk_nope_head_dim", "first_k_dense_replace", "n_shared_experts", "decoder_sparse_step", "max_window_layers",
    "sliding_window", "shared_expert_intermediate_size", "num_ln_in_parallel_attn", "query_pre_attn_scalar",
    "rotary_dim",
})
"""Config fields that are whole numbers: a float, a bool or a string there is refused, not rounded."""

_LARGEST = {"num_hidden_layers": 10_000, "n_layer": 10_000}
_LARGEST_SIZE = 2**31
"""Bounds on counts, far above any real model (the largest have 126 layers), so a typo cannot stall the tool."""

_NULL_MEANS_NONE = frozenset({
    "q_lora_rank", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "num_ln_in_parallel_attn",
    "rotary_dim", "clip_qkv",
})
"""Fields where an explicit ``null`` is a setting (no low-rank query, no window, no softcap), not a missing value."""


class _Config:
    """Read access to a config dict: required fields by name, optional ones with transformers' default for the
    model type (:data:`trainmem.config_defaults.CONFIG_DEFAULTS`), every integer checked."""

    def __init__(self, raw: dict[str, Any], origin: str):
        self.raw = raw
        self.origin = origin
        self.model_type = str(raw.get("model_type"))

    def req(self, *keys: str) -> Any:
        for key in keys:
            if self.raw.get(key) is not None:
                return self._check(key, self.raw[key])
        raise ModelError(
            f"{self.origin}: config has no {' / '.join(repr(k) for k in keys)} "
            f"(needed for model_type {self.raw.get('model_type')!r})"
        )

    def get(self, key: str) -> Any:
        """The config's value, or what transformers fills in for this model type when the key is missing."""
        value = self.raw.get(key)
        if value is None and not (key in self.raw and key in _NULL_MEANS_NONE):
            value = default_for(self.model_type, key, self.req)
        return None if value is None else self._check(key, value)

    def _check(self, key: str, value: Any) -> Any:
        if key in _COUNTS and (isinstance(value, bool) or not isinstance(value, int)):
            raise ModelError(f"{self.origin}: config field {key!r} is {_shown(value)}; it must be an integer")
        expected = CONFIG_DEFAULTS.get(self.model_type, {}).get(key)
        if isinstance(expected, bool) and not isinstance(value, bool):
            raise ModelError(f"{self.origin}: config field {key!r} is {_shown(value)}; it must be true or false")
        if isinstance(expected, str) and not isinstance(value, str):
            raise ModelError(f"{self.origin}: config field {key!r} is {_shown(value)}; it must be a string such as "
                             f"{expected!r}")
        if isinstance(expected, list):
            largest = _LARGEST["num_hidden_layers"]
            if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                                  or not 0 <= v < largest for v in value):
                raise ModelError(f"{self.origin}: config field {key!r} is {_shown(value)}; it must be a list of "
                                 "layer indices")
            return value
        if key in _FRACTIONS or (isinstance(expected, float) and key not in _POSITIVE_NUMBERS):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ModelError(f"{self.origin}: config field {key!r} is {_shown(value)}; it must be a number from "
                                 "0 to 1")
            return value
        if key in _POSITIVE_NUMBERS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ModelError(f"{self.origin}: config field {key!r} is {_shown(value)}; it must be a positive "
                                 "number")
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            return value
        largest = _LARGEST.get(key, _LARGEST_SIZE)
        if key in _COUNTS and value > largest:
            raise ModelError(f"{self.origin}: config field {key!r} is {_shown(value)}; at most {largest:,} is "
                             "accepted")
        if key in _SIZES and value <= 0:
            raise ModelError(f"{self.origin}: config field {key!r} is {value}; it must be a positive integer")
        if value < 0:
            raise ModelError(f"{self.origin}: config field {key!r} is {_shown(value)}; it must be non-negative")
        return value


_FRACTIONS = frozenset({"attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
                        "partial_rotary_factor", "rotary_pct"})
"""Probabilities and fractions: a number from 0 to 1."""
_POSITIVE_NUMBERS = frozenset({"attn_logit_softcapping", "final_logit_softcapping", "clip_qkv"})
"""Finite positive numbers (null, where it turns the feature off, is read as None before the check)."""


def _shown(value: Any) -> str:
    """A config value as one short piece of text for an error (a 400-digit number, a long list shortened)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) <= 40:
        return text
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{text[:8]}...({len(text.lstrip('-'))} digits)"
    return text[:36] + "..."


T = TypeVar("T")


def runs_of(items: Iterable[T]) -> tuple[tuple[T, int], ...]:
    """Consecutive equal items as (item, count): layers as ModelSpec.layer_runs holds them."""
    runs: list[tuple[T, int]] = []
    for item in items:
        if runs and runs[-1][0] == item:
            runs[-1] = (item, runs[-1][1] + 1)
        else:
            runs.append((item, 1))
    return tuple(runs)


def _split_heads(c: _Config, hidden: int, heads: int) -> int:
    """hidden // heads, for the families whose head width is not a config field."""
    if hidden % heads:
        raise ModelError(f"{c.origin}: hidden_size={hidden} is not a multiple of the {heads} attention heads")
    return hidden // heads


def _heads(c: _Config) -> tuple[int, int, int, int]:
    """(hidden, heads, kv_heads, head_dim) for the Llama-style families."""
    hidden = c.req("hidden_size")
    heads = c.req("num_attention_heads")
    kv = c.get("num_key_value_heads")
    if heads % kv:
        raise ModelError(f"{c.origin}: num_key_value_heads={kv} must divide num_attention_heads={heads}"
                         + ("" if "num_key_value_heads" in c.raw else
                            f" ({kv} is transformers' default for {c.model_type} when the key is missing)"))
    if c.raw.get("head_dim") is None and isinstance(CONFIG_DEFAULTS[c.model_type]["head_dim"], Derived):
        _split_heads(c, hidden, heads)
    return hidden, heads, kv, c.get("head_dim")


def _act(c: _Config) -> str:
    """The activation under the key this family's modeling file reads (Gemma 2/3 ``hidden_activation``, GPT-2
    and OPT ``activation_function``, Falcon ``activation``, the rest ``hidden_act``)."""
    for key in ("hidden_act", "hidden_activation", "activation_function", "activation"):
        if key in CONFIG_DEFAULTS[c.model_type]:
            act = c.get(key)
            if act not in ACTIVATIONS:
                raise ModelError(f"{c.origin}: config field {key!r} is {_shown(act)}; transformers' activations are "
                                 f"{', '.join(ACTIVATIONS)}")
            return str(act)
    raise AssertionError(f"no activation key for {c.model_type}")


ACTIVATIONS = ("gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
               "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu",
               "relu", "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu")
"""The names transformers 5 looks activations up by (transformers/activations.py, ACT2CLS; the modeling files read
``ACT2FN[config.hidden_act]``): any other name is a KeyError there, so it is refused here."""


def _rope_extension(c: _Config) -> str | None:
    """The RoPE scaling that lets a model run past ``max_position_embeddings`` (linear, dynamic, yarn, llama3,
    longrope, ...), from ``rope_scaling`` or transformers 5's ``rope_parameters``; None for plain RoPE."""
    for key in ("rope_scaling", "rope_parameters"):
        holder = c.raw.get(key)
        if holder is not None and not isinstance(holder, dict):
            raise ModelError(f"{c.origin}: config field {key!r} is {_shown(holder)}; it must be an object or null")
        if isinstance(holder, dict):
            kind = holder.get("rope_type", holder.get("type"))
            if kind is not None and not isinstance(kind, str):
                raise ModelError(f"{c.origin}: {key}.rope_type is {_shown(kind)}; it must be a string such as "
                                 "'llama3' or 'yarn'")
            if kind and kind != "default":
                return str(kind)
    return None


def _rotary_fraction(c: _Config) -> float:
    """The fraction of each head RoPE rotates: ``partial_rotary_factor`` (top level, or inside ``rope_parameters``
    / ``rope_scaling`` as transformers 5 stores it) or GPT-NeoX's ``rotary_pct``."""
    for holder in (c.raw, c.raw.get("rope_parameters"), c.raw.get("rope_scaling")):
        if isinstance(holder, dict):
            for key in ("partial_rotary_factor", "rotary_pct"):
                if holder.get(key) is not None:
                    value = holder[key]
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                        raise ModelError(f"{c.origin}: {key}={_shown(value)} must be a number in (0, 1]")
                    return float(value)
    return float(c.get("partial_rotary_factor"))


def _positions(c: _Config, key: str = "max_position_embeddings") -> dict[str, Any]:
    return dict(max_position_embeddings=c.get(key), rope_extension=_rope_extension(c))


def _layer_windows(c: _Config, n_layers: int, window: int | None, sliding: Callable[[int], bool]) -> list[int | None]:
    """Each layer's sliding window (None: full attention), from ``layer_types`` when the config lists them, else
    from the family's default pattern ``sliding(i)`` (each configuration_<family>.py's ``__post_init__``)."""
    types = c.raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers or not all(isinstance(t, str) for t in types):
            raise ModelError(f"{c.origin}: layer_types must list one type per layer ({n_layers}), such as "
                             "'full_attention' or 'sliding_attention'")
        flags = [t == "sliding_attention" for t in types]
    else:
        flags = [sliding(i) for i in range(n_layers)]
    if window is not None and window <= 0 and any(flags):
        raise ModelError(f"{c.origin}: sliding_window must be positive, got {window}")
    return [window if flag and window else None for flag in flags]


def _sparse_layer(c: _Config, idx: int) -> bool:
    """Qwen2-MoE / Qwen3-MoE rule (modeling_qwen2_moe.py, Qwen2MoeDecoderLayer)."""
    step = c.get("decoder_sparse_step")
    return idx not in c.get("mlp_only_layers") and step > 0 and (idx + 1) % step == 0


def _llama_like(
    c: _Config,
    *,
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool = False,
    qk_norm: bool = False,
    num_norms: int = 2,
    fused: bool = False,
    moe_for_layer: Callable[[int], MoE | None] | None = None,
    rotary_fraction: float = 1.0,
    windows: Callable[[int], list[int | None]] | None = None,
    softcaps: tuple[float | None, float | None] = (None, None),
) -> dict[str, Any]:
    hidden, heads, kv, head_dim = _heads(c)
    n_layers = c.req("num_hidden_layers")
    act = _act(c)
    att = Attention("mha", heads, kv, head_dim, head_dim, qkv_bias, o_bias, fused_qkv=fused, qk_norm=qk_norm,
                    rotary_dim=int(head_dim * rotary_fraction), logit_softcap=softcaps[0])
    layer_windows = windows(n_layers) if windows else [None] * n_layers
    layers = []
    for idx in range(n_layers):
        moe = moe_for_layer(idx) if moe_for_layer else None
        mlp = None
        if moe is None:
            mlp = MLP(c.req("intermediate_size"), True, act, mlp_bias, fused_gate_up=fused)
        layers.append(Layer(att, mlp, moe, num_norms, sliding_window=layer_windows[idx]))
    return dict(
        hidden_size=hidden,
        vocab_size=c.req("vocab_size"),
        layer_runs=runs_of(layers),
        norm="rms",
        norm_vectors=1,
        tied_embeddings=bool(c.get("tie_word_embeddings")),
        dropout=Dropout(attention=c.get("attention_dropout")),
        final_logit_softcap=softcaps[1],
        **_positions(c),
    )


def _softcaps(c: _Config) -> tuple[float | None, float | None]:
    """Gemma's (attn_logit_softcapping, final_logit_softcapping); an explicit null turns one off."""
    return c.get("attn_logit_softcapping"), c.get("final_logit_softcapping")


def _parse_llama(c: _Config) -> dict[str, Any]:
    _split_heads(c, c.req("hidden_size"), c.req("num_attention_heads"))  # LlamaConfig.validate_architecture
    bias = bool(c.get("attention_bias"))
    return _llama_like(c, qkv_bias=bias, o_bias=bias, mlp_bias=bool(c.get("mlp_bias")))


def _all_layers(c: _Config, window: int | None) -> Callable[[int], list[int | None]]:
    """One sliding window (or None) for every layer: the families whose model picks one mask function for all
    layers (``create_sliding_window_causal_mask`` when ``config.sliding_window`` is set)."""
    def windows(n_layers: int) -> list[int | None]:
        if window is not None and window <= 0:
            raise ModelError(f"{c.origin}: sliding_window must be positive, got {window}")
        return [window] * n_layers
    return windows


def _parse_mistral(c: _Config) -> dict[str, Any]:
    return _llama_like(c, qkv_bias=False, o_bias=False, windows=_all_layers(c, c.get("sliding_window")))


def _qwen_windows(c: _Config) -> Callable[[int], list[int | None]]:
    """configuration_qwen2.py / qwen3: with use_sliding_window, layers from max_window_layers on are sliding."""
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    first = c.get("max_window_layers")
    return lambda n: _layer_windows(c, n, window, lambda i: window is not None and i >= first)


def _parse_qwen2(c: _Config) -> dict[str, Any]:
    # modeling_qwen2.py: q/k/v always have a bias, o_proj never does.
    return _llama_like(c, qkv_bias=True, o_bias=False, windows=_qwen_windows(c))


def _parse_qwen3(c: _Config) -> dict[str, Any]:
    bias = bool(c.get("attention_bias"))
    return _llama_like(c, qkv_bias=bias, o_bias=bias, qk_norm=True, windows=_qwen_windows(c))


def _parse_olmo2(c: _Config) -> dict[str, Any]:
    """modeling_olmo2.py: Llama's modules with no pre-norms, a norm on each block's output (traits below) and q/k
    norms over the whole projection width."""
    bias = bool(c.get("attention_bias"))
    spec = _llama_like(c, qkv_bias=bias, o_bias=bias, qk_norm=True)
    spec["layer_runs"] = tuple((replace(layer, attention=replace(layer.attention, qk_norm_width="projection")), n)
                               for layer, n in spec["layer_runs"])
    return spec


def _parse_olmo(c: _Config) -> dict[str, Any]:
    """modeling_olmo.py (OLMo-1): Llama's modules with OlmoLayerNorm, a LayerNorm without weight or bias over an fp32
    copy of its input (traits), as the two pre-norms and the final norm; q/k/v/o take ``attention_bias``; with
    ``clip_qkv`` the q, k and v projection outputs are clamped in place (OlmoAttention.forward)."""
    bias = bool(c.get("attention_bias"))
    spec = _llama_like(c, qkv_bias=bias, o_bias=bias)
    clip = c.get("clip_qkv") is not None
    spec["layer_runs"] = tuple((replace(layer, attention=replace(layer.attention, clip_qkv=clip)), n)
                               for layer, n in spec["layer_runs"])
    return dict(spec, norm="layer", norm_vectors=0)


def _parse_cohere(c: _Config) -> dict[str, Any]:
    """modeling_cohere.py: one input norm shared by attention and the MLP, which run in parallel on it and are
    both added to the residual (CohereDecoderLayer); CohereLayerNorm has a weight and no bias; optional q/k norms
    with a weight per head (use_qk_norm); tied embeddings by default.

    CohereLayerNorm upcasts to fp32 and keeps ``x - mean`` (fp32), the rsqrt per row and the fp32 normalised
    value the weight multiplies: what an RMSNorm that keeps its fp32 product keeps (Olmo2RMSNorm) plus the second
    ``x - mean`` (norm_centred_twice), so it is
    described as one (``norm="rms"``, rms_norm_fp32_product) for the activation terms; its parameters are the same
    (one vector)."""
    bias = bool(c.get("attention_bias"))
    spec = _llama_like(c, qkv_bias=bias, o_bias=bias, qk_norm=bool(c.get("use_qk_norm")), num_norms=1)
    spec["layer_runs"] = tuple((replace(layer, parallel_residual=True,
                                        attention=replace(layer.attention, qk_norm_width="head_weights")), n)
                               for layer, n in spec["layer_runs"])
    return spec


def _parse_granite(c: _Config) -> dict[str, Any]:
    """modeling_granite.py: Llama's modules; its multipliers (embedding_multiplier, residual_multiplier,
    attention_multiplier as the softmax scale, logits_scaling) are products with Python scalars, which save
    nothing for backward (a scalar needs no gradient)."""
    bias = bool(c.get("attention_bias"))
    return _llama_like(c, qkv_bias=bias, o_bias=bias, mlp_bias=bool(c.get("mlp_bias")))


def _rotary_off(runs: tuple[tuple[Layer, int], ...], off: list[bool]) -> tuple[tuple[Layer, int], ...]:
    """The layers with RoPE turned off (``rotary_dim=0``) where ``off[i]``: q and k go from their projections to
    attention unrotated (SmolLM3's NoPE layers, Cohere 2's full-attention layers)."""
    layers = [layer for layer, count in runs for _ in range(count)]
    return runs_of(replace(layer, attention=replace(layer.attention, rotary_dim=0)) if no_rope else layer
                   for layer, no_rope in zip(layers, off))


def _parse_smollm3(c: _Config) -> dict[str, Any]:
    """modeling_smollm3.py: Llama's modules; SmolLM3Attention rotates q and k only where ``no_rope_layers[i]`` is 1
    (configuration_smollm3.py: every ``no_rope_layer_interval``-th layer is NoPE by default) and slides only with
    ``use_sliding_window``, on the layers ``layer_types`` calls sliding (by default the NoPE ones, when a window is
    set)."""
    n_layers = c.req("num_hidden_layers")
    rope = c.raw.get("no_rope_layers")
    if rope is None:  # SmolLM3Config.__post_init__
        interval = c.get("no_rope_layer_interval")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ModelError(f"{c.origin}: no_rope_layer_interval is {_shown(interval)}; it must be a positive integer")
        rope = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(rope, list) or len(rope) < n_layers or any(v not in (0, 1) or isinstance(v, bool)
                                                                  for v in rope):
        raise ModelError(f"{c.origin}: no_rope_layers is {_shown(rope)}; it must list a 1 (RoPE) or a 0 (NoPE) for "
                         f"each of the {n_layers} layers")
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    bias = bool(c.get("attention_bias"))
    spec = _llama_like(c, qkv_bias=bias, o_bias=bias, mlp_bias=bool(c.get("mlp_bias")),
                       windows=lambda n: _layer_windows(c, n, window, lambda i: window is not None and not rope[i]))
    spec["layer_runs"] = _rotary_off(spec["layer_runs"], [not rope[i] for i in range(n_layers)])
    return spec


def _parse_internlm3(c: _Config) -> dict[str, Any]:
    """configuration_internlm3.py: InternLM3Config is a LlamaConfig built as LlamaForCausalLM (modeling_auto.py)
    whose ``qkv_bias`` and ``bias`` are aliases (attribute_map) of ``attention_bias`` and ``mlp_bias``, the alias
    winning; its validate_architecture refuses the two different."""
    attention_bias = c.get("qkv_bias" if c.raw.get("qkv_bias") is not None else "attention_bias")
    mlp_bias = c.get("bias" if c.raw.get("bias") is not None else "mlp_bias")
    if not isinstance(attention_bias, bool) or not isinstance(mlp_bias, bool) or attention_bias != mlp_bias:
        raise ModelError(f"{c.origin}: qkv_bias/attention_bias ({_shown(attention_bias)}) and bias/mlp_bias "
                         f"({_shown(mlp_bias)}) must be the same true or false (InternLM3Config refuses them apart)")
    return _llama_like(c, qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=mlp_bias)


def _parse_ernie4_5(c: _Config) -> dict[str, Any]:
    """modeling_ernie4_5.py: Llama's modules with ``use_bias`` on every Linear but the head, no attention dropout
    (Ernie4_5Attention sets ``attention_dropout = 0.0`` whatever the config holds) and its own rotary (traits)."""
    bias = bool(c.get("use_bias"))
    return _llama_like(_Config(dict(c.raw, attention_dropout=0.0), c.origin), qkv_bias=bias, o_bias=bias,
                       mlp_bias=bias)


def _parse_glm4(c: _Config) -> dict[str, Any]:
    """modeling_glm4.py: Glm4DecoderLayer normalises each block's input and output (input_layernorm,
    post_self_attn_layernorm; post_attention_layernorm, post_mlp_layernorm: four RMSNorms, Gemma 2's sandwich);
    Glm4MLP is Phi-3's one ``gate_up_proj`` chunked in two; q/k/v take ``attention_bias``, o_proj none; partial
    rotary (``partial_rotary_factor``, 0.5 by default) on separate q and k, joined to the passed part by cat."""
    spec = _llama_like(c, qkv_bias=bool(c.get("attention_bias")), o_bias=False, num_norms=4,
                       rotary_fraction=_rotary_fraction(c))
    spec["layer_runs"] = tuple((replace(layer, mlp=replace(layer.mlp, fused_gate_up=True)), n)
                               for layer, n in spec["layer_runs"])
    return spec


def _parse_olmo3(c: _Config) -> dict[str, Any]:
    """modeling_olmo3.py: OLMo-2's modules (_parse_olmo2), with sliding-window layers from ``layer_types``
    (configuration_olmo3.py: every fourth layer full, the others sliding, by default) and one pair of rotary tables
    per layer type (traits); rope_scaling applies to the full-attention layers."""
    spec = _parse_olmo2(c)
    layers = [layer for layer, n in spec["layer_runs"] for _ in range(n)]
    windows = _layer_windows(c, len(layers), c.get("sliding_window"), lambda i: bool((i + 1) % 4))
    spec["layer_runs"] = runs_of(replace(layer, sliding_window=w) for layer, w in zip(layers, windows))
    nested = c.raw.get("rope_parameters")  # (transformers 5 saves one set per layer type)
    if spec["rope_extension"] is None and isinstance(nested, dict) and isinstance(nested.get("full_attention"), dict):
        spec["rope_extension"] = _rope_extension(_Config(dict(rope_parameters=nested["full_attention"]), c.origin))
    return spec


def _parse_cohere2(c: _Config) -> dict[str, Any]:
    """modeling_cohere2.py: Cohere's parallel block (_parse_cohere) without q/k norms; layers slide by
    ``layer_types`` (configuration_cohere2.py: every ``sliding_window_pattern``-th, 4 by default, full), and only the
    sliding ones apply RoPE (``if self.sliding_window is not None``). Cohere2Config sets ``head_dim`` to
    ``hidden_size // num_attention_heads`` whatever the config says."""
    c = _Config({k: v for k, v in c.raw.items() if k != "head_dim"}, c.origin)
    pattern, window, bias = c.get("sliding_window_pattern"), c.get("sliding_window"), bool(c.get("attention_bias"))
    spec = _llama_like(c, qkv_bias=bias, o_bias=bias, num_norms=1,
                       windows=lambda n: _layer_windows(c, n, window, lambda i: bool((i + 1) % pattern)))
    layers = [replace(layer, parallel_residual=True) for layer, n in spec["layer_runs"] for _ in range(n)]
    spec["layer_runs"] = _rotary_off(runs_of(layers), [layer.sliding_window is None for layer in layers])
    return spec


def _moe_fields(c: _Config, *, experts_keys: tuple[str, ...]) -> tuple[int, int]:
    """(routed experts, experts per token), validated."""
    experts = c.req(*experts_keys)
    top_k = c.req("num_experts_per_tok")
    if top_k > experts:
        raise ModelError(f"{c.origin}: num_experts_per_tok={top_k} exceeds the {experts} experts")
    return experts, top_k


def _parse_mixtral(c: _Config) -> dict[str, Any]:
    experts, top_k = _moe_fields(c, experts_keys=("num_experts", "num_local_experts"))  # the attribute_map alias wins
    moe = MoE(experts, top_k, c.req("intermediate_size"), _act(c))
    return _llama_like(c, qkv_bias=False, o_bias=False, moe_for_layer=lambda _: moe,
                       windows=_all_layers(c, c.get("sliding_window")))


def _parse_qwen2_moe(c: _Config) -> dict[str, Any]:
    experts, top_k = _moe_fields(c, experts_keys=("num_experts", "num_local_experts"))
    # Qwen2MoeSparseMoeBlock always builds shared_expert_gate, even for a zero-width shared expert.
    moe = MoE(experts, top_k, c.req("moe_intermediate_size"), _act(c), c.get("shared_expert_intermediate_size"),
              True, normalize_top_k=bool(c.get("norm_topk_prob")), weights_in_compute_dtype=True)
    # configuration_qwen2_moe.py: sliding layers are the odd-numbered ones below max_window_layers.
    use_window = bool(c.get("use_sliding_window"))
    window = c.get("sliding_window") if use_window else None
    first = c.get("max_window_layers")
    return _llama_like(
        c, qkv_bias=bool(c.get("qkv_bias")), o_bias=False,
        moe_for_layer=lambda i: moe if _sparse_layer(c, i) else None,
        windows=lambda n: _layer_windows(c, n, window, lambda i: use_window and bool((i + 1) % 2) and i < first),
    ) | {"sliding_mask_window": window or 0}


def _parse_qwen3_moe(c: _Config) -> dict[str, Any]:
    experts, top_k = _moe_fields(c, experts_keys=("num_experts", "num_local_experts"))
    moe = MoE(experts, top_k, c.req("moe_intermediate_size"), _act(c),
              normalize_top_k=bool(c.get("norm_topk_prob")), weights_in_compute_dtype=True)
    bias = bool(c.get("attention_bias"))
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    return _llama_like(
        c, qkv_bias=bias, o_bias=bias, qk_norm=True, moe_for_layer=lambda i: moe if _sparse_layer(c, i) else None,
        windows=_all_layers(c, window),
    )


def _parse_gpt_oss(c: _Config) -> dict[str, Any]:
    """modeling_gpt_oss.py: Llama's layer (two RMSNorms that multiply the fp32 normalised value by their weight, as
    OLMo-2's) with q/k/v/o biases (``attention_bias``, true by default), a learned sink logit per head
    (GptOssAttention.sinks), sliding-window and full layers by ``layer_types`` (configuration_gpt_oss.py: even
    layers slide by default) and a MoE block in every layer: GptOssTopKRouter (a Linear with a bias, top-k of the
    logits, softmax over the k) and GptOssExperts (transposed 3-D weights with biases, gate and up interleaved in
    gate_up_proj, the clamped SwiGLU of ``swiglu_alpha`` and ``swiglu_limit``). ``hidden_act`` is read by no
    module."""
    experts, top_k = _moe_fields(c, experts_keys=("num_experts", "num_local_experts"))  # (the attribute_map alias)
    moe = MoE(experts, top_k, c.req("intermediate_size"), "clamped_swiglu", router="topk_softmax",
              normalize_top_k=False, weights_in_compute_dtype=True, bias=True, gate="clamped_swiglu")
    bias = bool(c.get("attention_bias"))
    window = c.get("sliding_window")
    spec = _llama_like(c, qkv_bias=bias, o_bias=bias, moe_for_layer=lambda _: moe,
                       windows=lambda n: _layer_windows(c, n, window, lambda i: bool((i + 1) % 2)))
    spec["layer_runs"] = tuple((replace(layer, attention=replace(layer.attention, sinks=True)), n)
                               for layer, n in spec["layer_runs"])
    return spec


def _parse_gemma(c: _Config) -> dict[str, Any]:
    bias = bool(c.get("attention_bias"))
    return _llama_like(c, qkv_bias=bias, o_bias=bias)


def _parse_gemma2(c: _Config) -> dict[str, Any]:
    bias = bool(c.get("attention_bias"))
    window = c.get("sliding_window")  # configuration_gemma2.py: even-indexed layers are sliding
    return _llama_like(
        c, qkv_bias=bias, o_bias=bias, num_norms=4,
        windows=lambda n: _layer_windows(c, n, window, lambda i: bool((i + 1) % 2)), softcaps=_softcaps(c),
    )


def _parse_gemma3_text(c: _Config) -> dict[str, Any]:
    bias = bool(c.get("attention_bias"))
    window = c.get("sliding_window")
    if window is not None and c.get("use_bidirectional_attention"):
        window = window // 2 + 1  # configuration_gemma3.py
    pattern = c.get("sliding_window_pattern")  # every pattern-th layer is global
    return _llama_like(
        c, qkv_bias=bias, o_bias=bias, qk_norm=True, num_norms=4,
        windows=lambda n: _layer_windows(c, n, window, lambda i: bool((i + 1) % pattern)), softcaps=_softcaps(c),
    )


def _parse_phi3(c: _Config) -> dict[str, Any]:
    spec = _llama_like(c, qkv_bias=False, o_bias=False, fused=True, rotary_fraction=_rotary_fraction(c),
                       windows=_all_layers(c, c.get("sliding_window")))
    # (Phi3Model in transformers 5 has no embedding dropout: embd_pdrop is read by no module)
    spec["dropout"] = Dropout(attention=c.get("attention_dropout"), hidden=c.get("resid_pdrop"))
    return spec


def _parse_deepseek_v3(c: _Config) -> dict[str, Any]:
    hidden = c.req("hidden_size")
    heads = c.req("num_attention_heads")
    rope, nope, v = c.req("qk_rope_head_dim"), c.req("qk_nope_head_dim"), c.req("v_head_dim")
    bias = bool(c.get("attention_bias"))
    att = Attention(
        "mla", heads, heads, nope + rope, v, qkv_bias=bias, o_bias=bias,
        q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=c.req("kv_lora_rank"), qk_rope_head_dim=rope, rotary_dim=rope,
    )
    experts, top_k = _moe_fields(c, experts_keys=("num_local_experts", "n_routed_experts"))  # (attribute_map)
    act = _act(c)
    moe_i = c.req("moe_intermediate_size")
    groups, top_groups = c.get("n_group"), c.get("topk_group")
    if experts % groups or top_groups > groups:
        raise ModelError(f"{c.origin}: n_group={groups} must divide n_routed_experts={experts} and topk_group="
                         f"{top_groups} must be between 1 and n_group")
    moe = MoE(experts, top_k, moe_i, act, shared_intermediate_size=moe_i * c.get("n_shared_experts"),
              router="sigmoid_grouped", normalize_top_k=bool(c.get("norm_topk_prob")), groups=groups,
              top_groups=top_groups, shared_always_built=True)
    first_dense = c.get("first_k_dense_replace")
    n_layers = c.req("num_hidden_layers")
    # The multi-token-prediction module (num_nextn_predict_layers) is not part of DeepseekV3ForCausalLM.
    layers = [Layer(att, MLP(c.req("intermediate_size"), True, act) if i < first_dense else None,
                    None if i < first_dense else moe, 2) for i in range(n_layers)]
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"), layer_runs=runs_of(layers), norm="rms", norm_vectors=1,
        tied_embeddings=bool(c.get("tie_word_embeddings")), dropout=Dropout(attention=c.get("attention_dropout")),
        **_positions(c),
    )


def _parse_gpt2(c: _Config) -> dict[str, Any]:
    # GPT2Config.attribute_map: hidden_size, num_attention_heads, num_hidden_layers and max_position_embeddings
    # write n_embd, n_head, n_layer and n_positions, after them, so where a config has both the alias wins.
    hidden = c.req("hidden_size", "n_embd")
    heads = c.req("num_attention_heads", "n_head")
    d = _split_heads(c, hidden, heads)
    att = Attention("mha", heads, heads, d, d, True, True, fused_qkv=True)
    # modeling_gpt2.py, GPT2Block: inner_dim = n_inner if not None else 4 * hidden_size.
    layer = Layer(att, MLP(c.get("n_inner"), False, _act(c), bias=True), None, 2)
    positions = c.get("max_position_embeddings") if c.raw.get("max_position_embeddings") is not None else \
        c.get("n_positions")
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"),
        layer_runs=((layer, c.req("num_hidden_layers", "n_layer")),),
        norm="layer", norm_vectors=2, tied_embeddings=bool(c.get("tie_word_embeddings")),
        max_position_embeddings=positions, position_table_rows=positions,
        dropout=Dropout(c.get("attn_pdrop"), c.get("resid_pdrop"), c.get("embd_pdrop")),
    )


def _parse_gpt_neox(c: _Config) -> dict[str, Any]:
    hidden = c.req("hidden_size")
    heads = c.req("num_attention_heads")
    bias = bool(c.get("attention_bias"))
    d = _split_heads(c, hidden, heads)
    att = Attention("mha", heads, heads, d, d, bias, bias, fused_qkv=True, rotary_dim=int(d * _rotary_fraction(c)))
    mlp = MLP(c.req("intermediate_size"), False, _act(c), bias=True)
    layer = Layer(att, mlp, None, 2, parallel_residual=bool(c.get("use_parallel_residual")))
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"), layer_runs=((layer, c.req("num_hidden_layers")),),
        norm="layer", norm_vectors=2, tied_embeddings=bool(c.get("tie_word_embeddings")),
        dropout=Dropout(c.get("attention_dropout"), c.get("hidden_dropout"), c.get("hidden_dropout")),
        **_positions(c),
    )


def _parse_falcon(c: _Config) -> dict[str, Any]:
    # modeling_falcon.py: FalconAttention.query_key_value and FalconDecoderLayer's norms.
    hidden = c.req("hidden_size")
    heads = c.req("num_attention_heads", "n_head")
    d = _split_heads(c, hidden, heads)
    new_arch = bool(c.get("new_decoder_architecture"))
    parallel = bool(c.get("parallel_attn"))
    norms_in_parallel = c.get("num_ln_in_parallel_attn")
    if new_arch:
        kv = c.get("num_kv_heads")
        if heads % kv:
            raise ModelError(f"{c.origin}: num_kv_heads={kv} must divide num_attention_heads={heads}")
        if not parallel and norms_in_parallel in (None, 2):
            # FalconDecoderLayer builds input_layernorm/post_attention_layernorm but its forward calls ln_attn.
            raise ModelError(f"{c.origin}: new_decoder_architecture with parallel_attn=false does not run in "
                             "transformers' FalconDecoderLayer; set parallel_attn=true")
        norms = 2 if norms_in_parallel in (None, 2) else 1
    else:
        kv = 1 if c.get("multi_query") else heads
        if parallel and norms_in_parallel == 2:
            # FalconDecoderLayer builds ln_attn/ln_mlp but only the new architecture's forward uses them.
            raise ModelError(f"{c.origin}: num_ln_in_parallel_attn=2 needs new_decoder_architecture=true in "
                             "transformers' FalconDecoderLayer")
        norms = 1 if parallel else 2
    bias = bool(c.get("bias"))
    alibi = bool(c.get("alibi"))
    att = Attention("mha", heads, kv, d, d, bias, bias, fused_qkv=True, rotary_dim=0 if alibi else d,
                    kv_broadcast=new_arch)
    mlp = MLP(c.get("ffn_hidden_size"), False, _act(c), bias=bias)
    layer = Layer(att, mlp, None, norms, parallel_residual=parallel or new_arch)
    positions = _positions(c)
    if alibi:
        positions["max_position_embeddings"] = 0  # ALiBi has no position table and no trained length limit
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"),
        layer_runs=((layer, c.req("num_hidden_layers", "n_layer")),),
        norm="layer", norm_vectors=2, tied_embeddings=bool(c.get("tie_word_embeddings")),
        dropout=Dropout(c.get("attention_dropout"), c.get("hidden_dropout")), **positions,
    )


def _parse_phi(c: _Config) -> dict[str, Any]:
    """modeling_phi.py: PhiDecoderLayer runs attention and the MLP in parallel on one LayerNorm's output and adds
    both to the residual (each through ``resid_dropout``); PhiAttention has q/k/v and ``dense`` with biases,
    partial rotary (the rotated and passed parts joined by ``torch.cat``) and optional per-head LayerNorms on q and
    k (``qk_layernorm``); PhiMLP is fc1 -> act -> fc2 with biases; ``embed_dropout`` on the embeddings; the LM head
    has a bias."""
    hidden, heads, kv, d = _heads(c)
    att = Attention("mha", heads, kv, d, d, True, True, qk_norm=bool(c.get("qk_layernorm")), qk_layer_norm=True,
                    rotary_dim=int(d * _rotary_fraction(c)))
    layer = Layer(att, MLP(c.req("intermediate_size"), False, _act(c), bias=True), None, 1, parallel_residual=True)
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"), layer_runs=((layer, c.req("num_hidden_layers")),),
        norm="layer", norm_vectors=2, tied_embeddings=bool(c.get("tie_word_embeddings")), head_bias=True,
        dropout=Dropout(c.get("attention_dropout"), c.get("resid_pdrop"), c.get("embd_pdrop")), **_positions(c),
    )


def _parse_starcoder2(c: _Config) -> dict[str, Any]:
    """modeling_starcoder2.py: Mistral's attention (separate q/k/v, full rotary, GQA, one sliding window for every
    layer: ``create_sliding_window_causal_mask`` when ``config.sliding_window`` is set) with ``use_bias`` on q/k/v/o,
    pre-norm LayerNorms (weight and bias), Starcoder2MLP c_fc -> act -> c_proj (plain, ``use_bias``),
    ``residual_dropout`` on the attention and MLP outputs and ``embedding_dropout`` on the embeddings."""
    hidden, heads, kv, d = _heads(c)
    bias = bool(c.get("use_bias"))
    att = Attention("mha", heads, kv, d, d, bias, bias, rotary_dim=d)
    mlp = MLP(c.req("intermediate_size"), False, _act(c), bias=bias)
    n_layers = c.req("num_hidden_layers")
    layers = [Layer(att, mlp, None, 2, sliding_window=w) for w in _all_layers(c, c.get("sliding_window"))(n_layers)]
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"), layer_runs=runs_of(layers), norm="layer", norm_vectors=2,
        tied_embeddings=bool(c.get("tie_word_embeddings")),
        dropout=Dropout(c.get("attention_dropout"), c.get("residual_dropout"), c.get("embedding_dropout")),
        **_positions(c),
    )


def _parse_stablelm(c: _Config) -> dict[str, Any]:
    """modeling_stablelm.py: StableLmAttention is PhiAttention's (q/k/v with ``use_qkv_bias``, o_proj without a
    bias, partial rotary on the first ``partial_rotary_factor`` of hidden_size // heads, the rotated and passed
    parts joined by ``torch.cat``), GQA; StableLmMLP is Llama's gated MLP without biases; LayerNorms with a bias;
    ``use_parallel_residual`` runs attention and the MLP on the one input norm; ``hidden_dropout`` only on the MLP
    output (StableLmDecoderLayer.dropout). Its per-head q/k LayerNorms (``qk_layernorm``, StableLM 2 12B:
    StableLmLayerNormPerHead splits q into heads and normalises each with its own LayerNorm) are not described:
    such a config takes the traced path."""
    if c.get("qk_layernorm"):
        raise UnsupportedModelType(f"{c.origin}: StableLM's per-head q/k LayerNorms (qk_layernorm=true) have no "
                                   "analytic description")
    hidden, heads = c.req("hidden_size"), c.req("num_attention_heads")
    d = _split_heads(c, hidden, heads)  # (StableLmAttention: head_dim = hidden_size // num_heads, always)
    kv = c.get("num_key_value_heads")
    if heads % kv:
        raise ModelError(f"{c.origin}: num_key_value_heads={kv} must divide num_attention_heads={heads}")
    att = Attention("mha", heads, kv, d, d, bool(c.get("use_qkv_bias")), False,
                    rotary_dim=int(d * _rotary_fraction(c)))
    parallel = bool(c.get("use_parallel_residual"))
    layer = Layer(att, MLP(c.req("intermediate_size"), True, _act(c)), None, 1 if parallel else 2,
                  parallel_residual=parallel)
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"), layer_runs=((layer, c.req("num_hidden_layers")),),
        norm="layer", norm_vectors=2, tied_embeddings=bool(c.get("tie_word_embeddings")),
        dropout=Dropout(c.get("attention_dropout"), c.get("hidden_dropout")), **_positions(c),
    )


def _parse_gptj(c: _Config) -> dict[str, Any]:
    """modeling_gptj.py: GPTJBlock runs GPTJAttention and GPTJMLP in parallel on one LayerNorm (``ln_1``) and adds
    both to the residual; q/k/v and ``out_proj`` without biases; RoPE on the first ``rotary_dim`` dims of each
    head (None: all of them) rotated in interleaved pairs (``rotate_every_two`` with each layer's
    ``repeat_interleave``'d sin and cos), joined to the passed part by ``torch.cat`` in (b, s, a, d) layout;
    GPTJMLP fc_in -> act -> fc_out with biases (``n_inner``, 4 * n_embd by default); ``resid_pdrop`` on the
    attention and MLP outputs, ``embd_pdrop`` on the embeddings; the LM head has a bias. GPTJConfig.attribute_map
    makes hidden_size, num_attention_heads, num_hidden_layers and max_position_embeddings aliases of n_embd,
    n_head, n_layer and n_positions (the alias wins, as for GPT-2)."""
    hidden = c.req("hidden_size", "n_embd")
    heads = c.req("num_attention_heads", "n_head")
    d = _split_heads(c, hidden, heads)  # (GPTJAttention refuses any other width)
    # (GPTJRotaryEmbedding's tables are ``rotary_dim or n_embd`` wide: a null rotary_dim fits one head only, and
    # an odd or wider one, or 0, does not fit the rotated slice)
    rotary = c.get("rotary_dim")
    if rotary is None and heads == 1:
        rotary = d
    if rotary is None or not 0 < rotary <= d or rotary % 2:
        raise ModelError(f"{c.origin}: rotary_dim={_shown(rotary)} must be an even number from 2 to the head width "
                         f"{d} (n_embd // n_head; null only with one head)")
    att = Attention("mha", heads, heads, d, d, False, False, rotary_dim=rotary)
    layer = Layer(att, MLP(c.get("n_inner"), False, _act(c), bias=True), None, 1, parallel_residual=True)
    positions = c.get("max_position_embeddings") if c.raw.get("max_position_embeddings") is not None else \
        c.get("n_positions")
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"), layer_runs=((layer, c.req("num_hidden_layers", "n_layer")),),
        norm="layer", norm_vectors=2, tied_embeddings=bool(c.get("tie_word_embeddings")), head_bias=True,
        max_position_embeddings=positions, buffer_bytes=4 * positions * rotary,
        dropout=Dropout(c.get("attn_pdrop"), c.get("resid_pdrop"), c.get("embd_pdrop")),
    )


def _parse_gpt_bigcode(c: _Config) -> dict[str, Any]:
    """modeling_gpt_bigcode.py: GPT-2's block (ln_1, attention, residual, ln_2, c_fc -> act -> c_proj, residual,
    ``resid_pdrop`` after each, learned positions ``wpe`` added to the token embeddings, then ``embd_pdrop``) with
    nn.Linear where GPT-2 has Conv1D; GPTBigCodeAttention's one fused ``c_attn`` makes q and, with ``multi_query``
    (the default), one key and one value head (h + 2 x head_dim wide), else every head's q, k, v side by side;
    c_proj with a bias; the LM head tied and without a bias. The attention is transformers' shared one: eager is
    Llama's (``softmax(..., dtype=torch.float32).to(query.dtype)``); ``attention_softmax_in_fp32`` and
    ``scale_attention_softmax_in_fp32`` are read by upcast_softmax, which nothing calls in transformers 5.
    GPTBigCodeConfig.attribute_map makes hidden_size, num_attention_heads, num_hidden_layers and
    max_position_embeddings aliases of n_embd, n_head, n_layer and n_positions (the alias wins)."""
    hidden = c.req("hidden_size", "n_embd")
    heads = c.req("num_attention_heads", "n_head")
    d = _split_heads(c, hidden, heads)  # (GPTBigCodeAttention refuses any other width)
    kv = 1 if c.get("multi_query") else heads  # (GPTBigCodeConfig.__post_init__: num_key_value_heads)
    att = Attention("mha", heads, kv, d, d, True, True, fused_qkv=True)
    layer = Layer(att, MLP(c.get("n_inner"), False, _act(c), bias=True), None, 2)
    positions = c.get("max_position_embeddings") if c.raw.get("max_position_embeddings") is not None else \
        c.get("n_positions")
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"), layer_runs=((layer, c.req("num_hidden_layers", "n_layer")),),
        norm="layer", norm_vectors=2, tied_embeddings=bool(c.get("tie_word_embeddings")),
        max_position_embeddings=positions, position_table_rows=positions, buffer_bytes=positions * positions,
        dropout=Dropout(c.get("attn_pdrop"), c.get("resid_pdrop"), c.get("embd_pdrop")),
    )


def _parse_opt(c: _Config) -> dict[str, Any]:
    hidden = c.req("hidden_size")
    heads = c.req("num_attention_heads")
    d = _split_heads(c, hidden, heads)
    bias = bool(c.get("enable_bias"))
    att = Attention("mha", heads, heads, d, d, bias, bias)
    mlp = MLP(c.req("ffn_dim"), False, _act(c), bias=bias)
    affine = bool(c.get("layer_norm_elementwise_affine"))
    layer = Layer(att, mlp, None, 2)
    max_pos = c.get("max_position_embeddings")
    proj = c.get("word_embed_proj_dim")
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"), layer_runs=((layer, c.req("num_hidden_layers")),),
        norm="layer", norm_vectors=2 if affine else 0, tied_embeddings=bool(c.get("tie_word_embeddings")),
        max_position_embeddings=max_pos,
        position_table_rows=max_pos + 2,  # OPTLearnedPositionalEmbedding keeps an offset of 2 rows
        embedding_dim=proj if proj != hidden else 0,
        final_norm=bool(c.get("do_layer_norm_before")) and not c.get("_remove_final_layer_norm"),
        dropout=Dropout(c.get("attention_dropout"), c.get("dropout")),
        trait_switches={"norm_after_residual": not c.get("do_layer_norm_before")},
    )


def _parse_bloom(c: _Config) -> dict[str, Any]:
    hidden = c.req("hidden_size", "n_embed")
    heads = c.req("num_attention_heads", "n_head")  # BloomConfig.attribute_map: the alias wins, as for GPT-2
    d = _split_heads(c, hidden, heads)
    att = Attention("mha", heads, heads, d, d, True, True, fused_qkv=True)
    # BloomGelu: a tanh GELU written in Python inside a custom autograd Function (modeling_bloom.py)
    layer = Layer(att, MLP(4 * hidden, False, "bloom_gelu", bias=True), None, 2)
    return dict(
        hidden_size=hidden, vocab_size=c.req("vocab_size"),
        layer_runs=((layer, c.req("num_hidden_layers", "n_layer")),),
        norm="layer", norm_vectors=2, tied_embeddings=bool(c.get("tie_word_embeddings")), embedding_norm=True,
        dropout=Dropout(c.get("attention_dropout"), c.get("hidden_dropout")),
    )


PARSERS: dict[str, Callable[[_Config], dict[str, Any]]] = {
    "llama": _parse_llama,
    "mistral": _parse_mistral,
    "mixtral": _parse_mixtral,
    "qwen2": _parse_qwen2,
    "qwen2_moe": _parse_qwen2_moe,
    "qwen3": _parse_qwen3,
    "qwen3_moe": _parse_qwen3_moe,
    "gemma": _parse_gemma,
    "gemma2": _parse_gemma2,
    "gemma3_text": _parse_gemma3_text,
    "phi3": _parse_phi3,
    "gpt2": _parse_gpt2,
    "gpt_neox": _parse_gpt_neox,
    "falcon": _parse_falcon,
    "opt": _parse_opt,
    "bloom": _parse_bloom,
    "deepseek_v3": _parse_deepseek_v3,
    "olmo2": _parse_olmo2,
    "cohere": _parse_cohere,
    "phi": _parse_phi,
    "granite": _parse_granite,
    "smollm3": _parse_smollm3,
    "internlm3": _parse_internlm3,
    "ernie4_5": _parse_ernie4_5,
    "glm4": _parse_glm4,
    "olmo3": _parse_olmo3,
    "cohere2": _parse_cohere2,
    "starcoder2": _parse_starcoder2,
    "stablelm": _parse_stablelm,
    "gptj": _parse_gptj,
    "gpt_bigcode": _parse_gpt_bigcode,
    "olmo": _parse_olmo,
    "gpt_oss": _parse_gpt_oss,
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(PARSERS)


class UnsupportedModelType(ModelError):
    """The config parses as JSON but its model_type has no analytic parser."""


_GEMMA = FamilyTraits(rms_norm_fp32_plus_one=True)
FAMILY_TRAITS: dict[str, FamilyTraits] = {
    "gpt2": FamilyTraits(eager_attention="gpt2", hidden_dropout="per_block", embedding_dropout=True,
                         position_ids="per_sequence", decoder_locals="token_and_shared_position",
                         mlp_applies_dropout=True),
    "opt": FamilyTraits(hidden_dropout="per_block", position_ids="per_token", decoder_locals="opt", mlp_inline=True),
    "gpt_neox": FamilyTraits(q_built_by_cat=True, fused_qkv_layout="per_head", hidden_dropout="per_block",
                             embedding_dropout=True, decoder_locals="dropped_embeddings"),
    "phi3": FamilyTraits(q_built_by_cat=True, fused_qkv_layout="blocks", hidden_dropout="per_block"),
    "bloom": FamilyTraits(block="bloom", sdpa_supported=False, hidden_dropout="per_block"),
    "falcon": FamilyTraits(block="falcon", sdpa_mask_always=True, hidden_dropout="per_residual_add",
                           bias_after_matmul=True, weight_casts_cached=False,
                           rotary_tables_without_rotary=True),
    "gemma": _GEMMA,
    "gemma2": replace(_GEMMA, sdpa_supported=False, eager_masks_always_built=frozenset({False, True})),
    "gemma3_text": replace(_GEMMA, rotary_tables=2, eager_masks_always_built=frozenset({False, True})),
    "qwen2_moe": FamilyTraits(eager_masks_always_built=frozenset({False, True})),
    "qwen2": FamilyTraits(eager_masks_always_built=frozenset({False})),
    "qwen3": FamilyTraits(eager_masks_always_built=frozenset({False})),
    "olmo2": FamilyTraits(norm_placement="post", rms_norm_fp32_product=True, rotary_in_input_dtype=True,
                          rotary_tables_fp32=True),
    # (CohereForCausalLM's ``logits * logit_scale`` saves nothing and its transient is under the traced peaks)
    "cohere": FamilyTraits(rms_norm_fp32_product=True, norm_centred_twice=True, rotary_in_input_dtype=True,
                           rotary_float_copies=True, residual_first_in_parallel_sum=True),
    "phi": FamilyTraits(q_built_by_cat=True, hidden_dropout="per_block", embedding_dropout=True,
                        rotary_split_locals=True),
    "smollm3": FamilyTraits(eager_masks_always_built=frozenset({False})),
    "ernie4_5": FamilyTraits(rotary_in_input_dtype=True, rotary_half_copied=True, rotary_tables_per_layer=True,
                             rotary_tables_fp32=True, attention_dropout=False),
    "glm4": FamilyTraits(q_built_by_cat=True, rotary_tables_per_layer=True),
    "olmo3": FamilyTraits(norm_placement="post", rms_norm_fp32_product=True, rotary_in_input_dtype=True,
                          rotary_tables=2, eager_masks_always_built=frozenset({False, True}), rotary_tables_fp32=True),
    "cohere2": FamilyTraits(rms_norm_fp32_product=True, norm_centred_twice=True, rotary_in_input_dtype=True,
                            rotary_float_copies=True, eager_masks_always_built=frozenset({False, True}),
                            residual_first_in_parallel_sum=True),
    "starcoder2": FamilyTraits(hidden_dropout="per_block", embedding_dropout=True,
                               decoder_locals="dropped_embeddings", mlp_applies_dropout=True),
    "stablelm": FamilyTraits(q_built_by_cat=True, hidden_dropout="after_mlp", rotary_split_locals=True,
                             attention_output_held=True, residual_first_in_parallel_sum=True),
    "gptj": FamilyTraits(eager_attention="fp32_scores", hidden_dropout="per_block", embedding_dropout=True,
                         decoder_locals="dropped_embeddings", rotary_split_locals=True, rotary_tables_per_layer=True,
                         rotary_tables_split=True),
    "gpt_bigcode": FamilyTraits(fused_qkv_layout="blocks", hidden_dropout="per_block", embedding_dropout=True,
                                position_ids="per_sequence", decoder_locals="token_and_shared_position",
                                mlp_applies_dropout=True),
    "olmo": FamilyTraits(layer_norm_upcast=True, rotary_in_input_dtype=True, rotary_tables_fp32=True),
    # (GptOssPreTrainedModel._supports_sdpa is False: --attention sdpa runs eager, as transformers' default does;
    # GptOssModel.forward builds the full and the sliding mask whatever the layers use)
    "gpt_oss": FamilyTraits(sdpa_supported=False, rms_norm_fp32_product=True,
                            eager_masks_always_built=frozenset({False, True}), rotary_tables_half=True),
    "granite": FamilyTraits(residual_branches_scaled=True),
}
"""Each family's traits; a family not listed has Llama's. Gemma 2/3 and Qwen2-MoE build the full and the sliding
eager mask whatever their layers use, Qwen2/Qwen3 the full one always; the others (Mistral, Mixtral, Phi-3,
Qwen3-MoE: ``create_sliding_window_causal_mask if config.sliding_window else create_causal_mask``) only the one
their layers use."""


def spec_from_config(config: dict[str, Any], name: str = "", source: str = "") -> ModelSpec:
    """Turn a Hugging Face config dict into a :class:`ModelSpec`.

    Raises :class:`UnsupportedModelType` for a ``model_type`` without a parser (the caller may then fall
    back on counting with transformers) and :class:`ModelError` for a config missing a needed field.
    """
    origin = source or name or "config"
    if not isinstance(config, dict):
        raise ModelError(f"{origin}: a config must be a JSON object, got {type(config).__name__}")
    model_type = model_type_of(config, origin)
    parser = PARSERS.get(model_type)
    if parser is None:
        raise UnsupportedModelType(
            f"{origin}: model_type {model_type!r} has no analytic parser; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    reader = _Config(config, origin)
    for key in sorted(_COUNTS & config.keys()):  # every size in the file, read by this family's modules or not
        if config[key] is not None:
            reader._check(key, config[key])
    fields = parser(reader)
    traits = FAMILY_TRAITS.get(model_type, FamilyTraits())
    traits = replace(traits, **fields.pop("trait_switches", {}))  # (the ones a config sets: OPT's norm placement)
    return ModelSpec(name=name or str(model_type), model_type=str(model_type), source=source, traits=traits,
                     **fields)


MODEL_TYPE_LIMIT = 100
"""The longest model_type read (transformers' longest is under 40 characters)."""


def model_type_of(config: dict[str, Any], origin: str) -> str:
    """The config's ``model_type``: a non-empty string (a list, a number or an object there is refused in one line,
    not looked up)."""
    model_type = config.get("model_type")
    if model_type is None or model_type == "":
        raise ModelError(f"{origin}: config has no 'model_type'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if not isinstance(model_type, str):
        raise ModelError(f"{origin}: config field 'model_type' is {_json_type(model_type)}; it must be a string such "
                         f"as 'llama' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if len(model_type) > MODEL_TYPE_LIMIT or not model_type.isprintable():
        raise ModelError(f"{origin}: config field 'model_type' is {model_type[:40]!r}...; a model_type is a short "
                         f"name such as 'llama' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return model_type


def check_learned_positions(spec: ModelSpec, seq: int, command: str) -> None:
    """Refuse a sequence past a learned position table for a command that runs the model for real (measure,
    precision-check): GPT-2's ``wpe`` has n_positions rows and OPT's ``embed_positions`` max_position_embeddings
    (plus its offset of 2), and ``torch.nn.functional.embedding`` raises IndexError for a position past them.
    (RoPE models compute their positions and run past max_position_embeddings; the estimate only warns there.)"""
    limit = spec.max_position_embeddings
    if spec.position_table_rows and limit and seq > limit:
        key = "n_positions" if spec.model_type == "gpt2" else "max_position_embeddings"
        raise ModelError(f"--seq {seq:,} is past {spec.name}'s {limit:,} positions ({key}, a learned position table "
                         f"that cannot be indexed further): {command} runs the model, so give --seq {limit:,} or "
                         "less")


def nominal_spec(num_parameters: int) -> ModelSpec:
    """A model known only by its parameter count (the seed article's "7B"), as one flat tensor."""
    if num_parameters <= 0:
        raise ModelError(f"--params must be a positive number of parameters, got {num_parameters}")
    flat = ParamGroup("parameters", 1, (ParamTensor("all", (num_parameters,)),))
    return ModelSpec(
        name=f"{num_parameters:.4g} parameters", model_type="nominal", hidden_size=0, vocab_size=0, layer_runs=(),
        norm="rms", norm_vectors=0, tied_embeddings=True, explicit_param_groups=(flat,), source="--params",
    )


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


CONFIG_SIZE_LIMIT = 8 * 2**20
"""The largest config file read (real ones are a few KB): a FIFO, a device or a huge file is refused, not read."""


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a config.json (or the config.json inside a folder), with one-line errors: only a regular file of at
    most CONFIG_SIZE_LIMIT bytes holding a UTF-8 JSON object."""
    try:
        if path.is_dir():
            path = path / "config.json"
            if not path.is_file():
                raise ModelError(f"{path.parent}: folder holds no config.json")
        if not path.is_file():
            raise ModelError(f"{path}: not a regular file; give a config.json or the folder holding one")
        if path.stat().st_size > CONFIG_SIZE_LIMIT:
            raise ModelError(f"{path}: {path.stat().st_size:,} bytes; a config.json is at most "
                             f"{CONFIG_SIZE_LIMIT:,} bytes")
        with path.open("rb") as handle:
            data = handle.read(CONFIG_SIZE_LIMIT + 1)
    except OSError as exc:
        raise ModelError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > CONFIG_SIZE_LIMIT:
        raise ModelError(f"{path}: more than {CONFIG_SIZE_LIMIT:,} bytes; a config.json is a few KB")
    try:
        config = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise ModelError(f"{path}: JSON nested too deeply for a config") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: a config must be a JSON object, got {_json_type(config)}")
    # Multimodal wrappers (Gemma 3, Llama 4, ...) keep the language model under text_config.
    outer_type = config.get("model_type")
    if outer_type is not None and not isinstance(outer_type, str):
        model_type_of(config, str(path))  # (refuses it in one line)
    if "text_config" in config and outer_type not in PARSERS:
        if not isinstance(config["text_config"], dict):
            raise ModelError(f"{path}: text_config must be a JSON object, got {_json_type(config['text_config'])}")
        inner = dict(config["text_config"])
        inner.setdefault("model_type", f"{outer_type or ''}_text")
        return inner
    return config
