"""Datasets -> token ids + assistant-only loss masks (ShareGPT, Alpaca, plain text)."""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

TEXT_SEPARATOR = "<|endoftext|>"
USER_ROLES = {"human": "user", "user": "user"}
ASSISTANT_ROLES = {"gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
                   "bing": "assistant", "model": "assistant"}
SYSTEM_ROLES = {"system": "system"}


class DataError(ValueError):
    """A data file or record the loader cannot use; says which and how to fix it."""


@dataclass
class DataStats:
    records: int = 0
    skipped: dict = field(default_factory=dict)  # reason -> count
    train_examples: int = 0
    eval_examples: int = 0
    train_tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0  # answers and texts marked `truncated` (distill-data: cut by its length limit), both splits
    cut_at_max_len: int = 0  # conversations kept whose end data.max_len cut off, both splits
    formats: dict = field(default_factory=dict)  # format (text, sharegpt, alpaca) -> records read as it

    def summary(self, max_len: int) -> str:
        """One line for the log: what training reads and what was left out."""
        kept = self.train_examples + self.eval_examples
        line = (f"data: {self.train_examples:,} training examples ({self.train_tokens:,} tokens, {self.loss_tokens:,} "
                f"in the loss), {self.eval_examples:,} held out, from {self.records:,} records")
        if self.cut_at_max_len:
            line += (f"; {self.cut_at_max_len:,} conversations ({self.cut_at_max_len / max(kept, 1):.0%}) longer than "
                     f"data.max_len={max_len} lost their end")
        if self.skipped:
            line += "; skipped: " + ", ".join(f"{n:,} ({why})" for why, n in self.skipped.items())
        return line

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


class Examples(Sequence):
    """Tokenised examples held as two flat arrays (token ids as int32, loss masks as bytes) with each example's
    start and end: 5 bytes a token, where Python lists of ints take about 45 (100k conversations of 1k tokens:
    0.5 GB a process, not 4.5). An item is {'input_ids': list, 'loss_mask': list}, made when asked for; a slice,
    `take` and `+` give Examples again, sharing the arrays where they can."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        self.ids, self.mask, self.starts, self.ends = ids, mask, starts, ends

    @classmethod
    def of(cls, pairs) -> "Examples":
        """From (ids, mask) pairs of sequences or arrays."""
        ids, mask = [], []
        for i, m in pairs:
            ids.append(np.asarray(i, dtype=np.int32))
            mask.append(np.asarray(m, dtype=np.uint8))
        return cls.flat(np.concatenate(ids or [np.zeros(0, np.int32)]), np.concatenate(mask or [np.zeros(0, np.uint8)]),
                        np.array([len(i) for i in ids], dtype=np.int64))

    @classmethod
    def flat(cls, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> "Examples":
        """From the examples' ids and masks laid end to end, and their lengths."""
        ends = np.cumsum(lengths, dtype=np.int64)
        return cls(ids, mask, ends - lengths, ends)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Examples(self.ids, self.mask, self.starts[i], self.ends[i])
        a, b = int(self.starts[i]), int(self.ends[i])
        return {"input_ids": self.ids[a:b].tolist(), "loss_mask": self.mask[a:b].tolist()}

    def take(self, indices) -> "Examples":
        idx = np.asarray(indices, dtype=np.int64)
        return Examples(self.ids, self.mask, self.starts[idx], self.ends[idx])

    def compact(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, mask, lengths) of these examples alone, laid end to end."""
        part = lambda a: np.concatenate([a[s:e] for s, e in zip(self.starts.tolist(), self.ends.tolist())]
                                        or [a[:0]])
        return part(self.ids), part(self.mask), self.lengths

    def __add__(self, other: "Examples") -> "Examples":
        a, b = self.compact(), other.compact()
        return Examples.flat(*(np.concatenate([x, y]) for x, y in zip(a, b)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Examples):
            return isinstance(other, Sequence) and len(self) == len(other) and list(self) == list(other)
        return len(self) == len(other) and all(np.array_equal(x, y) for x, y in zip(self.compact(), other.compact()))

    def __repr__(self) -> str:
        return f"Examples({len(self)} examples, {self.tokens()} tokens)"

    def __reduce__(self):
        """Pickled (to a worker process, say) with their own tokens only: a slice of a larger set does not carry
        the whole arrays."""
        if self.tokens() < len(self.ids):
            return Examples.flat, self.compact()
        return Examples, (self.ids, self.mask, self.starts, self.ends)

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.starts

    def tokens(self) -> int:
        return int(self.lengths.sum())

    def loss_tokens(self) -> int:
        before = np.concatenate([[0], np.cumsum(self.mask, dtype=np.int64)])
        return int((before[self.ends] - before[self.starts]).sum())


# ---------------------------------------------------------------------------------------------
# reading

def replace_text(path: str | Path, text: str) -> None:
    """path's new contents in place of the old at once: a kill meanwhile leaves the old file (or none), never part of
    the new one, which a later run would read (a tree file, a cache's fingerprint)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def rewrite_lines(path: Path, lines: list[str]) -> None:
    """path's new contents, one line each, in place of the old at once (replace_text): how a resumed run drops the
    records it redoes, or a line a killed one tore, from a file it appends to."""
    replace_text(path, "".join(l + "\n" for l in lines))


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in {".json", ".jsonl", ".txt"})
        if not files:
            raise DataError(f"data.path={str(path)!r}: folder holds no .json, .jsonl or .txt files")
        return files
    return [path]


class Malformed(str):
    """A line of a JSONL file that is not JSON, read leniently (data.on_malformed=skip): why, in place of a record."""


def _read_file(path: Path, lenient: bool = False) -> list:
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8", errors="replace")
        docs = text.split(TEXT_SEPARATOR) if TEXT_SEPARATOR in text else [text]
        return [{"text": d.strip()} for d in docs if d.strip()]
    if path.suffix == ".jsonl":
        out = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                if lenient:  # (skipped and counted like any malformed record: walk-through)
                    out.append(Malformed("a JSONL line that is not valid JSON"))  # (one reason: counted together)
                    continue
                raise DataError(f"{path} line {i + 1}: not valid JSON ({e.msg}); each line must be one record") from None
        return out
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON at line {e.lineno} ({e.msg})") from None
    if isinstance(data, dict):
        turns = data.get("conversations", data.get("messages"))
        if isinstance(turns, list) and turns and all(isinstance(t, dict) and ("from" in t or "role" in t)
                                                      for t in turns):
            return [data]  # one conversation
        for key in ("data", "train", "conversations", "records"):
            if isinstance(data.get(key), list):
                return data[key]
        raise DataError(f"{path}: a JSON object; expected a list of records (or an object with a 'data' list)")
    return data


def read_records(path: str, split: str = "train", max_records: int | None = None,
                 field: str = "data.path", lenient: bool = False) -> list[tuple[str, int, object]]:
    """(source, index, raw record) for a local file/folder or a hub dataset id; `field` names the path in errors
    (the recipe's data.path, or a command's option). lenient: a JSONL line that is not JSON is a Malformed record
    (its reason) instead of an error."""
    p = Path(path)
    out: list[tuple[str, int, object]] = []
    if p.exists():
        for f in _files(p):
            out += [(str(f), i, r) for i, r in enumerate(_read_file(f, lenient))]
            if max_records and len(out) >= max_records:
                break
    else:
        ds = hub_dataset(path, split, field)
        n = len(ds) if max_records is None else min(len(ds), max_records)
        out = [(path, i, ds[i]) for i in range(n)]
    return out[:max_records] if max_records else out


def hub_dataset(path: str, split: str, field: str = "data.path"):
    """A data.path that is no local file or folder, as a hub dataset; a path that names a file (an extension, a
    leading . or /) is refused at once, without asking the hub."""
    if path.endswith((".json", ".jsonl", ".txt")) or path.startswith((".", "/")):
        raise DataError(f"{field}={path!r}: no such file or folder (from {os.getcwd()})")
    try:
        import datasets

        return datasets.load_dataset(path, split=split)
    except Exception as e:  # the hub client raises many types; all mean "cannot get it"
        raise DataError(f"{field}={path!r}: not a local file and not loadable as a hub dataset "
                        f"(split={split!r}): {e}") from None


def detect_format(record) -> str:
    if isinstance(record, dict):
        if "conversations" in record or "messages" in record:
            return "sharegpt"
        if "instruction" in record:
            return "alpaca"
        if "text" in record:
            return "text"
    return "unknown"


def to_messages(record, fmt: str, need_answer: bool = True) -> list[dict]:
    """One raw record -> [{'role', 'content'}]; raises DataError(reason) when malformed, or (need_answer) when no
    assistant turn has text (prompts alone serve as prompts: search-tree, distill-data)."""
    if not isinstance(record, dict):
        raise DataError(f"a record must be a JSON object, got {type(record).__name__}")
    if fmt == "sharegpt":
        turns = record.get("conversations", record.get("messages"))
        if not isinstance(turns, list) or not turns:
            raise DataError("'conversations' (or 'messages') must be a non-empty list of turns")
        msgs = []
        for j, t in enumerate(turns):
            if not isinstance(t, dict):
                raise DataError(f"turn {j} is not an object")
            role = t.get("from", t.get("role"))
            content = t.get("value", t.get("content"))
            if not isinstance(role, str) or not isinstance(content, str):
                raise DataError(f"turn {j} needs string 'from'/'value' (or 'role'/'content')")
            mapped = USER_ROLES.get(role.lower()) or ASSISTANT_ROLES.get(role.lower()) or SYSTEM_ROLES.get(role.lower())
            if mapped is None:
                raise DataError(f"turn {j} has unknown role {role!r} (use human/gpt or user/assistant/system)")
            msgs.append({"role": mapped, "content": content})
            if mapped == "assistant" and t.get("truncated") is True:  # cut by a length limit (distill-data)
                msgs[-1]["truncated"] = True
        # Conversations that open with the assistant are trimmed to the first user turn (as FastChat does).
        first_user = next((j for j, m in enumerate(msgs) if m["role"] == "user"), None)
        if first_user is None:
            raise DataError("no user turn")
        system = [m for m in msgs[:first_user] if m["role"] == "system"]
        msgs = system + msgs[first_user:]
    elif fmt == "alpaca":
        inst, inp, out = record.get("instruction"), record.get("input", ""), record.get("output")
        if not isinstance(inst, str) or not isinstance(out, str):
            raise DataError("Alpaca records need string 'instruction' and 'output'")
        msgs = []
        for pair in record.get("history") or []:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise DataError("'history' must be a list of [user, assistant] string pairs")
            msgs += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        prompt = inst if not inp else f"{inst}\n\n{inp}"
        msgs += [{"role": "user", "content": prompt}, {"role": "assistant", "content": out}]
    else:
        raise DataError(f"format {fmt!r} has no messages")
    if need_answer and not has_answer(msgs):
        raise DataError(NO_ANSWER)
    return msgs


NO_ANSWER = "no non-empty assistant turn"


def has_answer(msgs: list[dict]) -> bool:
    return any(m["role"] == "assistant" and m["content"].strip() for m in msgs)


# ---------------------------------------------------------------------------------------------
# tokenising

def _located(content: str, own: str, full: str, after: int, truncated: bool = False) -> tuple[int, int]:
    """The span of an answer that a template renders otherwise when it is the conversation's last (Qwen3 shows the
    thinking of the last answer only): its text in the whole conversation, after the spans before it, with the
    end-of-turn text that follows it in its own rendering (`own`), unless the answer was truncated. An earlier
    answer whose thinking the template drops (Qwen3, DeepSeek-R1: the text after its last `</think>`) is found by
    the text it keeps, which is all the loss then covers: the thinking is in no context the model is served."""
    shown = content
    if full.find(content, after) < 0 and "</think>" in content:
        shown = content.rsplit("</think>", 1)[1].strip()
    at = full.find(shown, after) if shown else -1
    if at < 0 or content not in own:
        raise DataError("the tokenizer's chat template renders an answer differently when later turns follow it, "
                        "and its text is not found in the whole conversation, so its span cannot be located; set a "
                        "chat_template that renders earlier answers as written")
    end = at + len(shown)
    tail = own[own.rindex(content) + len(content):]
    return at, end + len(tail) if full.startswith(tail, end) and not truncated else end


def _text_end(content: str, own: str) -> int:
    """Where a truncated answer's text ends in its rendering `own` (before the end of turn the template adds)."""
    key = content.strip()
    at = own.rfind(key) if key else -1
    if at < 0:
        raise DataError("a truncated answer's text is not found in the chat template's rendering of it, so the end "
                        "of turn the template adds cannot be left out of the loss")
    return at + len(key)


def plain_messages(msgs: list[dict]) -> list[dict]:
    """Messages as a chat template or an OpenAI-compatible server takes them: role and content (no marks such as
    `truncated`)."""
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def tokenize_chat(messages: list[dict], tokenizer, max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of the conversation via the chat template, and a 0/1 mask on assistant tokens: each answer with its
    end of turn, except an answer marked `truncated` (a length limit cut it, so its end of turn is the template's,
    not the model's), which is masked up to its text's end."""
    plain = plain_messages(messages)
    _warn_fallback(tokenizer)
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    full = render(plain, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        own, cut = render(plain[: i + 1], False), m.get("truncated", False)
        if not full.startswith(own):  # (the template renders this answer otherwise when it is the last one)
            spans.append(_located(m["content"], own, full, spans[-1][1] if spans else 0, cut))
            continue
        # The answer starts after the generation prompt, or where the conversation leaves it: a template whose
        # generation prompt holds more than a rendered turn does (DeepSeek-R1's "<think>\n") would otherwise
        # leave the answer's first characters out of the loss.
        start = len(os.path.commonprefix([render(plain[:i], True), full])) if i else 0
        end = _text_end(m["content"], own) if cut else len(own)
        spans.append((min(max(start, len(render(plain[:i], False)) if i else 0), end), end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=max_len)
    ids = enc["input_ids"]
    mask = [0] * len(ids)
    k = 0
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        # A token inside an answer, or one that starts with the whitespace before it (a word's leading space merged
        # into the answer's first token).
        if k < len(spans) and b > a and (spans[k][0] <= a < spans[k][1] or
                                         a < spans[k][0] < b and not full[a:spans[k][0]].strip()):
            mask[t] = 1
    return ids, mask


FALLBACK_WARNING = ("the tokenizer has no chat template: conversations are rendered with draftlab's simple one "
                    "(User: / Assistant:), which the export keeps as chat_template.jinja for serving; set "
                    "base.chat_template (a built-in name, a file or Jinja text) for the format your base was tuned on")


def _warn_fallback(tokenizer) -> None:
    if getattr(tokenizer, "draftlab_fallback_template", False):
        warnings.warn(FALLBACK_WARNING, stacklevel=3)


PARALLEL_MIN = 2000  # conversations below which num_proc is not worth starting processes for


def tokenize_all(conversations: list[list[dict]], tokenizer, max_len: int, num_proc: int = 1,
                 worker_init=None) -> list[tuple]:
    """tokenize_chat of each conversation, in order: (ids, mask, whether max_len cut it), or (error type, message)
    where the chat template refused it. With num_proc > 1, at least PARALLEL_MIN conversations and a worker_init
    (called first in each worker: procs.die_with_parent, which the caller passes, so workers end with this
    process), in that many worker processes, each given the tokenizer once; a failure in one is raised here with
    its traceback."""
    if num_proc <= 1 or len(conversations) < PARALLEL_MIN or worker_init is None:
        return _tokenize_chunk(conversations, tokenizer, max_len)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _warn_fallback(tokenizer)  # here, once, and not in each worker (which ignore it)
    n = -(-len(conversations) // (4 * num_proc))  # 4 chunks a process: an uneven chunk does not hold up the rest
    chunks = [conversations[i:i + n] for i in range(0, len(conversations), n)]
    try:
        with ProcessPoolExecutor(num_proc, mp_context=mp.get_context("spawn"), initializer=_tokenizer_worker,
                                 initargs=(worker_init, tokenizer, max_len)) as pool:
            return [r for part in pool.map(_tokenize_chunk, chunks) for r in part]
    except BrokenProcessPool as e:  # (a worker that raised at its start printed its traceback on stderr)
        raise DataError(f"a tokenizing process (data.num_proc={num_proc}) failed or died: {e}; its traceback, if it "
                        "raised one, is on stderr above; one killed may have run out of memory (lower "
                        "data.num_proc)") from e


_WORKER: dict = {}  # in a tokenizing process: its tokenizer and max_len


def _tokenizer_worker(worker_init, tokenizer, max_len: int) -> None:
    worker_init()
    warnings.filterwarnings("ignore", message=FALLBACK_WARNING[:40])  # the parent said it once
    _WORKER.update(tokenizer=tokenizer, max_len=max_len)


def _tokenize_chunk(conversations: list, tokenizer=None, max_len: int | None = None) -> list[tuple]:
    from jinja2 import TemplateError

    tokenizer = tokenizer if tokenizer is not None else _WORKER["tokenizer"]
    max_len = max_len if max_len is not None else _WORKER["max_len"]
    out = []
    for msgs in conversations:
        try:  # (as arrays: a tenth of the memory, and quick to pass between processes)
            ids, mask = tokenize_chat(msgs, tokenizer, max_len + 1)  # (one more token tells a conversation max_len cut)
            out.append((np.asarray(ids[:max_len], dtype=np.int32), np.asarray(mask[:max_len], dtype=np.uint8),
                        len(ids) > max_len))
        except (DataError, TemplateError) as e:
            out.append((type(e).__name__, str(e)))
    return out


def pack_text(texts: list[str | tuple[str, bool]], tokenizer, max_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Documents -> BOS doc EOS stream -> blocks of max_len tokens (int32 arrays), loss on every token. A document
    given as (text, True) was cut by a length limit (distill-data's `truncated`): no EOS follows it."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    docs = [t if isinstance(t, tuple) else (t, False) for t in texts]
    encoded = tokenizer([t for t, _ in docs], add_special_tokens=False, verbose=False)["input_ids"]
    stream = np.concatenate([np.asarray(bos + ids + ([] if cut else eos), dtype=np.int32)
                             for ids, (_, cut) in zip(encoded, docs)] or [np.zeros(0, np.int32)])
    del encoded
    blocks = [stream[i:i + max_len] for i in range(0, len(stream), max_len)]
    return [(b, np.ones(len(b), dtype=np.uint8)) for b in blocks if len(b) >= 2]


def _split(items: list, eval_size: float, pick: str, seed: int, key=lambda x: x) -> tuple[list, list]:
    """(train, held out): eval_size of the items (a fraction, or a count), a seeded random choice or the last ones;
    the copies of one item (equal key) go to one side, so no held-out example is also trained on. Without copies,
    the held-out items are the last n_eval of the seeded shuffle."""
    n_eval = int(round(eval_size * len(items))) if eval_size < 1 else int(eval_size)
    n_eval = min(n_eval, max(len(items) - 1, 0))
    groups: dict = {}
    for it in items:
        groups.setdefault(key(it), []).append(it)
    order = list(groups.values())
    if pick == "random":
        random.Random(seed).shuffle(order)
    held: list = []
    while order and len(held) < n_eval and len(held) + len(order[-1]) < len(items):
        held[:0] = order.pop()
    return [it for g in order for it in g], held


def load_examples(data_cfg, tokenizer, seed: int = 0, worker_init=None) -> tuple[Examples, Examples, DataStats]:
    """Records of the recipe's data section -> (train, eval) Examples ({'input_ids', 'loss_mask'}). worker_init: what
    processes that tokenize (data.num_proc) call first (see tokenize_all)."""
    stats = DataStats()
    rows = read_records(data_cfg.path, data_cfg.split, data_cfg.max_records, lenient=data_cfg.on_malformed == "skip")
    stats.records = len(rows)
    if not rows:
        raise DataError(f"data.path={data_cfg.path!r}: no records")
    texts, convs = [], []
    for source, idx, rec in rows:
        fmt = data_cfg.format if data_cfg.format != "auto" else detect_format(rec)
        try:
            if isinstance(rec, Malformed):
                raise DataError(str(rec))
            if fmt == "text":
                if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                    seen = detect_format(rec)
                    raise DataError("text records need a string 'text' field" + (
                        f"; this one reads as {seen} (data.format={data_cfg.format} was given: data.format=auto "
                        "tells each record's format)" if data_cfg.format == "text" and seen not in ("text", "unknown")
                        else ""))
                texts.append((rec["text"], rec.get("truncated") is True))
                stats.truncated += rec.get("truncated") is True
                stats.formats[fmt] = stats.formats.get(fmt, 0) + 1
            elif fmt == "unknown":
                raise DataError("cannot tell the format (no 'conversations'/'messages', 'instruction' or 'text' key)")
            else:
                msgs = to_messages(rec, fmt, need_answer=False)
                if not has_answer(msgs):
                    stats.skip(NO_ANSWER)  # nothing to learn (an empty answer a base gave, say): counted, as a
                    continue  # conversation truncated to no answer is
                convs.append((msgs, (source, idx)))
                stats.truncated += sum(bool(m.get("truncated")) for m in msgs)
                stats.formats[fmt] = stats.formats.get(fmt, 0) + 1
        except DataError as e:
            if data_cfg.on_malformed == "skip":
                stats.skip(str(e))
                continue
            raise DataError(f"{source} record {idx}: {e}. Fix the record, or set data.on_malformed=skip "
                            "to drop such records and count them") from None
    pack = lambda docs: pack_text(docs, tokenizer, data_cfg.max_len) if docs else []
    if len(texts) == 1:  # one document (a .txt without separators): its last blocks are held out
        train_t, eval_t = _split(pack(texts), data_cfg.eval_size, "tail", seed, key=id)
    else:
        train_t, eval_t = (pack(d) for d in _split(texts, data_cfg.eval_size, data_cfg.eval_pick, seed))
    train_c, eval_c = _split(convs, data_cfg.eval_size, data_cfg.eval_pick, seed,
                             key=lambda c: json.dumps(c[0], sort_keys=True))

    done = tokenize_all([msgs for msgs, _ in train_c + eval_c], tokenizer, data_cfg.max_len, data_cfg.num_proc,
                        worker_init)  # (both splits in one go: one set of processes)

    def encode(conversations, done, blocks):
        out = list(blocks)
        for res, (_, (source, idx)) in zip(done, conversations):
            if isinstance(res[0], str):  # the chat template refused it (e.g. roles that do not alternate, under a
                if data_cfg.on_malformed == "skip":  # template that insists)
                    stats.skip(f"the chat template could not render it ({res[0]})")
                    continue
                raise DataError(f"{source} record {idx}: the chat template: {res[1]}. Fix the record, or set "
                                "data.on_malformed=skip to drop such records and count them")
            ids, mask, cut = res
            if not mask.any():
                stats.skip("no assistant tokens left after truncation to data.max_len")
                continue
            stats.cut_at_max_len += int(cut)
            out.append((ids, mask))
        return Examples.of(out)

    train, held = encode(train_c, done[:len(train_c)], train_t), encode(eval_c, done[len(train_c):], eval_t)
    if not train:
        raise DataError(f"data.path={data_cfg.path!r}: no usable training examples (skipped: {stats.skipped})")
    stats.train_examples, stats.eval_examples = len(train), len(held)
    stats.train_tokens, stats.loss_tokens = train.tokens(), train.loss_tokens()
    return train, held, stats


def prompt_turns(msgs: list[dict]) -> list[dict]:
    """The messages before the first assistant turn (all of them without one): what a model is asked to answer."""
    return msgs[:next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))]


def collate(batch: list[dict], pad_id: int) -> dict:
    """Right-pad a list of examples -> input_ids, attention_mask, loss_mask [B, S]."""
    S = max(len(e["input_ids"]) for e in batch)
    ids = torch.full((len(batch), S), pad_id, dtype=torch.long)
    att = torch.zeros((len(batch), S), dtype=torch.long)
    lm = torch.zeros((len(batch), S), dtype=torch.long)
    for b, e in enumerate(batch):
        n = len(e["input_ids"])
        ids[b, :n] = torch.tensor(e["input_ids"])
        att[b, :n] = 1
        lm[b, :n] = torch.tensor(e["loss_mask"])
    return {"input_ids": ids, "attention_mask": att, "loss_mask": lm}


def prompt_length(example: dict) -> int:
    """Tokens of an example's prompt part: those before its first supervised token (a chat example: everything
    before the first assistant token); a fully supervised text block has none, so its first half (at most 32
    tokens) stands in. At least one token, and one token left to compare."""
    mask, n = example["loss_mask"], len(example["input_ids"])
    first = next((t for t, m in enumerate(mask) if m), n)
    if first == 0:
        first = max(2, min(32, n // 2))
    return max(1, min(first, n - 1))
