"""Models that are not transformers models, for `trainmem trace --factory` (tests/test_factory.py)."""

import torch


class TinyDecoder(torch.nn.Module):
    """An embedding, two blocks of eager attention (the b x s x s scores are saved) and an MLP, an untied head and
    the cross-entropy of the next token: a model of one's own, written in plain PyTorch."""

    vocab_size = 64

    def __init__(self, width: int = 32, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(self.vocab_size, width)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "norm": torch.nn.LayerNorm(width), "qkv": torch.nn.Linear(width, 3 * width),
            "out": torch.nn.Linear(width, width), "up": torch.nn.Linear(width, 4 * width),
            "down": torch.nn.Linear(4 * width, width)}) for _ in range(layers))
        self.head = torch.nn.Linear(width, self.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm"](x)).chunk(3, dim=-1)
            scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1)
            x = x + block["out"](scores @ v)
            x = x + block["down"](torch.nn.functional.gelu(block["up"](x)))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


def build_model():
    return TinyDecoder()


def build_wide_model():
    """Wide enough that every activation is many 512-byte blocks (the CUDA rounding then bends no line)."""
    return TinyDecoder(width=256)


def make_batch(batch, seq):
    return (torch.randint(0, TinyDecoder.vocab_size, (batch, seq)),)


NOT_A_FUNCTION = 3
