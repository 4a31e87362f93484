"""Helpers shared by the benchmark scripts: paths, the stories260K base, machine description, results."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
STORIES = SHARED / "models" / "stories260K"
TINYSTORIES = SHARED / "tinystories" / "tinystories_sample.txt"
EXPORTS = ROOT / "benchmarks" / "exports"
RESULTS = ROOT / "benchmarks" / "results"
STORIES_BASE = ROOT / "runs" / "stories260k-base"

sys.path.insert(0, str(ROOT))
os.chdir(ROOT)  # recipes name paths relative to the repository root


def require_shared() -> None:
    if not STORIES.is_dir():
        sys.exit(f"this benchmark needs {STORIES} (../shared/data beside the repository)")


def stories_base() -> Path:
    """stories260K imported to runs/stories260k-base (once)."""
    from draftlab.base import import_llama2c

    require_shared()
    if not (STORIES_BASE / "config.json").is_file():
        import_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.model", STORIES_BASE)
    return STORIES_BASE


def machine() -> dict:
    """What the figures were measured on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# The stories260K exports benchmarks/train_heads.py leaves in EXPORTS, by head type.
STORIES_EXPORTS = {"medusa": "stories260k-medusa", "hydra": "stories260k-hydra", "hydra++": "stories260k-hydra++"}


def tinystories_split() -> tuple[list[str], list[str]]:
    """(first 90%, last 10%) of the TinyStories sample: the recipes' training and held-out parts."""
    from draftlab.data import _split, read_records

    docs = [r["text"] for _, _, r in read_records(str(TINYSTORIES))]
    return _split(docs, 0.1, "tail", 0)


def heldout_story_prompts(n: int, chars: int = 64) -> list[str]:
    """Openings of the first n stories of the held-out last 10% of the TinyStories sample."""
    _, held = tinystories_split()
    return [d[:chars].rsplit(" ", 1)[0] for d in held[:n]]


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    data = {"date": datetime.date.today().isoformat(), "machine": machine(), **data}
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return out


# Llama-2-7B's shape, for GPU runs with random weights (what is timed does not depend on the values).
SHAPE_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)


def random_llama(shape: dict = SHAPE_7B, dtype: str = "bfloat16", device: str = "cuda", seed: int = 0):
    """A random-weight Llama of the given shape, built directly on the device in the given dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    model.generation_config.eos_token_id = None  # random weights: decode fixed lengths
    return model.requires_grad_(False).eval()
