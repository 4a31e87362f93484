"""The tree decoder over a tensor-parallel base: one process per GPU, launched with torchrun.

    torchrun --standalone --nproc-per-node 8 benchmarks/tp_decode.py --shape 70b --out $OUT   # 8 GPUs, 70B shape
    torchrun --standalone --nproc-per-node 2 benchmarks/tp_decode.py --shape 7b                # 2 GPUs
    torchrun --standalone --nproc-per-node 2 benchmarks/tp_decode.py --shape tiny              # CPU smoke test

Random weights (no checkpoint needed; `--base PATH` takes a real one instead): rank 0 writes a random-weight
checkpoint of the shape once to --scratch (7B: 13.5 GB, 70B: 138 GB of disk in bf16), then every rank loads its
shard of it with transformers' tensor-parallel plan, as `draftlab generate --tp` does. Measured on rank 0:

1. plain HF generate over the sharded base (the baseline) and its time per token;
2. one verification forward over N tree tokens (4D mask, explicit positions, KV cache) on a --context-token
   context, N = 1..128, against one plain decoding step (all-reduces included);
3. the decoder loop with an oracle drafter of per-token acceptance alpha (draftlab's gpu_decode.py), replicated
   on every rank with rank 0's proposals broadcast: tokens/s and speedup over plain generate on the same shards.

Run the same line with --nproc-per-node 1 for the unsharded figures on one GPU (a base that fits).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from common import ROOT, SHAPE_7B, Oracle, sync, timed

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=512, max_position_embeddings=2048),
    "7b": SHAPE_7B,
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
}


def random_checkpoint(shape: str, dtype: str, scratch: Path) -> Path:
    """Rank 0 writes a random-weight checkpoint of the shape (once; reused when present); the others wait."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    d = scratch / f"random-llama-{shape}-{dtype}"
    if int(os.environ.get("RANK", "0")) == 0 and not (d / "config.json").is_file():
        torch.manual_seed(0)
        cfg = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
        model.to_empty(device="cpu")
        for p in model.parameters():  # layer by layer on the CPU: the model is never on a GPU whole
            p.data.normal_(0, 0.02)
        model.save_pretrained(d, max_shard_size="5GB")
        del model
        from draftlab.cli.quickstart import build_tokenizer

        build_tokenizer(["a random-weight base needs some tokenizer to load"], d)  # never used to encode
    if dist.is_initialized():
        dist.barrier()
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="a real checkpoint (path or hub id) instead of random weights")
    ap.add_argument("--shape", choices=list(SHAPES), default="7b")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on GPUs, float32 on CPU")
    ap.add_argument("--scratch", default="/tmp/draftlab-tp", help="where the random checkpoint is written")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--alphas", type=float, nargs="*", default=[0.6, 0.8])
    ap.add_argument("--trees", nargs="*", default=["chain-3", "default-4h-25"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "benchmarks" / "results")))
    a = ap.parse_args()
    from draftlab.decode.cache import SlotCache
    from draftlab.decode.decoder import SpeculativeDecoder
    from draftlab.serve.generate import load_placed
    from draftlab.decode.tensor_parallel import RankSync, init_tp, is_main, shutdown, world_size
    from draftlab.decode.search import default_tree
    from draftlab.decode.tree import Tree, TreeView

    torch.set_num_threads(max(1, torch.get_num_threads() // max(world_size(), 1)))
    n = world_size()
    if n > 1:
        init_tp()
    dtype = a.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    path = a.base or str(random_checkpoint(a.shape, dtype, Path(a.scratch)))
    base, _ = load_placed(path, dtype, None, n > 1, None)
    dev = base.get_output_embeddings().weight.device
    sync_ranks = RankSync() if n > 1 else None
    V = base.config.vocab_size
    prompt = torch.randint(3, V, (1, a.context), generator=torch.Generator().manual_seed(0)).tolist()[0]
    res = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "processes": n,
           "torch": torch.__version__, "base": a.base or f"random {a.shape}", "dtype": dtype, "context": a.context,
           "new_tokens": a.new_tokens}

    ids = torch.tensor([prompt], device=dev)
    gen = lambda k: base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False,
                                  temperature=None, top_p=None, top_k=None, pad_token_id=0)
    truth = gen(a.new_tokens + 16)[0, len(prompt):].tolist()
    plain_ms = timed(lambda: gen(a.new_tokens), reps=3, warmup=1)
    res["plain"] = {"tokens_per_s": round(1000 * a.new_tokens / plain_ms, 1),
                    "ms_per_token": round(plain_ms / a.new_tokens, 3)}
    if is_main():
        print("plain", res["plain"], flush=True)

    rows = []
    target = SlotCache(base)
    with torch.no_grad():
        target.prefill(ids, torch.ones(1, len(prompt), dtype=torch.bool, device=dev))
        for size in a.sizes:
            tree = default_tree(4, size - 1) if size > 1 else Tree.from_paths([])
            view = TreeView.of_static(tree.buffers(dev), 1)
            toks = torch.randint(3, V, (1, tree.size), generator=torch.Generator().manual_seed(size)).to(dev)
            start = target.length

            def verify():
                target.forward(toks, view.ancestors, view.depth)
                target.keep(start, torch.zeros(1, 0, dtype=torch.long, device=dev),
                            torch.zeros(1, 0, dtype=torch.bool, device=dev))
            ms = timed(verify)
            rows.append({"tree_size": tree.size, "verify_ms": round(ms, 3),
                         "over_plain_step": round(ms / res["plain"]["ms_per_token"], 3)})
            if is_main():
                print(rows[-1], flush=True)
    res["verify"] = rows

    trees = {"chain-3": Tree.chain(3), "chain-5": Tree.chain(5), "default-4h-25": default_tree(4, 24)}
    loops = []
    for alpha in a.alphas:
        for name in a.trees:
            tree = trees[name]
            SpeculativeDecoder(base, Oracle(base, prompt, truth, tree, alpha), sync=sync_ranks).generate(
                [prompt], max_new_tokens=8)  # warm-up
            runs = []
            for rep in range(a.reps):
                drafter = Oracle(base, prompt, truth, tree, alpha, seed=rep)
                sync()
                r = SpeculativeDecoder(base, drafter, sync=sync_ranks).generate([prompt], max_new_tokens=a.new_tokens)
                sync()
                runs.append((sum(r.time_s.values()) - drafter.excluded_s, r, drafter))
            wall, r, drafter = sorted(runs, key=lambda x: x[0])[len(runs) // 2]
            tps = a.new_tokens / wall
            loops.append({"alpha": alpha, "tree": name, "tree_size": tree.size,
                          "accept_length": round(r.accept_length, 3), "tokens_per_s": round(tps, 1),
                          "speedup": round(tps / res["plain"]["tokens_per_s"], 3),
                          "verify_ms_per_step": round(1000 * r.time_s["verify"] / r.steps, 3),
                          "identical_to_plain": r.tokens[0] == truth[:len(r.tokens[0])],
                          "bf16_resyncs": drafter.resyncs})
            if is_main():
                print(loops[-1], flush=True)
    res["oracle_loop"] = loops
    if is_main():
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"tp_decode_{a.shape if not a.base else 'base'}_x{n}.json"
        (out / name).write_text(json.dumps(res, indent=2))
        print("wrote", out / name)
    if n > 1:
        shutdown()


if __name__ == "__main__":
    main()
