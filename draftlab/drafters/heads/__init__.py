"""Draft heads on the base's own hidden state: Medusa, Hydra and Hydra++ (training modules and their drafter)."""

from __future__ import annotations

from .drafter import HeadsDrafter
from .medusa import MedusaHeads


def build_heads(head: dict, hidden_size: int, vocab_size: int, base=None):
    """A heads module from a head config (recipe section or export's `head` dict)."""
    kind = head["type"]
    if kind == "medusa":
        module = MedusaHeads(hidden_size, vocab_size, head["num_heads"], head["num_layers"])
    elif kind == "hydra":
        from .hydra import HydraHeads

        module = HydraHeads(hidden_size, vocab_size, head["num_heads"], head["num_layers"],
                            prefix_attention=head.get("prefix_attention", False), base=base,
                            dropout=head.get("dropout", 0.0))
    else:
        raise ValueError(f"head.type={kind!r} is not a head type (medusa, hydra)")
    if base is not None:
        module.init_from_base(base)
    return module


__all__ = ["HeadsDrafter", "MedusaHeads", "build_heads"]
