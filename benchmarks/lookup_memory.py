"""What a retrieval datastore costs in memory and per lookup, indexed as drafters.retrieval.Datastore (flat arrays)
and as NgramIndex (the dict of tuples the datastore was before, and the growing text's index still is), with the
lookup drafter's settings (n-grams 2..3, 8 occurrences per key), on two corpora: the TinyStories sample's training
part with stories260K's tokenizer (512 pieces: n-grams repeat a lot) and LIMA's conversations with the Llama 2
tokenizer (32,000 pieces: most n-grams are new, as in an LLM's chat data). Memory is tracemalloc's peak of the build
and what stays allocated after it; per lookup, the mean over held-out contexts; both indexes must give the same
continuations.

    python benchmarks/lookup_memory.py     # about a minute on a CPU; writes benchmarks/results/lookup_memory.json
"""

from __future__ import annotations

import gc
import time
import tracemalloc

from common import stories_base, tinystories_split, write_result

MIN_N, MAX_N, PER_KEY, LENGTH, LIMIT = 2, 3, 8, 5, 4


def measure(build):
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    index = build()
    build_s = time.perf_counter() - t0
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return index, {"build_s": round(build_s, 2), "kept_bytes": kept, "peak_bytes": peak}


def corpora():
    """{name: (training sequences, held-out sequences)}."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from transformers import LlamaTokenizer

    from common import DATA
    from draftlab.base import load_tokenizer

    tok = load_tokenizer(str(stories_base()))
    train, held = tinystories_split()
    enc = lambda t, docs: [t(d, add_special_tokens=False)["input_ids"] for d in docs]
    out = {"TinyStories sample, stories260K tokenizer (512)": (enc(tok, train), enc(tok, held[:100]))}
    with tempfile.TemporaryDirectory() as d:  # transformers converts tokenizer.model found in the folder it loads
        shutil.copy(DATA / "tokenizers" / "llama2" / "tokenizer.model", Path(d) / "tokenizer.model")
        llama = LlamaTokenizer.from_pretrained(d, legacy=False)
    lima = [r["instruction"] + "\n" + r["output"] for r in json.loads((DATA / "lima" / "lima.json").read_text())]
    cut = len(lima) * 9 // 10
    out["LIMA, Llama 2 tokenizer (32,000)"] = (enc(llama, lima[:cut]), enc(llama, lima[cut:cut + 100]))
    return out


def main() -> None:
    from draftlab.drafters.retrieval import Datastore, NgramIndex

    results = {}
    for corpus, (seqs, held) in corpora().items():
        tokens = sum(map(len, seqs))

        contexts = [h[:k] for h in held for k in (8, 16, 32) if len(h) >= k]
        rows, answers = {}, {}
        for name, build in (("flat arrays (Datastore)",
                             lambda: Datastore.from_sequences(seqs, MIN_N, MAX_N, PER_KEY)),
                            ("dict of tuples (NgramIndex)", lambda: NgramIndex.of(seqs, MIN_N, MAX_N, PER_KEY))):
            index, r = measure(build)
            t0 = time.perf_counter()
            answers[name] = [index.continuations(c, LENGTH, LIMIT) for c in contexts]
            r["us_per_lookup"] = round((time.perf_counter() - t0) / len(contexts) * 1e6, 1)
            r["kept_bytes_per_token"] = round(r["kept_bytes"] / tokens, 1)
            r["peak_bytes_per_token"] = round(r["peak_bytes"] / tokens, 1)
            rows[name] = r
            print(corpus, name, r, flush=True)
            del index
        same = len(set(map(repr, answers.values()))) == 1
        print("same continuations:", same)
        results[corpus] = {"sequences": len(seqs), "tokens": tokens, "lookups": len(contexts),
                           "same_continuations": same, "indexes": rows}
    write_result("lookup_memory", {"settings": {"min_n": MIN_N, "max_n": MAX_N, "per_key": PER_KEY,
                                                "length": LENGTH, "limit": LIMIT}, "corpora": results})


if __name__ == "__main__":
    main()
