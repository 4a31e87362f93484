"""A heads export's grown default tree against its kind's tree (train.grow_tree), on a quickstart run's exports.

    python benchmarks/grown_tree.py --quickstart runs/quickstart

For each heads draft of the quickstart run: what training decided (draftlab.json's training.default_tree: the
two-fold held-out check on the accept prompts), and the accept length of greedy decoding of the quickstart's
held-out prompts (the opening of each held-out file, 96 new tokens) with the export's default tree and with
`--tree kind`. Accept lengths only: no timing. Writes benchmarks/results/grown_tree_quickstart.json.
"""

from __future__ import annotations

import argparse

from common import write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quickstart", default="runs/quickstart", help="a `draftlab quickstart --out` directory")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()

    from draftlab.cli.quickstart import HEADS, PROMPT_CHARS, split_corpus, stdlib_corpus
    from draftlab.interop.export import read_meta
    from draftlab.serve.generate import encode_prompt, load_decoder

    held = split_corpus(stdlib_corpus())[1][:16]  # quickstart's held-out files, at most 16, as it decodes them
    rows = {}
    for kind in HEADS:
        export = f"{a.quickstart}/{kind}/export"
        info = read_meta(export).get("training", {}).get("default_tree")
        if info is None:
            continue  # (not a heads export, or trained without train.grow_tree)
        row = {"training": info}
        for tree in ("default", "kind"):
            dec, tok, _ = load_decoder(export, tree=tree)
            committed = steps = 0
            for d in held:
                r = dec.generate([encode_prompt(tok, d[:PROMPT_CHARS], chat=False)], max_new_tokens=a.max_new_tokens,
                                 eos_token_id=tok.eos_token_id)
                committed, steps = committed + sum(r.committed), steps + r.steps
            row[f"accept_length_{tree}_tree"] = round(committed / steps, 4)
        rows[kind] = row
        print(f"{kind}: {info['source']} (held-out check {info.get('held_out_accept_length')}); quickstart prompts: "
              f"default tree {row['accept_length_default_tree']}, kind's tree {row['accept_length_kind_tree']}")
    write_result("grown_tree_quickstart", {"quickstart": a.quickstart, "prompts": len(held),
                                           "max_new_tokens": a.max_new_tokens, "drafts": rows})


if __name__ == "__main__":
    main()
