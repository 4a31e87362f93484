"""Tokenised examples kept in the run directory: made once by the main process, read by the other processes of
a launch and by every resume, so neither tokenises the data again (100k conversations through a chat template
take minutes, once per rank per launch without it).

The file is OUTPUT_DIR/tokenized/KEY.npz (token ids as int32 and loss masks as bytes, one flat array each, with
the examples' lengths), KEY a hash of everything the examples depend on: the data section (all but num_proc),
the split seed, the data files (path, size, modification time; a hub dataset: its id, split and the fingerprint
`datasets` gives its contents), the tokenizer (vocabulary, special ids, chat template), the transformers and
tokenizers versions and draftlab's data code. Anything else changed makes another key, and the file is made
again; a directory holds the current key's file only.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .. import data as data_mod
from ..data import DataStats, Examples, load_examples
from ..interop.export import tokenizer_fingerprint

CACHE_DIR = "tokenized"


def data_identity(path: str, split: str) -> list:
    """What names the data's contents without reading them: each local file's path, size and modification time, or
    a hub dataset's id, split and content fingerprint."""
    p = Path(path)
    if p.exists():
        return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in data_mod._files(p)]
    ds = data_mod.hub_dataset(path, split)  # (from the local cache after the first time)
    return [["hub", path, split, getattr(ds, "_fingerprint", None)]]


def examples_key(data_cfg, tok, seed: int) -> str:
    import tokenizers
    import transformers

    parts = {"data": data_cfg.model_dump(mode="json", exclude={"num_proc"}), "seed": seed,
             "files": data_identity(data_cfg.path, data_cfg.split), "tokenizer": tokenizer_fingerprint(tok),
             "versions": [transformers.__version__, tokenizers.__version__],
             "code": hashlib.sha256(Path(data_mod.__file__).read_bytes()).hexdigest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def save_examples(f: Path, train: Examples, held: Examples, stats: DataStats) -> None:
    """Write the examples to f at once (a temporary file renamed), and remove other keys' files beside it."""
    f.parent.mkdir(parents=True, exist_ok=True)
    ids, mask, lengths = (train + held).compact()
    tmp = f.with_name(f.stem + ".tmp.npz")
    np.savez(tmp, ids=ids, mask=mask, lengths=lengths, n_train=np.array(len(train)),
             stats=np.frombuffer(json.dumps(asdict(stats)).encode(), dtype=np.uint8))
    os.replace(tmp, f)
    for old in f.parent.glob("*.npz"):
        if old != f:
            old.unlink(missing_ok=True)


def read_examples(f: Path) -> tuple[Examples, Examples, DataStats]:
    with np.load(f) as z:
        every = Examples.flat(z["ids"].astype(np.int32, copy=False), z["mask"].astype(np.uint8, copy=False),
                              z["lengths"].astype(np.int64, copy=False))
        n_train, stats = int(z["n_train"]), DataStats(**json.loads(z["stats"].tobytes()))
    return every[:n_train], every[n_train:], stats


def cached_examples(data_cfg, tok, seed: int, out_dir: Path, accelerator, worker_init=None):
    """load_examples through the cache (see the module doc); every process of the launch calls it. The main
    process makes the file where it is missing while the others wait; a process that does not see it then (a
    node without the run directory) tokenises for itself."""
    f = Path(out_dir) / CACHE_DIR / f"{examples_key(data_cfg, tok, seed)}.npz"
    made = None
    if accelerator.is_main_process and not f.is_file():
        made = load_examples(data_cfg, tok, seed=seed, worker_init=worker_init)
        save_examples(f, *made)
    accelerator.wait_for_everyone()
    if made is not None:
        return made
    if f.is_file():
        return read_examples(f)
    return load_examples(data_cfg, tok, seed=seed, worker_init=worker_init)
