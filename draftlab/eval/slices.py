"""Per-slice reports: accept length, tokens/s and speedup of an eval run broken down by slices.

A record is one turn of one question: its category (or the value of `--slice-field`), the turn number, the
context length in tokens when the turn started (the prompt the decoder saw, after any truncation), its
verification steps with the tokens each committed (in order, so each step's position in the output is known),
its new tokens and wall time, and the same turn's plain-decoding tokens and wall time when the run measured them.

Slicings:
- `category`: the question's category (MT-Bench category, Spec-Bench task) or `--slice-field NAME`.
- `turn`: 1, 2, ...
- `context_tokens`: prompt length in tokens at the start of the turn, in power-of-two buckets (0-31, 32-63,
  64-127, ...). Fixed edges, not quantiles, so that two runs' buckets mean the same thing and can be compared.
- `output_position`: where in the answer a verification step started, same buckets. A step belongs wholly to
  the bucket of its first committed token (the position = tokens committed before it in that turn): a step
  that starts at position 30 and commits 4 tokens counts as one step with 4 tokens in 0-31. The bucket says
  where the draft was made, and every step is counted exactly once. Position 0 is the token the prefill
  emits (the base's first token, no verification step), so the first step starts at position 1.

Per slice, a standard error beside accept length and speedup (`accept_length_se`, `speedup_se`): the delta method
over the slice's questions (a turn's steps are not independent of each other, and a question's turns share its
text, so each question's turns in the slice count as one sample), None below two questions. `eval compare` reads
them to tell a drop from noise.

Per slice: `records` (turns that have at least one step in the slice), `steps`, `committed` (tokens committed by
those steps, bonus tokens included; the prefill's first token of each turn is no step's, as in the overall
figure), `accept_length` = committed / steps (so the steps-weighted mean over a slicing's slices is the overall
accept length); for the record slicings also `new_tokens`, `tokens_per_s`
(new tokens / wall time, summed over the slice's records) and, where plain decoding was measured,
`plain_tokens_per_s` and `speedup`, and in a --compile run `compiled_plain_tokens_per_s` and
`speedup_vs_compiled_plain` (over the compiled plain decoding of the same turns). Output-position slices carry no
tokens/s: steps are not timed one by one.
"""

from __future__ import annotations

import math
from pathlib import Path

SLICINGS = ("category", "turn", "context_tokens", "output_position")
FIRST_BUCKET = 32  # the first bucket is 0-31; after it, powers of two: 32-63, 64-127, ...


def bucket(n: int, first: int = FIRST_BUCKET) -> str:
    """Power-of-two bucket label of a non-negative count: 0-31, 32-63, 64-127, ..."""
    if n < first:
        return f"0-{first - 1}"
    lo = 1 << int(math.floor(math.log2(n)))
    return f"{lo}-{2 * lo - 1}"


def bucket_key(label: str):
    """Sort key that orders bucket labels by their lower edge and other labels by name."""
    head = label.split("-", 1)[0]
    return (0, int(head), "") if head.isdigit() else (1, 0, label)


def step_positions(committed: list[int], start: int = 1) -> list[int]:
    """Output position of each step's first committed token; the first step starts after the `start` tokens
    that came before any verification step (the prefill's token: 1)."""
    pos, out = start, []
    for c in committed:
        out.append(pos)
        pos += c
    return out


def turn_records(questions: list[dict], d_ans: dict, b_ans: dict, field: str = "category") -> list[dict]:
    """One record per (question, turn) answered by the decoder, with what slicing needs (see the module doc).
    Answers written before per-slice records existed lack `context_tokens` / `step_committed`: those records
    have None there and are left out of the slicings that need them."""
    recs = []
    for q in questions:
        if q["question_id"] not in d_ans:
            continue
        ch = d_ans[q["question_id"]]["choices"][0]
        bch = b_ans[q["question_id"]]["choices"][0] if q["question_id"] in b_ans else None
        n = len(ch["turns"])
        for t in range(n):
            r = {"question_id": q["question_id"], "category": str(q.get(field)), "turn": t + 1,
                 "context_tokens": (ch.get("context_tokens") or [None] * n)[t],
                 "new_tokens": ch["new_tokens"][t], "steps": ch["steps"][t], "wall_time": ch["wall_time"][t],
                 "committed": round(ch["accept_length"][t] * ch["steps"][t]),
                 "step_committed": (ch.get("step_committed") or [None] * n)[t]}
            if r["step_committed"] is not None:
                r["committed"] = sum(r["step_committed"])
            r["tokens_per_s"] = r["new_tokens"] / r["wall_time"] if r["wall_time"] else 0.0
            if bch is not None:
                r["plain_new_tokens"], r["plain_wall_time"] = bch["new_tokens"][t], bch["wall_time"][t]
                r["plain_tokens_per_s"] = r["plain_new_tokens"] / r["plain_wall_time"] if r["plain_wall_time"] else 0.0
            if "compiled_plain_wall_time" in ch:  # --compile: compiled plain decoding of the same turn
                r["compiled_plain_new_tokens"] = ch["compiled_plain_new_tokens"][t]
                r["compiled_plain_wall_time"] = ch["compiled_plain_wall_time"][t]
            recs.append(r)
    return recs


def influences(rows: list[tuple], up: int = 1) -> tuple[float, list[float]] | None:
    """A figure made of sums over samples, prod(sum of up columns) / prod(sum of the others) (rows hold one sample's
    terms, the first `up` of them in the numerator), and each sample's influence on its logarithm by the delta
    method (its share of each numerator sum less its share of each denominator sum, centred); None with fewer than
    two samples or an empty sum."""
    n = len(rows)
    if n < 2:
        return None
    totals = [sum(col) for col in zip(*rows)]
    if not all(totals):
        return None
    value = math.prod(totals[:up]) / math.prod(totals[up:])
    infl = [sum(x / t for x, t in zip(r[:up], totals[:up])) - sum(x / t for x, t in zip(r[up:], totals[up:]))
            for r in rows]
    mean = sum(infl) / n  # (0 when the numerator and denominator have as many sums)
    return value, [z - mean for z in infl]


def spread(terms: list[float]) -> float:
    """Standard error of a sum of n independent samples' centred influence terms: sqrt(n / (n - 1) sum z^2)."""
    n = len(terms)
    return math.sqrt(n / (n - 1) * sum(z * z for z in terms))


def ratio_se(rows: list[tuple], up: int = 1) -> float | None:
    """Standard error of a figure made of sums over samples (see influences), samples independent; None with fewer
    than two samples or an empty sum."""
    got = influences(rows, up)
    return None if got is None else round(abs(got[0]) * spread(got[1]), 4)


def _by_question(parts) -> dict:
    """(question_id, terms) pairs -> the terms summed per question (one sample per question), by question id (a
    string, as JSON keeps it)."""
    out: dict = {}
    for q, terms in parts:
        q = str(q)
        out[q] = [a + b for a, b in zip(out[q], terms)] if q in out else list(terms)
    return out


NUMERATOR_SUMS = {"accept_length": 1, "speedup": 2}  # committed / steps; new x plain wall / (wall x plain new)


def _with_error(row: dict, figure: str, samples: dict) -> None:
    """A slice's figure's standard error over its questions, and the per-question terms it came from (`by_question`:
    eval compare pairs two runs' questions with them)."""
    row[figure + "_se"] = ratio_se(list(samples.values()), NUMERATOR_SUMS[figure])
    row.setdefault("by_question", {})[figure] = samples


def plus_minus(row: dict, figure: str) -> str:
    """" ± se" of a slice's figure (its standard error, two decimals), or "" where it has none."""
    se = row.get(figure + "_se")
    return "" if se is None else f" ± {se:.2f}"


def _record_slice(recs: list[dict]) -> dict:
    steps, committed = sum(r["steps"] for r in recs), sum(r["committed"] for r in recs)
    new, wall = sum(r["new_tokens"] for r in recs), sum(r["wall_time"] for r in recs)
    row = {"records": len(recs), "steps": steps, "committed": committed, "new_tokens": new,
           "accept_length": round(committed / steps, 4) if steps else 0.0,
           "tokens_per_s": round(new / wall, 2) if wall else 0.0}
    _with_error(row, "accept_length", _by_question((r["question_id"], (r["committed"], r["steps"])) for r in recs))
    if recs and all("plain_wall_time" in r for r in recs):
        pnew, pwall = sum(r["plain_new_tokens"] for r in recs), sum(r["plain_wall_time"] for r in recs)
        row["plain_tokens_per_s"] = round(pnew / pwall, 2) if pwall else 0.0
        row["speedup"] = round(new * pwall / (wall * pnew), 4) if wall and pnew else 0.0
        _with_error(row, "speedup", _by_question(
            (r["question_id"], (r["new_tokens"], r["plain_wall_time"], r["wall_time"], r["plain_new_tokens"]))
            for r in recs))
    if recs and all("compiled_plain_wall_time" in r for r in recs):
        cnew = sum(r["compiled_plain_new_tokens"] for r in recs)
        cwall = sum(r["compiled_plain_wall_time"] for r in recs)
        row["compiled_plain_tokens_per_s"] = round(cnew / cwall, 2) if cwall else 0.0
        row["speedup_vs_compiled_plain"] = round(new * cwall / (wall * cnew), 4) if wall and cnew else 0.0
    return row


def _group(recs: list[dict], key) -> dict:
    groups: dict = {}
    for r in recs:
        k = key(r)
        if k is not None:
            groups.setdefault(k, []).append(r)
    return {k: _record_slice(groups[k]) for k in sorted(groups, key=bucket_key)}


def position_slices(recs: list[dict]) -> dict:
    """Steps and tokens committed per output-position bucket (a step goes to the bucket where it starts)."""
    acc: dict = {}  # bucket -> [(question_id, [committed, steps]) of each record with steps there]
    for r in recs:
        if r["step_committed"] is None:
            continue
        mine: dict = {}
        start = r["new_tokens"] - sum(r["step_committed"])  # the prefill's token (or none for an empty answer)
        for pos, c in zip(step_positions(r["step_committed"], start), r["step_committed"]):
            part = mine.setdefault(bucket(pos), [0, 0])
            part[0] += c
            part[1] += 1
        for k, part in mine.items():
            acc.setdefault(k, []).append((r["question_id"], part))
    out = {}
    for k in sorted(acc, key=bucket_key):
        committed, steps = sum(c for _, (c, _) in acc[k]), sum(n for _, (_, n) in acc[k])
        out[k] = {"records": len(acc[k]), "steps": steps, "committed": committed,
                  "accept_length": round(committed / steps, 4)}
        _with_error(out[k], "accept_length", _by_question(acc[k]))
    return out


def slice_report(recs: list[dict], field: str = "category") -> dict:
    """The `slices` section of summary.json: every slicing of the records (see the module doc)."""
    return {"category_field": field, "bucket_rule": "power-of-two buckets (0-31, 32-63, 64-127, ...); an output "
                                                    "step belongs to the bucket of its first committed token",
            "category": _group(recs, lambda r: r["category"]),
            "turn": _group(recs, lambda r: str(r["turn"])),
            "context_tokens": _group(recs, lambda r: None if r["context_tokens"] is None else bucket(r["context_tokens"])),
            "output_position": position_slices(recs),
            "all_records": _record_slice(recs) if recs else {}}  # (the run as one slice: its standard errors)


def slice_tables(sl: dict) -> list[str]:
    """Markdown tables of a `slices` section, one per slicing (report.md)."""
    lines = []
    for name in SLICINGS:
        rows = sl.get(name) or {}
        if not rows:
            continue
        timed = name != "output_position"
        label = sl.get("category_field", "category") if name == "category" else name
        fast = timed and all("speedup_vs_compiled_plain" in r for r in rows.values())  # (--compile)
        head = [label.replace("_", " "), "records", "steps", "accept length"] + (
            ["tokens/s", "plain tokens/s", "speedup"] if timed else []) + (["vs compiled plain"] if fast else [])
        lines += ["", f"### by {label.replace('_', ' ')}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for k, r in rows.items():
            cells = [k, str(r["records"]), str(r["steps"]), f"{r['accept_length']:.2f}{plus_minus(r, 'accept_length')}"]
            if timed:
                cells += [f"{r['tokens_per_s']:.1f}",
                          f"{r['plain_tokens_per_s']:.1f}" if "plain_tokens_per_s" in r else "-",
                          f"{r['speedup']:.2f}x{plus_minus(r, 'speedup')}" if "speedup" in r else "-"]
            cells += [f"{r['speedup_vs_compiled_plain']:.2f}x"] if fast else []
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot_slices(out: Path, sl: dict, title: str = "") -> list[str]:
    """One PNG per slicing, slices_<slicing>.png: accept length per slice (and speedup where measured), with the
    number of records (steps for output position) over each bar, so small slices show as such."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name in SLICINGS:
        rows = sl.get(name) or {}
        if not rows:
            continue
        keys = list(rows)
        panels = ["accept_length"] + (["speedup"] if all("speedup" in r for r in rows.values()) else [])
        fig, axes = plt.subplots(1, len(panels), figsize=(max(4.5, 0.7 * len(keys) + 2) * len(panels), 3.5),
                                 squeeze=False)
        count = "steps" if name == "output_position" else "records"
        for ax, key in zip(axes[0], panels):
            vals = [rows[k][key] for k in keys]
            bars = ax.bar(keys, vals, color="tab:blue")
            for b, k in zip(bars, keys):
                ax.annotate(f"n={rows[k][count]}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
            if key == "speedup":
                ax.axhline(1.0, color="0.4", lw=1, ls="--")
            ax.margins(y=0.12)  # room for the counts over the bars
            ax.set_ylabel(key.replace("_", " "))
            ax.set_xlabel(name.replace("_", " ") + (" (bucket of the step's first token)" if count == "steps" else ""))
            ax.tick_params(axis="x", rotation=30)
        fig.suptitle(f"{title}: by {name.replace('_', ' ')}" if title else f"by {name.replace('_', ' ')}")
        fig.tight_layout()
        p = out / f"slices_{name}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(str(p))
    return paths
