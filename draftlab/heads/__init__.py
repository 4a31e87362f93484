"""Draft modules. Each has .config(), .train_hidden(hidden, input_ids) and .lm_heads."""

from __future__ import annotations

from .medusa import MedusaHeads


def build_draft(head: dict, hidden_size: int, vocab_size: int, base=None):
    """A draft module from a head config (recipe section or export's `head` dict)."""
    kind = head["type"]
    if kind == "medusa":
        module = MedusaHeads(hidden_size, vocab_size, head["num_heads"], head["num_layers"])
    elif kind == "hydra":
        from .hydra import HydraHeads

        module = HydraHeads(hidden_size, vocab_size, head["num_heads"], head["num_layers"],
                            prefix_attention=head.get("prefix_attention", False), base=base)
    else:
        raise ValueError(f"head.type={kind!r}: use 'medusa' or 'hydra'")
    if base is not None:
        module.init_from_base(base)
    return module


__all__ = ["MedusaHeads", "build_draft"]
