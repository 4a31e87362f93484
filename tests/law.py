"""Goodness of fit of sampled continuations to a causal LM's sampling law, at every position.

Every token of a lossless speculative sample is a draw from the base's warped law given the prompt and the
tokens before it. For N continuations of K tokens, with p[n, k] that law for sample n at position k:

    O[k, c] = #{n : label[n, k, x[n, k]] = c}          E[k, c] = sum_n sum_{v : label[n, k, v] = c} p[n, k, v]

label defaults to the token itself (cells = (position, token), the plain statistic). Any label that depends only
on the past (the prompt and x[n, :k]) is allowed, e.g. the rank of a token by a drafter's q / p there: O - E stays a
sum of martingale differences. The statistic is sum (O - E)^2 / E over cells with E >= min_expected (per position
the rest is pooled into one cell, or into the smallest cell when the pool is itself too small), df = cells - K.
Under "the decoder keeps the base's law" its mean is at most df (equal for one fixed law, less when the laws vary
from sample to sample; positions are uncorrelated) and its spread is chi-square-like, so `LawCheck.ok` asks for a
chi-square p-value of at least ALPHA = 1e-4 (the rule stat < df + 4 sqrt(2 df) would be a false alarm in 250 at
df 4, in 2500 at df 55). Tokens the law gives probability 0 (cut by top-p or top-k) are counted apart: a single
one fails the check. Samples may differ in length (rows that stopped at EOS): a position past a row's end counts
nowhere, and whether a row is still alive at k depends on its past only, so the argument holds.

per_position=False adds each label's counts over all positions first (df = cells - 1). Token cells then average
out errors that push different tokens in different contexts; labels that line such an error up (tokens ranked by
q / p: a pull towards the drafter's tokens lands in the top ranks in every context) add it up over the whole
sample instead, which is several times the power for the same samples.

Positions k >= 2 are tokens accepted at tree depth >= 2 or committed in later steps, which a test of the first two
tokens never sees. Samples are cheap as rows of one `generate` call (rows are independent samples, whatever
their prompts); the laws are one batched teacher-forced forward (`conditional_laws`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.decode.acceptance import Sampling, warp


def pad_samples(samples) -> torch.Tensor:
    """Samples of any lengths (rows that stopped at EOS) as ids [N, K], -1 past each row's end."""
    if isinstance(samples, torch.Tensor):
        return samples.long().cpu()
    K = max(len(t) for t in samples)
    return torch.tensor([list(t) + [-1] * (K - len(t)) for t in samples], dtype=torch.long)


@torch.no_grad()
def conditional_laws(model, prompts: list[list[int]], samples, sampling: Sampling, batch: int = 1024) -> torch.Tensor:
    """p[n, k] = warp(model's logits after prompts[n] + samples[n][:k], sampling), [N, K, V] float64 (zero past the
    end of a shorter sample)."""
    x = pad_samples(samples)
    N, K = x.shape
    if len(prompts) != N:
        raise ValueError(f"{len(prompts)} prompts for {N} samples")
    lengths = (x >= 0).sum(-1).tolist()
    dev = model.get_output_embeddings().weight.device
    out = []
    for i in range(0, N, batch):
        rows = [list(p) + x[n, : max(lengths[n] - 1, 0)].tolist() for n, p in enumerate(prompts[i: i + batch], i)]
        L = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), L, dtype=torch.long, device=dev)
        mask = torch.zeros(len(rows), L, dtype=torch.long, device=dev)
        for b, r in enumerate(rows):  # right-padded: a causal model's real positions never see the padding
            ids[b, : len(r)] = torch.tensor(r, device=dev)
            mask[b, : len(r)] = 1
        pos = torch.arange(L, device=dev)[None].expand(len(rows), L)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # [b, L, V]
        # Token k of sample n follows prompt + k tokens: the logits at index len(prompt) - 1 + k.
        first = torch.tensor([len(p) - 1 for p in prompts[i: i + batch]], device=dev)
        at = first[:, None] + torch.arange(K, device=dev)  # [b, K]
        law = warp(logits.gather(1, at.clamp(max=L - 1)[..., None].expand(-1, -1, logits.shape[-1])), sampling)
        alive = x[i: i + batch] >= 0  # [b, K]
        out.append(law.double().cpu() * alive[..., None])
    return torch.cat(out)


def rank_labels(score: torch.Tensor) -> torch.Tensor:
    """Labels [N, K, V]: each token's rank by score [N, K, V] (highest 0, ties by token id), for law_statistic."""
    V = score.shape[-1]
    # A stable descending sort: equal scores keep token order, so the ranks are deterministic.
    order = torch.sort(score.double(), dim=-1, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(-1, order, torch.arange(V).expand_as(order).contiguous())


def ratio_labels(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Labels [N, K, V] ranking tokens by q / p (a drafter's law over the base's): cells that a bias towards (or
    away from) the drafter's tokens fills one way in every context, which token cells would average out."""
    return rank_labels(q.double() / p.double().clamp(min=1e-300))


ALPHA = 1e-4  # the false-alarm rate a check allows itself


def chi2_sf(stat: float, df: int) -> float:
    """P(chi-square with df degrees of freedom >= stat), from torch's regularised upper incomplete gamma."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(max(stat, 0.0) / 2, dtype=torch.float64)))


@dataclass
class LawCheck:
    """The statistic, its degrees of freedom, and how many sampled tokens the law calls impossible."""

    stat: float
    df: int
    impossible: int
    n: int

    @property
    def p_value(self) -> float:
        """The statistic's chi-square tail probability (conservative: under the law the statistic's mean is <= df)."""
        return chi2_sf(self.stat, self.df)

    @property
    def threshold(self) -> float:
        """The statistic at which the p-value falls to ALPHA (for reports)."""
        lo, hi = 0.0, self.df + 100.0 * (self.df + 1) ** 0.5
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if chi2_sf(mid, self.df) > ALPHA else (lo, mid)
        return hi

    @property
    def ok(self) -> bool:
        """The samples fit the law: no impossible token and a p-value of at least ALPHA."""
        return self.impossible == 0 and self.p_value >= ALPHA

    def __str__(self) -> str:
        return (f"stat {self.stat:.1f} (df {self.df}, p {self.p_value:.2g}, threshold {self.threshold:.1f}), "
                f"{self.impossible} impossible tokens, {self.n} samples")


def law_statistic(samples, probs: torch.Tensor, labels: torch.Tensor | None = None, per_position: bool = True,
                  min_expected: float = 5.0) -> LawCheck:
    """The statistic of samples [N, K] (token ids; ragged lists or -1 past a row's end) against their conditional
    laws probs [N, K, V], over cells (position, label) with labels [N, K, V] (default: the token), or (label) summed
    over positions."""
    x = pad_samples(samples)  # [N, K], -1 past a row's end
    alive = x >= 0
    x = x.clamp(min=0)
    probs = probs.double().cpu() * alive[..., None]  # a row that ended adds nothing
    N, K, V = probs.shape
    if x.shape != (N, K):
        raise ValueError(f"samples {tuple(x.shape)} and laws {tuple(probs.shape)} disagree")
    lab = torch.arange(V).expand(N, K, V) if labels is None else labels.long().cpu()
    C = int(lab.max()) + 1
    seen = lab.gather(2, x[..., None])[..., 0]  # [N, K] the cell each sampled token falls in
    observed = torch.zeros(K, C, dtype=torch.float64).scatter_add_(1, seen.t(), alive.t().double())
    expected = torch.zeros(N, K, C, dtype=torch.float64).scatter_add_(2, lab, probs).sum(0)  # [K, C]
    impossible = int(((probs.gather(2, x[..., None])[..., 0] <= 0) & alive).sum())
    if not per_position:  # one group: every position's counts added up
        observed, expected = observed.sum(0, keepdim=True), expected.sum(0, keepdim=True)
    stat, cells = 0.0, 0
    for k in range(observed.shape[0]):
        o, e = observed[k], expected[k]
        big = e >= min_expected
        oc, ec = o[big], e[big]
        rest_o, rest_e = o[~big].sum(), e[~big].sum()
        if rest_e >= min_expected or not len(ec):
            oc, ec = torch.cat([oc, rest_o[None]]), torch.cat([ec, rest_e[None]])
        else:  # too little left for a cell of its own: pool it into the smallest cell
            j = int(ec.argmin())
            oc, ec = oc.clone(), ec.clone()
            oc[j] += rest_o
            ec[j] += rest_e
        live = ec > 0
        stat += float(((oc[live] - ec[live]) ** 2 / ec[live]).sum())
        cells += int(live.sum())
    return LawCheck(stat, cells - observed.shape[0], impossible, N)


def check_law(model, prompts: list[list[int]], samples, sampling: Sampling, labels: torch.Tensor | None = None,
              per_position: bool = True, min_expected: float = 5.0) -> LawCheck:
    """law_statistic of samples against model's own conditional laws under sampling."""
    return law_statistic(samples, conditional_laws(model, prompts, samples, sampling), labels,
                         per_position=per_position, min_expected=min_expected)


class StepLog:
    """An on_tokens callback for generate: how many tokens each row gained at each call (prefill: the first)."""

    def __init__(self):
        self.lengths: list[int] = []

    def __call__(self, row: int, new: list[int]) -> None:
        self.lengths.append(len(new))

    def accepted_at_depth(self, depth: int) -> int:
        """How many (row, step) commits accepted at least `depth` drafted tokens (the bonus not counted)."""
        return sum(n - 1 >= depth for n in self.lengths)
