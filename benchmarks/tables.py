"""Print the README's benchmark tables from benchmarks/results/*.json (the only source of README figures)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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


def main() -> None:
    if d := load("train_heads"):
        print(f"### Training Medusa heads (`benchmarks/train_heads.py`; {where(d)})\n")
        print(f"{d['steps']} steps, {d['train_tokens_per_s']:.0f} training tokens/s, {d['wall_s']:.0f} s wall; "
              f"held-out positions: {d['eval_positions']}\n")
        print("| head | top-1 | top-5 |\n|---|---|---|")
        for k, (a, b) in enumerate(zip(d["head_top1"], d["head_top5"]), 1):
            print(f"| {k} | {a:.3f} | {b:.3f} |")
        print()
    if d := load("decode"):
        print(f"### Greedy decoding (`benchmarks/decode.py`; {d['prompts']} prompts x {d['max_new_tokens']} "
              f"tokens; {where(d)})\n")
        print("| method | tree size | accept length | tokens/s | speedup | identical to plain greedy | "
              f"{phases(d['methods'].values())} |")
        print("|---|---|---|---|---|---|---|")
        for m, r in d["methods"].items():
            print(f"| {m} | {r.get('tree_size', '-')} | {r.get('accept_length', '-')} | {r['tokens_per_s']:.0f} | "
                  f"{r['speedup']:.2f}x | {r['identical_to_baseline']} | {split(r)} |")
        print()
    if d := load("heads"):
        print(f"### Medusa vs Hydra vs Hydra++ (`benchmarks/heads.py`; same data and optimizer steps, default tree of "
              f"{d['tree_size']} tokens, {d['prompts']} prompts x {d['max_new_tokens']} tokens, greedy; {where(d)})\n")
        print(f"plain HF generate: {d['baseline_tokens_per_s']:.0f} tokens/s\n")
        print(f"| heads | head top-1 (1..4) | accept length | tokens/s | speedup | identical | "
              f"{phases(d[k] for k in ('medusa', 'hydra', 'hydra++'))} |")
        print("|---|---|---|---|---|---|---|")
        for k in ("medusa", "hydra", "hydra++"):
            r = d[k]
            print(f"| {k} | {' '.join(f'{x:.3f}' for x in r['head_top1'])} | {r['accept_length']:.3f} | "
                  f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['identical_to_baseline']} | {split(r)} |")
        print()
    if d := load("hidden_cache"):
        on, off = d["cache_on"], d["cache_off"]
        print(f"### Hidden-state cache (`benchmarks/hidden_cache.py`; Hydra++ recipe, 2 epochs; {where(d)})\n")
        print("| run | epoch 1 tokens/s | epoch 2 tokens/s | wall s |\n|---|---|---|---|")
        print(f"| recompute the base | {off['epoch1']:.0f} | {off['epoch2']:.0f} | {off['wall_s']:.0f} |")
        print(f"| `train.cache_hidden: true` | {on['epoch1']:.0f} | {on['epoch2']:.0f} | {on['wall_s']:.0f} |")
        print(f"\nepoch-2 speed-up {d['epoch2_speedup']:.2f}x; cache size {d['cache_bytes'] / 2**20:.0f} MiB\n")
    if d := load("tree_search"):
        print(f"### Tree search (`benchmarks/tree_search.py`; statistics from {d['calibration_prompts']} training "
              f"stories, check on {d['heldout_prompts']} held-out prompts x {d['max_new_tokens']} tokens; {where(d)})\n")
        print("| heads | chosen tree size | expected accept | replayed accept (calibration) | measured accept "
              "(held-out) | error | chosen tokens/s | default tree size | default accept | default tokens/s | "
              "plain tokens/s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for k in ("medusa", "hydra"):
            if k in d:
                r = d[k]
                print(f"| {k} | {r['tree_size']} | {r['expected_accept_length']:.3f} | "
                      f"{r['replayed_accept_length']:.3f} | {r['measured_accept_length']:.3f} | "
                      f"{100 * r['relative_error']:.1f}% | {r['tokens_per_s']:.0f} | {r['default_tree_size']} | "
                      f"{r['default_accept_length']:.3f} | {r['default_tokens_per_s']:.0f} | "
                      f"{r['baseline_tokens_per_s']:.0f} |")
        print()
    if d := load("mt_bench"):
        print(f"### MT-Bench (`benchmarks/mt_bench.py`; {d['questions']} questions, 2 turns, max "
              f"{d['max_new_tokens']} new tokens, greedy, default trees; {where(d)})\n")
        cats = list(d["runs"]["medusa"]["categories"])
        print("| heads | " + " | ".join(cats) + " | overall speedup | accept length | identical |")
        print("|---" * (len(cats) + 4) + "|")
        for k, r in d["runs"].items():
            print(f"| {k} | " + " | ".join(f"{r['categories'][c]['speedup']:.2f}x" for c in cats) +
                  f" | {r['overall']['speedup']:.2f}x | {r['overall']['accept_length']:.2f} | "
                  f"{100 * r['overall']['identical_share']:.0f}% |")
        print()
    if d := load("train_ssm"):
        print(f"### Distilling an SSM (`benchmarks/train_ssm.py`; recipes/stories260k-ssm.yaml on the base's greedy "
              f"continuations of the training stories; {where(d)})\n")
        print("| divergence | steps | wall s | training tokens/s | held-out top-1 (data token) | top-1 agreement with the base |")
        print("|---|---|---|---|---|---|")
        for div, r in d["divergences"].items():
            print(f"| {div} | {r['steps']} | {r['wall_s']:.0f} | {r['train_tokens_per_s']:.0f} | {r['head_top1'][0]:.3f} | "
                  f"{r['agree_top1'][0]:.3f} |")
        print()
    if d := load("ssm"):
        print(f"### SSM drafting vs HF assisted generation and the heads (`benchmarks/ssm.py`; {d['prompts']} held-out "
              f"prompts x {d['max_new_tokens']} tokens, greedy; SSM {d['ssm_params'] / 1e3:.0f}K parameters; {where(d)})\n")
        print("| method | tokens per base forward | accept length | tokens/s | speedup | identical | c | predicted "
              f"speedup | break-even c | {phases(d['methods'].values())} |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for m, r in d["methods"].items():
            print(f"| {m} | {r['tokens_per_base_forward']:.2f} | {r.get('accept_length', '-')} | {r['tokens_per_s']:.0f} | "
                  f"{r['speedup']:.2f}x | {r['identical_to_baseline']} | {r.get('cost_ratio_c', '-')} | "
                  f"{r.get('predicted_speedup', '-')} | {r.get('break_even_c', '-')} | {split(r)} |")
        print()
    if d := load("train_ensemble"):
        print(f"### Boost-tuning an SSM ensemble (`benchmarks/train_ensemble.py`; recipes/stories260k-ensemble.yaml, "
              f"5 one-layer members x 300 steps; {where(d)})\n")
        print("| ensemble | stage | trained on examples | ensemble coverage (mean) | covered examples | tau (merged, "
              "16 held-out prompts) |\n|---|---|---|---|---|---|")
        for name in ("boost", "independent"):
            for st in d[name]["stages"]:
                print(f"| {name} | {st['stage']} | {st['trained_on_examples']} | {st['mean_coverage']:.3f} | "
                      f"{st['covered_examples']} | {st['tau']:.3f} |")
        print(f"\nwall: boost {d['boost']['wall_s']:.0f} s, independent {d['independent']['wall_s']:.0f} s; members' "
              "held-out top-1 agreement: boost " + ", ".join(f"{x:.3f}" for x in d["boost"]["member_agree_top1"]) +
              "; independent " + ", ".join(f"{x:.3f}" for x in d["independent"]["member_agree_top1"]) + "\n")
    if d := load("ensemble"):
        print(f"### Ensembles at decoding time (`benchmarks/ensemble.py`; {d['prompts']} held-out prompts x "
              f"{d['max_new_tokens']} tokens, greedy, chains of {d['chain']} per member, merged trees of 32 tokens; "
              f"{where(d)})\n")
        print("| members | boost merge | boost vote | independent merge | independent vote |\n|---|---|---|---|---|")
        z = d["sizes"]
        for k in z["boost"]["merge"]:
            print(f"| {k} | {z['boost']['merge'][k]:.3f} | {z['boost']['vote'][k]:.3f} | "
                  f"{z['independent']['merge'][k]:.3f} | {z['independent']['vote'][k]:.3f} |")
        print("\n(accept length: tokens committed per base forward; 1 member = that member alone)\n")
        print(f"| method | accept length | tokens/s | speedup | identical | {phases(d['methods'].values())} | "
              "ensemble bookkeeping ms/step (share) |\n|---|---|---|---|---|---|---|")
        for m, r in d["methods"].items():
            ov = (f"{r['ensemble_overhead_ms_per_step']:.2f} ({100 * r['ensemble_overhead_share']:.1f}%)"
                  if "ensemble_overhead_ms_per_step" in r else "-")
            print(f"| {m} | {r.get('accept_length', '-')} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
                  f"{r['identical_to_baseline']} | {split(r)} | {ov} |")
        sm = d["sampled"]
        print(f"\nScheduler: the untrained member drafted in {100 * d['scheduler']['bad_member_active_share']:.0f}% of "
              f"the steps after warm-up. Sampled (T = 0.8): plain HF {sm['hf_sample']['tokens_per_s']:.0f} tokens/s; "
              f"one member {sm['single']['tokens_per_s']:.0f} tokens/s (accept {sm['single']['accept_length']}); "
              f"boosted 5-member merge {sm['boost_merge5']['tokens_per_s']:.0f} tokens/s (accept "
              f"{sm['boost_merge5']['accept_length']}).\n")
    if d := load("eagle"):
        print(f"### EAGLE-3-style drafter and Medusa-2 vs Medusa, Hydra, Hydra++ (`benchmarks/eagle.py`; same data and optimizer "
              f"steps; {d['prompts']} held-out prompts x {d['max_new_tokens']} tokens, greedy; {where(d)})\n")
        print("| draft | tree | tokens per verification | accept length | tokens/s | speedup | identical | "
              f"{phases([d[k] for k in d['trees']])} | train steps | train tokens/s | held-out top-1 agreement per "
              "head / step |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for k, tree in d["trees"].items():
            r = d[k]
            print(f"| {k} | {tree} | {r['tree_size']} | {r['accept_length']} | {r['tokens_per_s']:.0f} | "
                  f"{r['speedup']:.2f}x | {r['identical_to_baseline']} | {split(r)} | {r['train_steps']} | "
                  f"{r['train_tokens_per_s']:.0f} | {', '.join(f'{x:.2f}' for x in r['agree_top1'])} |")
        adapted = d.get("adapted_baseline_tokens_per_s")
        print(f"\nplain HF generate in the same run: {d['baseline_tokens_per_s']:.0f} tokens/s" +
              (f"; of Medusa-2's adapted base (its baseline): {adapted:.0f} tokens/s\n" if adapted else "\n"))
    if d := load("dsi"):
        print(f"### DSI as processes with emulated latencies (`benchmarks/dsi.py`; stories260K base, oracle drafter with "
              f"i.i.d. acceptance, {d['runs']} prompts x {d['tokens']} tokens; {where(d)})\n")
        print("| target ms | drafter ms | acceptance | SP | lookahead (DSI / SI) | identical | measured s non-SI / SI / DSI | "
              "expected s non-SI / SI / DSI | DSI vs SI measured (expected) | DSI vs non-SI measured (expected) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in d["configs"]:
            m, e, ms, es = r["measured_s"], r["expected_s"], r["measured_speedup"], r["expected_speedup"]
            print(f"| {1000 * r['t_target_s']:.1f} | {1000 * r['t_draft_s']:.1f} | {r['acceptance']} | {r['sp']} | "
                  f"{r['lookahead']} / {r['si_lookahead']} | {r['identical_to_greedy']} | "
                  f"{m['non_si']:.2f} / {m['si']:.2f} / {m['dsi']:.2f} | {e['non_si']:.2f} / {e['si']:.2f} / {e['dsi']:.2f} | "
                  f"{ms['dsi_vs_si']:.2f} ({es['dsi_vs_si']:.2f}) | {ms['dsi_vs_non_si']:.2f} ({es['dsi_vs_non_si']:.2f}) |")
        print()
    if d := load("pipeline"):
        print(f"### Pipelined drafting and verification (`benchmarks/pipeline.py`; {d['prompts']} MT-Bench first turns x "
              f"{d['max_new_tokens']} tokens, greedy, stories260K + the fkl SSM, {d['in_flight']} groups in flight, median "
              f"of {d['reps']} interleaved runs; {d['machine']['cpu']}, {d['machine']['cores']} cores, torch "
              f"{d['machine']['torch']}, {d['date']})\n")
        print("| tree | verifier batch | method | tokens/s | vs sequential x1 | vs sequential x2 | accept length | "
              "verifier waiting s | drafter paused / pool max | identical to plain greedy |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        ref = {(r["tree"], r["batch_size"], r["method"]): r["tokens_per_s"] for r in d["rows"]}
        for r in d["rows"]:
            k = (r["tree"], r["batch_size"])
            dr = r.get("drafter")
            pool = f"{dr['paused']} / {dr['pool_max']}" if dr else "-"
            print(f"| {r['tree']} | {r['batch_size']} | {r['method']} | {r['tokens_per_s']:.0f} | "
                  f"{r['tokens_per_s'] / ref[k + ('sequential x1',)]:.2f}x | {r['tokens_per_s'] / ref[k + ('sequential x2',)]:.2f}x | "
                  f"{r['accept_length']:.2f} | {r['verifier_wait_s']:.2f} | "
                  f"{pool} | {r['identical_to_plain']} |")
        print(f"\nplain HF greedy, one prompt at a time, 1 thread: {d['plain_tokens_per_s']:.0f} tokens/s\n")
    if d := load("tp_decode"):
        print(f"### Tensor-parallel decoding (`benchmarks/tp_decode.py`; {d['device']} x {d['processes']}, {d['base']}, "
              f"{d['dtype']}, {d['context']}-token context; {d['date']})\n")
        print("| tree tokens | verify ms | / plain step |\n|---|---|---|")
        for r in d["verify"]:
            print(f"| {r['tree_size']} | {r['verify_ms']:.2f} | {r['over_plain_step']:.2f} |")
        print(f"\nplain generate over the shards: {d['plain']['tokens_per_s']:.1f} tokens/s\n")
        print("| oracle alpha | tree | accept length | tokens/s | speedup | identical |\n|---|---|---|---|---|---|")
        for r in d["oracle_loop"]:
            print(f"| {r['alpha']} | {r['tree']} | {r['accept_length']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                  f"{r['identical_to_plain']} |")
        print()
    if d := load("refactor_check"):
        print(f"### The drafter interface against the decoder before it (`benchmarks/refactor_check.py`; before = "
              f"{d['before']}, same exports, base object and prompts, interleaved; {d['prompts']} prompts x "
              f"{d['max_new_tokens']} tokens; {where(d)})\n")
        print("| heads | accept length before / after | tokens/s before | tokens/s after | after / before |")
        print("|---|---|---|---|---|")
        for k, ratio in d["after_over_before"].items():
            b, a = d["methods"][f"{k}_before"], d["methods"][f"{k}_after"]
            print(f"| {k} | {b['accept_length']} / {a['accept_length']} | {b['tokens_per_s']:.0f} | {a['tokens_per_s']:.0f} | "
                  f"{ratio:.3f} |")
        print(f"\nplain HF generate in the same run: {d['methods']['hf_generate']['tokens_per_s']:.0f} tokens/s\n")
    if d := load("gpu_decode"):
        print(f"### The decoder on a GPU (`benchmarks/gpu_decode.py`; {d['device']}, torch {d['torch']}, transformers "
              f"{d['transformers']}, {d['date']}; random-weight Llama-2-7B shape, {d['dtype']}, batch 1, "
              f"{d['context']}-token context)\n")
        print(f"Plain HF generate: {d['plain_call_a']['tokens_per_s']} tokens/s in one call, "
              f"{d['plain_call_b']['tokens_per_s']} in the other.\n")
        print("| tree size | " + " | ".join(str(r["tree_size"]) for r in d["verify"]) + " |")
        print("|---" * (len(d["verify"]) + 1) + "|")
        print("| verify forward ms | " + " | ".join(f"{r['verify_ms']:.1f}" for r in d["verify"]) + " |")
        print("| over a plain step | " + " | ".join(f"{r['over_plain_step']:.2f}" for r in d["verify"]) + " |\n")
        print("| drafter | tree size | " + phases(d["drafter_costs"]) + " | draft / verify | parameters |")
        print("|---|---|---|---|---|")
        for r in d["drafter_costs"]:
            print(f"| {r['drafter']} ({r['tree']}) | {r['tree_size']} | {split(r)} | {r['draft_over_verify']:.3f} | "
                  f"{r['params'] / 1e6:.0f}M |")
        print("\n| oracle acceptance alpha | tree | accept length | tokens/s | speedup | "
              f"{phases(d['oracle_loop'])} | bf16 re-syncs |")
        print("|---|---|---|---|---|---|---|")
        for r in d["oracle_loop"]:
            print(f"| {r['alpha']} | {r['tree']} | {r['accept_length']:.2f} | {r['tokens_per_s']:.1f} | "
                  f"{r['speedup']:.2f}x | {split(r)} | {r['bf16_resyncs']} |")
        print()
    if d := load("gpu_train"):
        print(f"### bf16 training steps on a GPU (`benchmarks/gpu_train.py`; {d['device']}, torch {d['torch']}, "
              f"{d['date']}; random-weight Llama-2-7B shape in bfloat16, batch {d['batch_size']} x up to {d['max_len']} "
              f"tokens of ShareGPT, {d['steps']} steps)\n")
        print("| draft | trainable parameters | training tokens/s | peak GPU memory GiB | wall s |\n|---|---|---|---|---|")
        for k, r in d["runs"].items():
            print(f"| {k} | {r['draft_params'] / 1e6:.0f}M | {r['train_tokens_per_s']:.0f} | {r['peak_gpu_mem_gib']:.1f} | "
                  f"{r['wall_s']:.0f} |")
        print()


if __name__ == "__main__":
    main()
