"""CPU attention over grouped heads with a mask, as draftlab's compiled calls run it (decode.gqa): each group's query
heads packed as one head's rows (the default) against the grouping passed to the kernel (`enable_gqa=True`,
DRAFTLAB_CPU_GQA_PACKED=0), through decode.gqa.grouped_sdpa itself, compiled (torch.compile, fixed shapes, so the
mask's repeat is fused as in a verify step), both ways one after the other for each shape, in one run, per thread
count; the largest difference of the outputs too.

Shapes: stories260K's attention (8 query heads over 4, head size 8, a 256-slot window: draftlab's smallest) and a
Llama-3-8B layer's (32 over 8, head size 128, 1,024 slots), batch 1, for 1 (plain decoding) to 60 query rows (a
tree's nodes); an additive mask of one row per query, shared by the heads.

    python benchmarks/attention_packing.py     # a few minutes on 2 CPU cores; results/attention_packing.json
"""

from __future__ import annotations

import time
import types

import torch

from common import write_result

SHAPES = {"stories260K": (8, 4, 8, 256), "Llama-3-8B layer": (32, 8, 128, 1024)}
ROWS = (1, 5, 8, 25, 60)


def timed_us(fn, seconds: float = 0.4) -> float:
    """Best of 3 rounds of mean microseconds per call (each round about `seconds` long)."""
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 4:
        fn()
        n += 1
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n * 4):
            fn()
        best = min(best, (time.perf_counter() - t0) / (n * 4) * 1e6)
    return round(best, 2)


def main() -> None:
    from draftlab.decode import fuse, gqa

    gqa.install()
    fuse.ACTIVE[0] = True  # inside draftlab's compiled calls: grouped_sdpa attends as they do

    def attend(query, key, value, mask, module):
        return gqa.grouped_sdpa(module, query, key, value, mask)[0]

    res = {"shapes": {}, "threads": []}
    with torch.no_grad():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            res["threads"].append(threads)
            for name, (H, KV, D, W) in SHAPES.items():
                module = types.SimpleNamespace(num_key_value_groups=H // KV)
                for n in ROWS:
                    g = torch.Generator().manual_seed(n)
                    q, k, v = (torch.randn(1, h, s, D, generator=g) for h, s in ((H, n), (KV, W), (KV, W)))
                    seen = torch.rand(1, 1, n, W, generator=g) > 0.3
                    seen[..., 0] = True
                    mask = torch.zeros(1, 1, n, W).masked_fill(~seen, torch.finfo(torch.float32).min)
                    row, outs, calls = {}, {}, {}
                    for packed in (True, False):
                        gqa.PACKED[0] = packed
                        fn = torch.compile(attend, dynamic=False)
                        outs[packed] = fn(q, k, v, mask, module)
                        calls[packed] = fn
                    for packed, fn in calls.items():  # (dynamo guards on the switch: each call runs its variant)
                        gqa.PACKED[0] = packed
                        row["packed_us" if packed else "enable_gqa_us"] = timed_us(lambda: fn(q, k, v, mask, module))
                    torch._dynamo.reset()
                    row["speedup"] = round(row["enable_gqa_us"] / row["packed_us"], 3)
                    row["max_abs_difference"] = float((outs[True] - outs[False]).abs().max())
                    res["shapes"].setdefault(name, {"heads": H, "kv_heads": KV, "head_dim": D, "slots": W,
                                                    "rows": {}})["rows"].setdefault(str(n), {})[str(threads)] = row
                    print(threads, name, n, row, flush=True)
    gqa.PACKED[0] = True
    fuse.ACTIVE[0] = False
    write_result("attention_packing", res)


if __name__ == "__main__":
    main()
