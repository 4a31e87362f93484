"""bf16 training steps on a GPU at 7B scale, through the real trainer: Medusa heads, Hydra++ (prefix attention,
distillation, 4-layer heads), a distilled SSM (2 layers, 768 wide, projected embeddings), an EAGLE-3 layer (7
training-time-test steps) and a DFlash block drafter (5 layers, blocks of 16, 512 anchors per sequence; the
defaults of both) on a random-weight
Llama-2-7B-shaped base (32 layers, 4096 wide, 32k vocabulary; bfloat16, frozen) with ShareGPT conversations.

The weights are random, so the losses and accuracies say nothing; what this measures is that each recipe runs
in bf16 on a GPU at the real shapes, its training tokens/s and its peak GPU memory.

    python benchmarks/gpu_train.py --assets gpu_assets --out $OUT      # on a GPU machine (needs ~20 GB disk)

`--assets` is a folder with `tokenizer/` (a Llama-2 tokenizer saved by transformers) and `sharegpt.json`;
`python benchmarks/gpu_train.py --make-assets gpu_assets` makes it from data/ (tokenizers/llama2, sharegpt).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from common import DATA, ROOT, SHAPE_7B, random_llama

DRAFTS = {
    "medusa": {"head": {"type": "medusa", "num_heads": 4, "num_layers": 1}},
    "hydra++": {"head": {"type": "hydra", "num_heads": 4, "num_layers": 4, "prefix_attention": True},
                "loss": {"distill_weight": 1.0}},
    "ssm": {"head": {"type": "ssm", "ssm": {"num_layers": 2, "hidden_size": 768, "num_attention_heads": 12,
                                            "intermediate_size": 3072, "init": "project"}},
            "loss": {"distill_weight": 1.0, "divergence": "fkl"}},
    "eagle3": {"head": {"type": "eagle3"}},
    "dflash": {"head": {"type": "dflash"}},
}


def make_assets(out: Path) -> None:
    """Llama-2 tokenizer and ShareGPT sample from data/, in a folder the GPU machine can receive."""
    import shutil

    from transformers import LlamaTokenizer

    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    # transformers converts a SentencePiece model found as tokenizer.model in the folder it loads from.
    shutil.copy(DATA / "tokenizers" / "llama2" / "tokenizer.model", out / "tokenizer" / "tokenizer.model")
    LlamaTokenizer.from_pretrained(out / "tokenizer", legacy=False).save_pretrained(out / "tokenizer")
    shutil.copy(DATA / "sharegpt" / "sharegpt_sample.json", out / "sharegpt.json")


def random_base(path: Path, tokenizer_dir: Path, shape: dict, seed: int = 0) -> None:
    """A random-weight Llama in bfloat16, saved with the tokenizer (built on the GPU: seconds)."""
    import torch
    from transformers import AutoTokenizer

    if (path / "config.json").is_file():
        return
    model = random_llama(shape, device="cuda" if torch.cuda.is_available() else "cpu", seed=seed)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    del model


def export_params(export: Path) -> int:
    """Parameters stored in an export's weight files."""
    from safetensors.torch import load_file

    meta = json.loads((export / "draftlab.json").read_text())
    return sum(t.numel() for f in meta["files"] if f.endswith(".safetensors") for t in load_file(export / f).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--assets", default="gpu_assets")
    ap.add_argument("--make-assets", default=None, help="write the assets folder here and exit")
    ap.add_argument("--base-dir", default="/tmp/draftlab-base-7b")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "benchmarks" / "results")))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--drafts", nargs="*", default=list(DRAFTS))
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 256-wide base on this machine's device (smoke test)")
    a = ap.parse_args()
    if a.make_assets:
        make_assets(Path(a.make_assets))
        return
    import torch

    from draftlab.config import build_recipe
    from draftlab.train import train

    assets, base_dir = Path(a.assets), Path(a.base_dir)
    t0 = time.perf_counter()
    shape = dict(SHAPE_7B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4) if a.tiny else SHAPE_7B
    random_base(base_dir, assets / "tokenizer", shape)
    results = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "shape": shape,
               "base_build_s": round(time.perf_counter() - t0, 1), "batch_size": a.batch_size, "max_len": a.max_len,
               "steps": a.steps, "runs": {}}
    drafts = dict(DRAFTS)
    if a.tiny:  # an SSM narrower than the tiny base
        drafts["ssm"] = {**DRAFTS["ssm"], "head": {"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 64}}}
    for name in a.drafts:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        recipe = build_recipe({
            "base": {"name_or_path": str(base_dir), "dtype": "bfloat16"}, **drafts[name],
            "data": {"path": str(assets / "sharegpt.json"), "max_len": a.max_len, "eval_size": 4},
            "train": {"lr": 1e-3, "warmup_steps": 5, "max_steps": a.steps, "epochs": 100, "batch_size": a.batch_size,
                      "mixed_precision": "bf16", "eval_every_steps": a.steps, "save_every_steps": a.steps,
                      "log_every_steps": 5},
            "output_dir": f"/tmp/draftlab-gpu-{name}"}, source=f"gpu_train {name}")
        t1 = time.perf_counter()
        summary = train(recipe, overwrite=True)
        wall = time.perf_counter() - t1
        logs = [json.loads(l) for l in Path(recipe.output_dir, "metrics.jsonl").read_text().splitlines()]
        steps = [l for l in logs if "tokens_per_s" in l]
        results["runs"][name] = {
            "wall_s": round(wall, 1), "finished": summary["finished"],
            "train_tokens_per_s": round(sum(l["tokens_per_s"] for l in steps[1:]) / max(1, len(steps) - 1), 1),
            "peak_gpu_mem_gib": max(l.get("gpu_mem_gib", 0) for l in steps),
            "loss_first_last": [round(steps[0]["loss"], 3), round(steps[-1]["loss"], 3)],
            "draft_params": export_params(Path(summary["export"])),
        }
        print(name, json.dumps(results["runs"][name]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("gpu_train_tiny.json" if a.tiny else "gpu_train.json")).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
