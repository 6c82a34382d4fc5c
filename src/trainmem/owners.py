"""Who a tensor of the step belongs to, as ``trainmem diff`` groups them: typed, so that no label is a key."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OwnerKind(enum.Enum):
    """The parts of a model a tensor can belong to (docs/method.md, "trainmem diff")."""

    EMBEDDING = "embedding"
    """The token (and position) embeddings and what they save."""
    LAYER = "layer"
    """One decoder layer (``Owner.layer`` says which)."""
    FINAL_NORM = "final_norm"
    """The base model's modules with parameters outside the layers and embeddings: the final norm."""
    HEAD = "head"
    """The LM head: its weight, the input it keeps, the logits."""
    LOSS = "loss"
    """What the CausalLM forward computes itself: the loss's upcast, log_softmax, labels."""
    MODEL = "model"
    """The rest of the base model: rotary tables, masks, buffers, the shared constants."""
    OPTIMIZER = "optimizer"
    """optimizer.step()'s temporaries, and states not tied to one parameter."""
    ALL = "all"
    """A whole category, where the estimate's moment does not say whose its bytes are."""
    REST = "rest"
    """What an estimated moment split by owner holds beyond its owners' parts."""


_ORDER = {kind: i for i, kind in enumerate(OwnerKind)}


@dataclass(frozen=True)
class Owner:
    kind: OwnerKind
    layer: int | None = None

    def label(self) -> str:
        """For people only."""
        if self.kind is OwnerKind.LAYER:
            return f"layer {self.layer}"
        return "rest of the moment" if self.kind is OwnerKind.REST else self.kind.value.replace("_", " ")

    def sort_key(self) -> tuple[int, int]:
        return (_ORDER[self.kind], -1 if self.layer is None else self.layer)
