"""`draftlab search-tree`: acceptance statistics on calibration text -> greedy trees -> the fastest here."""

from __future__ import annotations

import datetime
import json
import platform
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .decoder import SpeculativeDecoder, sync_device
from .search import RankStats, geometric_sizes, proposal_trees, replay_accept_length
from .tree import Tree


def greedy_continuations(base, prompts: list[list[int]], max_new_tokens: int, eos) -> list[list[int]]:
    """prompt + the base's greedy continuation, the text decoding will actually walk."""
    from .acceptance import Sampling
    from .cli import plain_generate

    return [p + plain_generate(base, [p], max_new_tokens, Sampling(), eos)[0][0]
            for p in tqdm(prompts, desc="greedy continuations", leave=False)]


@torch.no_grad()
def collect_ranks(base, draft, sequences: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """Per sequence, rank vectors [T, D] of the states greedy decoding can verify from; a rank of V means
    'beyond the text'.

    At state t (x_0..x_t committed, root x_{t+1}), depth d's target is x_{t+d+1}; Hydra heads are
    conditioned on the true path x_{t+1..t+d}, as an accepting tree would have them. States run from the
    prompt's last token to the one before the text's last: once the root is the final token (max_new_tokens
    or EOS), decoding stops without another verification step.
    """
    from ..base import base_hidden

    rows = []
    V = base.get_output_embeddings().weight.shape[0]
    D = draft.num_heads
    dtype = next(draft.parameters()).dtype
    for seq, plen in zip(sequences, prompt_lens):
        ids = torch.tensor([seq], device=base.device)
        S = ids.shape[1]
        h = base_hidden(base, ids, torch.ones_like(ids))
        feats = draft.train_hidden(h.to(dtype), ids, torch.ones_like(ids))
        ranks = torch.full((S, D), V, dtype=torch.long, device=ids.device)
        for k in range(D):
            n = S - (k + 2)
            if n <= 0:
                continue
            logits = draft.lm_heads[k](feats[k][0, :n])  # [n, V]
            target = ids[0, k + 2:]  # [n]
            ranks[:n, k] = (logits > logits.gather(1, target[:, None])).sum(-1)
        start = max(plen - 1, 0)
        rows.append(ranks[start: max(S - 2, start)].cpu())
    return rows


def measure(decoder: SpeculativeDecoder, prompts: list[list[int]], batch_size: int, max_new_tokens: int, eos) -> dict:
    """Greedy tokens/s and accept length of the decoder on prompts, in batches of batch_size."""
    decoder.generate(prompts[:1], max_new_tokens=8, eos_token_id=eos)  # warm-up
    tokens = committed = rows = 0
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        res = decoder.generate(prompts[s:s + batch_size], max_new_tokens=max_new_tokens, eos_token_id=eos)
        tokens += res.new_tokens
        committed += sum(res.committed)
        rows += sum(res.rows_per_step)
    sync_device(decoder.device)
    dt = time.perf_counter() - t0
    return {"tokens_per_s": tokens / dt, "accept_length": committed / max(rows, 1)}


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU x{torch.get_num_threads()} threads"


def search_tree(export: str, data: str, out: str, max_nodes: int = 64, batch_size: int = 1, max_rank: int = 10,
                calibration_prompts: int = 64, timing_prompts: int = 8, max_new_tokens: int = 128, chat: bool = False,
                prompt_chars: int = 64, sizes: list[int] | None = None, plot: bool = False) -> dict:
    """The whole search; writes the tree file (and PNGs with plot) and returns a report."""
    from ..data import detect_format, prompt_turns, read_records, to_messages
    from .cli import encode_prompt, load_decoder

    decoder, tok, meta = load_decoder(export, tree="chain")
    base, draft, eos = decoder.base, decoder.draft, tok.eos_token_id
    prompts = []
    for _, _, rec in read_records(data, max_records=calibration_prompts + timing_prompts):
        fmt = detect_format(rec)
        if fmt == "text":
            text = rec["text"][:prompt_chars]
            prompts.append(encode_prompt(tok, text.rsplit(" ", 1)[0] if " " in text else text, chat))
        else:
            prompts.append(encode_prompt(tok, prompt_turns(to_messages(rec, fmt)), True))
    if len(prompts) < 2:
        raise ValueError(f"--data {data}: need at least 2 prompts, found {len(prompts)}")
    calib, timing = prompts[:calibration_prompts], prompts[calibration_prompts:] or prompts[:timing_prompts]

    seqs = greedy_continuations(base, calib, max_new_tokens, eos)
    per_text = collect_ranks(base, draft, seqs, [len(p) for p in calib])
    stats = RankStats(torch.cat(per_text), max_rank)
    trees = proposal_trees(stats, max_nodes)
    if not trees:
        raise ValueError("the draft's candidates never matched the base on the calibration text; train the heads longer")
    sizes = sorted({min(s, len(trees)) for s in (sizes or geometric_sizes(len(trees)))})
    rows = []
    for n in tqdm(sizes, desc="timing tree sizes"):
        tree = trees[n - 1]
        m = measure(SpeculativeDecoder(base, draft, tree), timing, batch_size, max_new_tokens, eos)
        rows.append({"nodes": n, "tree_size": tree.size, "expected_accept_length": tree.metadata["expected_accept_length"],
                     "replayed_accept_length": round(replay_accept_length(tree, per_text), 4),
                     "measured_accept_length": round(m["accept_length"], 4), "tokens_per_s": round(m["tokens_per_s"], 2)})
    best = max(rows, key=lambda r: r["tokens_per_s"])
    chosen = trees[best["nodes"] - 1]
    chosen = Tree.from_paths([list(p) for p in chosen.paths], {
        "name": Path(out).stem, "method": "greedy growth on empirical acceptance statistics (Hydra sec. 4)",
        "export": str(export), "calibration": {"data": str(data), "prompts": len(calib), "states": stats.n},
        "expected_accept_length": best["expected_accept_length"],
        "replayed_accept_length": best["replayed_accept_length"],
        "measured_accept_length": best["measured_accept_length"], "tokens_per_s": best["tokens_per_s"],
        "tree_size": best["tree_size"], "batch_size": batch_size, "hardware": hardware(),
        "date": datetime.date.today().isoformat(), "sizes_measured": rows})
    chosen.save(out)
    report = {"tree": str(out), **{k: chosen.metadata[k] for k in ("expected_accept_length", "replayed_accept_length",
                                                                    "measured_accept_length",
                                                                    "tokens_per_s", "tree_size", "batch_size", "hardware")},
              "sizes": rows}
    if plot:
        report["plots"] = plot_search(rows, chosen, Path(out))
    return report


def plot_search(rows: list[dict], tree: Tree, out: Path) -> list[str]:
    """PNG of expected accept length and tokens/s against tree size, and a drawing of the chosen tree."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p1 = out.with_suffix(".sizes.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["tree_size"] for r in rows]
    ax.plot(xs, [r["expected_accept_length"] for r in rows], "o-", label="expected accept length")
    ax.plot(xs, [r["measured_accept_length"] for r in rows], "s--", label="measured accept length")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree size (tokens per verification)")
    ax.set_ylabel("accept length")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["tokens_per_s"] for r in rows], "^-", color="tab:red", label="tokens/s")
    ax2.set_ylabel("tokens/s", color="tab:red")
    ax.legend(loc="upper left")
    ax.set_title(f"tree search ({tree.metadata.get('hardware', '')})")
    fig.tight_layout()
    fig.savefig(p1, dpi=120)
    plt.close(fig)

    p2 = out.with_suffix(".tree.png")
    buf = tree.buffers()
    depth = buf.depth.tolist()
    x = {}
    leaves = iter(range(tree.size))
    order = [0] + [i + 1 for i in range(len(tree.paths))]

    def place(n):
        kids = buf.children[n]
        if not kids:
            x[n] = next(leaves)
        else:
            for c in kids:
                place(c)
            x[n] = sum(x[c] for c in kids) / len(kids)
    place(0)
    fig, ax = plt.subplots(figsize=(max(4, 0.35 * tree.size), 1.2 + 0.9 * tree.depth))
    for n in order[1:]:
        par = buf.parent[n].item()
        ax.plot([x[par], x[n]], [-depth[par], -depth[n]], color="0.6", lw=1)
    for n in order:
        label = "root" if n == 0 else str(tree.paths[n - 1][-1])
        ax.text(x[n], -depth[n], label, ha="center", va="center", fontsize=7,
                bbox=dict(boxstyle="round", fc="white", ec="tab:blue"))
    ax.set_axis_off()
    ax.set_title(f"{tree.size} nodes, depth {tree.depth} (labels: top-k rank)")
    fig.tight_layout()
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [str(p1), str(p2)]


def add_search_args(p) -> None:
    p.add_argument("export")
    p.add_argument("--data", required=True, help="calibration text: .txt / JSON(L) of text, ShareGPT or Alpaca records")
    p.add_argument("--out", required=True, help="tree file to write (.json)")
    p.add_argument("--max-nodes", type=int, default=64, help="largest tree (non-root nodes) to consider")
    p.add_argument("--batch-size", type=int, default=1, help="batch size the tree is tuned for")
    p.add_argument("--max-rank", type=int, default=10, help="candidates per depth considered (top-k)")
    p.add_argument("--calibration-prompts", type=int, default=64)
    p.add_argument("--timing-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="tree sizes to time (default 1, 2, 4, ...)")
    p.add_argument("--plot", action="store_true", help="write OUT.sizes.png and OUT.tree.png")
    p.add_argument("--json", action="store_true")


def search_command(a) -> int:
    rep = search_tree(a.export, a.data, a.out, a.max_nodes, a.batch_size, a.max_rank, a.calibration_prompts,
                      a.timing_prompts, a.max_new_tokens, sizes=a.sizes, plot=a.plot)
    if a.json:
        print(json.dumps(rep))
        return 0
    print("| nodes | expected accept | measured accept | tokens/s |\n|---|---|---|---|")
    for r in rep["sizes"]:
        print(f"| {r['tree_size']} | {r['expected_accept_length']:.3f} | {r['measured_accept_length']:.3f} | "
              f"{r['tokens_per_s']:.1f} |")
    print(f"\nchose {rep['tree_size']} nodes ({rep['tokens_per_s']:.1f} tokens/s at batch size {rep['batch_size']} on "
          f"{rep['hardware']}); wrote {rep['tree']}")
    return 0
