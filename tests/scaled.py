"""Scaled-down versions of real configs: same family, same head grouping and MLP ratio, tiny widths."""

import json

from conftest import CONFIGS


def scale_down(config: dict, heads: int = 4, head_dim: int = 16, layers: int = 3, vocab: int = 256) -> dict:
    cfg = dict(config)
    cfg.pop("_name_or_path", None)
    if cfg["model_type"] == "gpt2":
        h = heads * head_dim
        return dict(cfg, n_embd=h, hidden_size=h, n_head=heads, num_attention_heads=heads, num_key_value_heads=heads,
                    n_layer=layers, num_hidden_layers=layers, vocab_size=vocab, n_positions=128,
                    max_position_embeddings=128, intermediate_size=4 * h)
    h_old, a_old = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_old = cfg.get("num_key_value_heads") or a_old
    group = a_old // kv_old
    heads = max(heads, 2 * group if kv_old > 1 else group) // group * group  # keep GQA with >1 kv head
    h = heads * head_dim
    cfg.update(hidden_size=h, num_attention_heads=heads, num_key_value_heads=heads // group, head_dim=head_dim,
               num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=128,
               intermediate_size=max(8, round(cfg["intermediate_size"] / h_old * h)))
    return cfg


def reference(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


SCALED = {
    "Llama-2-7B": scale_down(reference("Llama-2-7b.json")),
    "Llama-3-8B": scale_down(reference("Meta-Llama-3-8B.json")),
    "Mistral-7B": scale_down(reference("Mistral-7B-v0.1.json")),
    "Qwen2.5-0.5B": scale_down(reference("Qwen2.5-0.5B.json"), heads=7),
    "GPT-2": scale_down(reference("gpt2.json")),
    "Mixtral-8x7B": scale_down(reference("Mixtral-8x7B-v0.1.json")),
}
