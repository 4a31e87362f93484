"""Why the DFlash-style block drafter falls short on stories260K (issue 23): feature probes and short ablations.

    python benchmarks/dflash_probe.py                  # all of it, one CPU thread: ~9 min probes + ~37 min trainings
    python benchmarks/dflash_probe.py --skip-train     # the probes only
    python benchmarks/dflash_probe.py --reuse          # keep trainings whose runs/probe-NAME/export exists
    python benchmarks/dflash_probe.py --runs recipe,self_data --steps 250 --json

Writes benchmarks/results/dflash_probe.json. One thread (torch.set_num_threads(1) here, OMP_NUM_THREADS=1 for the
trainings), one thing at a time. Needs runs/probe-self.jsonl, the base's greedy continuations of all 2317 stories of
the TinyStories sample; made first with `draftlab distill-data` when missing (DISTILL_CMD, ~3 min).

1. Feature probes. DFlash's block position k (1..block_size-1) predicts x_{a+k} from the base's features before
   the anchor a (the recipe's layers: hidden_states ids 2, 3, 4) and the anchor token x_a. Small probes (a linear
   map; a Linear-SiLU-Linear MLP) get the features at a-1 and the embedding of x_a and predict, for k = 1..7, the
   target draftlab's DFlash evaluation scores `agree1` against (DFlashDraft.objective -> losses.head_loss): the
   base's argmax at position a+k-1, the text up to a+k-1 as its prefix. Anchors follow DFlashDraft.anchors (a >= 1,
   x_a and x_{a+1} supervised; a+k inside the sequence). Trained on random anchors of the recipe's training split
   (draftlab.data.load_examples: the first 90% of the TinyStories sample in blocks of max_len 256), scored on the
   very anchors draftlab's evaluation draws on the held-out split (64 seeded per sequence). References: the token
   alone; the base's final state at a-1 instead of the three layers; the features plus the TRUE intermediate
   tokens x_{a+1} (, x_{a+2}) for k = 2 (3), what an autoregressive drafter such as EAGLE-3 conditions on.
   Run twice: along the data text (the recipe's, what agree1 measures) and along the base's own greedy text (the
   same stories continued by the base: what greedy decoding walks, where x_{a+1} is itself the base's argmax).
2. Short DFlash trainings: `draftlab train recipes/stories260k-dflash.yaml train.max_steps=250 ... KEY=VALUE` for
   the recipe as is and one change each (RUNS). From each run's metrics.jsonl its held-out agree1 per block
   position; from each export, on the base's greedy continuations of 30 held-out story prompts x 128 tokens (the
   benchmark tables' prompts), the expected accept length of its default chain (draftlab's replay of greedy
   decoding on the ranks, which equals the decoder's own accept length) and the top-1 rate per position.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, STORIES_BASE, heldout_story_prompts, stories_base, write_result

RECIPE = "recipes/stories260k-dflash.yaml"
SELF_DATA = "runs/probe-self.jsonl"  # the base's greedy continuations of every story of the sample
DISTILL_CMD = ["distill-data", str(STORIES_BASE.relative_to(ROOT)), "--prompts", "data/tinystories/tinystories_sample.txt",
               "--mode", "text", "--max-new-tokens", "256", "--batch-size", "64", "--dtype", "float32", "--out", SELF_DATA]
K = 7  # block positions 1..7 of the recipe's blocks of 8

# Ablations: name -> overrides on top of the recipe (and of the common max_steps / eval settings).
RUNS = {
    "recipe": [],
    "self_data": [f"data.path={SELF_DATA}"],
    "distill": ["loss.distill_weight=1.0"],
    "block4": ["head.dflash.block_size=4"],
    "layers4": ["head.dflash.num_layers=4"],
    "anchors128": ["head.dflash.num_anchors=128"],
}


def draftlab_cmd(args: list[str]) -> list[str]:
    return [str(Path(sys.executable).parent / "draftlab"), *args]


def one_thread_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def self_distilled() -> str:
    """The base's greedy continuations of all 2317 stories (so the recipe's tail split keeps the held-out stories
    held out), made once with draftlab's own command."""
    out = ROOT / SELF_DATA
    if out.is_file() and sum(1 for _ in out.open()) >= 2317:
        return SELF_DATA
    print("self-distilled data: draftlab " + " ".join(DISTILL_CMD), flush=True)
    subprocess.run(draftlab_cmd(DISTILL_CMD), check=True, env=one_thread_env(), cwd=ROOT)
    return SELF_DATA


# --- 1. feature probes ------------------------------------------------------------------------------------

def eval_anchors(ok, num_anchors: int):
    """The anchors draftlab's held-out evaluation scores (DFlashDraft.anchors outside training): per batch, a
    generator seeded 0, uniform noise over [B, S], the num_anchors highest-scoring allowed positions per row."""
    import torch

    noise = torch.rand(ok.shape, generator=torch.Generator().manual_seed(0))
    A = min(num_anchors, max(int(ok.sum(-1).max()), 1))
    anchor = torch.where(ok, noise, torch.full_like(noise, -1.0)).topk(A, -1).indices.sort(-1).values
    return [a[ok[r, a]] for r, a in enumerate(anchor)]


def collect(base, examples: list[dict], layers: tuple, batch: int, pick) -> dict:
    """Probe rows at anchors a of the examples (pick(ok [B, S]) -> per row its anchors): the base's states at a-1
    (`layers` and the final state), the tokens x_a, x_{a+1}, x_{a+2}, and per k = 1..K the target (the base's
    argmax at a+k-1; -1 where draftlab's evaluation has no position: a+k past the sequence or not supervised)."""
    import torch

    from draftlab.base import base_states
    from draftlab.data import collate

    W = base.get_output_embeddings().weight
    rows = {"feats": [], "final": [], "tokens": [], "target": []}
    for s in range(0, len(examples), batch):
        b = collate(examples[s:s + batch], 0)
        ids, valid = b["input_ids"], b["attention_mask"].bool()
        sup = b["loss_mask"].bool() & valid
        B, S = ids.shape
        with torch.no_grad():
            st = base_states(base, ids, b["attention_mask"], layers)  # [B, S, n+1, H]
            teacher = (st[:, :, -1] @ W.t()).argmax(-1)  # [B, S]: the base's next-token argmax at each position
        ok = torch.zeros(B, S, dtype=torch.bool)
        ok[:, 1:S - 1] = sup[:, 1:S - 1] & sup[:, 2:]  # DFlashDraft.anchors' rule: a >= 1, x_a and x_{a+1} supervised
        for r, a in enumerate(pick(ok)):
            rows["feats"].append(st[r, a - 1, :-1].flatten(1))
            rows["final"].append(st[r, a - 1, -1])
            rows["tokens"].append(torch.stack([ids[r, (a + j).clamp(max=S - 1)] for j in range(3)], 1))
            tgt = []
            for k in range(1, K + 1):
                at = (a + k).clamp(max=S - 1)
                keep = (a + k < S) & sup[r, at]
                tgt.append(torch.where(keep, teacher[r, at - 1], torch.full_like(at, -1)))
            rows["target"].append(torch.stack(tgt, 1))
    return {k: torch.cat(v) for k, v in rows.items()}


def inputs(data: dict, base, spec: str):
    """The probe's input for a feature spec: '+'-joined parts of feats (the DFlash layers at a-1), final (the
    final state at a-1), tok0 / tok1 / tok2 (the base's input embeddings of x_a / x_{a+1} / x_{a+2})."""
    import torch

    E = base.get_input_embeddings().weight
    parts = {"feats": lambda: data["feats"], "final": lambda: data["final"],
             "tok0": lambda: E[data["tokens"][:, 0]], "tok1": lambda: E[data["tokens"][:, 1]],
             "tok2": lambda: E[data["tokens"][:, 2]]}
    return torch.cat([parts[p]() for p in spec.split("+")], 1).float()


def fit_probe(x_tr, y_tr, x_ev, y_ev, vocab: int, hidden: int, epochs: int, seed: int = 0) -> dict:
    """K probes side by side (one per target column of y [N, K]), each a linear map or a Linear-SiLU-Linear MLP of
    `hidden` units from the standardised input to the vocabulary, trained with Adam (cosine lr) on cross-entropy
    towards the targets (-1: no target). Returns held-out and training top-1 agreement per column."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    mu, sd = x_tr.mean(0), x_tr.std(0).clamp(min=1e-6)
    x_tr, x_ev = (x_tr - mu) / sd, (x_ev - mu) / sd
    Kc, D, V = y_tr.shape[1], x_tr.shape[1], vocab
    dims = [D, hidden, V] if hidden else [D, V]
    ws = [torch.nn.Parameter(torch.randn(Kc, i, o) / i ** 0.5) for i, o in zip(dims, dims[1:])]
    bs = [torch.nn.Parameter(torch.zeros(Kc, 1, o)) for o in dims[1:]]

    def logits(x):  # x [N, D] -> [Kc, N, V]
        h = x.expand(Kc, -1, -1)
        for j, (w, b) in enumerate(zip(ws, bs)):
            h = torch.baddbmm(b, h, w)
            if j < len(ws) - 1:
                h = F.silu(h)
        return h

    bsz = 2048
    steps = epochs * ((len(x_tr) + bsz - 1) // bsz)
    opt = torch.optim.Adam(ws + bs, lr=3e-3 if hidden else 1e-2)
    cosine = lambda t: 0.5 * (1 + torch.cos(torch.tensor(t / steps * 3.14159))).item()  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine)
    for _ in range(epochs):
        perm = torch.randperm(len(x_tr))
        for s in range(0, len(x_tr), bsz):
            i = perm[s:s + bsz]
            y = y_tr[i].t()  # [Kc, n]
            lg = logits(x_tr[i])
            loss = F.cross_entropy(lg.reshape(-1, V), y.reshape(-1), ignore_index=-1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()

    @torch.no_grad()
    def agree(x, y):
        hit, n, run_sum, run_n = torch.zeros(Kc), torch.zeros(Kc), 0.0, 0
        for s in range(0, len(x), 8192):
            pred, t = logits(x[s:s + 8192]).argmax(-1), y[s:s + 8192].t()
            right = (pred == t) & (t >= 0)  # [Kc, n]
            hit += right.sum(1)
            n += (t >= 0).sum(1)
            full = (t >= 0).all(0)  # anchors with all Kc targets: 1 + the leading positions all right
            run_sum += float((1 + right.int().cumprod(0).sum(0))[full].sum())
            run_n += int(full.sum())
        return (hit / n.clamp(min=1)).tolist(), n.tolist(), run_sum / max(run_n, 1)

    held, n_ev, run = agree(x_ev, y_ev)
    train, _, _ = agree(x_tr[:50000], y_tr[:50000])
    out = {"heldout": [round(v, 4) for v in held], "train": [round(v, 4) for v in train],
           "heldout_positions": [int(v) for v in n_ev]}
    if Kc == K:  # along greedy text: the accept length of a chain drafted by the probe, per state
        out["heldout_chain_run"] = round(run, 3)
    return out


# Probes: name -> (input spec, target columns (k - 1), hidden units (0 = linear)).
def probe_specs(hidden: int) -> dict:
    ks = list(range(K))
    return {
        "token_linear": ("tok0", ks, 0),
        "dflash_feats_linear": ("feats+tok0", ks, 0),
        "dflash_feats_mlp": ("feats+tok0", ks, hidden),
        "final_state_linear": ("final+tok0", ks, 0),
        "true_tokens_k2_linear": ("feats+tok0+tok1", [1], 0),
        "true_tokens_k2_mlp": ("feats+tok0+tok1", [1], hidden),
        "true_tokens_k3_mlp": ("feats+tok0+tok1+tok2", [2], hidden),
    }


def run_probes(base, recipe, text: str, per_row: int, hidden: int, epochs: int) -> dict:
    """All probes on one text (the recipe's data, or the self-distilled data): training rows from the training
    split, scored on the anchors draftlab's evaluation draws on the held-out split."""
    import torch

    from draftlab.base import load_tokenizer
    from draftlab.data import load_examples

    layers = tuple(recipe.head.dflash.layers)
    tok = load_tokenizer(recipe.base.name_or_path)
    train_ex, eval_ex, _ = load_examples(recipe.data, tok, recipe.train.seed)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)

    def random_anchors(ok):  # training rows: per_row anchors drawn at random per example
        cands = (r.nonzero()[:, 0] for r in ok)
        return [a[torch.randperm(len(a), generator=gen)[:per_row]].sort().values for a in cands]

    tr = collect(base, train_ex, layers, 64, random_anchors)
    # Held-out rows: the very anchors draftlab's evaluation scores (same batches, same seeded draw).
    ev = collect(base, eval_ex, layers, recipe.train.batch_size,
                 lambda ok: eval_anchors(ok, recipe.head.dflash.num_anchors))
    out = {"text": text, "data_path": recipe.data.path, "train_rows": len(tr["target"]), "eval_rows": len(ev["target"]),
           "collect_s": round(time.perf_counter() - t0, 1), "probes": {}}
    print(f"[{text}] {out['train_rows']} training / {out['eval_rows']} held-out anchors, features in "
          f"{out['collect_s']} s", flush=True)
    for name, (spec, cols, h) in probe_specs(hidden).items():
        t0 = time.perf_counter()
        r = fit_probe(inputs(tr, base, spec), tr["target"][:, cols], inputs(ev, base, spec), ev["target"][:, cols],
                      base.get_output_embeddings().weight.shape[0], h, epochs)
        r.update({"input": spec, "k": [c + 1 for c in cols], "hidden": h, "fit_s": round(time.perf_counter() - t0, 1)})
        out["probes"][name] = r
        print(f"  {name:24s} k={r['k']} held-out {r['heldout']} (train {r['train']}) {r['fit_s']} s", flush=True)
    return out


# --- 2. short trainings -----------------------------------------------------------------------------------

def train_run(name: str, overrides: list[str], steps: int, reuse: bool) -> dict:
    """One DFlash training through draftlab's CLI (one thread); its held-out figures from metrics.jsonl."""
    out_dir = f"runs/probe-{name}"
    common = [f"train.max_steps={steps}", f"train.eval_every_steps={steps}", f"train.save_every_steps={steps}"]
    cmd = ["train", RECIPE, *common, *overrides, f"output_dir={out_dir}", "--overwrite"]
    done = (ROOT / out_dir / "export" / "draftlab.json").is_file()
    wall = None
    if not (reuse and done):
        print(f"train {name}: draftlab " + " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(draftlab_cmd(cmd), check=True, env=one_thread_env(), cwd=ROOT, stdout=subprocess.DEVNULL)
        wall = round(time.perf_counter() - t0, 1)
    logs = [json.loads(l) for l in (ROOT / out_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [l for l in logs if "agree1" in l]
    last = evals[-1]
    speeds = [l["tokens_per_s"] for l in logs if "tokens_per_s" in l][1:]  # the first window includes start-up
    rec = {"command": "draftlab " + " ".join(cmd), "overrides": overrides, "wall_s": wall, "reused": wall is None,
           "step": last["step"],
           "agree1": [round(v, 4) for v in last["agree1"]], "top1_data": [round(v, 4) for v in last["top1"]],
           "eval_loss": [round(v, 4) for v in last["eval_loss"]],
           "expected_accept_length_recipe_prompts": last.get("expected_accept_length"),
           "export": f"{out_dir}/export"}
    if wall is None:
        prev = {}
        try:
            prev = json.loads((ROOT / "benchmarks/results/dflash_probe.json").read_text())["trainings"][name]
        except (OSError, KeyError, ValueError):
            pass
        rec["wall_s"] = prev.get("wall_s")
    if speeds:
        rec["train_tokens_per_s"] = round(sum(speeds) / len(speeds), 1)
    return rec


def greedy_texts(base, tok, n: int, max_new_tokens: int) -> list[tuple[int, list[int]]]:
    """(prompt length, prompt + the base's greedy continuation) of the first n held-out story openings."""
    from draftlab.serve.generate import encode_prompt
    from draftlab.train.accept import greedy_continuation

    eos = {tok.eos_token_id}
    out = []
    for p in heldout_story_prompts(n):
        ids = encode_prompt(tok, p, chat=False)
        out.append((len(ids), greedy_continuation(base, ids, max_new_tokens, eos)))
    return out


def accept_along_greedy(export: str, base, texts) -> dict:
    """An export's expected accept length with its default chain (draftlab's replay of greedy decoding on the ranks
    along the base's greedy text, which equals the decoder's own accept length), and per block position the share
    of states whose top-1 is the base's next greedy token (unconditioned on earlier positions)."""
    import torch

    from draftlab.decode.search import replay_accept_length
    from draftlab.decode.tree import Tree
    from draftlab.drafters import text_ranks
    from draftlab.interop.export import load_export

    draft, _ = load_export(export, base)
    depth = draft.block_size - 1
    rows = [text_ranks(draft, base, seq, plen, depth) for plen, seq in texts]
    allr = torch.cat(rows)
    inside = allr < base.get_output_embeddings().weight.shape[0]
    top1 = ((allr == 0) & inside).sum(0) / inside.sum(0).clamp(min=1)
    full = inside.all(1)  # states with the whole block inside the text: 1 + leading top-1 hits, as the probes' figure
    per_state = (1 + (allr[full] == 0).int().cumprod(1).sum(1)).float().mean()
    return {"expected_accept_length": round(replay_accept_length(Tree.chain(depth), rows), 3),
            "per_state_chain_run": round(float(per_state), 3),
            "greedy_agree1": [round(v, 4) for v in top1.tolist()], "states": int(allr.shape[0])}


# --- report ---------------------------------------------------------------------------------------------

def fmt(v: list) -> str:
    return " / ".join(f"{x:.3f}" for x in v)


def summary(res: dict) -> None:
    for part in res.get("probes", []):
        print(f"\nProbe held-out top-1 agreement with the base's argmax, k = 1..7, along {part['text']} "
              "(chain run: 1 + the leading positions all right, per held-out anchor):")
        print("| probe | input at a-1 / tokens | k | held-out | train | chain run |")
        print("|---|---|---|---|---|---|")
        for name, r in part["probes"].items():
            print(f"| {name} | {r['input']} | {','.join(map(str, r['k']))} | {fmt(r['heldout'])} | {fmt(r['train'])} "
                  f"| {r.get('heldout_chain_run', '-')} |")
    if res.get("trainings"):
        print(f"\nShort DFlash trainings ({res['train_steps']} steps): held-out agree1 per block position (the "
              "recipe's metric, on the run's own held-out text), and on 30 held-out prompts x 128 greedy tokens the "
              "top-1 per position, the expected accept length (chain, replayed) and the per-state chain run:")
        print("| run | overrides | agree1 | greedy-text top-1 | accept length | chain run | wall s |")
        print("|---|---|---|---|---|---|---|")
        for name, r in res["trainings"].items():
            print(f"| {name} | {' '.join(r['overrides']) or '-'} | {fmt(r['agree1'])} | "
                  f"{fmt(r.get('greedy_agree1', []))} | {r.get('expected_accept_length')} | "
                  f"{r.get('per_state_chain_run')} | {r['wall_s']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-train", action="store_true", help="the probes only")
    ap.add_argument("--skip-probes", action="store_true", help="the trainings only")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"trainings to run, of {', '.join(RUNS)}")
    ap.add_argument("--steps", type=int, default=250, help="optimizer steps per training")
    ap.add_argument("--reuse", action="store_true", help="keep trainings whose export exists")
    ap.add_argument("--per-row", type=int, default=24, help="training anchors per example for the probes")
    ap.add_argument("--hidden", type=int, default=256, help="MLP probes' hidden units")
    ap.add_argument("--epochs", type=int, default=4, help="probe training epochs")
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from draftlab.base import load_base
    from draftlab.config import load_recipe

    stories_base()
    t_all = time.perf_counter()
    data_self = self_distilled()
    base, tok = load_base(str(STORIES_BASE), "float32")
    res = {"recipe": RECIPE, "self_distilled_data": {"path": data_self, "command": "draftlab " + " ".join(DISTILL_CMD)},
           "threads": 1, "agree1_definition": (
               "top-1 of the draft (probe) at block position k equals the base's argmax at position a+k-1 with the "
               "data text as prefix (teacher forcing), over anchors a >= 1 with x_a and x_{a+1} supervised and a+k "
               "inside the sequence and supervised: DFlashDraft.objective's `agree1` (the probes are scored on the "
               "same 64 seeded anchors per held-out sequence that draftlab's evaluation draws)"),
           "figures": {
               "heldout / train": "probe top-1 agreement per k on held-out / training anchors",
               "heldout_chain_run": "per held-out anchor with all 7 targets, 1 + the leading k all right (along greedy "
                                    "text: the accept length of the probe's chain at that state, a per-state mean)",
               "expected_accept_length": "draftlab's replay of greedy decoding with the export's chain (the decoder's "
                                         "own accept length on those texts)",
               "per_state_chain_run": "the probes' chain-run figure for the export, over every state of those texts",
               "greedy_agree1": "per block position, top-1 = the base's next greedy token, over every state"}}
    if not a.skip_probes:
        t0 = time.perf_counter()
        res["probe_settings"] = {"train_anchors_per_example": a.per_row, "mlp_hidden": a.hidden, "epochs": a.epochs,
                                 "optimizer": "Adam, batch 2048, cosine lr (1e-2 linear, 3e-3 MLP), "
                                              "inputs standardised",
                                 "layers": "hidden_states ids 2, 3, 4 at a-1 (the recipe's head.dflash.layers)"}
        res["probes"] = []
        for text, overrides in (("the data text (the recipe's split)", []),
                                ("the base's greedy text (self-distilled)", [f"data.path={data_self}"])):
            recipe = load_recipe(RECIPE, [f"base.name_or_path={STORIES_BASE}", *overrides])
            res["probes"].append(run_probes(base, recipe, text, a.per_row, a.hidden, a.epochs))
        res["probe_s"] = round(time.perf_counter() - t0, 1)
    if not a.skip_train:
        t0 = time.perf_counter()
        texts = greedy_texts(base, tok, a.prompts, a.max_new_tokens)
        res["train_steps"], res["trainings"] = a.steps, {}
        res["accept_texts"] = {"prompts": a.prompts, "max_new_tokens": a.max_new_tokens,
                               "source": "common.heldout_story_prompts, the base's greedy continuations"}
        for name in a.runs.split(","):
            r = train_run(name, RUNS[name], a.steps, a.reuse)
            r.update(accept_along_greedy(str(ROOT / r["export"]), base, texts))
            res["trainings"][name] = r
            print(f"  {name}: agree1 {fmt(r['agree1'])}, greedy-text top-1 {fmt(r['greedy_agree1'])}, accept length "
                  f"{r['expected_accept_length']} ({r['wall_s']} s)", flush=True)
        res["train_s"] = round(time.perf_counter() - t0, 1)
        res["trainings_wall_s"] = round(sum(r["wall_s"] or 0 for r in res["trainings"].values()), 1)
    res["total_s"] = round(time.perf_counter() - t_all, 1)
    old = ROOT / "benchmarks" / "results" / "dflash_probe.json"
    if (a.skip_probes or a.skip_train) and old.is_file():  # keep the part not rerun from the last full result
        prev = json.loads(old.read_text())
        keep = (("probes", "probe_settings", "probe_s") if a.skip_probes
                else ("trainings", "train_steps", "accept_texts", "train_s", "trainings_wall_s"))
        res.update({k: prev[k] for k in keep if k in prev and k not in res})
    summary(res)
    write_result("dflash_probe", res)
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
