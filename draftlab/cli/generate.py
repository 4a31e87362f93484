"""`draftlab generate`: speculative decoding with an export, optionally compared with plain decoding."""

from __future__ import annotations

import json
import sys

from ..serve.generate import load_decoder, run_generate
from .args import (DEVICE_HELP, DTYPE_HELP, SEED_HELP, add_compile_cache_arg, add_placement_args, add_typical_args,
                   non_negative_float, positive_int, sampling_from_args)


def add_generate_args(p) -> None:
    p.add_argument("export", help="export directory (OUTPUT_DIR/export of a training run), or `lookup` / `lookup:N` "
                                  "for prompt-lookup drafting with --base")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--tree", default=None,
                   help="'default', 'kind' (the kind's tree where the export grew its own), 'chain', 'chain:N', "
                        "'expansion:K1,K2,...' (SpecInfer), 'dynamic:DEPTH,TOP_K,TOTAL' "
                        "(EAGLE-2 dynamic trees, eagle3 exports), a tree file (JSON/YAML), FILE.py:NAME (a list "
                        "assigned in a Python file, e.g. Medusa's medusa_choices.py) or inline paths, e.g. "
                        "'[[0], [1], [0, 0]]'")
    p.add_argument("--base", default=None, help="base model path or hub id (default: the one the export names)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"], help=DTYPE_HELP)
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    add_typical_args(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens decoded per prompt")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    p.add_argument("--compare", action="store_true", help="also run plain decoding of the base and report speedup")
    p.add_argument("--stream", action="store_true", help="print text as it is committed (batch of one)")
    p.add_argument("--compile", action="store_true",
                   help="static-shape decoding (static KV cache, trees padded to the drafter's node budget) with "
                        "torch.compile (CUDA graphs on a GPU); same tokens as the default eager path. The first "
                        "call compiles (reported as compile_s); with --compare, also plain decoding compiled")
    add_compile_cache_arg(p)
    p.add_argument("--seed", type=int, default=0, help=SEED_HELP)
    p.add_argument("--ensemble-mode", choices=["merge", "vote"], default=None,
                   help="ensemble exports: merged trees (SpecInfer) or weighted-majority vote (Minions)")
    p.add_argument("--node-budget", type=positive_int, default=None, help="ensemble exports, merge: tokens per tree")
    p.add_argument("--length", type=positive_int, default=None, help="ensemble exports, vote: chain length")
    p.add_argument("--adaptive", action="store_true", default=None,
                   help="ensemble exports, vote: adapt the chain length online (Minions)")
    p.add_argument("--ensemble-option", action="append", default=[], metavar="NAME=VALUE",
                   help="ensemble exports: a scheduler / vote / adaptive-length parameter, e.g. reward_factor=1.5 "
                        "(repeatable; names and defaults: the Ensembles section of docs/drafters.md)")
    add_placement_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def generate_command(a) -> int:
    sampling = sampling_from_args(a)  # before loading anything: a bad flag fails fast
    if a.stream and a.json:
        raise ValueError("--stream prints the text as it is committed, --json one object at the end: pick one")
    if a.stream and len(a.prompt) > 1:  # (the rows' text would interleave in one stream)
        raise ValueError(f"--stream prints one text as it is committed: give one --prompt (got {len(a.prompt)}), "
                         "or leave --stream out to print each row's text at the end")
    options = {}
    for item in a.ensemble_option:
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--ensemble-option {item!r}: expected NAME=VALUE, e.g. reward_factor=1.5")
        options[name.strip()] = value.strip()
    decoder, tok, _ = load_decoder(a.export, a.base, a.tree, a.dtype, a.device, a.tp, a.device_map,
                                   mode=a.ensemble_mode,
                                   node_budget=a.node_budget, length=a.length, adaptive=a.adaptive,
                                   options=options or None, compile=a.compile)
    on_text = None
    if a.stream and not a.json:
        on_text = lambda b, delta: (sys.stdout.write(delta), sys.stdout.flush())
    if a.compile and not a.json:
        print("compiling the decode steps for these shapes (the warm-up; its time is reported below, not in the "
              "figures)...", file=sys.stderr, flush=True)
    rep = run_generate(decoder, tok, a.prompt, a.max_new_tokens, sampling, a.compare, a.chat, a.stop, a.seed, on_text)
    rep.pop("tokens")
    if a.json:
        print(json.dumps(rep))
        return 0
    if a.stream:
        print()
    else:
        for t in (rep["text"] if isinstance(rep["text"], list) else [rep["text"]]):
            print(t)
    line = f"\n{rep['new_tokens']} tokens in {rep['steps']} steps, accept length {rep['accept_length']:.2f}, " \
           f"{rep['tokens_per_s']:.1f} tokens/s"
    if rep["compiled"]:
        cache = rep["compile_cache"]
        line += (f"; warm-up {rep['warmup_s']:.1f} s ({cache['hits']} compiled graphs loaded from the on-disk cache, "
                 f"{cache['misses']} built)")
    if a.compare and "compiled_plain_tokens_per_s" in rep:  # the fair comparison first: both compiled
        line += (f"; speedup {rep['speedup_vs_compiled_plain']:.2f}x over compiled plain decoding "
                 f"({rep['compiled_plain_tokens_per_s']:.1f} tokens/s), {rep['speedup']:.2f}x over HF's eager "
                 f"generate ({rep['baseline_tokens_per_s']:.1f} tokens/s)")
    elif a.compare:
        line += f"; plain decoding {rep['baseline_tokens_per_s']:.1f} tokens/s, speedup {rep['speedup']:.2f}x"
    if a.compare:
        if "identical_to_baseline" in rep:
            line += f", identical to plain greedy: {rep['identical_to_baseline']}"
            dtype = str(next(decoder.base.parameters()).dtype).removeprefix("torch.")
            if rep["identical_to_baseline"] is False and dtype in ("bfloat16", "float16"):
                line += (f"\n(in {dtype} a forward over a tree rounds otherwise than a one-token step, so where "
                         "the base's top two logits nearly tie the two greedy paths can part; `--dtype float32` "
                         "compares token for token)")
        # One prompt, both loops draftlab's on the compiled path: a step verifies at least one token at no less than
        # a plain step's cost, so the speedup is at most the accept length. (With several prompts the rows' lengths
        # differ, and HF's eager steps cost otherwise than draftlab's: no such bound.)
        fair = rep.get("speedup_vs_compiled_plain")
        if fair is not None and rep["batch_size"] == 1 and fair > rep["accept_length"]:
            line += (f"\nnote: a speedup of {fair:.2f}x over compiled plain decoding, above the accept length "
                     f"({rep['accept_length']:.2f} tokens a step), is most likely not speculation's: the plain run was "
                     "slowed by something else on this machine; run --compare again")
        if "compiled_plain_tokens_per_s" in rep:
            if rep["speedup_vs_compiled_plain"] < 1 and not a.export.startswith("lookup"):
                line += (f"\nplain decoding is faster on this machine with this tree: `draftlab search-tree "
                         f"{a.export} --data FILE --compile` times trees on the compiled path and picks the fastest")
    print(line, file=sys.stderr)
    return 0
