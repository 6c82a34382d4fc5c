"""Tiny configs of every supported model_type, small enough to build with transformers in milliseconds.

Each exercises the features of its family that change the parameter count (GQA, biases, fused
projections, MoE with shared experts and dense layers, MLA, learned position tables, tied embeddings).
"""

_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=211, max_position_embeddings=64)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_BASE, model_type="llama"),
    "llama-bias-tied": dict(_BASE, model_type="llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "mistral": dict(_BASE, model_type="mistral", head_dim=24),
    "mixtral": dict(_BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(_BASE, model_type="qwen2"),
    "qwen2_moe": dict(_BASE, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "qwen3": dict(_BASE, model_type="qwen3", head_dim=20),
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=16, decoder_sparse_step=2),
    "gemma": dict(_BASE, model_type="gemma", head_dim=32),
    "olmo2": dict(_BASE, model_type="olmo2"),
    "olmo2-bias-tied": dict(_BASE, model_type="olmo2", attention_bias=True, tie_word_embeddings=True, head_dim=24),
    "cohere": dict(_BASE, model_type="cohere"),
    "cohere-qk-norm-untied": dict(_BASE, model_type="cohere", use_qk_norm=True, tie_word_embeddings=False,
                                  attention_bias=True),
    "phi": dict(_BASE, model_type="phi", num_key_value_heads=4),
    "phi-gqa-qk-norm-tied": dict(_BASE, model_type="phi", qk_layernorm=True, tie_word_embeddings=True,
                                 partial_rotary_factor=0.4),
    "granite": dict(_BASE, model_type="granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.0078125, logits_scaling=16.0, tie_word_embeddings=True),
    "granite-bias": dict(_BASE, model_type="granite", attention_bias=True, mlp_bias=True),
    "gemma2": dict(_BASE, model_type="gemma2", head_dim=16),
    "gemma3_text": dict(_BASE, model_type="gemma3_text", head_dim=16),
    "phi3": dict(_BASE, model_type="phi3", pad_token_id=0),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=3, n_head=4, n_positions=48, vocab_size=211),
    "gpt2-inner-untied": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=48, vocab_size=211,
                              n_inner=80, tie_word_embeddings=False),
    "gpt_neox": dict(_BASE, model_type="gpt_neox"),
    "falcon": dict(model_type="falcon", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=211),
    "falcon-new-arch": dict(model_type="falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_kv_heads=2, new_decoder_architecture=True, bias=True, vocab_size=211),
    "falcon-sequential": dict(model_type="falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              multi_query=False, parallel_attn=False, vocab_size=211, tie_word_embeddings=False),
    "opt": dict(model_type="opt", hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4,
                vocab_size=211, max_position_embeddings=48, pad_token_id=1, bos_token_id=2, eos_token_id=2),
    "opt-proj": dict(model_type="opt", hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=211, max_position_embeddings=48, word_embed_proj_dim=32, do_layer_norm_before=False,
                     pad_token_id=1, bos_token_id=2, eos_token_id=2),
    "bloom": dict(model_type="bloom", hidden_size=64, n_layer=3, n_head=4, vocab_size=211),
    "deepseek_v3": dict(_BASE, model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16,
                        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1),
    "deepseek_v3-noqlora": dict(_BASE, model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                                n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=2, q_lora_rank=None,
                                kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=2,
                                topk_group=1),
}

# SmolLM3, InternLM3, ERNIE 4.5, GLM-4, OLMo-3 and Cohere 2: each with the layer pattern that changes its modules
# (NoPE layers, sliding and full layers) reached within four or five layers.
TINY_CONFIGS.update({
    "smollm3": dict(_BASE, model_type="smollm3", pad_token_id=0, num_hidden_layers=4),
    "smollm3-window-bias-untied": dict(_BASE, model_type="smollm3", pad_token_id=0, num_hidden_layers=4,
                                       use_sliding_window=True, sliding_window=16, no_rope_layer_interval=2,
                                       attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "internlm3": dict(_BASE, model_type="internlm3", head_dim=16),
    "internlm3-bias": dict(_BASE, model_type="internlm3", head_dim=24, qkv_bias=True, bias=True),
    "ernie4_5": dict(_BASE, model_type="ernie4_5", head_dim=16),
    "ernie4_5-bias-untied": dict(_BASE, model_type="ernie4_5", head_dim=24, use_bias=True, tie_word_embeddings=False),
    "glm4": dict(_BASE, model_type="glm4", pad_token_id=0, head_dim=16),
    "glm4-nobias-tied": dict(_BASE, model_type="glm4", pad_token_id=0, head_dim=32, attention_bias=False,
                             tie_word_embeddings=True, partial_rotary_factor=0.25),
    "olmo3": dict(_BASE, model_type="olmo3", num_hidden_layers=4, sliding_window=16),
    "olmo3-bias-tied": dict(_BASE, model_type="olmo3", attention_bias=True, tie_word_embeddings=True, head_dim=24),
    "cohere2": dict(_BASE, model_type="cohere2", num_hidden_layers=4, sliding_window=16),
    "cohere2-bias-untied": dict(_BASE, model_type="cohere2", num_hidden_layers=5, attention_bias=True,
                                tie_word_embeddings=False, sliding_window_pattern=2),
})
