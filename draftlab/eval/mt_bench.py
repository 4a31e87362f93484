"""MT-Bench / Spec-Bench speed and losslessness runs, and comparisons of runs.

For every question, the draftlab decoder and plain decoding of the same base answer each turn in
turn (draftlab turn 1, plain turn 1, draftlab turn 2, ...), so both see the same machine state;
the second turn sees that method's own first answer through the chat template. Answers are written
in FastChat's model-answer JSONL format (one file per method) with per-turn statistics beside the
turns, so FastChat's judge can score them and a killed run resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
import zlib
from collections import Counter
from pathlib import Path

import torch
from ..base import stop_token_ids
from ..data import rewrite_lines
from ..progress import progress as progress_bar

from ..decode.acceptance import Sampling
from ..decode.compiled import RETIMES, compile_cache_report, timed_without_compiling
from ..decode.decoder import NoDraft, SpeculativeDecoder, sync_device
from ..serve.generate import encode_prompt, load_decoder, plain_generate
from ..decode.tensor_parallel import agree, is_main
from ..interop.export import content_fingerprint, files_fingerprint, files_stat
from ..serve.tree_search import hardware
from .slices import plot_slices, slice_report, slice_tables, turn_records

NEAR_TIE_ULPS = 8  # see near_tie_tolerance
RUN_KEYS = ("export", "base", "questions", "tree", "temperature", "top_p", "top_k", "typical", "typical_epsilon",
            "typical_alpha", "max_new_tokens", "seed", "baseline", "compiled", "dtype", "system")
# Checked when the run directory records them (run.json files written before 2026-12-01 do not): an export or base
# whose files changed in place (a retrained run's export is the same path), and another machine or thread count,
# whose timings would be mixed with these under one hardware label.
# Since 2026-12-03 the export is known by its files' contents (export_content), so a copy that did not keep
# modification times is the same export; a run.json from before is checked on export_files, as it was. The
# contents are read again only when the files' stat digest (export_stat) moved since the run.json was written.
RUN_KEYS_SINCE_1201 = ("base_files", "hardware")


class EvalError(ValueError):
    """A user-fixable problem with the questions or the output directory."""


def load_questions(src: str, categories: list[str] | None = None, limit: int | None = None,
                   slice_field: str | None = None) -> list[dict]:
    """FastChat / Spec-Bench questions ({question_id, category, turns}) from a JSONL file or a hub dataset id;
    slice_field: a field of the user's records to slice the report by, kept beside them (required in every one)."""
    if Path(src).exists():
        rows = []
        with open(src, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{src}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise EvalError(f"{src}:{n}: not valid JSON ({e.msg})") from None
    else:
        if "/" not in src or src.endswith((".json", ".jsonl")) or src.startswith(("/", ".", "~")) or src.count("/") > 1:
            raise EvalError(f"--questions {src!r}: no such file, and not a hub dataset id (owner/name)")
        from datasets import load_dataset

        try:
            ds = load_dataset(src, split="train")
        except Exception as e:  # (offline, a typo of a local path, no such dataset: datasets' own traceback before)
            raise EvalError(f"--questions {src!r}: no such file here, and the hub dataset does not load "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        rows = [(f"{src}[{i}]", dict(r)) for i, r in enumerate(ds)]
    out, seen = [], set()
    for where, r in rows:
        if not isinstance(r, dict):  # (a line such as `5` was a TypeError: walk-through)
            raise EvalError(f"{where}: a question record is a JSON object (FastChat's {{question_id, category, "
                            f"turns}}), not {type(r).__name__}")
        missing = [k for k in ("question_id", "category", "turns") if k not in r]
        if missing:
            raise EvalError(f"{where}: question record lacks {', '.join(missing)} "
                            "(expected FastChat's {question_id, category, turns})")
        if not isinstance(r["turns"], list) or not r["turns"] or not all(isinstance(t, str) for t in r["turns"]):
            raise EvalError(f"{where}: `turns` must be a non-empty list of strings")
        if slice_field and slice_field not in r:
            raise EvalError(f"{where}: --slice-field {slice_field}: the question record has no such field "
                            f"(fields: {', '.join(sorted(r))})")
        if r["question_id"] in seen:
            raise EvalError(f"{where}: question_id {r['question_id']!r} again: answers are kept by question_id, so "
                            "ids must be unique")
        seen.add(r["question_id"])
        out.append({"question_id": r["question_id"], "category": r["category"], "turns": r["turns"],
                    **({slice_field: r[slice_field]} if slice_field else {})})
    if categories:
        known = sorted({q["category"] for q in out})
        bad = [c for c in categories if c not in known]
        if bad:
            raise EvalError(f"--category {', '.join(bad)}: not in {src} (categories: {', '.join(known)})")
        out = [q for q in out if q["category"] in categories]
    if limit is not None and limit < 1:
        raise EvalError(f"--limit {limit}: at least 1 question")
    return out[:limit] if limit else out


def read_answers(path: Path) -> dict:
    """question_id -> answer record of an answer file (a torn last line from a crash is ignored)."""
    done = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[r["question_id"]] = r
    return done


def _prompt_ids(tok, messages: list[dict], budget: int) -> tuple[list[int], bool]:
    """Chat-template ids of a conversation ending in a user turn; keeps the last `budget` tokens."""
    ids = encode_prompt(tok, messages, chat=True)
    if len(ids) > budget:
        return ids[-budget:], True
    return ids, False


def _check_system(tok, system: str, name: str) -> None:
    """A system message the chat template places in the prompt: some templates refuse the role (Gemma's raise),
    others drop it without a word."""
    user = [{"role": "user", "content": "Hi."}]
    try:
        text = tok.apply_chat_template([{"role": "system", "content": system}] + user, tokenize=False,
                                       add_generation_prompt=True)
    except Exception as e:  # a template's own raise_exception(): jinja2's TemplateError, or what it chose
        raise EvalError(f"--system: the chat template of {name} refuses a system message ({e})") from e
    if text == tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) or system not in text:
        raise EvalError(f"--system: the chat template of {name} leaves the system message out of the prompt")


def _context_budget(base, max_new_tokens: int, tree_size: int) -> int:
    ctx = getattr(base.config, "max_position_embeddings", None) or 1 << 30
    budget = ctx - max_new_tokens - tree_size - 1
    if budget < 16:
        raise EvalError(f"--max-new-tokens {max_new_tokens} leaves {budget} prompt tokens in the base's "
                        f"{ctx}-token context; lower it")
    return budget


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def answer_question(q: dict, decoder, tok, sampling: Sampling, max_new_tokens: int, seed: int, budget: int,
                    baseline: bool, retime: bool = True, plain_compiled=None,
                    system: str | None = None) -> tuple[dict, dict | None]:
    """Both methods answer every turn of one question, interleaved; returns (draftlab turns, plain turns).
    retime: on the compiled path a turn whose decoding compiled something (a shape met for the first time: a new
    prompt width, cache size or attention window) is decoded again, up to RETIMES times until a run compiles
    nothing, and the last run is timed; the first run's extra time is the turn's `compile_s`, reported beside the
    speed figures rather than inside them.
    plain_compiled: a decoder of the same base without a drafter on the compiled path (decode.decoder.NoDraft),
    which decodes each turn's prompt too, timed the same way: the fastest plain decoding, the second baseline.
    system: a system message that opens each conversation (None: the chat template's own default, if any)."""
    eos = stop_token_ids(decoder.base, tok)
    dev = decoder.device
    opening = [{"role": "system", "content": system}] if system is not None else []
    conv = {"draftlab": list(opening), "plain": list(opening)}
    turns = {"draftlab": [], "plain": []}

    def timed(dec, ids, turn_seed):
        """(result, seconds, compile seconds or None when nothing compiled)."""
        def run():
            gen = torch.Generator(device=dev).manual_seed(turn_seed)
            res = dec.generate([ids], max_new_tokens=max_new_tokens, sampling=sampling, eos_token_id=eos,
                               generator=gen)
            sync_device(dev)
            return res

        res, wall, compile_s = timed_without_compiling(run, agree, RETIMES if retime else 0)
        return res, wall, None if compile_s is None else round(compile_s, 3)

    for t, question in enumerate(q["turns"]):
        turn_seed = seed + 1000 * (zlib.crc32(str(q["question_id"]).encode()) % 1000003) + t  # same on resume
        for method in ("draftlab", "plain") if baseline else ("draftlab",):
            conv[method].append({"role": "user", "content": question})
            ids, cut = _prompt_ids(tok, conv[method], budget)
            if method == "draftlab":
                res, wall, compile_s = timed(decoder, ids, turn_seed)
                tokens = res.tokens[0]
                stats = {"new_tokens": len(tokens), "steps": res.steps, "accept_length": round(res.accept_length, 4),
                         "wall_time": round(wall, 5), "compile_s": compile_s, "step_hist": dict(Counter(res.committed)),
                         "step_committed": list(res.committed)}  # in order: each step's output position (slices)
                if plain_compiled is not None:
                    res, wall, _ = timed(plain_compiled, ids, turn_seed)
                    stats.update(compiled_plain_new_tokens=len(res.tokens[0]), compiled_plain_wall_time=round(wall, 5))
            else:
                out, wall = plain_generate(decoder.base, [ids], max_new_tokens, sampling, eos, turn_seed)
                tokens = out[0]
                stats = {"new_tokens": len(tokens), "steps": len(tokens), "wall_time": round(wall, 5)}
            stats["context_tokens"] = len(ids)  # prompt tokens the turn started from (after any cut)
            text = tok.decode(tokens, skip_special_tokens=True).strip()
            conv[method].append({"role": "assistant", "content": text})
            turns[method].append({"text": text, "tokens": tokens, "prompt_truncated": cut, "prompt_ids": ids,
                                  **stats})
    return turns["draftlab"], (turns["plain"] if baseline else None)


def near_tie_tolerance(logits: torch.Tensor) -> float:
    """The top-2 logit margin below which the order of two tokens is rounding's to decide: NEAR_TIE_ULPS units in
    the last place of the largest logit in the base's dtype (float32, logits of about 10: 1e-5; bfloat16: 0.6).
    Compiled kernels, a batched verify and a one-token forward add the same numbers in different orders."""
    return NEAR_TIE_ULPS * torch.finfo(logits.dtype).eps * float(logits.abs().max())


def explain_difference(base, prompt: list[int], plain: list[int], other: list[int], position: int) -> dict:
    """Why greedy speculative decoding's tokens `other` part from plain decoding's `plain` at `position`: the base's
    own logits there (an eager forward over the prompt and plain's first `position` tokens), its top two tokens,
    their margin and whether that is a near tie (near_tie_tolerance) with the speculative token the runner-up. A
    difference that is not a near tie is a bug."""
    dev = next(base.parameters()).device
    ids = torch.tensor([prompt + plain[:position]], device=dev)
    with torch.no_grad():
        logits = base(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
    top = logits.float().topk(2)
    margin = float(top.values[0] - top.values[1])
    theirs = other[position] if position < len(other) else None
    tie = theirs in top.indices.tolist() and margin <= near_tie_tolerance(logits)
    return {"margin": margin, "top2": top.indices.tolist(), "tokens": [plain[position] if position < len(plain)
                                                                        else None, theirs], "near_tie": tie}


def turn_differences(base, d_turns: list[dict], b_turns: list[dict], where: list) -> list[dict]:
    """Each turn where greedy speculative decoding's tokens part from plain decoding's (`where`: the first differing
    position per turn, or None), explained by explain_difference; a turn after one that differed is marked
    after_earlier_difference and not explained: each method's later turns follow its own earlier answers, so their
    prompts differ too (and plain's logits say nothing of the other's tokens)."""
    diffs = []
    for t, (d, b, pos) in enumerate(zip(d_turns, b_turns, where)):
        if pos is None:
            continue
        if diffs:
            diffs.append({"turn": t + 1, "position": pos, "after_earlier_difference": True})
        else:
            diffs.append({"turn": t + 1, "position": pos,
                          **explain_difference(base, b["prompt_ids"], b["tokens"], d["tokens"], pos)})
    return diffs


def running_totals(run: dict, turns: list[dict]) -> dict:
    """Add one answer's turns to the run's totals; returns the progress line's figures: tokens so far and the mean
    accept length so far (weighted by steps, as the summary's), not the last question's."""
    for t in turns:
        run["new_tokens"] += t["new_tokens"]
        run["steps"] += t["steps"]
        run["committed"] += t["accept_length"] * t["steps"]
    accept = run["committed"] / run["steps"] if run["steps"] else 0.0
    return {"tokens": run["new_tokens"], "accept": f"{accept:.2f}"}


def answer_record(q: dict, model_id: str, turns: list[dict], extra: dict | None = None) -> dict:
    """FastChat model-answer record; per-turn statistics sit beside `turns` in the choice (as EAGLE's do)."""
    choice = {"index": 0, "turns": [t["text"] for t in turns]}
    for k in ("new_tokens", "steps", "wall_time", "accept_length", "step_hist", "prompt_truncated", "context_tokens",
              "step_committed", "compile_s", "compiled_plain_new_tokens", "compiled_plain_wall_time"):
        if k in turns[0]:
            choice[k] = [t[k] for t in turns]
    if "step_committed" in turns[0]:  # (Spec-Bench's evaluation/speed.py reads these two: tokens committed per
        choice["accept_lengths"] = [n for t in turns for n in t["step_committed"]]  # step, and the category)
    rec = {"question_id": q["question_id"], "category": q["category"], "answer_id": uuid.uuid4().hex[:22],
           "model_id": model_id, "choices": [choice], "tstamp": time.time()}
    rec.update(extra or {})
    return rec


def _agg(d_recs: list[dict], b_recs: list[dict]) -> dict:
    """Accept length (token-weighted over steps), tokens/s and speedup over a set of answers."""
    ch = [r["choices"][0] for r in d_recs]
    new = sum(sum(c["new_tokens"]) for c in ch)
    wall = sum(sum(c["wall_time"]) for c in ch)
    steps = sum(sum(c["steps"]) for c in ch)
    committed = sum(sum(a * s for a, s in zip(c["accept_length"], c["steps"])) for c in ch)
    row = {"answers": len(d_recs), "turns": sum(len(c["turns"]) for c in ch), "new_tokens": new,
           "accept_length": round(committed / steps, 3) if steps else 0.0,
           "tokens_per_s": round(new / wall, 2) if wall else 0.0}
    if ch and all("compiled_plain_wall_time" in c for c in ch):  # compiled plain decoding of the same turns (not in
        # answers resumed from a run made before draftlab measured it)
        cnew, cwall = (sum(sum(c[k]) for c in ch) for k in ("compiled_plain_new_tokens", "compiled_plain_wall_time"))
        row["compiled_plain_tokens_per_s"] = round(cnew / cwall, 2) if cwall else 0.0
        row["speedup_vs_compiled_plain"] = round(row["tokens_per_s"] / row["compiled_plain_tokens_per_s"], 3) \
            if cwall and cnew else 0.0
    compiles = [x for c in ch for x in c.get("compile_s", []) if x is not None]
    if compiles:  # turns that compiled while decoding, timed again (answer_question): their compile time
        row.update(compile_s=round(sum(compiles), 2), turns_compiled=len(compiles))
    if b_recs:
        bch = [r["choices"][0] for r in b_recs]
        bnew, bwall = sum(sum(c["new_tokens"]) for c in bch), sum(sum(c["wall_time"]) for c in bch)
        row["baseline_tokens_per_s"] = round(bnew / bwall, 2) if bwall else 0.0
        row["speedup"] = round(row["tokens_per_s"] / row["baseline_tokens_per_s"], 3) if bwall and bnew else 0.0
    if d_recs and "identical" in d_recs[0]:
        row["identical_share"] = round(sum(r["identical"] for r in d_recs) / len(d_recs), 4)
    return row


def summarize(questions: list[dict], d_ans: dict, b_ans: dict, settings: dict, slice_field: str = "category") -> dict:
    qs = [q for q in questions if q["question_id"] in d_ans]
    cats = sorted({q["category"] for q in qs})
    by = lambda ans, c: [ans[q["question_id"]] for q in qs if c in (None, q["category"]) and q["question_id"] in ans]
    hist = Counter()
    for q in qs:
        for h in d_ans[q["question_id"]]["choices"][0]["step_hist"]:
            hist.update({int(k): v for k, v in h.items()})
    diffs = [{"question_id": q["question_id"], "category": q["category"], **d}
             for q in qs for d in d_ans[q["question_id"]].get("differences", [])]
    answered = json.dumps(sorted(str(q["question_id"]) for q in qs))  # (which questions, whatever the file's path)
    return {**settings, "hardware": hardware(), "questions_answered": f"{zlib.crc32(answered.encode()):08x}",
            "overall": _agg(by(d_ans, None), by(b_ans, None)),
            "categories": {c: _agg(by(d_ans, c), by(b_ans, c)) for c in cats},
            "accept_histogram": {str(k): hist[k] for k in sorted(hist)}, "differences": diffs,
            "slices": slice_report(turn_records(qs, d_ans, b_ans, slice_field), slice_field)}


def write_report(out: Path, s: dict, plots: bool = True) -> Path:
    """report.md: settings, overall and per-category table, differences from plain decoding."""
    fast = "speedup_vs_compiled_plain" in s["overall"]  # --compile: compiled plain decoding measured too
    cols = ["accept length", "tokens/s", "plain tokens/s", "speedup"] + (
        ["compiled plain tokens/s", "vs compiled plain"] if fast else []) + (["identical"] if s["greedy"] else [])
    lines = [f"# MT-Bench speed: {s['model_id']}", "",
             f"export `{s['export']}`, base `{s['base']}`, tree of {s['tree_size']} tokens, "
             f"temperature {s['temperature']}" + (
                 f", top-p {s['top_p']}" if s.get("top_p", 1.0) < 1 else "") + (
                 f", top-k {s['top_k']}" if s.get("top_k") else "") + (
                 f", typical acceptance (epsilon {s['typical_epsilon']}, alpha {s['typical_alpha']}: not lossless)"
                 if s.get("typical") else "") + (", compiled" if s.get("compiled") else "") +
             f", max {s['max_new_tokens']} new tokens, questions `{s['questions']}`, {s['hardware']}", "",
             "| category | answers | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]

    compared = s.get("baseline", True)  # (--no-baseline: nothing measured to compare; it read 0.0, 0.00x, 0%)

    def row(name, r):
        cells = [f"{r['accept_length']:.2f}", f"{r['tokens_per_s']:.1f}"] + (
            [f"{r.get('baseline_tokens_per_s', 0):.1f}", f"{r.get('speedup', 0):.2f}x"] if compared else ["-", "-"])
        if fast:
            cells += [f"{r['compiled_plain_tokens_per_s']:.1f}", f"{r['speedup_vs_compiled_plain']:.2f}x"]
        if s["greedy"]:
            cells.append(f"{100 * r.get('identical_share', 0):.0f}%" if compared else "-")
        return f"| {name} | {r['answers']} | " + " | ".join(cells) + " |"
    lines += [row(c, r) for c, r in s["categories"].items()] + [row("**overall**", s["overall"])]
    if s["overall"].get("turns_compiled"):
        lines += ["", f"Compiling: {s['overall']['turns_compiled']} turns met a shape for the first time and compiled "
                  f"while decoding ({s['overall']['compile_s']:.1f} s in all); each was decoded again until a run "
                  f"compiled nothing (at most {RETIMES} times) and that run timed, so the figures above hold no "
                  "compile time."]
    if s.get("compile_cache"):
        c = s["compile_cache"]
        lines += ["", f"Compiled graphs in this run's process: {c['hits']} loaded from the on-disk cache, "
                  f"{c['misses']} built (`{c['dir']}`; `--compile-cache DIR` keeps them for the next run)."]
    if s["greedy"]:
        lines += ["", "Greedy decoding must reproduce plain decoding exactly."]
        if s["differences"]:
            lines += ["Differences (the base's top-2 logit margin at the first differing token, from an eager "
                      "forward; a near tie is one within rounding, which the order of additions decides):", ""]
            lines += [f"- question {d['question_id']} ({d['category']}), turn {d['turn']}: first differing token "
                      f"at position {d['position']}" + (f"; margin {d['margin']:.3g}, " + (
                          "a near tie" if d["near_tie"] else "NOT a near tie: a bug") if "margin" in d else
                          "; it follows an earlier turn's difference (each method's turn follows its own answers)"
                          if d.get("after_earlier_difference") else "")
                      for d in s["differences"]]
        elif s.get("baseline"):
            lines.append("Every answer is identical to plain decoding.")
        else:
            lines.append("No plain baseline ran (--no-baseline): losslessness was not checked.")
    else:
        lines += ["", "Sampling: speculative and plain decoding draw from their own random streams, so their answers "
                  "differ and are not compared token by token. " + (
                      "Typical acceptance does not keep the base's distribution." if s.get("typical") else
                      "Speculative sampling keeps the base's distribution; this run does not check that (the "
                      "test suite's law tests do).")]
    if s.get("slices"):
        lines += ["", "## Slices", "", "Accept length = tokens committed / verification steps within the slice; "
                  "buckets are powers of two, and an output-position step counts where it starts."]
        lines += slice_tables(s["slices"])
    lines += ["", "Plots: `speedup_per_category.png`, `accept_length_hist.png`, `slices_<slicing>.png`." if plots else
              "Plots: none (--no-plots)."]
    p = out / "report.md"
    p.write_text("\n".join(lines) + "\n")
    return p


def plot_summary(out: Path, s: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(s["categories"])
    p1, p2 = out / "speedup_per_category.png", out / "accept_length_hist.png"
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(cats) + 2), 3.5))
    key = "speedup" if "speedup" in s["overall"] else "accept_length"
    vals = [s["categories"][c].get(key, 0) for c in cats] + [s["overall"].get(key, 0)]
    ax.bar(cats + ["overall"], vals, color=["tab:blue"] * len(cats) + ["tab:orange"])
    if key == "speedup":
        ax.axhline(1.0, color="0.4", lw=1, ls="--")
    ax.set_ylabel(key.replace("_", " "))
    ax.set_title(f"{s['model_id']}: {key.replace('_', ' ')} per category")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(p1, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    h = s["accept_histogram"]
    ax.bar([int(k) for k in h], list(h.values()))
    ax.set_xlabel("tokens committed per verification step (bonus included)")
    ax.set_ylabel("steps")
    ax.set_title(f"mean accept length {s['overall']['accept_length']:.2f}")
    fig.tight_layout()
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [str(p1), str(p2)]


def same_run_value(key: str, value):
    """A run setting as runs compare it: the questions file by its absolute path, `--tree default` as no --tree
    (run.json files before 2026-12-02 hold them as given; naming either another way is the same run)."""
    if key == "questions" and isinstance(value, str) and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    if key == "tree" and value in (None, "", "default"):
        return None
    return value


def _settings_file(out: Path, settings: dict, overwrite: bool) -> None:
    """Refuse to mix answers made under other settings into one run directory."""
    f = out / "run.json"
    answered = any(p.stat().st_size for p in (out / "answers").glob("*.jsonl")) if (out / "answers").is_dir() else False
    if f.is_file() and not overwrite and answered:  # (a run that failed before answering holds nothing to mix)
        old = json.loads(f.read_text())
        old = {k: same_run_value(k, v) for k, v in old.items()}
        diff = [k for k in RUN_KEYS if old.get(k) != settings.get(k)]
        export_key = "export_content" if "export_content" in old else "export_files"
        diff += [k for k in (export_key, *RUN_KEYS_SINCE_1201) if k in old and old[k] != settings.get(k)]
        if diff:
            raise EvalError(f"{out} holds answers made with other settings ({', '.join(f'{k}: {old.get(k)!r} -> {settings.get(k)!r}' for k in diff)}); "
                            "use another --out, or --overwrite to start again")
    if overwrite:  # (a summary or report left from the old run would be read as this one's until it ends)
        shutil.rmtree(out / "answers", ignore_errors=True)
        for name in ("summary.json", "report.md"):
            (out / name).unlink(missing_ok=True)
        for png in out.glob("*.png"):  # (the old run's plots stayed beside a --no-plots report: walk-through)
            png.unlink()
    out.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(settings, indent=2))


def run_mt_bench(export: str, questions: str, out: str, tree: str | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, typical: bool = False, max_new_tokens: int = 1024,
                 limit: int | None = None, categories: list[str] | None = None, base: str | None = None,
                 dtype: str | None = None, device: str | None = None, seed: int = 0, baseline: bool = True,
                 model_id: str | None = None, overwrite: bool = False, progress: bool = True,
                 plots: bool = True, tp: bool = False, device_map: str | None = None,
                 typical_epsilon: float | None = None, typical_alpha: float | None = None,
                 compile: bool = False, slice_field: str | None = None, system: str | None = None) -> dict:
    """Answer the questions with the decoder (and plain decoding), write answers, summary, report and plots.
    tp: every rank of the launch answers every question with its shard of the base; rank 0 writes --out, the
    others a private scratch directory, and all follow rank 0's list of questions still to answer.
    system: a system message opening every conversation (FastChat's templates carry one, e.g. Vicuna's), or None."""
    qs = load_questions(questions, categories, limit, slice_field)
    if not qs:
        raise EvalError(f"{questions}: no questions selected")
    decoder, tok, meta = load_decoder(export, base, tree, dtype, device, tp, device_map, compile=compile)
    if not is_main():
        out, progress, plots = tempfile.mkdtemp(prefix="draftlab-eval-rank"), False, False
    if tok.chat_template is None:
        raise EvalError(f"the tokenizer of {meta['base']['name_or_path']} has no chat template")
    if system is not None:
        _check_system(tok, system, meta["base"]["name_or_path"])
    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, typical=typical,
                        posterior_alpha=typical_alpha,
                        **({} if typical_epsilon is None else {"posterior_threshold": typical_epsilon}))
    greedy = temperature <= 0 and not typical
    base_name = base or meta["base"]["name_or_path"]
    short = Path(base_name.rstrip("/")).name
    model_id = model_id or f"{short}-draftlab-{meta['head']['type']}"
    # The questions file by its absolute path and `--tree default` as no --tree: the same run either way (a resume
    # was refused for `data/...` against the default's absolute path, and for default -> None: walk-through).
    settings = {"export": str(export), "base": base_name, "questions": same_run_value("questions", str(questions)),
                "tree": same_run_value("tree", tree),
                "tree_size": decoder.drafter.max_nodes, "head": meta["head"]["type"], "temperature": temperature,
                "top_p": top_p, "top_k": top_k, "typical": typical,
                "typical_epsilon": sampling.posterior_threshold if typical else None,
                "typical_alpha": sampling.typical_alpha if typical else None, "greedy": greedy, "compiled": compile,
                "dtype": dtype,
                "max_new_tokens": max_new_tokens, "seed": seed, "baseline": baseline, "model_id": model_id,
                "baseline_model_id": f"{short}-plain", "slice_field": slice_field or "category",
                "system": system, "limit": limit, "category": categories, "export_files": files_fingerprint(export),
                "export_stat": files_stat(export), "base_files": files_fingerprint(base_name),
                "hardware": hardware()}
    outp = Path(out)
    prev = outp / "run.json"  # (its content digest stands while the files' stat digest does: no read of the export)
    settings["export_content"] = content_fingerprint(
        export, json.loads(prev.read_text()) if prev.is_file() and not overwrite else None) if is_main() else None
    budget = _context_budget(decoder.base, max_new_tokens, decoder.drafter.max_nodes)  # (before run.json is written)
    _settings_file(outp, settings, overwrite)
    ans_dir = outp / "answers"
    ans_dir.mkdir(exist_ok=True)
    d_path, b_path = ans_dir / f"{model_id}.jsonl", ans_dir / f"{short}-plain.jsonl"
    d_ans, b_ans = read_answers(d_path), read_answers(b_path)
    # A question counts as done only when every method's answer is on disk.
    done = {qid for qid in d_ans if qid in b_ans or not baseline}
    for path, ans in ((d_path, d_ans), (b_path, b_ans)):
        for qid in [qid for qid in ans if qid not in done]:
            del ans[qid]
        if path.is_file():  # only whole records of done questions (a torn last line too is dropped)
            rewrite_lines(path, [json.dumps(r) for r in ans.values()])
    done = agree(done)  # the ranks of a tensor-parallel run answer the same questions
    todo = [q for q in qs if q["question_id"] not in done]
    # --compile: draftlab's own plain decoding on the compiled path too, so a speedup is speculation's and not
    # compilation's (HF's eager generate stays the first baseline). Its static cache is one more sequence's KV.
    plain_compiled = SpeculativeDecoder(decoder.base, NoDraft(), sync=getattr(decoder, "sync", None),
                                        compile=compile) if compile and baseline else None
    if todo:  # warm-up of both paths, not timed and not recorded
        warm = {"question_id": -1, "category": "warm-up", "turns": ["Hello."]}
        answer_question(warm, decoder, tok, sampling, 8, seed, budget, baseline, retime=False,
                        plain_compiled=plain_compiled, system=system)
    # (counted from the answers kept: a finished run read "0 question, 0 question/s"; walk-through)
    bar = progress_bar(todo, total=len(qs), initial=len(qs) - len(todo), desc="mt-bench", unit="question",
                       disable=not progress)
    run = {"new_tokens": 0, "steps": 0, "committed": 0.0}  # this run's answers so far, for the progress line
    with open(d_path, "a", encoding="utf-8") as fd, open(b_path, "a", encoding="utf-8") as fb:
        for q in bar:
            d_turns, b_turns = answer_question(q, decoder, tok, sampling, max_new_tokens, seed, budget, baseline,
                                               plain_compiled=plain_compiled, system=system)
            extra = {}
            if baseline and greedy:
                # rank 0's positions: the explaining forward runs on every rank of a tensor-parallel base, or none
                where = agree([_first_diff(d["tokens"], b["tokens"]) for d, b in zip(d_turns, b_turns)])
                diffs = turn_differences(decoder.base, d_turns, b_turns, where)
                extra = {"identical": not diffs, "differences": diffs}
            d_rec = answer_record(q, model_id, d_turns, extra)
            if baseline:
                b_rec = answer_record(q, settings["baseline_model_id"], b_turns)
                fb.write(json.dumps(b_rec) + "\n")
                fb.flush()
                b_ans[q["question_id"]] = b_rec
            fd.write(json.dumps(d_rec) + "\n")  # written last: its presence marks the question done
            fd.flush()
            os.fsync(fd.fileno())
            d_ans[q["question_id"]] = d_rec
            bar.set_postfix(running_totals(run, d_turns))
    summary = summarize(qs, d_ans, b_ans if baseline else {}, settings, slice_field or "category")
    summary["answers"] = {"draftlab": str(d_path), **({"plain": str(b_path)} if baseline else {})}
    if compile:  # this process's compiles (a resumed run's earlier ones are not in it)
        summary["compile_cache"] = compile_cache_report()
    summary["report"] = str(write_report(outp, summary, plots))
    if plots:
        summary["plots"] = plot_summary(outp, summary) + plot_slices(outp, summary["slices"], model_id)
    (outp / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summary_path(src: str) -> Path:
    """summary.json of a run: the file itself, or the run directory holding it."""
    p = Path(src)
    f = p / "summary.json" if p.is_dir() else p
    if not f.is_file():
        raise EvalError(f"{src}: no summary.json (not a `draftlab eval mt-bench` output directory or summary file, "
                        "or the run is unfinished)")
    return f


def load_summary(src: str) -> dict:
    """A run's summary.json, with `dir` set to what the user named; one that is not JSON or lacks a run's figures
    is named (it was a KeyError traceback, or json's message without the file: walk-through)."""
    path = summary_path(src)
    try:
        s = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EvalError(f"{path}: not valid JSON ({e.msg}); give an `eval mt-bench` run directory") from None
    missing = [k for k in ("overall", "categories") if not isinstance(s, dict) or k not in s]
    if missing:
        raise EvalError(f"{path}: not an `eval mt-bench` summary (no {', '.join(missing)})")
    return {"dir": src, **s}


def compare_runs(dirs: list[str]) -> tuple[str, list[dict]]:
    """Markdown table of several eval runs side by side (overall, then speedup per category)."""
    runs = [load_summary(d) for d in dirs]
    cats = sorted({c for r in runs for c in r["categories"]})
    key = "speedup" if all("speedup" in r["overall"] for r in runs) else "accept_length"
    fast = all("speedup_vs_compiled_plain" in r["overall"] for r in runs)  # all --compile runs: both baselines
    head = ["run", "head", "tree size", "accept length", "tokens/s", "speedup"] + (
        ["vs compiled plain"] if fast else []) + ["identical"] + cats
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in runs:
        o = r["overall"]
        ident = f"{100 * o['identical_share']:.0f}%" if "identical_share" in o else "-"
        cells = [r["dir"], r["head"], str(r["tree_size"]), f"{o['accept_length']:.2f}", f"{o['tokens_per_s']:.1f}",
                 f"{o['speedup']:.2f}x" if "speedup" in o else "-"]
        cells += [f"{o['speedup_vs_compiled_plain']:.2f}x"] if fast else []
        cells.append(ident)
        cells += [f"{r['categories'][c][key]:.2f}" if c in r["categories"] else "-" for c in cats]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\nper-category columns: {key.replace('_', ' ')}")
    return "\n".join(lines), runs
