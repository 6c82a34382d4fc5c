"""Scaled-down versions of real configs: same family, same head grouping and MLP ratio, tiny widths."""

import json

from conftest import CONFIGS

from trainmem import validate


def scale_down(config: dict, heads: int = 4) -> dict:
    """trainmem.validate.scale_down with a 256-token vocabulary (the matrix's own is 512)."""
    return validate.scale_down(config, heads=heads, vocab=256)


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
