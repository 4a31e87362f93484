"""Medusa-1 heads: K stacks of residual blocks over the base's last hidden state, each with its own lm_head."""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero-initialised so a fresh head starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """Head k (0-based) reads h_t and predicts token t+k+2 (the base itself predicts t+1)."""

    kind = "medusa"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))

    def config(self) -> dict:
        return {"type": "medusa", "num_heads": self.num_heads, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}

    @torch.no_grad()
    def init_from_base(self, base) -> None:
        """Copy the base's lm_head into every head (Medusa's initialisation)."""
        w = base.get_output_embeddings().weight
        for head in self.lm_heads:
            head.weight.copy_(w.to(head.weight.dtype))

    def train_hidden(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask=None) -> list[torch.Tensor]:
        """Per-head features [B, S, H]; position t of head k is trained on token t+k+2."""
        return [blocks(hidden) for blocks in self.blocks]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Decoding: h [..., H] -> [..., K, V] logits of all heads."""
        return torch.stack([lm(blk(hidden)) for blk, lm in zip(self.blocks, self.lm_heads)], dim=-2)
