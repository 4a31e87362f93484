"""Independent random streams per role (drafter, verifier, ...), by construction.

Two generators seeded with the same number produce the same draws: a drafter and a verifier seeded alike would
draw the first draft and the sampled root from the same uniform, so the draft would follow the root and speculative
sampling would no longer keep the base's law. Every role therefore seeds its generator from a hash of (seed, role):
one user-facing seed, distinct streams.
"""

from __future__ import annotations

import hashlib

import torch


def role_seed(seed: int, role: str) -> int:
    """A 63-bit seed for `role`'s stream, derived from the run's seed (distinct roles -> unrelated seeds)."""
    digest = hashlib.blake2b(f"draftlab/{int(seed)}/{role}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def role_generator(seed: int, role: str, device="cpu") -> torch.Generator:
    """A torch.Generator on `device` for `role`'s draws in a run seeded with `seed`."""
    return torch.Generator(device=device).manual_seed(role_seed(seed, role))


def derived_generator(parent: torch.Generator, role: str) -> torch.Generator:
    """A generator for `role` seeded from one draw of `parent` (on parent's device): a caller that hands over one
    generator still gets a separate stream for each role."""
    seed = int(torch.randint(0, 1 << 62, (1,), generator=parent, device=parent.device))
    return role_generator(seed, role, parent.device)
