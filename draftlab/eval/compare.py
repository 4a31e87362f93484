"""`draftlab eval compare A B`: two runs' slices side by side, marking the slices that got worse.

A slice got worse when B's accept length, or B's speedup, is lower than A's by more than `threshold` (relative:
(B-A)/A < -threshold) and, where both runs give the figure's standard error (slices of two questions or more, in
summaries made since 2026-12-02), by more than `noise` standard errors of the difference. A drop past the threshold
but within that is shown as within noise, not marked. Where both summaries hold the slice's per-question terms
(`by_question`; a summary made by an earlier draftlab has none), the difference's error is paired by question: the
delta method on B - A, each question's influence on B less its influence on A (a question in one run only counts on
its side), so what the two runs share (the questions' own difficulty) cancels. Otherwise it is
sqrt(se_A^2 + se_B^2), as if the runs were independent: on the same questions they are positively correlated, so that
margin is wide and misses some real drops in small slices rather than flagging noise. Slices present in one run only,
and figures one run lacks (speedup of a --no-baseline run, any figure of an output-position slice but accept length),
are shown and never marked. Each row carries the slice's size in both runs (records, or verification steps for output
position), so a drop in a slice of two records reads as what it is.

Runs are compared for what a comparison holds fixed (`held_fixed`): the base, the questions, which of them and how
many turns were answered, the field the slices follow, the sampling, the length limit, the dtype and the hardware. Where they differ the command says so
above the tables (`not_comparable` with --json); the export, tree, compiling and baseline are what one compares.
"""

from __future__ import annotations

import json
import math

from .mt_bench import EvalError, same_run_value
from .slices import NUMERATOR_SUMS, SLICINGS, bucket_key, influences, plus_minus, spread


HELD_FIXED = ("base", "questions", "questions_answered", "slice_field", "max_new_tokens", "temperature", "top_p",
              "top_k", "typical", "typical_epsilon", "typical_alpha", "dtype", "hardware", "system")


def held_fixed(runs: list[dict]) -> list[str]:
    """What differs between runs' summaries among the settings a fair comparison holds fixed (HELD_FIXED, and the
    number of turns answered), one line each with every run's value in order; empty: comparable."""
    values = {k: [same_run_value(k, r.get(k)) for r in runs] for k in HELD_FIXED}
    values["turns answered"] = [r["overall"].get("turns") for r in runs]
    return [f"{k}: {' / '.join(repr(v) for v in vals)}" for k, vals in values.items()
            if len({json.dumps(v, sort_keys=True) for v in vals}) > 1]


CHANGE = {"accept_length": "accept_change", "speedup": "speedup_change"}  # a compared row's change of each figure


def _change(a, b):
    return None if a is None or b is None or not a else round((b - a) / a, 4)


def diff_se(x: dict, y: dict, f: str) -> tuple[float | None, bool]:
    """The standard error of B - A for figure f of one slice, and whether it is paired by question (both slices hold
    their per-question terms) or independent (sqrt(se_A^2 + se_B^2)); (None, False) where a run gives no error."""
    terms = [(r.get("by_question") or {}).get(f) for r in (x, y)]
    if None not in terms:
        psi: dict = {}
        for samples, sign in zip(terms, (-1, 1)):
            got = influences(list(samples.values()), NUMERATOR_SUMS[f])
            if got is None:
                break
            for q, z in zip(samples, got[1]):
                psi[q] = psi.get(q, 0.0) + sign * got[0] * z
        else:
            return round(spread(list(psi.values())), 4), True
    se = (x.get(f + "_se"), y.get(f + "_se"))
    return (None, False) if None in se else (round(math.hypot(*se), 4), False)


def compare_slices(a: dict, b: dict, threshold: float = 0.05, noise: float = 2.0) -> dict:
    """Per slicing, rows {slice, a, b, accept_change, speedup_change, diff_se, worse, within_noise} for the union of
    both runs' slices; `worse` names the figures that dropped by more than `threshold` (relative) and by more than
    `noise` standard errors of the difference (diff_se: {figure: {se, paired}}) where both runs give one,
    `within_noise` those that dropped past the threshold only."""
    for r in (a, b):
        if "slices" not in r:
            raise EvalError(f"{r['dir']}: the summary has no per-slice section (made by an older draftlab); run "
                            "`draftlab eval mt-bench` again with the same --out: answers are kept, the summary is "
                            "rewritten")
    out = {"threshold": threshold, "noise": noise, "slicings": {}, "worse": []}
    error_terms = lambda r: {k: v for k, v in r["slices"].get("all_records", {}).items()
                             if k.endswith("_se") or k == "by_question"}
    # the run as one slice
    whole = lambda r: {"all": {**r["overall"], "records": r["overall"]["turns"], **error_terms(r)}}
    for name in ("overall",) + SLICINGS:
        sa = whole(a) if name == "overall" else a["slices"].get(name) or {}
        sb = whole(b) if name == "overall" else b["slices"].get(name) or {}
        size = "steps" if name == "output_position" else "records"
        rows = []
        for k in sorted(set(sa) | set(sb), key=bucket_key):
            x, y = sa.get(k, {}), sb.get(k, {})
            figures = (size, "accept_length", "accept_length_se", "speedup", "speedup_se")
            row = {"slice": k, "size": size, "a": {f: x.get(f) for f in figures},
                   "b": {f: y.get(f) for f in figures},
                   "accept_change": _change(x.get("accept_length"), y.get("accept_length")),
                   "speedup_change": _change(x.get("speedup"), y.get("speedup")),
                   "diff_se": {}, "worse": [], "within_noise": []}
            for f, c in ((f, row[key]) for f, key in CHANGE.items()):
                se, paired = diff_se(x, y, f)
                if se is not None:
                    row["diff_se"][f] = {"se": se, "paired": paired}
                if c is not None and c < -threshold:
                    bound = None if not noise or se is None else noise * se
                    row["worse" if bound is None or x[f] - y[f] > bound else "within_noise"].append(f)
            if row["worse"]:
                out["worse"].append({"slicing": name, "slice": k, "worse": row["worse"]})
            rows.append(row)
        out["slicings"][name] = rows
    return out


def format_comparison(cmp: dict, a: str, b: str) -> str:
    """Markdown tables, one per slicing, of a compare_slices result."""
    f2 = lambda v, suf="": "-" if v is None else f"{v:.2f}{suf}"
    pct = lambda v: "-" if v is None else f"{100 * v:+.1f}%"
    z = cmp.get("noise")
    kinds = {d["paired"] for rows in cmp["slicings"].values() for r in rows for d in r.get("diff_se", {}).values()}
    how = {frozenset({True}): "paired by question", frozenset({False}): "the runs taken as independent",
           frozenset({True, False}): "paired by question where both summaries hold per-question terms, else the runs "
                                     "taken as independent"}.get(frozenset(kinds), "")
    lines = [f"A = {a}", f"B = {b}",
             f"worse: accept length or speedup lower in B by more than {100 * cmp['threshold']:.1f}% (relative)" +
             (f" and by more than {z:g} standard errors of the difference where both runs give them (± beside a "
              f"figure: its error; beside a change: the difference's, {how})" if z else "")]
    err = lambda row, f: plus_minus(row, f) if z else ""

    def change(r, f):
        d, base = r.get("diff_se", {}).get(f), r["a"][f]
        return pct(r[CHANGE[f]]) + (f" ± {100 * d['se'] / base:.1f}%" if z and d and base else "")

    for name, rows in cmp["slicings"].items():
        if not rows:
            continue
        size = rows[0]["size"]
        lines += ["", f"### {name.replace('_', ' ')}", "",
                  f"| slice | {size} A | {size} B | accept A | accept B | change | speedup A | speedup B | change | |",
                  "|---" * 10 + "|"]
        for r in rows:
            x, y = r["a"], r["b"]
            names = lambda fs: ", ".join(f.replace("_", " ") for f in fs)
            mark = " ".join(([f"**worse** ({names(r['worse'])})"] if r["worse"] else []) +
                            ([f"within noise ({names(r['within_noise'])})"] if r.get("within_noise") else []))
            cells = [r["slice"], str(x[size] if x[size] is not None else "-"), str(y[size] if y[size] is not None else "-"),
                     f2(x["accept_length"]) + err(x, "accept_length"),
                     f2(y["accept_length"]) + err(y, "accept_length"),
                     change(r, "accept_length"),
                     f2(x["speedup"], "x") + err(x, "speedup"),
                     f2(y["speedup"], "x") + err(y, "speedup"), change(r, "speedup"), mark]
            lines.append("| " + " | ".join(cells) + " |")
    n = len(cmp["worse"])
    lines += ["", f"{n} slice{'s' if n != 1 else ''} got worse" + (":" if n else "") +
              "".join(f"\n- {w['slicing']} {w['slice']}: {', '.join(w['worse'])}" for w in cmp["worse"])]
    return "\n".join(lines)
