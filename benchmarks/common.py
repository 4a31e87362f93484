"""Helpers shared by the benchmark scripts: paths, the stories260K base, machine description, results."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"  # the repository's data/ (data/README.md)
STORIES = DATA / "models" / "stories260K"
TINYSTORIES = DATA / "tinystories" / "tinystories_sample.txt"
EXPORTS = ROOT / "benchmarks" / "exports"
RESULTS = ROOT / "benchmarks" / "results"
STORIES_BASE = ROOT / "runs" / "stories260k-base"

sys.path.insert(0, str(ROOT))
os.chdir(ROOT)  # recipes name paths relative to the repository root


def stories_base() -> Path:
    """stories260K imported to runs/stories260k-base (once)."""
    from draftlab.interop.llama2c import import_llama2c

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


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn() in ms, synchronising the GPU."""
    import statistics
    import time

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(1000 * (time.perf_counter() - t0))
    return statistics.median(ts)


def _oracle_class():
    from draftlab.drafters import Drafter

    class Oracle(Drafter):
        """A drafter of controlled acceptance for random-weight bases: it knows the base's greedy continuation of
        the committed text ("truth") and proposes each rank-0 token of the tree correctly with probability alpha
        (other ranks: wrong tokens); drafting costs nothing. When bf16 rounding makes the decoder commit another
        token than plain generate would (a near-tie), it re-derives truth from the committed text with plain
        generate, or with `continuation(text, n)` (n greedy tokens after text) where given; that time is kept apart
        (excluded_s) and the events are counted (resyncs)."""

        def __init__(self, base, prompt: list[int], truth: list[int], tree, alpha: float, seed: int = 0,
                     continuation=None):
            import random

            from draftlab.decode.tree import TreeView

            self.base, self.prompt, self.truth0 = base, prompt, truth
            self.dev = base.get_output_embeddings().weight.device
            self.tree, self.alpha, self.rng = tree, alpha, random.Random(seed)
            self.buf = tree.buffers(self.dev)
            self.view = TreeView.of_static(self.buf, 1)
            self.depth, self.rank = self.buf.depth.tolist(), self.buf.rank.tolist()
            self.V = base.config.vocab_size
            self.excluded_s, self.resyncs = 0.0, 0
            self.continuation = continuation

        @property
        def max_nodes(self):
            return self.tree.size

        def begin(self, prompt_state, sampling, generator):
            self.text, self.truth, self.first = list(self.prompt), list(self.truth0), True

        def propose(self, root):
            import torch

            from draftlab.drafters import Proposal

            if self.first:  # the prefill's token
                self._follow([int(root[0])])
                self.first = False
            j0 = len(self.text) - len(self.prompt)  # truth index of the token after the root
            toks = [int(root[0])]
            for n in range(1, self.tree.size):
                j = j0 + self.depth[n] - 1
                t = self.truth[j] if j < len(self.truth) else 0
                right = self.rank[n] == 0 and self.rng.random() < self.alpha
                toks.append(t if right else (t + 1 + self.rank[n]) % self.V)
            return Proposal(torch.tensor([toks], device=self.dev), self.view)

        def commit(self, step):
            self._follow([int(step.tokens[0, n]) for n in step.paths[0][1:]] + [int(step.bonus[0])])

        def _follow(self, new):
            import time

            import torch

            start = len(self.text) - len(self.prompt)
            self.text += new
            ahead = max(self.depth) + 1  # truth the next proposal reads past the committed text
            if self.truth[start:start + len(new)] != new or len(self.truth) < start + len(new) + ahead:
                sync()
                t0 = time.perf_counter()
                self.resyncs += self.truth[start:start + len(new)] != new
                if self.continuation is not None:
                    cont = list(self.continuation(self.text, 32))
                else:
                    ids = torch.tensor([self.text], device=self.dev)
                    cont = self.base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                              do_sample=False, temperature=None, top_p=None, top_k=None,
                                              pad_token_id=0)[0, ids.shape[1]:].tolist()
                self.truth = self.text[len(self.prompt):] + cont
                sync()
                self.excluded_s += time.perf_counter() - t0

    return Oracle


def Oracle(*args, **kwargs):  # noqa: N802 - a class built on first use (draftlab imports stay lazy here)
    return _oracle_class()(*args, **kwargs)
