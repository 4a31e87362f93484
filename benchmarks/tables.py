"""The documentation's figure tables, generated from benchmarks/results/*.json (their only source).

    python benchmarks/tables.py            # print every table
    python benchmarks/tables.py --write    # rewrite the tables in README.md and docs/*.md
    python benchmarks/tables.py --check    # exit 1 if a table there disagrees with its JSON

A table lives in a document between `<!-- tables:begin NAME -->` and `<!-- tables:end -->`; the text
between the markers is this script's output for NAME and nothing else (write notes outside them).
A results file with no block in any document is reported by --check; --write appends its block to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCHMARKS_DOC = ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"^<!-- tables:begin (?P<name>[\w.+-]+) -->\n(?P<body>.*?)^<!-- tables:end -->", re.S | re.M)


def load(name: str) -> dict | None:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def where(d: dict) -> str:
    m = d["machine"]
    return f"{m.get('gpu') or m['cpu']}, {m['torch_threads']} threads, torch {m['torch']}, {d['date']}"


def phases(rows) -> str:
    """Header naming the per-step phases the results hold (older results have no separate commit phase)."""
    keys = next((list(r["ms_per_step"]) for r in rows if r.get("ms_per_step")), ["draft", "verify", "accept"])
    return "ms/step " + " / ".join(keys)


def split(r: dict) -> str:
    return " / ".join(f"{v:.2f}" for v in r.get("ms_per_step", {}).values()) or "-"


def heading(p, title: str, setting: str) -> None:
    p(f"## {title}\n")
    p(f"{setting}.\n")


def minutes(wall_s: float) -> str:
    """A recipe's CPU wall time, rounded up to the half minute."""
    return f"~{math.ceil(wall_s / 30) / 2:g} min"


# --- tables kept outside docs/benchmarks.md ------------------------------------------------------------------


def kinds(p) -> None:
    """README: one row per drafter kind with its headline figures (stories260K on CPU, greedy)."""
    e, s, en = load("eagle"), load("ssm"), load("ensemble")
    if not (e and s and en):
        return
    p("| kind | what drafts | tree | accept length | speedup | identical to plain greedy | recipe | benchmark |")
    p("|---|---|---|---|---|---|---|---|")
    eagle_link = "[eagle.py](docs/benchmarks.md#eagle-3-style-drafter-and-medusa-2-vs-medusa-hydra-hydra)"
    rows = [("Medusa", "medusa", "4 heads on the base's last hidden state", "stories260k-medusa"),
            ("Hydra", "hydra", "4 heads, each also reading the tokens drafted before it", "stories260k-hydra"),
            ("Hydra++", "hydra++", "Hydra with 4-layer heads, a prefix-attention layer, distillation",
             "stories260k-hydra++"),
            ("Medusa-2", "medusa2", "Medusa heads trained with a LoRA on the base (speedup and identity against the adapted base)",
             "stories260k-medusa2"),
            ("EAGLE-3", "eagle3", "one decoder layer over three of the base's layers", "stories260k-eagle3"),
            ("EAGLE-3", "eagle3_t60", "the same drafter, EAGLE's 60-token tree", "stories260k-eagle3")]
    for kind, key, what, recipe in rows:
        r = e[key]
        p(f"| {kind} | {what} | {e['trees'][key]} | {r['accept_length']} | {r['speedup']:.2f}x | "
          f"{r['identical_to_baseline']} | [{recipe}](recipes/{recipe}.yaml) | {eagle_link} |")
    tree = f"draftlab_ssm_tree{len(s['tree']) + 1}"
    r = s["methods"][tree]
    p(f"| SSM | a 1-layer causal LM ({s['ssm_params'] / 1e3:.0f}K parameters) distilled from the base | "
      f"searched, {len(s['tree']) + 1} tokens | {r['accept_length']} | {r['speedup']:.2f}x | "
      f"{r['identical_to_baseline']} | [stories260k-ssm](recipes/stories260k-ssm.yaml) | "
      "[ssm.py](docs/benchmarks.md#ssm-drafting-vs-hf-assisted-generation-and-the-heads) |")
    r = en["methods"]["boost_merge5"]
    p(f"| ensemble | 5 boost-tuned SSMs, merged trees | chains of {en['chain']}, merged, up to 32 tokens | "
      f"{r['accept_length']} | {r['speedup']:.2f}x | {r['identical_to_baseline']} | "
      "[stories260k-ensemble](recipes/stories260k-ensemble.yaml) | "
      "[ensemble.py](docs/benchmarks.md#ensembles-at-decoding-time) |")
    p("| lookup | continuations of the text's last n-gram found earlier in it (no model) | - | - | - | - | - | "
      "not benchmarked on its own |")
    runs = {"eagle.py": e, "ssm.py": s, "ensemble.py": en}
    places = {where(d) for d in runs.values()}
    on = (lambda d: "") if len(places) == 1 else (lambda d: f"; {where(d)}")
    p(f"\nPlain decoding of the same base, in the same run: {e['baseline_tokens_per_s']:.0f} tokens/s in `eagle.py` "
      f"({e['prompts']} prompts{on(e)}), {s['methods']['hf_generate']['tokens_per_s']:.0f} in `ssm.py` "
      f"({s['prompts']} prompts{on(s)}), {en['methods']['hf_generate']['tokens_per_s']:.0f} in `ensemble.py` "
      f"({en['prompts']} prompts{on(en)}); {e['max_new_tokens']} new tokens per prompt"
      + (f"; {places.pop()}." if len(places) == 1 else ". Speedups compare methods of one run only."))


def recipes(p) -> None:
    """docs/recipes.md: the shipped recipes, with CPU wall times from the training benchmarks."""
    runs = {name: load(f"train_heads_stories260k-{name}") for name in ("hydra", "hydra++", "eagle3", "medusa2", "dflash")}
    runs["medusa"] = load("train_heads")
    ssm, ens = load("train_ssm"), load("train_ensemble")

    def cpu(d, note=""):
        return f"CPU, {minutes(d['wall_s'])}{note}" if d else "CPU"

    p("| recipe | base | hardware |\n|---|---|---|")
    p(f"| `recipes/stories260k-medusa.yaml` | stories260K imported from `data/models/stories260K` | {cpu(runs['medusa'])} |")
    p(f"| `recipes/stories260k-hydra.yaml` | same, Hydra heads | {cpu(runs['hydra'])} |")
    p("| `recipes/stories260k-hydra++.yaml` | same, Hydra++ (4-layer heads, prefix attention, distillation, hidden "
      f"cache) | {cpu(runs['hydra++'])} |")
    p("| `recipes/stories260k-ssm.yaml` | same base, a 1-layer SSM distilled on the base's own continuations | "
      f"{cpu(ssm and ssm['divergences']['fkl'])} |")
    p("| `recipes/stories260k-ensemble.yaml` | same base, 5 one-layer SSMs boost-tuned in stages | "
      f"{cpu(ens and ens['boost'])} |")
    p("| `recipes/stories260k-eagle3.yaml` | same base, an EAGLE-3-style drafter | "
      f"{cpu(runs['eagle3'], ' (measured while sharing the machine with the Medusa-2 run)')} |")
    p("| `recipes/stories260k-medusa2.yaml` | same base, Medusa-2 (heads + a LoRA on the base) | "
      f"{cpu(runs['medusa2'], ' (measured while sharing the machine with the EAGLE-3 run)')} |")
    p("| `recipes/stories260k-dflash.yaml` | same base, a DFlash-style block drafter (2 layers, blocks of 8) | "
      f"{cpu(runs['dflash'])} |")
    p("| `recipes/vicuna7b-medusa.yaml` | `lmsys/vicuna-7b-v1.3`, ShareGPT | 8 GPUs, bf16 |")
    p("| `recipes/vicuna7b-hydra.yaml` | same, Hydra: lr 1e-3, 1 epoch (the paper's) | 8 GPUs, bf16 |")
    p("| `recipes/vicuna7b-hydra++.yaml` | same, Hydra++ with the Hydra authors' settings (lr 5e-4, wd 0.1, cosine "
      "to 0.33x, dropout 0.2, 10 epochs); its header lists where the architecture still differs | 8 GPUs, bf16 |")
    p("| `recipes/llama3-8b-medusa.yaml` | `meta-llama/Meta-Llama-3-8B-Instruct`, ShareGPT | 8 GPUs, bf16 |")
    p("| `recipes/llama2-70b-medusa-fsdp.yaml` | `meta-llama/Llama-2-70b-chat-hf`, ShareGPT, base sharded with FSDP | "
      "8 x 80 GB GPUs, bf16 |")


# --- docs/benchmarks.md -----------------------------------------------------------------------------------------


def train_heads(p, d) -> None:
    heading(p, "Training Medusa heads", f"`benchmarks/train_heads.py`; {where(d)}")
    p(f"{d['steps']} steps, {d['train_tokens_per_s']:.0f} training tokens/s, {d['wall_s']:.0f} s wall; "
      f"held-out positions: {d['eval_positions']}\n")
    p("| head | top-1 | top-5 |\n|---|---|---|")
    for k, (a, b) in enumerate(zip(d["head_top1"], d["head_top5"]), 1):
        p(f"| {k} | {a:.3f} | {b:.3f} |")


def decode(p, d) -> None:
    heading(p, "Greedy decoding", f"`benchmarks/decode.py`; {d['prompts']} prompts x {d['max_new_tokens']} tokens; "
            f"{where(d)}")
    p("| method | tree size | accept length | tokens/s | speedup | identical to plain greedy | "
      f"{phases(d['methods'].values())} |")
    p("|---|---|---|---|---|---|---|")
    for m, r in d["methods"].items():
        p(f"| {m} | {r.get('tree_size', '-')} | {r.get('accept_length', '-')} | {r['tokens_per_s']:.0f} | "
          f"{r['speedup']:.2f}x | {r['identical_to_baseline']} | {split(r)} |")


def heads(p, d) -> None:
    heading(p, "Medusa vs Hydra vs Hydra++", f"`benchmarks/heads.py`; same data and optimizer steps, default tree of "
            f"{d['tree_size']} tokens, {d['prompts']} prompts x {d['max_new_tokens']} tokens, greedy; {where(d)}")
    p(f"plain HF generate: {d['baseline_tokens_per_s']:.0f} tokens/s\n")
    p(f"| heads | head top-1 (1..4) | accept length | tokens/s | speedup | identical | "
      f"{phases(d[k] for k in ('medusa', 'hydra', 'hydra++'))} |")
    p("|---|---|---|---|---|---|---|")
    for k in ("medusa", "hydra", "hydra++"):
        r = d[k]
        p(f"| {k} | {' '.join(f'{x:.3f}' for x in r['head_top1'])} | {r['accept_length']:.3f} | "
          f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['identical_to_baseline']} | {split(r)} |")


def hidden_cache(p, d) -> None:
    on, off = d["cache_on"], d["cache_off"]
    heading(p, "Hidden-state cache", f"`benchmarks/hidden_cache.py`; Hydra++ recipe, 2 epochs; {where(d)}")
    p("| run | epoch 1 tokens/s | epoch 2 tokens/s | wall s |\n|---|---|---|---|")
    p(f"| recompute the base | {off['epoch1']:.0f} | {off['epoch2']:.0f} | {off['wall_s']:.0f} |")
    p(f"| `train.cache_hidden: true` | {on['epoch1']:.0f} | {on['epoch2']:.0f} | {on['wall_s']:.0f} |")
    p(f"\nepoch-2 speed-up {d['epoch2_speedup']:.2f}x; cache size {d['cache_bytes'] / 2**20:.0f} MiB")


def tree_search(p, d) -> None:
    heading(p, "Tree search", f"`benchmarks/tree_search.py`; statistics from {d['calibration_prompts']} training "
            f"stories, check on {d['heldout_prompts']} held-out prompts x {d['max_new_tokens']} tokens; {where(d)}")
    p("| heads | chosen tree size | expected accept | replayed accept (calibration) | measured accept "
      "(held-out) | error | chosen tokens/s | default tree size | default accept | default tokens/s | "
      "plain tokens/s |")
    p("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in ("medusa", "hydra"):
        if k in d:
            r = d[k]
            p(f"| {k} | {r['tree_size']} | {r['expected_accept_length']:.3f} | "
              f"{r['replayed_accept_length']:.3f} | {r['measured_accept_length']:.3f} | "
              f"{100 * r['relative_error']:.1f}% | {r['tokens_per_s']:.0f} | {r['default_tree_size']} | "
              f"{r['default_accept_length']:.3f} | {r['default_tokens_per_s']:.0f} | "
              f"{r['baseline_tokens_per_s']:.0f} |")


def mt_bench(p, d) -> None:
    heading(p, "MT-Bench", f"`benchmarks/mt_bench.py`; {d['questions']} questions, 2 turns, max "
            f"{d['max_new_tokens']} new tokens, greedy, default trees; {where(d)}")
    cats = list(d["runs"]["medusa"]["categories"])
    p("| heads | " + " | ".join(cats) + " | overall speedup | accept length | identical |")
    p("|---" * (len(cats) + 4) + "|")
    for k, r in d["runs"].items():
        p(f"| {k} | " + " | ".join(f"{r['categories'][c]['speedup']:.2f}x" for c in cats) +
          f" | {r['overall']['speedup']:.2f}x | {r['overall']['accept_length']:.2f} | "
          f"{100 * r['overall']['identical_share']:.0f}% |")


def mt_bench_compiled(p, d) -> None:
    """eval mt-bench --compile: both baselines, the compile time kept out of the figures and beside them, and what
    the figures would be with it inside (as eval timed them before it decoded a compiling turn again)."""
    heading(p, "MT-Bench on the compiled path", f"`benchmarks/mt_bench.py --compile --max-new-tokens "
            f"{d['max_new_tokens']} --name mt_bench_compiled --export " +
            " --export ".join(f"{k}={v}" for k, v in d["exports"].items()) +
            f"`; {d['questions']} questions, 2 turns, greedy, default trees, base `runs/stories260k-base`; {where(d)}")
    p("| export | accept length | tokens/s | HF generate tokens/s | speedup | compiled plain tokens/s | vs compiled "
      "plain | turns that compiled | compile s | speedup with the compile time inside | identical | differences |")
    p("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k, r in d["runs"].items():
        o = r["overall"]
        inside = o["new_tokens"] / (o["new_tokens"] / o["tokens_per_s"] + o.get("compile_s", 0))
        diffs = "; ".join(f"q{x['question_id']} turn {x['turn']} at {x['position']}: margin {x['margin']:.2g}"
                          + (" (near tie)" if x["near_tie"] else " (NOT a near tie)") for x in r["differences"])
        p(f"| {k} | {o['accept_length']:.2f} | {o['tokens_per_s']:.0f} | {o['baseline_tokens_per_s']:.0f} | "
          f"{o['speedup']:.2f}x | {o['compiled_plain_tokens_per_s']:.0f} | {o['speedup_vs_compiled_plain']:.2f}x | "
          f"{o.get('turns_compiled', 0)} of {o['turns']} | {o.get('compile_s', 0):.0f} | "
          f"{inside / o['baseline_tokens_per_s']:.2f}x | {100 * o['identical_share']:.0f}% | {diffs or '-'} |")


def rerun_compiles(p, d) -> None:
    label, export = next(iter(d["export"].items()))
    heading(p, "A second run of the same length: compiled graphs and speed", f"`benchmarks/rerun_compiles.py --commit "
            f"{d['commit']} --export {label}={export}`; before = {d['commit']}; one prompt, {d['max_new_tokens']} new "
            f"tokens, greedy, the compiled path, each side's runs in turn in one process; {where(d)}")
    p("| side | run | graphs compiled during the run | seconds | tokens/s | tokens as run 1 |")
    p("|---|---|---|---|---|---|")
    for side, rows in d["runs"].items():
        for r in rows:
            p(f"| {side} | {r['run']} | {r['graphs']} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | {r['same_tokens']} |")


def compile_shapes(p, d, name: str = "compile_shapes") -> None:
    label, export = next(iter(d["export"].items()))
    named = "" if name == "compile_shapes" else f" --name {name}"
    heading(p, f"Compiled shapes of a long eval ({label})", f"`benchmarks/compile_shapes.py --commit {d['commit']} "
            f"--export {label}={export} --questions {d['questions']}{named}` at {d['after']}; before = {d['commit']}, "
            f"after = {d['after']} (a growth rule for cache sizes, reverted since: see below); "
            f"`eval mt-bench --compile` of the first {d['questions']} questions (two turns, {d['max_new_tokens']} new "
            f"tokens each, greedy) on stories260K with a {d['context']}-position context, through the `{d['backend']}` "
            f"torch.compile backend "
            f"(dynamo's tracing and guards without code generation: the same variants); each side in its own process; "
            f"{where(d)}")
    names = sorted({n for s in d["sides"].values() for n in s["variants"]})
    p("| side | " + " | ".join(f"variants of `{n}`" for n in names) + " | graphs compiled | turns that compiled | "
      "identical to HF |")
    p("|---|" + "---|" * len(names) + "---|---|---|")
    for side, s in d["sides"].items():
        p(f"| {side} | " + " | ".join(str(s["variants"].get(n, 0)) for n in names) + f" | {s['graphs']} | "
          f"{s['turns_compiled']} of {s['turns']} | {100 * s['identical_share']:.0f}% |")


def compile_warmup(p, d) -> None:
    exports = ", ".join(f"{k}: `{m['export'].split('=', 1)[-1]}`" for k, m in d["methods"].items() if k != "plain")
    heading(p, "Compile warm-up with an empty and a filled on-disk cache", f"`benchmarks/compile_warmup.py`; {exports}; "
            f"per method two processes in turn, the first with an empty `--compile-cache` folder, the second with the "
            f"folder the first filled; each decodes {d['prompts']} held-out prompts x {d['max_new_tokens']} tokens "
            f"(greedy, batch 1, compiled) and then the same prompts again; {where(d)}")
    p("| method | cache | first answer after the process's start, s | load s | first pass s | graphs built / loaded "
      "| second pass tokens/s | same tokens |")
    p("|---|---|---|---|---|---|---|---|")
    for k, m in d["methods"].items():
        for side, label in (("cold", "empty"), ("warm", "filled")):
            r = m[side]
            p(f"| {k} | {label} | {r['first_answer_s']:.1f} | {r['load_s']:.1f} | {r['first_pass_s']:.1f} | "
              f"{r['cache']['misses']} / {r['cache']['hits']} | {r['second_pass_tokens_per_s']:.0f} | "
              f"{m['same_tokens'] and r['second_pass_same']} |")


def train_ssm(p, d) -> None:
    heading(p, "Distilling an SSM", "`benchmarks/train_ssm.py`; recipes/stories260k-ssm.yaml on the base's greedy "
            f"continuations of the training stories; {where(d)}")
    p("| divergence | steps | wall s | training tokens/s | held-out top-1 (data token) | top-1 agreement with the base |")
    p("|---|---|---|---|---|---|")
    for div, r in d["divergences"].items():
        p(f"| {div} | {r['steps']} | {r['wall_s']:.0f} | {r['train_tokens_per_s']:.0f} | {r['head_top1'][0]:.3f} | "
          f"{r['agree_top1'][0]:.3f} |")


def ssm(p, d) -> None:
    heading(p, "SSM drafting vs HF assisted generation and the heads", f"`benchmarks/ssm.py`; {d['prompts']} held-out "
            f"prompts x {d['max_new_tokens']} tokens, greedy; SSM {d['ssm_params'] / 1e3:.0f}K parameters; {where(d)}")
    p("| method | tokens per base forward | accept length | tokens/s | speedup | identical | c | predicted "
      f"speedup | break-even c | {phases(d['methods'].values())} |")
    p("|---|---|---|---|---|---|---|---|---|---|")
    for m, r in d["methods"].items():
        p(f"| {m} | {r['tokens_per_base_forward']:.2f} | {r.get('accept_length', '-')} | {r['tokens_per_s']:.0f} | "
          f"{r['speedup']:.2f}x | {r['identical_to_baseline']} | {r.get('cost_ratio_c', '-')} | "
          f"{r.get('predicted_speedup', '-')} | {r.get('break_even_c', '-')} | {split(r)} |")


def timed_compiles(p, d) -> None:
    """A line on the graphs compiled inside the timed loop (results from 2026-11-28 on record them per method)."""
    counts = {k: r["graphs_compiled_timed"] for k, r in d["methods"].items() if "graphs_compiled_timed" in r}
    if not counts:
        return
    late = {k: n for k, n in counts.items() if n}
    p("\ngraphs compiled inside the timed loop (their compiling is in the figures): "
      + (", ".join(f"{k} {n}" for k, n in late.items()) if late else "none"))


def refactor_check(p, d, title: str, setting: str, per_phase: bool = False) -> None:
    """per_phase: also each side's milliseconds per step and phase."""
    heading(p, title, setting)
    extra = f" {phases(d['methods'].values())} before | after |" if per_phase else ""
    p(f"| {'drafter' if per_phase else 'heads'} | accept length before / after | tokens/s before | tokens/s after | "
      f"after / before |{extra}")
    p("|---|---|---|---|---|" + ("---|---|" if per_phase else ""))
    for k, ratio in d["after_over_before"].items():
        b, a = d["methods"][f"{k}_before"], d["methods"][f"{k}_after"]
        p(f"| {k} | {b['accept_length']} / {a['accept_length']} | {b['tokens_per_s']:.0f} | {a['tokens_per_s']:.0f} | "
          f"{ratio:.3f} |" + (f" {split(b)} | {split(a)} |" if per_phase else ""))
    p(f"\nplain HF generate in the same run: {d['methods']['hf_generate']['tokens_per_s']:.0f} tokens/s")
    timed_compiles(p, d)


def refactor_check_drafter(p, d) -> None:
    refactor_check(p, d, "The drafter interface against the decoder before it",
                   f"`benchmarks/refactor_check.py`; before = {d['before']}, same exports, base object and prompts, "
                   f"interleaved; {d['prompts']} prompts x {d['max_new_tokens']} tokens; {where(d)}")


def refactor_check_verifier(p, d) -> None:
    refactor_check(p, d, "The Verifier split against the decoder before it",
                   f"`benchmarks/refactor_check.py --commit {d['before']} --name refactor_check_verifier --prompts "
                   f"{d['prompts']}`; before = {d['before']}, same exports, base object and prompts, "
                   f"interleaved; {d['prompts']} prompts x {d['max_new_tokens']} tokens; {where(d)}")


def refactor_check_layout(p, d) -> None:
    refactor_check(p, d, "The package layout against the modules before it",
                   f"`benchmarks/refactor_check.py --commit {d['before']} --prompts {d['prompts']} --name "
                   "refactor_check_layout --export medusa=... --export hydra++=... --export eagle3=... --export "
                   "dflash=... --train recipes/stories260k-hydra++.yaml --train recipes/stories260k-dflash.yaml "
                   f"--train-steps 30` (the 250-step exports of the block-drafters table); before = {d['before']}, same "
                   f"exports, base object and prompts, interleaved; {d['prompts']} prompts x {d['max_new_tokens']} "
                   f"tokens; {where(d)}")
    if d.get("training"):
        p("\n| recipe (training) | steps | seconds before | seconds after | speed after / before | identical weights |")
        p("|---|---|---|---|---|---|")
        for k, r in d["training"].items():
            p(f"| {k} | {r['steps']} | {r['seconds_before']} | {r['seconds_after']} | {r['after_over_before']:.3f} | "
              f"{r['identical_weights']} |")


def gpu_decode(p, d) -> None:
    heading(p, "The decoder on a GPU", f"`benchmarks/gpu_decode.py`; {d['device']}, torch {d['torch']}, transformers "
            f"{d['transformers']}, {d['date']}; random-weight Llama-2-7B shape, {d['dtype']}, batch 1, "
            f"{d['context']}-token context")
    p(f"Plain HF generate: {d['plain_call_a']['tokens_per_s']} tokens/s in one call, "
      f"{d['plain_call_b']['tokens_per_s']} in the other.\n")
    p("| tree size | " + " | ".join(str(r["tree_size"]) for r in d["verify"]) + " |")
    p("|---" * (len(d["verify"]) + 1) + "|")
    p("| verify forward ms | " + " | ".join(f"{r['verify_ms']:.1f}" for r in d["verify"]) + " |")
    p("| over a plain step | " + " | ".join(f"{r['over_plain_step']:.2f}" for r in d["verify"]) + " |\n")
    p("| drafter | tree size | " + phases(d["drafter_costs"]) + " | draft / verify | parameters |")
    p("|---|---|---|---|---|")
    for r in d["drafter_costs"]:
        p(f"| {r['drafter']} ({r['tree']}) | {r['tree_size']} | {split(r)} | {r['draft_over_verify']:.3f} | "
          f"{r['params'] / 1e6:.0f}M |")
    p("\n| oracle acceptance alpha | tree | accept length | tokens/s | speedup | "
      f"{phases(d['oracle_loop'])} | bf16 re-syncs |")
    p("|---|---|---|---|---|---|---|")
    for r in d["oracle_loop"]:
        p(f"| {r['alpha']} | {r['tree']} | {r['accept_length']:.2f} | {r['tokens_per_s']:.1f} | "
          f"{r['speedup']:.2f}x | {split(r)} | {r['bf16_resyncs']} |")


def gpu_compiled(p, d, title: str) -> None:
    heading(p, title, f"`{d['command']}`; {d['device']}, torch {d['torch']}, transformers {d['transformers']}, "
            f"{d['date']}; random-weight Llama-2-7B shape, {d['dtype']}, batch 1, {d['context']}-token random prompt, "
            f"{d['new_tokens']} new tokens, median of {d['reps']} runs per method")
    p(f"Weights read per decoding step: {d['step_weight_gb']:.1f} GB; device-to-device copy measured in the run: "
      f"{d['copy_bandwidth_tbps']:.2f} TB/s (spec sheet: {d['nominal_tbps']} TB/s).\n")
    p("| method | tokens/s | vs fastest plain | accept length | ms/step (verify / accept) | share of the bandwidth "
      "bound | warm-up s (compiling) | first token unlike HF's eager greedy (its first run) |")
    p("|---|---|---|---|---|---|---|---|")
    for m, r in d["methods"].items():
        ph = r.get("phases_ms_per_step")
        ms = f"{r['ms_per_step']:.2f} ({ph['verify']:.2f} / {ph['accept']:.2f})" if ph else f"{r['ms_per_token']:.2f}"
        share = f"{r['bandwidth_share']:.0%}" if "bandwidth_share" in r else "-"
        if "bandwidth_share_decode" in r:
            share += f" ({r['bandwidth_share_decode']:.0%})"
        elif "bandwidth_share" in r and ph:  # runs before the prefill was recorded: a step's phases leave it out
            share += f" ({d['step_weight_gb'] / sum(ph.values()) / d['copy_bandwidth_tbps']:.0%}*)"
        warm = f"{r['warmup_s']:.1f}" + (f" ({r['compile_s']:.1f})" if r.get("compile_s") else "")
        diff = "none" if r["first_difference"] is None else r["first_difference"]
        vs = f"{r['vs_fastest_plain']:.2f}x" if "vs_fastest_plain" in r else "- (none in this run)"
        p(f"| {m} | {r['tokens_per_s']:.1f} | {vs} | {r.get('accept_length', 1.0):.2f} | "
          f"{ms} | {share} | {warm} | {diff} |")
    if any("bandwidth_share" in r for r in d["methods"].values()):
        recorded = any("bandwidth_share_decode" in r for r in d["methods"].values())
        p("\nShares of the bandwidth bound per token, the prefill included; in brackets per decoding step, the "
          "prefill left out (issue 20's target)" + ("" if recorded else "; * from the sum of a step's timed phases "
                                                    "(the run did not record its prefill)") + ".")
    if d.get("inductor_options"):
        p("\ninductor options set for every compile of the run: " + ", ".join(
            f"`{k}={v}`" for k, v in d["inductor_options"].items()))
    if d.get("note"):
        p(f"\n{d['note']}")
    failed = {m: e for m, e in d.get("errors", {}).items() if not e.startswith(("skipped", "not run"))}
    if failed:
        p("\nFailed in the run (left out of the rounds):\n")
        for m, e in failed.items():
            p(f"- {m}: {e.splitlines()[0][:160]}")
    parts = d.get("first_difference_from_split")
    if parts:
        p("\nFirst token where a fused (chained) method's output parts from its split one's: " + ", ".join(
            f"{k} {'none' if v is None else v}" for k, v in parts.items()))
    elif d.get("sampled_agree"):
        p("\nSampled runs of one seed, split and fused, the same tokens: " + ", ".join(
            f"{k} {'yes' if v else 'no'}" for k, v in d["sampled_agree"].items()))
    graphless = {m: r["cudagraph_skips"] for m, r in d["methods"].items() if r.get("cudagraph_skips")}
    if graphless:
        p("\nGraphs that ran without CUDA graphs (inductor's cudagraph_skips in the method's warm-up): "
          + ", ".join(f"{m} {n}" for m, n in graphless.items()))
    skipped = [m for m, e in d.get("errors", {}).items() if e.startswith("skipped")]
    if skipped:
        p(f"\nNot run (past the run's --deadline): {', '.join(skipped)}")
    absent = [m for m, e in d.get("errors", {}).items() if e.startswith("not run")]
    if absent:
        p(f"\nNamed by --only but not added by the run's options: {', '.join(absent)}")
    if d.get("verify_alone"):
        p("\n| compiled verify forward | tree size | alone ms | in the loop ms | in the loop / alone |\n"
          "|---|---|---|---|---|")
    for m, r in d.get("verify_alone", {}).items():
        p(f"| {m} | {r['tree_size']} | {r['alone_ms']:.2f} | {r['in_loop_ms']:.2f} | {r['in_loop_over_alone']:.3f} |")
    if d.get("draft_alone"):
        p("\n| drafting call | tree size | alone ms | draft phase in the loop, ms per step |\n|---|---|---|---|")
    for m, r in d.get("draft_alone", {}).items():
        p(f"| {m} | {r['tree_size']} | {r['alone_ms']:.2f} | {r['in_loop_ms']:.2f} |")
    prof = d.get("profile")
    if prof:
        p("\nThe matrix products alone (every linear layer of the base, lm_head included, through cuBLAS in one CUDA "
          "graph): " + "; ".join(f"{r['rows']} row{'s' if r['rows'] > 1 else ''}: {r['ms']:.2f} ms, "
                                  f"{r['tbps']:.2f} TB/s" for r in prof["matmul_floor"]) + ".")
        forwards = {m: r for m, r in prof.items() if m != "matmul_floor"}
        kinds = sorted({k for r in forwards.values() for k in r["by_kind_ms"]},
                       key=lambda k: -max(r["by_kind_ms"].get(k, 0) for r in forwards.values()))
        what = " (or drafting call)" if any(m.endswith("(drafting call)") for m in forwards) else ""
        p(f"\nKernels of one compiled verify forward{what} under the profiler (CUDA graph replays; ms per "
          f"{'call' if what else 'forward'}):\n")
        p(f"| forward | tree size | kernels | kernel ms | {' | '.join(kinds)} |\n|---|---|---|---|"
          + "---|" * len(kinds))
        for m, r in forwards.items():
            p(f"| {m} | {r['tree_size']} | {r['kernels_per_forward']} | {r['kernel_ms']:.2f} | "
              + " | ".join(f"{r['by_kind_ms'].get(k, 0):.2f}" for k in kinds) + " |")


def sampling_rounding(p, d) -> None:
    heading(p, "Inverse-CDF draws under last-bit changes of the law",
            f"`python benchmarks/sampling_rounding.py`; {d['draws']} draws per case, random bf16 logits of standard "
            f"deviation {d['logit_std']}, temperature {d['temperature']}, one uniform per draw on both sides; {where(d)}")
    p("| vocabulary | change | draws that differ | all of 127 draws agree |\n|---|---|---|---|")
    names = {"reordered": "float32 probabilities summed in another order", "bf16_bump_0.01": "1% of the logits one "
             "bf16 step up", "bf16_bump_0.1": "10% of the logits one bf16 step up"}
    for V, cases in d["vocab"].items():
        for k, r in cases.items():
            p(f"| {int(V):,} | {names[k]} | {r['draws_differ']:.3%} | {r['all_agree_over_127_draws']:.1%} |")


def lookup_memory(p, d) -> None:
    st = d["settings"]
    heading(p, "What a retrieval datastore costs",
            f"`python benchmarks/lookup_memory.py`; the lookup drafter's settings (n-grams {st['min_n']}..{st['max_n']}, "
            f"{st['per_key']} occurrences per key, {st['limit']} continuations of {st['length']} tokens); memory is "
            f"tracemalloc's, per token of the datastore; {where(d)}")
    p("| corpus | tokens | index | bytes/token kept | bytes/token at the build's peak | build s | us per lookup | "
      "same continuations |\n|---|---|---|---|---|---|---|---|")
    for corpus, c in d["corpora"].items():
        for name, r in c["indexes"].items():
            p(f"| {corpus} | {c['tokens']:,} | {name} | {r['kept_bytes_per_token']:.0f} | "
              f"{r['peak_bytes_per_token']:.0f} | {r['build_s']:.2f} | {r['us_per_lookup']:.0f} | "
              f"{'yes' if c['same_continuations'] else 'NO'} |")


def signature_cost(p, d) -> None:
    heading(p, "What a compiled call's signature costs per step",
            f"`python benchmarks/signature_cost.py`; the arguments of a fused verify step of compiled plain decoding "
            f"of stories260K ({d['arguments']} arguments, {d['tensors_in_state']} KV and pointer tensors), timeit; "
            f"{where(d)}")
    us = d["signature_us"]
    p("| arguments | us per signature |\n|---|---|")
    p(f"| as the decoder passes them now | {us['now']:.1f} |")
    p(f"| as before (buffers in lists, a new settings object) | {us['before']:.1f} (building them: "
      f"{us['building_the_before_arguments_alone']:.1f}) |")
    p("\n| argument | us |\n|---|---|")
    for k, v in d["per_argument_us"].items():
        p(f"| {k} | {v:.2f} |")


def attention_packing(p, d) -> None:
    heading(p, "CPU attention over grouped heads: a group's query heads packed as one head's rows, or enable_gqa",
            "`python benchmarks/attention_packing.py`; decode.gqa.grouped_sdpa compiled both ways (fixed shapes), "
            "one after the other per shape, best of 3 rounds; batch 1, an additive mask shared by the heads; "
            f"{d['machine']['cpu']}, torch {d['machine']['torch']}, {d['date']}")
    p("| shape | query rows | threads | packed us | enable_gqa us | packed speedup | largest difference |")
    p("|---|---|---|---|---|---|---|")
    for name, shape in d["shapes"].items():
        dims = (f"{name} ({shape['heads']} over {shape['kv_heads']} heads of {shape['head_dim']}, "
                f"{shape['slots']} slots)")
        for n, by_threads in shape["rows"].items():
            for t, r in by_threads.items():
                p(f"| {dims} | {n} | {t} | {r['packed_us']:.1f} | {r['enable_gqa_us']:.1f} | {r['speedup']:.2f}x | "
                  f"{r['max_abs_difference']:.1e} |")


def gpu_train(p, d, title: str = "bf16 training steps on a GPU") -> None:
    heading(p, title, f"`benchmarks/gpu_train.py`; {d['device']}, torch {d['torch']}, "
            f"{d['date']}; random-weight Llama-2-7B shape in bfloat16, batch {d['batch_size']} x up to {d['max_len']} "
            f"tokens of ShareGPT, {d['steps']} steps")
    p("| draft | trainable parameters | training tokens/s | peak GPU memory GiB | wall s |\n|---|---|---|---|---|")
    for k, r in d["runs"].items():
        p(f"| {k} | {r['draft_params'] / 1e6:.0f}M | {r['train_tokens_per_s']:.0f} | {r['peak_gpu_mem_gib']:.1f} | "
          f"{r['wall_s']:.0f} |")


def train_ensemble(p, d) -> None:
    heading(p, "Boost-tuning an SSM ensemble", "`benchmarks/train_ensemble.py`; recipes/stories260k-ensemble.yaml, "
            f"5 one-layer members x 300 steps; {where(d)}")
    p("| ensemble | stage | trained on examples | ensemble coverage (mean) | covered examples | tau (merged, "
      "16 held-out prompts) |\n|---|---|---|---|---|---|")
    for name in ("boost", "independent"):
        for st in d[name]["stages"]:
            p(f"| {name} | {st['stage']} | {st['trained_on_examples']} | {st['mean_coverage']:.3f} | "
              f"{st['covered_examples']} | {st['tau']:.3f} |")
    p(f"\nwall: boost {d['boost']['wall_s']:.0f} s, independent {d['independent']['wall_s']:.0f} s; members' "
      "held-out top-1 agreement: boost " + ", ".join(f"{x:.3f}" for x in d["boost"]["member_agree_top1"]) +
      "; independent " + ", ".join(f"{x:.3f}" for x in d["independent"]["member_agree_top1"]))


def ensemble(p, d) -> None:
    heading(p, "Ensembles at decoding time", f"`benchmarks/ensemble.py`; {d['prompts']} held-out prompts x "
            f"{d['max_new_tokens']} tokens, greedy, chains of {d['chain']} per member, merged trees of 32 tokens; "
            f"{where(d)}")
    p("| members | boost merge | boost vote | independent merge | independent vote |\n|---|---|---|---|---|")
    z = d["sizes"]
    for k in z["boost"]["merge"]:
        p(f"| {k} | {z['boost']['merge'][k]:.3f} | {z['boost']['vote'][k]:.3f} | "
          f"{z['independent']['merge'][k]:.3f} | {z['independent']['vote'][k]:.3f} |")
    p("\n(accept length: tokens committed per base forward; 1 member = that member alone)\n")
    p(f"| method | accept length | tokens/s | speedup | identical | {phases(d['methods'].values())} | "
      "ensemble bookkeeping ms/step (share) | warm-up s (compile included) |\n|---|---|---|---|---|---|---|---|")
    for m, r in d["methods"].items():
        ov = (f"{r['ensemble_overhead_ms_per_step']:.2f} ({100 * r['ensemble_overhead_share']:.1f}%)"
              if "ensemble_overhead_ms_per_step" in r else "-")
        p(f"| {m} | {r.get('accept_length', '-')} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
          f"{r['identical_to_baseline']} | {split(r)} | {ov} | {r.get('warmup_s', '-')} |")
    sm = d["sampled"]
    p(f"\nScheduler: the untrained member drafted in {100 * d['scheduler']['bad_member_active_share']:.0f}% of "
      f"the steps after warm-up. Sampled (T = 0.8): plain HF {sm['hf_sample']['tokens_per_s']:.0f} tokens/s; "
      f"one member {sm['single']['tokens_per_s']:.0f} tokens/s (accept {sm['single']['accept_length']}); "
      f"boosted 5-member merge {sm['boost_merge5']['tokens_per_s']:.0f} tokens/s (accept "
      f"{sm['boost_merge5']['accept_length']}).")
    g = d.get("grouped")
    if g:
        p("\nFive boost-tuned members drafting as one grouped model (the default; `_one_by_one`: each member its own "
          "forwards), tokens/s and its ratio to the best member alone on the same path "
          f"(eager: {g['best_member_eager']}; compiled: {g['best_member_compiled']}) and to draftlab's compiled plain "
          "loop:\n")
        p("| ensemble | eager tokens/s | vs best member | compiled tokens/s | vs best member | vs compiled plain |\n"
          "|---|---|---|---|---|---|")
        for mode in ("merge", "vote"):
            for tag in ("_grouped", "_one_by_one"):
                e, c = g[f"{mode}5{tag}_eager"], g[f"{mode}5{tag}_compiled"]
                p(f"| {mode}, {tag[1:].replace('_', ' ')} | {e['tokens_per_s']:.0f} | {e['vs_best_member']:.2f}x | "
                  f"{c['tokens_per_s']:.0f} | {c['vs_best_member']:.2f}x | {c['vs_plain_compiled']:.2f}x |")


def eagle(p, d) -> None:
    heading(p, "EAGLE-3-style drafter and Medusa-2 vs Medusa, Hydra, Hydra++", "`benchmarks/eagle.py`; same data and "
            f"optimizer steps; {d['prompts']} held-out prompts x {d['max_new_tokens']} tokens, greedy; {where(d)}")
    p("| draft | tree | tokens per verification | accept length | tokens/s | speedup | identical | "
      f"{phases([d[k] for k in d['trees']])} | train steps | train tokens/s | held-out top-1 agreement per "
      "head / step |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for k, tree in d["trees"].items():
        r = d[k]
        p(f"| {k} | {tree} | {r['tree_size']} | {r['accept_length']} | {r['tokens_per_s']:.0f} | "
          f"{r['speedup']:.2f}x | {r['identical_to_baseline']} | {split(r)} | {r['train_steps']} | "
          f"{r['train_tokens_per_s']:.0f} | {', '.join(f'{x:.2f}' for x in r['agree_top1'])} |")
    adapted = d.get("adapted_baseline_tokens_per_s")
    p(f"\nplain HF generate in the same run: {d['baseline_tokens_per_s']:.0f} tokens/s" +
      (f"; of Medusa-2's adapted base (its baseline): {adapted:.0f} tokens/s" if adapted else ""))


def dsi(p, d) -> None:
    heading(p, "DSI as processes with emulated latencies", "`benchmarks/dsi.py`; stories260K base, oracle drafter "
            f"with i.i.d. acceptance, {d['runs']} prompts x {d['tokens']} tokens; {where(d)}")
    split = "dsi_wall_over_emulated" in d["configs"][0]  # runs before the split into runtime and draws lack it
    p("| target ms | drafter ms | acceptance | SP | lookahead (DSI / SI) | identical | measured s non-SI / SI / DSI | "
      "expected s non-SI / SI / DSI | DSI vs SI measured (expected) | DSI vs non-SI measured (expected) |" +
      (" DSI wall / its emulated clock | emulated / expected |" if split else ""))
    p("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if split else ""))
    for r in d["configs"]:
        m, e, ms, es = r["measured_s"], r["expected_s"], r["measured_speedup"], r["expected_speedup"]
        p(f"| {1000 * r['t_target_s']:.1f} | {1000 * r['t_draft_s']:.1f} | {r['acceptance']} | {r['sp']} | "
          f"{r['lookahead']} / {r['si_lookahead']} | {r['identical_to_greedy']} | "
          f"{m['non_si']:.2f} / {m['si']:.2f} / {m['dsi']:.2f} | {e['non_si']:.2f} / {e['si']:.2f} / {e['dsi']:.2f} | "
          f"{ms['dsi_vs_si']:.2f} ({es['dsi_vs_si']:.2f}) | {ms['dsi_vs_non_si']:.2f} ({es['dsi_vs_non_si']:.2f}) |" +
          (f" {r['dsi_wall_over_emulated']:.3f} | {r['dsi_emulated_over_expected']:.3f} |" if split else ""))


def dsi_grid(p, d) -> None:
    g = d["grid"]
    p(f"`benchmarks/dsi_grid.py`; drafter latency {g['drafter_ratio']} of the target's, acceptance "
      f"{g['acceptance']}, SP {g['sp']}: {g['points']} points; exact: a {g['tokens']}-token text; {d['date']}\n")
    p("| DSI lookahead rule | expectation | points where DSI is slower than min(SI, non-SI) | worst DSI / min(SI, "
      "non-SI) (where: acceptance, drafter ratio) | median speedup over min(SI, non-SI) | lookahead below / above "
      "the no-wait one |")
    p("|---|---|---|---|---|---|")
    for rule in ("expected", "no-wait"):
        for kind, label in (("closed_form", "per token, closed form"), ("exact", "text, exact")):
            r = d[kind][rule]
            w = r["worst_at"]
            p(f"| {rule} | {label} | {r['slower_points']} | {r['worst_dsi_over_best_baseline']:.4f} "
              f"({w['acceptance']:.2f}, {w['drafter_ratio']:.2f}) | {r['median_speedup_vs_best_baseline']:.3f} | "
              f"{r['lookahead_below_no_wait']} / {r['lookahead_above_no_wait']} |")
    s = d.get("simulator")
    if s:
        p(f"\nevent simulator ({s['runs_per_point']} runs a point, common random numbers, lookahead rule expected): "
          f"{s['slower_points_significant']} points where DSI is slower by more than {s['z']:g} standard errors "
          f"(largest z {s['largest_z_of_dsi_minus_best_baseline']:.2f}; {s['slower_points_mean_only']} with a higher "
          f"mean at all); simulated means against the exact expectations: DSI max |z| "
          f"{s['dsi_mean_vs_exact']['max_abs_z']:.2f}, SI {s['si_mean_vs_exact']['max_abs_z']:.2f}")


def pipeline(p, d) -> None:
    heading(p, "Pipelined drafting and verification", f"`benchmarks/pipeline.py`; {d['prompts']} MT-Bench first turns "
            f"x {d['max_new_tokens']} tokens, greedy, stories260K + the fkl SSM, {d['in_flight']} groups in flight, "
            f"median of {d['reps']} interleaved runs; {d['machine']['cpu']}, {d['machine']['cores']} cores, torch "
            f"{d['machine']['torch']}, {d['date']}")
    p("| tree | verifier batch | method | tokens/s | vs sequential x1 | vs sequential x2 | accept length | "
      "verifier waiting s | drafter paused / pool max | identical to plain greedy |")
    p("|---|---|---|---|---|---|---|---|---|---|")
    ref = {(r["tree"], r["batch_size"], r["method"]): r["tokens_per_s"] for r in d["rows"]}
    for r in d["rows"]:
        k = (r["tree"], r["batch_size"])
        dr = r.get("drafter")
        pool = f"{dr['paused']} / {dr['pool_max']}" if dr else "-"
        p(f"| {r['tree']} | {r['batch_size']} | {r['method']} | {r['tokens_per_s']:.0f} | "
          f"{r['tokens_per_s'] / ref[k + ('sequential x1',)]:.2f}x | "
          f"{r['tokens_per_s'] / ref[k + ('sequential x2',)]:.2f}x | "
          f"{r['accept_length']:.2f} | {r['verifier_wait_s']:.2f} | {pool} | {r['identical_to_plain']} |")
    p(f"\nplain HF greedy, one prompt at a time, 1 thread: {d['plain_tokens_per_s']:.0f} tokens/s")


def tp_decode(p, d) -> None:
    heading(p, "Tensor-parallel decoding", f"`benchmarks/tp_decode.py`; {d['device']} x {d['processes']}, {d['base']}, "
            f"{d['dtype']}, {d['context']}-token context; {d['date']}")
    p("| tree tokens | verify ms | / plain step |\n|---|---|---|")
    for r in d["verify"]:
        p(f"| {r['tree_size']} | {r['verify_ms']:.2f} | {r['over_plain_step']:.2f} |")
    p(f"\nplain generate over the shards: {d['plain']['tokens_per_s']:.1f} tokens/s\n")
    p("| oracle alpha | tree | accept length | tokens/s | speedup | identical |\n|---|---|---|---|---|---|")
    for r in d["oracle_loop"]:
        p(f"| {r['alpha']} | {r['tree']} | {r['accept_length']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
          f"{r['identical_to_plain']} |")


# block name -> (results file it reads, or None for a table over several, renderer), in docs/benchmarks.md order
def compiled(p, d) -> None:
    trees = d.get("trees") or {}
    exports = ", ".join(f"{k}: `{v}`" + (f" (tree `{trees[k]}`)" if k in trees else "") for k, v in d["exports"].items())
    if d.get("tree") and not trees:  # (newer results name it per export, above)
        exports += f", tree `{d['tree']}`"
    heading(p, d.get("title") or "Eager vs compiled decoding", f"`benchmarks/compiled.py`; {exports}; base `{d['base']}`; "
            f"{d['prompts']} prompts x {d['max_new_tokens']} tokens, greedy, batch 1; {where(d)}")
    p(f"fastest plain decoding in the run: {d['fastest_plain']}\n")
    p("| method | tree size | accept length | tokens/s | vs HF generate | vs fastest plain | identical to HF | "
      f"{phases(d['methods'].values())} | warm-up s (compile included) |")
    p("|---|---|---|---|---|---|---|---|---|")
    for m, r in d["methods"].items():
        if "tokens_per_s" not in r:
            p(f"| {m} | failed: {r.get('error')} | | | | | | | |")
            continue
        p(f"| {m} | {r.get('tree_size', '-')} | {r.get('accept_length', '-')} | {r['tokens_per_s']:.0f} | "
          f"{r['speedup']:.2f}x | {r['speedup_vs_fastest_plain']:.2f}x | {r['identical_to_baseline']} | {split(r)} | "
          f"{r.get('warmup_s', '-')} |")
    timed_compiles(p, d)


def step_exports(d) -> str:
    """A step_bounds run's exports as its tables' headings name them."""
    return ", ".join(f"{k}: `{v}`" for k, v in d["exports"].items())


def step_bounds(p, d, title: str = "Where a compiled step's time goes, and the kernel-only bound") -> None:
    exports = step_exports(d)
    same = all(r["identical_to_plain"] for r in d["methods"].values())
    heading(p, title, f"`benchmarks/step_bounds.py`; "
            f"{exports}; base `{d['base']}`; {d['prompts']} prompts x {d['max_new_tokens']} tokens (kernels profiled "
            f"on the first {d['profiled_prompts']}), greedy, batch 1, compiled; outputs "
            f"{'identical to' if same else 'NOT all identical to'} plain decoding; {where(d)}")
    p("| method | tree size | accept length | tokens/s | vs plain | ms/step | compiled kernels ms/step (share): per call "
      "| kernel-only bound vs plain | bound at plain's overhead vs plain | target | accept length the target needs: "
      "kernels only / at plain's overhead |")
    p("|---|---|---|---|---|---|---|---|---|---|---|")
    plain = d["methods"]["plain"]
    rate = plain["accept_length"] / plain["step_ms"]  # plain decoding's measured tokens per ms
    for k, r in d["methods"].items():
        # At plain's overhead: the step's kernels plus everything else plain decoding's own step pays (one compiled
        # call, the host copy, emitting), against plain decoding as measured.
        at_plain = r["accept_length"] / (r["kernels_ms"] + plain["other_ms"]) / rate
        target = f"{r['target']}x" if r.get("target") else "-"
        needs = "-"
        if r.get("target"):
            needs = f"{r['accept_for_target']} / {r['target'] * rate * (r['kernels_ms'] + plain['other_ms']):.2f}"
        calls = ", ".join(f"{g} {v['kernels_ms']:.2f}" for g, v in r["graphs"].items() if v["kernels_ms"] >= 0.02)
        p(f"| {k} | {r['tree_size']} | {r['accept_length']:.2f} | {r['tokens_per_s']:.0f} | "
          f"{r['speedup_vs_plain']:.2f}x | {r['step_ms']:.2f} | {r['kernels_ms']:.2f} ({r['kernel_share']:.0%}): "
          f"{calls} | {r['bound_vs_plain']:.2f}x | {at_plain:.2f}x | {target} | {needs} |")
    timed_compiles(p, d)


def step_ops(p, d, title: str = "What a compiled step's kernels are: products, attention and generated kernels",
             least_us: float = 2.0) -> None:
    """The --ops breakdown of a step_bounds run: per method, each kind of call by rows, costing at least least_us
    microseconds per step."""
    heading(p, title, f"`benchmarks/step_bounds.py --ops`; {step_exports(d)}; base `{d['base']}`; the first "
            f"{d['profiled_prompts']} of {d['prompts']} prompts x {d['max_new_tokens']} tokens profiled, greedy, "
            f"batch 1, compiled with the Python wrapper and inductor's kernel profile; {where(d)}")
    p("| method | call (rows) | calls per step | us per call | us per step |")
    p("|---|---|---|---|---|")
    for k, r in d["methods"].items():
        for o, v in r["ops"].items():
            if v["us_per_step"] >= least_us:
                p(f"| {k} | {o} | {v['calls_per_step']:.2f} | {v['us_per_call']:.1f} | {v['us_per_step']:.1f} |")


def ensemble_cost(p, d, title: str = "The ensemble's cost schedule: against its best member",
                  name: str = "ensemble_cost") -> None:
    same = all(r["identical_to_baseline"] for r in d["methods"].values())
    args = (f" --only {' '.join(d['only'])}" if d.get("only") else "") + "".join(
        f" --option {k}={v}" for k, v in (d.get("options") or {}).items()) + "".join(
        f" --alt-option {k}={v}" for k, v in (d.get("alt_options") or {}).items())
    heading(p, title, f"`benchmarks/ensemble_cost.py --prompts {d['prompts']}{args}"
            f"{'' if name == 'ensemble_cost' else ' --name ' + name}`; `{d['export']}`; {d['prompts']} prompts x {d['max_new_tokens']} tokens, greedy, batch 1, "
            f"every method compiled, interleaved after a warm-up over every prompt; outputs "
            f"{'identical to' if same else 'NOT all identical to'} plain decoding; {where(d)}")
    p(f"| method | tree size | accept length | tokens/s | vs plain | vs best member ({d['best_member']}) | "
      f"{phases(d['methods'].values())} | warm-up s (compile included) |")
    p("|---|---|---|---|---|---|---|---|")
    for k, r in d["methods"].items():
        split = " / ".join(f"{v:.2f}" for v in r.get("ms_per_step", {}).values()) or "-"
        p(f"| {k} | {r['tree_size']} | {r.get('accept_length', 1.0):.2f} | {r['tokens_per_s']:.0f} | "
          f"{r['speedup']:.2f}x | {r['vs_best_member']:.2f}x | {split} | {r['warmup_s']:.1f} |")
    timed_compiles(p, d)
    for key, who in (("cost_schedule", "The cost schedule"), ("cost_schedule_alt", "ensemble_cost_alt")):
        if key not in d:
            continue
        s = d[key]
        drafting = ", ".join(f"{k}: {v}" for k, v in s["members_drafting_per_step"].items())
        times = ", ".join(f"{k}: {v}" for k, v in s["step_ms_by_members"].items())
        p(f"\n{who} over the run ({s['steps']} steps, warm-up included): members drafting per step "
          f"{{{drafting}}}; steady-state step ms by members drafting {{{times}}}; final choice {s['final_choice']} "
          f"member(s), ranked {', '.join(s['ranking'])}.")
    if "best_member_per_prompt" in d:
        h = d["best_member_per_prompt"]
        p(f"\nEach prompt decoded by the member that took the fewest steps on it, chosen in hindsight: {h['steps']} "
          f"steps against {h['best_member_steps']} for {d['best_member']} on every prompt "
          f"({1 - h['steps'] / h['best_member_steps']:.1%} fewer), the most a choice of one member per prompt could save.")
    if d.get("steps_by_kind"):
        p("\nOne more pass over the prompts each, every step timed by its kind (from the end of one step's commit to the "
          "end of the next; a prompt's last step falls in the rest of its call):\n")
        p("| method | kind of step | steps | ms in all | ms per step |")
        p("|---|---|---|---|---|")
        for m, kinds in d["steps_by_kind"].items():
            for kind, r in kinds.items():
                p(f"| {m} | {kind} | {r['steps']} | {r['ms']:.1f} | {r['ms'] / r['steps']:.3f} |")


def drafter_steps(p, d) -> None:
    heading(p, "Per-step costs, eager vs compiled", f"`benchmarks/drafter_steps.py`; untrained drafters on "
            f"{d['base']} (they accept little: the figures are costs per step, not speedups); {d['prompts']} prompts x "
            f"{d['max_new_tokens']} tokens, greedy, batch 1; {where(d)}")
    p(f"| drafter, path | accept length | tokens/s | {phases(d['methods'].values())} | identical to eager | "
      "warm-up s |")
    p("|---|---|---|---|---|---|")
    for m, r in d["methods"].items():
        p(f"| {m} | {r['accept_length']} | {r['tokens_per_s']:.0f} | {split(r)} | "
          f"{r.get('identical_to_eager', '-')} | {r['warmup_s']} |")


def batch_schedule(p, d) -> None:
    heading(p, "Speculation schedule per batch size", f"`benchmarks/batch_schedule.py`; export `{d['export']}`, "
            f"base `{d['base']}`; {d['prompts']} held-out prompts x {d['max_new_tokens']} tokens, greedy, decoded in "
            f"batches of each size, fastest of {d['rounds']} interleaved rounds; {where(d)}")
    p("| batch size | schedule's tree (nodes) | schedule tokens/s | fixed tree tokens/s | plain tokens/s | "
      "schedule / fixed | schedule / plain | accept length schedule / fixed | identical to plain greedy |")
    p("|---|---|---|---|---|---|---|---|---|")
    for r in d["batch_sizes"]:
        s, f, n = r["schedule"], r["fixed"], r["plain"]
        same = all(r[m]["identical_to_plain_greedy"] for m in ("schedule", "fixed", "plain"))
        p(f"| {r['batch_size']} | {r['schedule_tree']} ({r['schedule_tree_size']}) | {s['tokens_per_s']:.0f} | "
          f"{f['tokens_per_s']:.0f} | {n['tokens_per_s']:.0f} | {r['schedule_vs_fixed']:.2f}x | "
          f"{r['schedule_vs_plain']:.2f}x | {s['accept_length']:.2f} / {f['accept_length']:.2f} | {same} |")
    cut = d["no_speculation_above"]
    top = d["batch_sizes"][-1]["batch_size"]
    fixed = d["batch_sizes"][0]["fixed_tree_size"]
    p(f"\nfixed tree: {d['fixed_tree']} ({fixed} nodes). search-tree's cut-off: " +
      ("speculation paid at no batch size" if cut == 0 else f"speculation paid up to batch size {top}, the largest"
       if cut is None else f"plain decoding wins above batch size {cut}") + f" (search {d['search_s']:.0f} s)")
    p("\n| batch size | search-tree's choice | nodes | accept length (statistics) | est. tokens/s | est. plain "
      "tokens/s | timed tokens/s | timed plain tokens/s | vLLM chain K |")
    p("|---|---|---|---|---|---|---|---|---|")
    for e in d["search"]:
        p(f"| {e['batch_size']} | {e['tree']} | {e['tree_size']} | {e['accept_length']:.3f} | "
          f"{e['estimated_tokens_per_s']:.0f} | {e['estimated_plain_tokens_per_s']:.0f} | {e['tokens_per_s']:.0f} | "
          f"{e['plain_tokens_per_s']:.0f} | {e['chain_length']} |")


def refactor_check_compiled(p, d) -> None:
    refactor_check(p, d, "The compiled path: guards checked once per signature, acceptance as one graph",
                   f"`benchmarks/refactor_check.py --compile --commit {d['before']} --prompts {d['prompts']} --name "
                   "refactor_check_compiled --export medusa=... --export hydra++=... --export eagle3=...` (exports "
                   f"trained for 250 steps); before = {d['before']}, both on the static-shape compiled path (inductor), "
                   f"same exports, base object and prompts, interleaved; {d['prompts']} prompts x "
                   f"{d['max_new_tokens']} tokens; {where(d)}", per_phase=True)


def refactor_check_compiled_exports(title: str, name: str):
    """A refactor check on the exports of "Every drafter kind at full training" (runs/...) or the boost-tuned
    ensemble (with its schedule options, if any, on both sides)."""
    dirs = {"hydra++": "runs/full-hydra++/export", "medusa": "runs/full-medusa/export",
            "eagle3": "runs/e6-eagle3-self/export", "dflash": "runs/e6-dflash-self/export",
            "ssm": "runs/ssm-member1/export", "ensemble": "benchmarks/exports/stories260k-ensemble-boost"}

    def table(p, d) -> None:
        kinds = [k[: -len("_after")] for k in d["methods"] if k.endswith("_after") and k != "plain_after"]
        paths = d.get("exports") or dirs  # (results before 2026-11-28 do not name their exports)
        exports = " ".join(f"--export {k}={paths[k]}" for k in kinds) + "".join(  # in the command's order
            f" --ensemble-option {k}={v}" for k, v in (d.get("ensemble_options") or {}).items())
        compiled, T = d.get("compiled", True), d.get("temperature", 0)
        typical = d.get("typical", False)
        opts = ("--compile " if compiled else "") + (f"--temperature {T} " if T else "") + \
            ("--typical " if typical else "")
        path = "the static-shape compiled path (inductor)" if compiled else "the eager path"
        sampled = (f"; sampled at temperature {T}{' with typical acceptance' if typical else ''}: the two sides draw "
                   "differently, so compare accept lengths within noise and time per step, not tokens" if T else "")
        refactor_check(p, d, title, f"`benchmarks/refactor_check.py {opts}--commit {d['before']} --prompts "
                       f"{d['prompts']} --name {name} {exports}`; before = {d['before']}, both on {path}, same "
                       f"exports, base object and prompts, interleaved; {d['prompts']} prompts x "
                       f"{d['max_new_tokens']} tokens{sampled}; {where(d)}", per_phase=True)
    return table


def refactor_check_session_cpu(p, d) -> None:
    refactor_check(p, d, "Plain steps that keep nothing, DFlash's greedy tree inside its call (CPU)",
                   f"`benchmarks/refactor_check.py --compile --commit {d['before']} --prompts {d['prompts']} --export "
                   "dflash=runs/e6-dflash-self/export --name refactor_check_session_cpu`; before = "
                   f"{d['before']}, both on the static-shape compiled path (inductor), interleaved; {d['prompts']} "
                   f"prompts x {d['max_new_tokens']} tokens; {where(d)}", per_phase=True)


def outside_verify(p, d, title: str = "Time per step outside the verification, per drafter kind") -> None:
    """benchmarks/outside_verify.py: each method's step against the verification at its tree width, same loop."""
    exports = ", ".join(f"{k}: `{v}`" for k, v in d["exports"].items())
    opts = "; ".join(f"{k}: " + ", ".join(f"{n}={v}" for n, v in o.items()) for k, o in d["ensemble_options"].items())
    same = all(r["identical_to_plain"] for r in d["methods"].values())
    heading(p, title, f"`benchmarks/outside_verify.py`; {exports}" + (f" (options {opts})" if opts else "")
            + f"; base `{d['base']}`; {d['prompts']} prompts x {d['max_new_tokens']} tokens, greedy, batch 1, "
            f"compiled, each drafter as draftlab decodes by default and unchained (its drafting in calls of its "
            f"own), interleaved; outputs {'identical to' if same else 'NOT all identical to'} plain decoding both "
            f"ways; {where(d)}")
    p(f"| method | tree size | accept length | tokens/s (unchained) | step ms | verification ms (unchained) | outside "
      f"it, ms | outside / verification (target <= {d['target']:.0%}) | unchained ms/step draft / verify / accept / "
      f"commit |")
    p("|---|---|---|---|---|---|---|---|---|")
    for k, r in d["methods"].items():
        apart = " / ".join(f"{v:.2f}" for v in r["unchained_phases_ms"].values())
        p(f"| {k} | {r['tree_size']} | {r['accept_length']:.2f} | {r['tokens_per_s']:.0f} "
          f"({r['unchained_tokens_per_s']:.0f}) | {r['step_ms']:.3f} | {r['verify_ms']:.3f} | {r['outside_ms']:.3f} | "
          f"{r['outside_share']:.0%}{'' if r['same_steps'] else ' (steps differ)'} | {apart} |")
    timed_compiles(p, d)


def titled(render, titles: dict) -> dict:
    """TABLES entries whose docs section and results file share a name, each drawn by render(p, d, its title)."""
    return {n: (n, lambda p, d, t=t: render(p, d, t)) for n, t in titles.items()}


def same_name(render, *names: str) -> dict:
    """TABLES entries whose docs section and results file share a name, all drawn by `render`."""
    return {n: (n, render) for n in names}


TABLES = {
    "kinds": (None, kinds),
    "recipes": (None, recipes),
    "train_heads": ("train_heads", train_heads),
    "decode": ("decode", decode),
    "heads": ("heads", heads),
    "hidden_cache": ("hidden_cache", hidden_cache),
    "tree_search": ("tree_search", tree_search),
    "mt_bench": ("mt_bench", mt_bench),
    "mt_bench_compiled": ("mt_bench_compiled", mt_bench_compiled),
    "rerun_compiles": ("rerun_compiles", rerun_compiles),
    "compile_shapes": ("compile_shapes", compile_shapes),
    "compile_warmup": ("compile_warmup", compile_warmup),
    "compile_shapes_eagle3": ("compile_shapes_eagle3", lambda p, d: compile_shapes(p, d, "compile_shapes_eagle3")),
    "train_ssm": ("train_ssm", train_ssm),
    "ssm": ("ssm", ssm),
    "refactor_check": ("refactor_check", refactor_check_drafter),
    "refactor_check_verifier": ("refactor_check_verifier", refactor_check_verifier),
    "refactor_check_layout": ("refactor_check_layout", refactor_check_layout),
    "refactor_check_compiled": ("refactor_check_compiled", refactor_check_compiled),
    "gpu_decode": ("gpu_decode", gpu_decode),
    "gpu_train": ("gpu_train", gpu_train),
    **same_name(compiled,
        "dflash_anchors", "eagle3_trees"),
    "refactor_check_session_cpu": ("refactor_check_session_cpu", refactor_check_session_cpu),
    "gpu_train_block": ("gpu_train_block", lambda p, d: gpu_train(p, d, "EAGLE-3 and DFlash training steps on a GPU")),
    **titled(gpu_compiled, {
        "gpu_compiled": "Compiled decoding on a GPU",
        "gpu_compiled_before": "Compiled decoding on a GPU, before plain steps skipped their KV keep, with the eager "
                               "methods",
        "gpu_compiled_fused": "Compiled decoding on a GPU: the fused, chained and sampled steps' first run, with a "
                              "profile",
        "gpu_compiled_fuseproj": "Compiled decoding on a GPU: the fused step, fused projections, the chained step "
                                 "and sampling",
        "gpu_compiled_fuseproj_2": "Compiled decoding on a GPU: the fused step and fused projections, the session's "
                                   "second call",
        "gpu_compiled_law_eagle3": "Compiled decoding on a GPU: after the law test, EAGLE-3's split and chained steps",
        "gpu_compiled_oracle_hf": "Compiled decoding on a GPU: the oracle's fused step and HF's static compile",
        "gpu_compiled_drafter_graphs": "Compiled decoding on a GPU: EAGLE-3's drafting call under CUDA graphs",
        "gpu_compiled_cdt": "Compiled plain decoding on a GPU with inductor's coordinate-descent tuning"}),
    "train_ensemble": ("train_ensemble", train_ensemble),
    "ensemble": ("ensemble", ensemble),
    "eagle": ("eagle", eagle),
    "pipeline": ("pipeline", pipeline),
    "dsi": ("dsi", dsi),
    "dsi_grid": ("dsi_grid", dsi_grid),
    "tp_decode": ("tp_decode", tp_decode),
    "compiled": ("compiled", compiled),
    "drafter_steps": ("drafter_steps", drafter_steps),
    "step_bounds": ("step_bounds", step_bounds),
    "ensemble_cost": ("ensemble_cost", ensemble_cost),
    "ensemble_cost_epyc_1thread": ("ensemble_cost_epyc_1thread", lambda p, d: ensemble_cost(
        p, d, "The cost schedule against its members after the tensor merge, one thread (AMD EPYC)",
        "ensemble_cost_epyc_1thread")),
    "ensemble_cost_small": ("ensemble_cost_small", lambda p, d: ensemble_cost(
        p, d, "The cost schedule beside its two best members alone, four decoders in the process", "ensemble_cost_small")),
    "ensemble_cost_no_probes": ("ensemble_cost_no_probes", lambda p, d: ensemble_cost(
        p, d, "The cost schedule without probes, four decoders in the process", "ensemble_cost_no_probes")),
    "ensemble_cost_probe_share": ("ensemble_cost_probe_share", lambda p, d: ensemble_cost(
        p, d, "Probes bounded by their share of the time against a fixed bound of 256 steps, one run",
        "ensemble_cost_probe_share")),
    "ensemble_cost_text_rank": ("ensemble_cost_text_rank", lambda p, d: ensemble_cost(
        p, d, "Members ranked on the text they sat out against the probes' rows, one run", "ensemble_cost_text_rank")),
    "refactor_check_text_rank_gain": ("refactor_check_text_rank_gain", refactor_check_compiled_exports(
        "The default schedule and plain decoding after the text ranking and the sliding-window guard, against the "
        "commit before them", "refactor_check_text_rank_gain")),
    "refactor_check_run_room": ("refactor_check_run_room", refactor_check_compiled_exports(
        "Drafter caches sized for the run and the SSM's feed reset per run, against the commit before them",
        "refactor_check_run_room")),
    "refactor_check_sliding_masks": ("refactor_check_sliding_masks", refactor_check_compiled_exports(
        "The default schedule and plain decoding after the sliding-window masks, against the commit before them",
        "refactor_check_sliding_masks")),
    "refactor_check_ensemble_feed": ("refactor_check_ensemble_feed", refactor_check_compiled_exports(
        "The SSM's feed widened to powers of two (13d7532): the default schedule against the commit before it",
        "refactor_check_ensemble_feed")),
    "refactor_check_ensemble_feed_exact": ("refactor_check_ensemble_feed_exact", refactor_check_compiled_exports(
        "The SSM's feed widened to the width a step needs up to 8: the default schedule against the commit before "
        "13d7532", "refactor_check_ensemble_feed_exact")),
    "refactor_check_cost_probes": ("refactor_check_cost_probes", refactor_check_compiled_exports(
        "The cost schedule with bounded probes, late members' text as their prompt and deferred following, against "
        "the commit before them", "refactor_check_cost_probes")),
    **same_name(compiled,
        "compiled_searched", "block_drafters", "block_drafters_selfdata", "compiled_all_kinds",
        "block_drafters_selfdata_full", "compiled_all_kinds_6ep"),
    "batch_schedule": ("batch_schedule", batch_schedule),
    **same_name(compiled,
        "compiled_all_kinds_fused", "compiled_all_kinds_dc71163", "compiled_targets_xeon_sort_free"),
    "refactor_check_eagle_frontier": ("refactor_check_eagle_frontier", refactor_check_compiled_exports(
        "EAGLE-3's draft carries its frontier's tokens, scores and parent entries (Intel Xeon)",
        "refactor_check_eagle_frontier")),
    "refactor_check_eagle_grouped_rows": ("refactor_check_eagle_grouped_rows", refactor_check_compiled_exports(
        "EAGLE-3's draft attention with each kv head's query heads as rows of one product (Intel Xeon)",
        "refactor_check_eagle_grouped_rows")),
    **same_name(compiled,
        "compiled_eagle3_xeon_draft_changes", "compiled_eagle3_xeon_draft_changes_2"),
    "refactor_check_sort_free": ("refactor_check_sort_free", refactor_check_compiled_exports(
        "The step's node order and EAGLE-3's rerank without the sorts they did not need (Intel Xeon)",
        "refactor_check_sort_free")),
    "refactor_check_cpp_wrapper": ("refactor_check_cpp_wrapper", refactor_check_compiled_exports(
        "Inductor's C++ wrapper on a CPU", "refactor_check_cpp_wrapper")),
    "refactor_check_keep_on_device": ("refactor_check_keep_on_device", refactor_check_compiled_exports(
        "The KV cache keeps the accepted paths inside the acceptance graph", "refactor_check_keep_on_device")),
    "refactor_check_fused_step": ("refactor_check_fused_step", refactor_check_compiled_exports(
        "Verify, decide and keep in one compiled call (CPU)", "refactor_check_fused_step")),
    "refactor_check_mask_in_graph": ("refactor_check_mask_in_graph", refactor_check_compiled_exports(
        "The fused verify step builds its mask and positions in its graph (CPU)", "refactor_check_mask_in_graph")),
    "refactor_check_signature": ("refactor_check_signature", refactor_check_compiled_exports(
        "A cheaper call signature for compiled calls (CPU)", "refactor_check_signature")),
    "refactor_check_fixed_commit": ("refactor_check_fixed_commit", refactor_check_compiled_exports(
        "Drafters gather their commit's base states inside their own call", "refactor_check_fixed_commit")),
    "refactor_check_chained_step": ("refactor_check_chained_step", refactor_check_compiled_exports(
        "The chained step: the drafter's commit and proposal inside the verify call (CPU)",
        "refactor_check_chained_step")),
    "refactor_check_sampled_on_device": ("refactor_check_sampled_on_device", refactor_check_compiled_exports(
        "Sampled acceptance on the device, compiled (CPU)", "refactor_check_sampled_on_device")),
    "refactor_check_sampled_on_device_eager": ("refactor_check_sampled_on_device_eager",
                                               refactor_check_compiled_exports(
        "Sampled acceptance on the device, eager (CPU)", "refactor_check_sampled_on_device_eager")),
    "refactor_check_compiled_prefill": ("refactor_check_compiled_prefill", refactor_check_compiled_exports(
        "The prefill through the compiled forward at a few widths (CPU)", "refactor_check_compiled_prefill")),
    "refactor_check_compiled_prefill_ssm": ("refactor_check_compiled_prefill_ssm", refactor_check_compiled_exports(
        "The compiled prefill, a second run with the SSM alone (CPU)", "refactor_check_compiled_prefill_ssm")),
    "refactor_check_ssm_chained": ("refactor_check_ssm_chained", refactor_check_compiled_exports(
        "The SSM's chained step: its commit, feed and tree inside the verify call (CPU)",
        "refactor_check_ssm_chained")),
    "refactor_check_direct_calls": ("refactor_check_direct_calls", refactor_check_compiled_exports(
        "Compiled calls without dynamo's frame hook (CPU)", "refactor_check_direct_calls")),
    **same_name(compiled,
        "compiled_all_kinds_direct", "compiled_hydra_searched_xeon", "compiled_eagle3_trees_xeon",
        "compiled_targets_xeon"),
    "ensemble_cost_xeon_direct": ("ensemble_cost_xeon_direct", lambda p, d: ensemble_cost(
        p, d, "The ensemble's cost schedule with direct calls (Intel Xeon)", "ensemble_cost_xeon_direct")),
    "step_bounds_xeon": ("step_bounds_xeon", lambda p, d: step_bounds(
        p, d, "Where a compiled step's time goes on the Intel Xeon, with direct calls")),
    "compiled_targets_xeon_timed": ("compiled_targets_xeon_timed", compiled),
    "step_bounds_ops_epyc": ("step_ops_epyc", lambda p, d: step_bounds(
        p, d, "Where a compiled step's time goes on the AMD EPYC, Python wrapper (the --ops run)")),
    "step_ops_epyc": ("step_ops_epyc", lambda p, d: step_ops(
        p, d, "What a compiled step's kernels are on the AMD EPYC: products and attention by rows")),
    **same_name(compiled,
        "compiled_targets_epyc", "compiled_targets_epyc_1thread", "compiled_targets_epyc_ssm",
        "compiled_targets_epyc_ssm_1thread", "compiled_targets_epyc_gqa_1thread"),
    "refactor_check_window128": ("refactor_check_window128", refactor_check_compiled_exports(
        "The smallest attention window 128 slots on a CPU rather than 256, against the commit before, one thread "
        "(AMD EPYC)", "refactor_check_window128")),
    "refactor_check_window128_2threads": ("refactor_check_window128_2threads", refactor_check_compiled_exports(
        "The smallest attention window 128 slots on a CPU, two threads (AMD EPYC)",
        "refactor_check_window128_2threads")),
    **same_name(compiled,
        "compiled_targets_epyc_final_1thread", "compiled_targets_epyc_final", "compiled_ssm_epyc1_tree_1thread",
        "window_fresh_cache_256", "window_fresh_cache_128", "window_fresh_cache_64"),
    "step_ops_epyc_gqa_1thread": ("step_ops_epyc_gqa_1thread", lambda p, d: step_ops(
        p, d, "What a compiled step's kernels are on the AMD EPYC with grouped-query attention, on one thread")),
    "step_ops_epyc_1thread": ("step_ops_epyc_1thread", lambda p, d: step_ops(
        p, d, "What a compiled step's kernels are on the AMD EPYC, on one thread")),
    "refactor_check_fuse_seen": ("refactor_check_fuse_seen", refactor_check_compiled_exports(
        "Fusing again only after a group changed, against the commit before (AMD EPYC)", "refactor_check_fuse_seen")),
    "sampling_rounding": ("sampling_rounding", sampling_rounding),
    "signature_cost": ("signature_cost", signature_cost),
    "lookup_memory": ("lookup_memory", lookup_memory),
    "refactor_check_fixed_signature": ("refactor_check_fixed_signature", refactor_check_compiled_exports(
        "A compiled call's signature reading the KV buffers and the sampling settings once, against the commit "
        "before (AMD EPYC)", "refactor_check_fixed_signature")),
    **same_name(compiled, "compiled_targets_epyc_signature_1thread"),
    "attention_packing": ("attention_packing", attention_packing),
    **same_name(compiled, "compiled_targets_epyc_packed_1thread", "compiled_targets_epyc_packed_2threads"),
    "step_bounds_epyc_packed_1thread": ("step_bounds_epyc_packed_1thread", lambda p, d: step_bounds(
        p, d, "Where a compiled step's time goes on the AMD EPYC with packed grouped-query attention, one thread")),
    "refactor_check_gqa_packed": ("refactor_check_gqa_packed", refactor_check_compiled_exports(
        "A group's query heads packed as one head's rows in CPU attention, against the commit before, one thread "
        "(AMD EPYC)", "refactor_check_gqa_packed")),
    "refactor_check_ssm_fixed_args": ("refactor_check_ssm_fixed_args", refactor_check_compiled_exports(
        "The SSM's chain arguments as kept signatures, against the commit before, one thread (AMD EPYC)",
        "refactor_check_ssm_fixed_args")),
    "refactor_check_drafter_signature": ("refactor_check_drafter_signature", refactor_check_compiled_exports(
        "A chained step's signature: the drafter's tensors and the SSM's chain arguments, against the commit before, "
        "one thread (AMD EPYC)", "refactor_check_drafter_signature")),
    "refactor_check_gqa_packed_2threads": ("refactor_check_gqa_packed_2threads", refactor_check_compiled_exports(
        "A group's query heads packed as one head's rows in CPU attention, two threads (AMD EPYC)",
        "refactor_check_gqa_packed_2threads")),
    **same_name(compiled, "compiled_ssm12_epyc_1thread", "compiled_targets_epyc_ssm12_1thread", "compiled_targets_epyc_ssm12_2threads",
                "compiled_targets_epyc_ssm12_2threads_c", "compiled_targets_epyc_hydra12_1thread",
                "compiled_targets_epyc_hydra12_2threads"),
    "refactor_check_signature_aliases": ("refactor_check_signature_aliases", refactor_check_compiled_exports(
        "Which tensors are one and the same in a compiled call's signature, against the commit before, one thread "
        "(AMD EPYC)", "refactor_check_signature_aliases")),
    "refactor_check_signature_review": ("refactor_check_signature_review", refactor_check_compiled_exports(
        "Compiled calls' signatures after the review against dynamo's guards, against the session's first commit, one "
        "thread (AMD EPYC)", "refactor_check_signature_review")),
    "refactor_check_tree_merge": ("refactor_check_tree_merge", refactor_check_compiled_exports(
        "The ensemble's merge as one call of tensor operations, against the commit before, one thread (AMD EPYC)",
        "refactor_check_tree_merge")),
    "refactor_check_tree_merge_2": ("refactor_check_tree_merge_2", refactor_check_compiled_exports(
        "The ensemble's merge as one call of tensor operations, a second run (members padded to their width), one "
        "thread (AMD EPYC)", "refactor_check_tree_merge_2")),
    "refactor_check_tree_merge_eager": ("refactor_check_tree_merge_eager", refactor_check_compiled_exports(
        "The ensemble's eager path after the change (its host merge), against the commit before, one thread (AMD EPYC)",
        "refactor_check_tree_merge_eager")),
    "refactor_check_own_path": ("refactor_check_own_path", refactor_check_compiled_exports(
        "Members following their own trees' paths, merge scores summed in member order: against the commit before, "
        "one thread (AMD EPYC)", "refactor_check_own_path")),
    "refactor_check_own_path_typical": ("refactor_check_own_path_typical", refactor_check_compiled_exports(
        "The same under typical acceptance, members on an uneven tree whose siblings can repeat a token, one thread "
        "(AMD EPYC)", "refactor_check_own_path_typical")),
    "refactor_check_signature_state": ("refactor_check_signature_state", refactor_check_compiled_exports(
        "Signatures holding a module's state, a sequence's type and slices by value, against the commit before, one "
        "thread (AMD EPYC)", "refactor_check_signature_state")),
    "refactor_check_dflash_cache": ("refactor_check_dflash_cache", refactor_check_compiled_exports(
        "DFlash's context cache advancing by each step's longest path, against the commit before, one thread "
        "(AMD EPYC)", "refactor_check_dflash_cache")),
    "refactor_check_dflash_row_ends": ("refactor_check_dflash_row_ends", refactor_check_compiled_exports(
        "DFlash's context cache with an end per row, against the commit before, one thread (AMD EPYC)",
        "refactor_check_dflash_row_ends")),
    "refactor_check_session_1130e": ("refactor_check_session_1130e", refactor_check_compiled_exports(
        "The afternoon's changes of 2026-11-30 against the commit before them, one thread (AMD EPYC)",
        "refactor_check_session_1130e")),
    "outside_verify_epyc_1thread_dflash_cache": ("outside_verify_epyc_1thread_dflash_cache",
                                                 lambda p, d: outside_verify(
        p, d, "Time per step outside the verification after DFlash's cache fix, one thread (AMD EPYC)")),
    "outside_verify_epyc_1thread": ("outside_verify_epyc_1thread", lambda p, d: outside_verify(
        p, d, "Time per step outside the verification, every drafter kind, one thread (AMD EPYC)")),
    "refactor_check_drafter_graphs_2threads": ("refactor_check_drafter_graphs_2threads",
                                               refactor_check_compiled_exports(
        "Drafters' compiled steps under CUDA graphs on a GPU: the CPU path against the commit before, two threads "
        "(AMD EPYC)", "refactor_check_drafter_graphs_2threads")),
    "ensemble_cost_packed": ("ensemble_cost_packed", lambda p, d: ensemble_cost(
        p, d, "The cost schedule against its members after the packed grouped-query attention (AMD EPYC)",
        "ensemble_cost_packed")),
    "ensemble_cost_fuse_seen": ("ensemble_cost_fuse_seen", lambda p, d: ensemble_cost(
        p, d, "The cost schedule against its members after fusing again only where a group changed (AMD EPYC)",
        "ensemble_cost_fuse_seen")),
    "ensemble_cost_xeon_fed": ("ensemble_cost_xeon_fed", lambda p, d: ensemble_cost(
        p, d, "The cost schedule with probes bounded by their feeding too and late prompts within the prefill's "
        "width (Intel Xeon)", "ensemble_cost_xeon_fed")),
    "refactor_check_graph_outputs": ("refactor_check_graph_outputs", refactor_check_compiled_exports(
        "Compiled calls with the CUDA graphs' output lifetime handled, against the commit before (Intel Xeon)",
        "refactor_check_graph_outputs")),
    "refactor_check_fuse_projections": ("refactor_check_fuse_projections", refactor_check_compiled_exports(
        "Fused q/k/v and gate/up projections in compiled calls, against the commit before (Intel Xeon)",
        "refactor_check_fuse_projections")),
    "refactor_check_fuse_projections_2": ("refactor_check_fuse_projections_2", refactor_check_compiled_exports(
        "Fused projections, a second run with the ensemble (Intel Xeon)", "refactor_check_fuse_projections_2")),
    "refactor_check_cpu_gqa_2threads": ("refactor_check_cpu_gqa_2threads", refactor_check_compiled_exports(
        "Grouped-query attention without copying keys and values, against the commit before (AMD EPYC)",
        "refactor_check_cpu_gqa_2threads")),
    "refactor_check_cpu_gqa": ("refactor_check_cpu_gqa", refactor_check_compiled_exports(
        "Grouped-query attention without copying keys and values, on one thread (AMD EPYC)",
        "refactor_check_cpu_gqa")),
    **same_name(compiled,
        "compiled_targets_xeon_fuse", "compiled_targets_xeon_selfdata", "compiled_targets_xeon_selfdata_2",
        "compiled_targets_xeon_selfdata_3", "compiled_hydra_selfdata_searched_xeon",
        "compiled_heads_selfdata_searched_xeon", "eagle3_chains_xeon", "compiled_targets_xeon_searched",
        "compiled_targets_xeon_searched_2", "eagle3_searched_selfdata_xeon"),
    "refactor_check_fuse_static": ("refactor_check_fuse_static", refactor_check_compiled_exports(
        "Fused weights marked as static addresses and fused again in place, against the commit before (Intel Xeon)",
        "refactor_check_fuse_static")),
    "refactor_check_cost_steady": ("refactor_check_cost_steady", refactor_check_compiled_exports(
        "The cost schedule's probes bounded with their feeding, late prompts within the prefill's width and the "
        "standing choice reused, against the commit before them (Intel Xeon)", "refactor_check_cost_steady")),
}


def tables() -> dict[str, str]:
    """Every table whose results exist, as the Markdown that goes between its markers."""
    out = {}
    for name, (source, render) in TABLES.items():
        buf = io.StringIO()
        p = lambda *a: print(*a, file=buf)  # noqa: E731
        if source is None:
            render(p)
        elif (d := load(source)) is not None:
            render(p, d)
        else:
            continue
        if text := buf.getvalue().strip("\n"):
            out[name] = text + "\n\n"
    return out


def update(text: str, generated: dict[str, str], problems: list[str], where_: str) -> tuple[str, set[str]]:
    """The document with each block replaced by its generated text; the names of the blocks it holds."""
    seen = set()

    def sub(m: re.Match) -> str:
        name = m["name"]
        seen.add(name)
        if name not in generated:
            problems.append(f"{where_}: block `{name}` has no table (unknown name, or its results file is missing)")
            return m[0]
        return f"<!-- tables:begin {name} -->\n{generated[name]}<!-- tables:end -->"

    new = BLOCK.sub(sub, text)
    if len(re.findall(r"^<!-- tables:(?:begin|end)", text, re.M)) != 2 * len(BLOCK.findall(text)):
        problems.append(f"{where_}: a `<!-- tables:begin NAME -->` or `<!-- tables:end -->` line has no partner")
    return new, seen


def run(write: bool) -> list[str]:
    """Check (or rewrite) every document; return the problems found (after --write: those left)."""
    generated, problems, placed = tables(), [], set()
    for doc in DOCS:
        if not doc.is_file():
            continue
        text = doc.read_text()
        rel = doc.relative_to(ROOT).as_posix() if doc.is_relative_to(ROOT) else str(doc)
        new, seen = update(text, generated, problems, rel)
        placed |= seen
        if new != text:
            if write:
                doc.write_text(new)
                print(f"rewrote the tables in {rel}")
            else:
                diff = difflib.unified_diff(text.splitlines(), new.splitlines(), f"{rel} (now)",
                                            f"{rel} (from benchmarks/results)", n=0, lineterm="")
                problems.append(f"{rel}: tables disagree with benchmarks/results/*.json; run "
                                f"`python benchmarks/tables.py --write`\n" + "\n".join(list(diff)[:40]))
    missing = [n for n in generated if n not in placed]
    if missing and write and BENCHMARKS_DOC.is_file():
        BENCHMARKS_DOC.write_text(BENCHMARKS_DOC.read_text().rstrip("\n") + "\n\n" + "".join(
            f"<!-- tables:begin {n} -->\n{generated[n]}<!-- tables:end -->\n\n" for n in missing).rstrip("\n") + "\n")
        print(f"appended {', '.join(missing)} to docs/benchmarks.md")
    elif missing:
        problems.append("tables with results but no place in the docs: " + ", ".join(missing) +
                        " (add `<!-- tables:begin NAME -->` / `<!-- tables:end -->`, or run --write)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the tables in README.md and docs/*.md")
    g.add_argument("--check", action="store_true", help="exit 1 if a table in the docs disagrees with its JSON")
    args = ap.parse_args(argv)
    if not (args.write or args.check):
        for name, text in tables().items():
            print(f"<!-- {name} -->\n{text}", end="")
        return 0
    problems = run(write=args.write)
    for msg in problems:
        print(msg, file=sys.stderr)
    if args.check and not problems:
        print(f"tables agree with benchmarks/results/*.json ({len(DOCS)} documents)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
