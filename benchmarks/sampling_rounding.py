"""How often inverse-CDF sampling with the same uniform draws another token when the law it samples differs in a last
bit: the reason split and fused sampled runs of one seed part on a GPU with random bf16 weights (docs/benchmarks.md,
"Compiled decoding on a GPU: the fused step, fused projections, the chained step and sampling").

Random logits of a random-weight 7B's scale (standard deviation 1.28) in bf16, temperature 0.8, the sampler of
decode.acceptance.draw (cumulative sums, searchsorted), one uniform per draw shared by both sides:
- `reordered`: the same float32 probabilities summed in another order (blocks of 128, then their prefix sums), as
  another kernel schedule would;
- `bf16_bump`: a share of the logits one bf16 step up (another fusion of the last norm or product), 1% and 10%.
Per vocabulary size: the share of draws that differ, and the chance that 127 draws in a row all agree.

    python benchmarks/sampling_rounding.py      # seconds on a CPU; writes benchmarks/results/sampling_rounding.json
"""

from __future__ import annotations

import torch

from common import write_result

DRAWS, TEMPERATURE, STD, STEPS = 20000, 0.8, 1.28, 127


def draw(logits: torch.Tensor, u: torch.Tensor, blocks: int | None = None) -> torch.Tensor:
    """decode.acceptance.draw on softmax(logits / T), its cumulative sums in one pass or in blocks."""
    from draftlab.decode.acceptance import draw as sample

    p = torch.softmax(logits.float() / TEMPERATURE, -1)
    if blocks is None:
        return sample(p, u)
    parts = p.view(p.shape[0], -1, blocks)
    offsets = torch.nn.functional.pad(parts.sum(-1).cumsum(-1), (1, -1))[..., None]
    cdf = (parts.cumsum(-1) + offsets).view_as(p)
    idx = torch.searchsorted(cdf, (u * cdf[..., -1:]).contiguous(), right=True)
    return idx.clamp(max=p.shape[-1] - 1)


def row(a: torch.Tensor, b: torch.Tensor) -> dict:
    share = (a != b).float().mean().item()
    return {"draws_differ": round(share, 6), "all_agree_over_127_draws": round((1 - share) ** STEPS, 4)}


def main() -> None:
    g = torch.Generator().manual_seed(0)
    out = {}
    for V in (512, 32000):
        logits = (torch.randn(DRAWS, V, generator=g) * STD).bfloat16()
        u = torch.rand(DRAWS, 1, generator=g)
        base = draw(logits, u)
        res = {"reordered": row(base, draw(logits, u, blocks=128 if V % 128 == 0 else 64))}
        for share in (0.01, 0.1):
            up = torch.nextafter(logits, torch.full_like(logits, 100.0))
            bumped = torch.where(torch.rand(DRAWS, V, generator=g) < share, up, logits)
            res[f"bf16_bump_{share:g}"] = row(base, draw(bumped, u))
        out[str(V)] = res
        print(V, res)
    write_result("sampling_rounding", {"draws": DRAWS, "temperature": TEMPERATURE, "logit_std": STD, "vocab": out})


if __name__ == "__main__":
    main()
