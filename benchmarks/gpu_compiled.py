"""Compiled decoding on a GPU at 7B scale (issue 20's GPU targets): a random-weight Llama-2-7B-shaped base in
bfloat16, batch 1, a 512-token random prompt, 128 new tokens.

Methods, each warmed up once (the warm-up compiles; its time is reported), then timed `--reps` times in rounds
(every method once per round) and the median kept:
- hf_generate: HF `generate`, dynamic cache, eager (the default a user has);
- plain_eager / plain_compiled: draftlab's plain loop (NoDraft) eager, and on the static-shape path through
  torch.compile with CUDA graphs (mode reduce-overhead): the fastest plain decoding draftlab has;
- oracle_eager / oracle_compiled: the decoder with an oracle drafter (benchmarks/common.py, Oracle) that proposes
  each rank-0 token of the tree correctly with probability alpha and costs nothing to draft, on the default tree
  for 4 heads (25 nodes) and any other --trees: the speedup a drafter of that acceptance can reach;
- with --fused-step, plain_compiled_fused and oracle_*_compiled_fused: the same with the verify step fused (the
  forward, the acceptance rule and the KV keep in one call, so one CUDA graph; docs/decoding.md), which a GPU runs
  by default for greedy steps since it was measured (decode.decoder.fused_default); plain_compiled and
  oracle_*_compiled run the split calls (fused=False), as they did before;
- with --chained, medusa_compiled_fused_split / _chained: random-weight Medusa heads (4 heads, the default tree)
  on the fused step, their fill in a call of its own or inside the verify call (the chained step, docs/decoding.md):
  the cost of a step each way (random heads accept next to nothing, so this is per-step cost, not speedup); and
  eagle3_compiled_fused_split / _chained, a random-weight EAGLE-3 drafter (its default tree) the same two ways,
  whose chained commit writes into its own buffers inside the call; and ssm_compiled_fused_split / _chained, a
  random-weight SSM of llama-68m's shape (2 layers x 768) drafting a 4-token chain, whose chained call keeps the
  accepted path in its own KV cache;
- with --sampled, plain_compiled[_fused]_sampled (and with --chained medusa_compiled_fused_{split,chained}_sampled):
  speculative sampling at temperature 0.8 with the on-device rule (docs/decoding.md), its acceptance in its own
  compiled graph or inside the fused verify call; each run draws from one seed. Their outputs part where the two
  graphs' logits differ in a last bit: over a near-flat law of 32,000 tokens (random weights) such a difference
  moves many inverse-CDF draws by one token, so `sampled_agree` (kept for earlier results) is not a check of the law
  here; tests/test_gpu_law.py is (benchmarks/gpu_check.sh runs it);
- with --fuse-projections, plain_compiled_fuseproj and oracle_default-4h-25_compiled_fuseproj (with --fused-step
  also each with the verify step fused, *_fuseproj_fused): plain and the oracle on a copy of the base whose q/k/v
  and gate/up projections run as one product each (decode.fuse; 129 matrix products per 7B forward instead of 225),
  which a GPU does not do by default (two calls disagreed); every other method runs unfused;
- hf_static_compiled (last; --no-hf-compile skips it): HF `generate` with a static cache and its own compile.

Methods warm up in the order of what the next GPU run needs most: plain decoding split and fused, the chained
drafters, then fused projections and the oracle's variants (both measured in two calls before), the sampled plain
pair, the sampled Medusa pair, then HF's static compile, so that a run cut short
by --deadline keeps the first; --only METHOD ... runs the named ones alone, in the order given. The fastest plain
decoding is the fastest greedy hf_* or plain_* method measured.

--inductor KEY=VALUE sets torch._inductor.config options before anything compiles (e.g.
coordinate_descent_tuning=True, under which inductor writes one-row matrix products as tuned Triton reductions
rather than calling cuBLAS); --name names the results file. --profile adds where a step's time goes: the matrix
products of every linear layer alone (cuBLAS, one CUDA graph, one row and one per tree node: the floor the weights'
reads set), and the kernels of the compiled verify forward under the profiler, summed by kind.

A plain method's share of the bandwidth bound is given per token (its prefill included, as HF's) and per decoding
step (`bandwidth_share_decode`: the prefill left out, issue 20's target). Per fused or chained method, the first
token where its output parts from its split counterpart's (`first_difference_from_split`; None: the same tokens).
Also: the GPU's copy bandwidth measured in the run (bytes read + written by a 4 GiB device-to-device copy), the
bytes of weights one decoding step reads (every parameter but the input embedding, of which one row is read), and so
plain decoding's share of the bandwidth bound; per method, the graphs compiled in its warm-up that inductor runs
without CUDA graphs (cudagraph_skips, e.g. for inputs written in place that are not marked static); and the compiled
verify forward timed alone (the same static cache, shapes and compiled graph, outside the loop) against its time per
step inside the loop; and the drafting call of EAGLE-3's and Medusa's split steps timed alone (`draft_alone`, its
kernels in the profile) against their draft phase in the loop.

Random weights make near-ties everywhere, and a compiled forward or one over N tree tokens rounds differently from
HF's one-token eager step in bf16, so outputs are compared with HF's (identical / first difference) but not
required to match; the oracle re-derives its truth where the committed text left it (with draftlab's compiled
plain loop; time excluded, events counted as bf16 re-syncs).

    python benchmarks/gpu_compiled.py --out $OUT          # on a GPU machine (a few minutes, mostly compiling)
    python benchmarks/gpu_compiled.py --tiny --no-hf-compile --out /tmp/gc   # a CPU smoke test of this script
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from common import ROOT, SHAPE_7B, Oracle, random_llama, sync, timed

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=512, max_position_embeddings=2048)
SSM_68M = {"num_layers": 2, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072, "init": "random"}
NOMINAL_TBPS = {"H200": 4.8, "H100 80GB HBM3": 3.35, "H100 PCIe": 2.0, "A100-SXM4-80GB": 2.04}  # spec sheets


def copy_bandwidth(dev: str) -> float | None:
    """Bytes read + written per second by a device-to-device copy of 4 GiB (median of 10)."""
    if dev != "cuda":
        return None
    x = torch.empty(2 ** 31, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), reps=10, warmup=2)
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 ** 32 / (ms / 1000)


def step_bytes(base) -> int:
    """Weight bytes one decoding step reads: every parameter, less the input embedding but one row of it."""
    emb = base.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in base.parameters())
    return total - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()


def matmul_floor(base, rows: int, dev: str) -> dict:
    """Every linear layer's matrix product (lm_head included) on `rows` rows, alone, in order: one CUDA graph on a
    GPU. Its time is the floor the weights' reads set for a forward through cuBLAS."""
    import torch.nn.functional as F

    ws = [m.weight for m in base.modules() if isinstance(m, torch.nn.Linear)]
    xs = {w.shape[1]: torch.randn(1, rows, w.shape[1], dtype=w.dtype, device=dev) for w in ws}

    @torch.no_grad()
    def run():
        for w in ws:
            F.linear(xs[w.shape[1]], w)
    fn = run
    if dev == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        fn = graph.replay
    ms = timed(fn, reps=20, warmup=3)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    return {"rows": rows, "layers": len(ws), "ms": round(ms, 3), "gb": round(nbytes / 1e9, 3),
            "tbps": round(nbytes / ms / 1e9, 3)}


def verify_call(dec, tree, n0: int, dev: str):
    """(tree size, verify, back): the compiled verify forward of decoder `dec` as its loop runs it (its static cache,
    graph and mask) over `tree`'s random tokens at cache length n0, then back to n0; back alone goes back to n0."""
    from draftlab.decode.tree import TreeView

    cache, size = dec._cache, dec.drafter.max_nodes
    view = TreeView.of_static(tree.buffers(dev), 1)
    toks = torch.randint(3, dec.base.config.vocab_size, (1, size), device=dev)
    back = lambda: cache.rewind(n0)  # noqa: E731
    back()

    @torch.no_grad()  # as the decoder runs it: with gradients on, dynamo compiles another graph, unfused (decode.fuse)
    def verify():
        cache.forward(toks, view.ancestors, view.depth)
        back()
    return size, verify, back


def draft_call(dec, dev: str):
    """(tree size, draft, None): the drafter's own call of decoder `dec` as its split loop runs it between two
    verifications, its proposal below a root, on the state its last run left (for the drafters whose proposal then
    changes nothing: EAGLE-3's next commit is empty, Medusa's heads read the last state)."""
    root = torch.tensor([5], device=dev)

    @torch.no_grad()
    def draft():
        dec.drafter.propose(root)
    return dec.drafter.max_nodes, draft, None


DRAFT_ALONE = ("eagle3_compiled_fused_split", "medusa_compiled_fused_split")  # (draft_call's drafters)

KINDS = (("matmul", ("gemv", "gemm", "nvjet", "cutlass", "xmma", "splitk", "cublas")),
         ("attention", ("flash", "fmha", "attention", "efficient", "sdpa")), ("triton", ("triton",)),
         ("copy", ("memcpy", "memset", "copy")))


def profile(base, verifies: dict, dev: str) -> dict:
    """The matrix products alone (matmul_floor) and, on a GPU, the kernels each compiled verify forward of
    `verifies` (name -> verify_call) runs under torch.profiler, per forward and summed by kind."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = {"matmul_floor": [matmul_floor(base, 1, dev), matmul_floor(base, 25, dev)]}
    if dev != "cuda":
        return out
    for name, (size, verify, _) in verifies.items():
        reps = 5
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                verify()
            sync()
        kinds: dict = {}
        kernels = []
        for e in prof.key_averages():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.self_device_time_total / reps
            low = e.key.lower()
            kind = next((k for k, words in KINDS if any(w in low for w in words)), "other")
            kinds[kind] = kinds.get(kind, 0.0) + us
            kernels.append((us, e.count // reps, kind, e.key[:120]))
        kernels.sort(reverse=True)
        out[name] = {"tree_size": size, "kernel_ms": round(sum(kinds.values()) / 1000, 3),
                     "by_kind_ms": {k: round(v / 1000, 3) for k, v in sorted(kinds.items(), key=lambda x: -x[1])},
                     "kernels_per_forward": sum(k[1] for k in kernels),
                     "top": [{"us": round(us, 1), "calls": c, "kind": k, "name": n} for us, c, k, n in kernels[:12]]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "benchmarks" / "results")))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--trees", nargs="*", default=["default-4h-25"], help="default-4h-25 and/or chain-K")
    ap.add_argument("--no-hf-compile", action="store_true")
    ap.add_argument("--no-eager", action="store_true", help="skip draftlab's eager methods (a shorter run)")
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 base on this machine's device (smoke test)")
    ap.add_argument("--fused-step", action="store_true", help="also plain and the oracle with the verify step fused "
                    "(forward, acceptance and keep in one call: one CUDA graph; every device's default)")
    ap.add_argument("--chained", action="store_true", help="also random-weight Medusa heads (4, the default tree), an "
                    "EAGLE-3 drafter and a llama-68m-shaped SSM on the fused step with their drafting in its call (the "
                    "chained step) and in a call of their own: the cost per step of each (random weights accept next "
                    "to nothing)")
    ap.add_argument("--sampled", action="store_true", help="also sampled decoding (temperature 0.8) with the "
                    "acceptance rule in its own graph and in the fused verify call (with --chained, the Medusa heads "
                    "too)")
    ap.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                    help="torch._inductor.config options set before anything compiles")
    ap.add_argument("--name", help="the results file's name (default gpu_compiled, gpu_compiled_tiny with --tiny)")
    ap.add_argument("--deadline", type=float, help="start no warm-up after this many seconds of the run (the methods "
                    "left are listed as skipped), so that a run with a time limit still reaches its timed rounds")
    ap.add_argument("--fuse-projections", action="store_true", help="also plain and the oracle (default tree) on a "
                    "copy of the base whose q/k/v and gate/up projections are fused (decode.fuse); every other "
                    "method's are not")
    ap.add_argument("--only", nargs="+", metavar="METHOD", help="run these methods alone, in this order (names as in "
                    "the results; the options above still add them, and a name they do not add is reported as not "
                    "run): a short call that settles chosen questions")
    ap.add_argument("--profile", action="store_true", help="also the matrix products alone and the verify forward's "
                    "kernels by kind")
    a = ap.parse_args()
    if a.fuse_projections:  # the other methods run unfused on every device (decode.fuse.fuse_by_default)
        os.environ["DRAFTLAB_FUSE_PROJECTIONS"] = "0"
    options = {}
    for item in a.inductor:
        key, _, value = item.partition("=")
        options[key] = ast.literal_eval(value)
        setattr(inductor_config, key, options[key])  # raises on an unknown option
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder
    from draftlab.decode.search import default_tree
    from draftlab.decode.tree import Tree

    t_start = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape, dtype = (TINY, "float32") if a.tiny else (SHAPE_7B, "bfloat16")
    base = random_llama(shape, dtype, dev)
    V, N = base.config.vocab_size, a.new_tokens
    prompt = torch.randint(3, V, (1, a.context), generator=torch.Generator().manual_seed(0)).tolist()[0]
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import transformers

    res = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(["python benchmarks/gpu_compiled.py", *[x for i, x in enumerate(sys.argv[1:]) if not (
               x.startswith("--out") or sys.argv[i] == "--out")]]), "torch": torch.__version__,
           "transformers": transformers.__version__, "shape": shape, "dtype": dtype, "context": a.context,
           "new_tokens": N, "alpha": a.alpha, "reps": a.reps, "inductor_options": options, "methods": {}, "errors": {}}
    path = out_dir / f"{a.name or ('gpu_compiled_tiny' if a.tiny else 'gpu_compiled')}.json"

    def save():
        res["wall_s"] = round(time.perf_counter() - t_start, 1)
        path.write_text(json.dumps(res, indent=2))

    bw = copy_bandwidth(dev)
    res["copy_bandwidth_tbps"] = None if bw is None else round(bw / 1e12, 3)
    res["nominal_tbps"] = next((v for k, v in NOMINAL_TBPS.items() if k in res["device"]), None)
    weights = step_bytes(base)
    res["step_weight_gb"] = round(weights / 1e9, 3)
    print({k: res[k] for k in ("device", "copy_bandwidth_tbps", "nominal_tbps", "step_weight_gb")}, flush=True)

    ids = torch.tensor([prompt], device=dev)

    def hf(**kw):
        return lambda: base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                                     temperature=None, top_p=None, top_k=None, pad_token_id=0,
                                     **kw)[0, a.context:].tolist()

    truth = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N + 16, do_sample=False,
                          temperature=None, top_p=None, top_k=None, pad_token_id=0)[0, a.context:].tolist()
    plain_compiled = SpeculativeDecoder(base, NoDraft(), compile=True, fused=False)
    continuation = lambda text, n: plain_compiled.generate([text], n).tokens[0]
    trees = {"default-4h-25": default_tree(4, 24), **{f"chain-{k}": Tree.chain(k) for k in range(1, 9)}}

    # name -> (run() -> (tokens, Result or None, excluded seconds), decoder or None)
    methods: dict = {"hf_generate": (lambda: (hf()(), None, 0.0), None)}

    def decoder_method(dec, make=None, sampling=None):
        def run(rep=0):
            if make is not None:
                dec.drafter = make(rep)
            kw = {} if sampling is None else {"sampling": sampling,  # one seed: split and fused runs agree
                                              "generator": torch.Generator(device=dev).manual_seed(0)}
            r = dec.generate([prompt], N, **kw)
            return r.tokens[0], r, getattr(dec.drafter, "excluded_s", 0.0)
        return run, dec

    kinds = (("compiled", True),) if a.no_eager else (("eager", False), ("compiled", True))
    if not a.no_eager:
        methods["plain_eager"] = decoder_method(SpeculativeDecoder(base, NoDraft()))
    methods["plain_compiled"] = decoder_method(plain_compiled)  # the split calls (fused=False), as before
    if a.fused_step:
        methods["plain_compiled_fused"] = decoder_method(SpeculativeDecoder(base, NoDraft(), compile=True, fused=True))

    def oracles(model, tree):  # rep -> a fresh oracle drafter (its seed) for a decoder of `model`
        return lambda rep: Oracle(model, prompt, truth, tree, a.alpha, seed=rep, continuation=continuation)

    if a.chained:  # the chained step under CUDA graphs: one call per step against two
        from draftlab.drafters import build_draft, make_drafter

        torch.manual_seed(0)
        # (name, draft head config, tree): EAGLE-3 commits into buffers of its own inside the chained call (in-place
        # writes under CUDA graphs); the SSM, of llama-68m's shape (2 layers x 768), keeps the accepted path in its
        # own KV cache and drafts the next chain inside the verify call
        drafters = (("medusa", {"type": "medusa", "num_heads": 4, "num_layers": 1}, default_tree(4, 24)),
                    ("eagle3", {"type": "eagle3", "eagle": {}}, None),
                    ("ssm", {"type": "ssm", "ssm": {"num_layers": 1, "init": "random"} if a.tiny else SSM_68M},
                     Tree.chain(4)))
        modules = {kind: (build_draft(head, base).to(dev, base.dtype).eval(), tree) for kind, head, tree in drafters}
        for kind, (module, tree) in modules.items():
            for label, chained in (("split", False), ("chained", True)):
                methods[f"{kind}_compiled_fused_{label}"] = decoder_method(SpeculativeDecoder(
                    base, make_drafter(module, tree), compile=True, fused=True, chained=chained))
    steps = (("", False), ("_fused", True)) if a.fused_step else (("", False),)
    if a.fuse_projections:  # on a copy: the oracle holds its base, and fusing is a property of the model object
        fused_base = copy.deepcopy(base)
        for label, fused in steps:
            methods[f"plain_compiled_fuseproj{label}"] = decoder_method(SpeculativeDecoder(
                fused_base, NoDraft(), compile=True, fuse=True, fused=fused))
    for name in a.trees:
        make = oracles(base, trees[name])
        for kind, compiled in kinds:
            methods[f"oracle_{name}_{kind}"] = decoder_method(SpeculativeDecoder(base, make(0), compile=compiled,
                                                                                 fused=False), make)
        if a.fused_step:
            methods[f"oracle_{name}_compiled_fused"] = decoder_method(
                SpeculativeDecoder(base, make(0), compile=True, fused=True), make)
    if a.fuse_projections:
        make = oracles(fused_base, trees["default-4h-25"])
        for label, fused in steps:
            methods[f"oracle_default-4h-25_compiled_fuseproj{label}"] = decoder_method(
                SpeculativeDecoder(fused_base, make(0), compile=True, fuse=True, fused=fused), make)
    if a.sampled:
        from draftlab.decode.acceptance import Sampling

        s = Sampling(temperature=0.8)
        for label, fused in (("", False), ("_fused", True)):
            methods[f"plain_compiled{label}_sampled"] = decoder_method(
                SpeculativeDecoder(base, NoDraft(), compile=True, fused=fused), sampling=s)
    if a.sampled and a.chained:
        for label, chained in (("split", False), ("chained", True)):
            methods[f"medusa_compiled_fused_{label}_sampled"] = decoder_method(SpeculativeDecoder(
                base, make_drafter(*modules["medusa"]), compile=True, fused=True, chained=chained), sampling=s)
    if not a.no_hf_compile:
        from transformers import CompileConfig

        cc = CompileConfig(mode="reduce-overhead" if dev == "cuda" else "default")
        cc._compile_all_devices = True  # on a CPU too (the smoke test)
        methods["hf_static_compiled"] = (lambda: (hf(cache_implementation="static", compile_config=cc)(), None, 0.0),
                                         None)

    if a.only:  # a name these options did not add (--no-hf-compile, a typo) is reported and left out
        for m in a.only:
            if m not in methods:
                res["errors"][m] = f"not run: --only names it, these options do not add it (they add {list(methods)})"
                print(res["errors"][m], flush=True)
        methods = {m: methods[m] for m in a.only if m in methods}

    def timed_run(fn, *args):
        sync()
        t0 = time.perf_counter()
        toks, r, excluded = fn(*args)
        sync()
        return time.perf_counter() - t0 - excluded, toks, r

    # Warm-up (compiles), in order: a method that fails is reported and left out of the timed rounds.
    live = {}
    for name, (fn, dec) in methods.items():
        if a.deadline is not None and time.perf_counter() - t_start > a.deadline:
            res["errors"][name] = f"skipped: past --deadline {a.deadline:g} s"
            continue
        try:
            before = dec.compile_s if dec is not None else 0.0  # decoders of one base share its compiled forward
            skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
            wall, toks, r = timed_run(fn)
            live[name] = []
            res["methods"][name] = {"warmup_s": round(wall, 2),
                                    "compile_s": round(dec.compile_s - before, 2) if dec is not None else None}
            skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - skips
            if skips:  # graphs compiled in this warm-up that run without CUDA graphs (inductor says why in its log)
                res["methods"][name]["cudagraph_skips"] = skips
            if dec is not None and dec.compile_failed:
                res["methods"][name]["compile_failed"] = dec.compile_failed
            print(name, "warm-up", res["methods"][name], flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on with the other methods
            res["errors"][name] = f"{type(e).__name__}: {e}"[:500]
            print(f"{name} failed in its warm-up:\n{traceback.format_exc()}", flush=True)
        save()

    def summarize(final: bool) -> list | None:
        """Rows from the runs so far (saved after every round: a run cut short keeps its rounds)."""
        hf_tokens, picked = None, {}  # picked: each method's median run's tokens
        for name, runs in live.items():
            wall, toks, r = sorted(runs, key=lambda x: x[0])[len(runs) // 2]
            picked[name] = toks
            if name == "hf_generate":
                hf_tokens = toks
            row = res["methods"][name]
            row.update(tokens_per_s=round(N / wall, 1), ms_per_token=round(1000 * wall / N, 3),
                       runs_tokens_per_s=[round(N / w, 1) for w, _, _ in runs])
            diff = next((i for i, (x, y) in enumerate(zip(toks, truth)) if x != y), None)
            row.update(identical_to_hf=diff is None and len(toks) == N, first_difference=diff)
            if r is not None:
                prefill = r.time_s.get("prefill", 0.0)  # the target's step time leaves the prompt's forward out
                row.update(steps=r.steps, chained_steps=r.chained_steps, accept_length=round(r.accept_length, 3),
                           ms_per_step=round(1000 * wall / r.steps, 3), prefill_ms=round(1000 * prefill, 2),
                           decode_ms_per_step=round(1000 * (wall - prefill) / r.steps, 3),
                           phases_ms_per_step={k: round(1000 * v / r.steps, 3) for k, v in r.time_s.items()
                                               if k != "prefill"})
                drafter = methods[name][1].drafter
                if hasattr(drafter, "resyncs"):
                    row["bf16_resyncs"] = drafter.resyncs
            if final:
                print(name, row, flush=True)
        speed = {m: row["tokens_per_s"] for m, row in res["methods"].items() if "tokens_per_s" in row}
        fastest = max((m for m in speed if m.startswith(("hf_", "plain_")) and not m.endswith("_sampled")),
                      key=speed.get, default=None)
        res["fastest_plain"] = fastest
        for name, row in res["methods"].items():
            if name in speed:
                if "hf_generate" in speed:
                    row["vs_hf_generate"] = round(speed[name] / speed["hf_generate"], 3)
                if fastest:
                    row["vs_fastest_plain"] = round(speed[name] / speed[fastest], 3)
                if name.startswith(("plain", "hf")) and bw:
                    # a plain step reads every weight once: its bandwidth bound over its measured time
                    row["bandwidth_share"] = round(weights / (row["ms_per_token"] / 1000) / bw, 3)
                    if "decode_ms_per_step" in row:  # per decoding step, the prefill left out (issue 20's target)
                        row["bandwidth_share_decode"] = round(weights / (row["decode_ms_per_step"] / 1000) / bw, 3)
        if final:  # each fused (chained) method against its split one: the first token where their outputs part
            parts = {}
            for name, toks in picked.items():
                other = next((o for o in (name.replace("_fused", "", 1), name.replace("_chained", "_split"))
                              if o != name and o in picked), None)
                if other is not None:
                    parts[f"{name} vs {other}"] = next(
                        (i for i, (x, y) in enumerate(zip(toks, picked[other])) if x != y), None)
            res["first_difference_from_split"] = parts
            res["sampled_agree"] = {k: v is None for k, v in parts.items() if k.endswith("_sampled")}
        save()
        return hf_tokens

    for rep in range(a.reps):
        for name in list(live):
            fn, dec = methods[name]
            try:
                live[name].append(timed_run(fn, *([rep] if dec is not None else [])))
            except Exception as e:  # noqa: BLE001
                res["errors"][name] = f"{type(e).__name__}: {e}"[:500]
                print(f"{name} failed:\n{traceback.format_exc()}", flush=True)
                del live[name]
        summarize(final=False)
    hf_tokens = summarize(final=True)

    # The compiled verify forward alone: the same decoder's static cache, graph and window, outside the loop, at a
    # length the run went through (the same attention window).
    verifies, alone = {}, {}
    for name in ("plain_compiled", "plain_compiled_fuseproj", *(f"oracle_{t}_compiled" for t in a.trees)):
        if name not in live:
            continue
        try:  # the forward as the loop times it (mask included), less going back to the length (timed apart)
            tree = Tree.from_paths([]) if name.startswith("plain") else trees[name[len("oracle_"):-len("_compiled")]]
            size, verify, back = verifies[name] = verify_call(methods[name][1], tree, a.context + N // 2, dev)
            ms = timed(verify, reps=20, warmup=3) - timed(back, reps=20, warmup=3)
            inside = res["methods"][name]["phases_ms_per_step"]["verify"]
            alone[name] = {"tree_size": size, "alone_ms": round(ms, 3), "in_loop_ms": inside,
                           "in_loop_over_alone": round(inside / ms, 3)}
            print("verify alone", name, alone[name], flush=True)
        except Exception as e:  # noqa: BLE001
            res["errors"][f"verify_alone_{name}"] = f"{type(e).__name__}: {e}"[:500]
            print(traceback.format_exc(), flush=True)
    res["verify_alone"] = alone
    # The drafting call alone (the split methods whose proposal leaves the drafter's state as it was), against the
    # draft phase in the loop; its kernels are profiled with the verify forwards'.
    res["draft_alone"] = {}
    for name in (n for n in DRAFT_ALONE if n in live):
        try:
            size, draft, _ = verifies[f"{name} (drafting call)"] = draft_call(methods[name][1], dev)
            ms, inside = timed(draft, reps=20, warmup=3), res["methods"][name]["phases_ms_per_step"]["draft"]
            res["draft_alone"][name] = {"tree_size": size, "alone_ms": round(ms, 3), "in_loop_ms": inside}
            print("draft alone", name, res["draft_alone"][name], flush=True)
        except Exception as e:  # noqa: BLE001
            res["errors"][f"draft_alone_{name}"] = f"{type(e).__name__}: {e}"[:500]
            print(traceback.format_exc(), flush=True)
    if a.profile:
        try:
            res["profile"] = profile(base, verifies, dev)
            print("profile", json.dumps(res["profile"], indent=1), flush=True)
        except Exception as e:  # noqa: BLE001
            res["errors"]["profile"] = f"{type(e).__name__}: {e}"[:500]
            print(traceback.format_exc(), flush=True)
    res["inductor_counters"] = dict(torch._dynamo.utils.counters["inductor"])  # cudagraph_skips among them
    res["identical_hf_vs_truth"] = hf_tokens == truth[:N] if hf_tokens is not None else None
    save()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
