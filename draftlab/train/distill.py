"""Self-distilled data: the base answers a dataset's prompts (or continues its texts), in this process or through
OpenAI-compatible servers (vLLM, SGLang, TGI); drafts then train on the base's own text.

Output: one JSON record per line with `source_index` (the record of the prompts file it came from, which is how
a killed run resumes): ShareGPT `conversations` (chat mode) or `text` (text mode), the same either way. An answer
(a turn) or text the length limit cut before the base ended it carries `"truncated": true`, so training does not
learn an end of turn where the base had none (data.tokenize_chat, data.pack_text).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from ..data import DataError, detect_format, plain_messages, prompt_turns, read_records, to_messages
from ..progress import progress
from .run_dir import resume_records


def _base_args(base_or_recipe: str, dtype: str | None, chat_template: str | None) -> tuple[str, str, str | None]:
    """(base, dtype, chat template): a recipe's base section, where those given are not."""
    if base_or_recipe.endswith((".yaml", ".yml")):
        from ..config import load_recipe

        r = load_recipe(base_or_recipe)
        return r.base.name_or_path, dtype or r.base.dtype, chat_template or r.base.chat_template
    return base_or_recipe, dtype or ("bfloat16" if torch.cuda.is_available() else "float32"), chat_template


def text_prefix(text: str, chars: int) -> str:
    """The first `chars` characters of a text, cut back to a word boundary."""
    head = text[:chars]
    return head.rsplit(" ", 1)[0] if " " in head and len(text) > chars else head


def prompts_of(path: str, max_records: int | None = None, mode: str = "chat", prompt_chars: int = 64,
               all_turns: bool = False) -> list[tuple[int, object]]:
    """(record index, prompt) per usable record, the index counted over every record read (a folder's files one
    after the other). chat: the messages up to the first assistant turn (all of a record without one), or with
    all_turns the whole conversation (its assistant turns are regenerated); text: the opening of the text, or the
    last message before the first assistant turn, whole."""
    out = []
    # i: the record's place among all records read (a folder's files one after the other), which names it in the
    # output (source_index) and on resume; a file's own numbering would repeat from file to file.
    for i, (_, _, rec) in enumerate(read_records(path, max_records=max_records, field="--prompts")):
        fmt = detect_format(rec)
        try:
            if mode == "text":
                out.append((i, text_prefix(rec["text"], prompt_chars) if fmt == "text"
                            else prompt_turns(to_messages(rec, fmt, need_answer=False))[-1]["content"]))
            elif fmt == "text":
                out.append((i, [{"role": "user", "content": rec["text"]}]))
            else:
                msgs = to_messages(rec, fmt, need_answer=False)
                out.append((i, msgs if all_turns else prompt_turns(msgs)))
        except (DataError, KeyError, TypeError):
            continue
    return out


# --- where answers come from ----------------------------------------------------------------------

class LocalModel:
    """The base in this process, batched (greedy by default)."""

    def __init__(self, name: str, dtype: str, device: str | None, max_new_tokens: int, temperature: float,
                 top_p: float, chat_template: str | None = None):
        from ..base import load_base, stop_token_ids

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.tok = load_base(name, dtype, self.device, chat_template=chat_template)
        self.tok.padding_side = "left"
        self.stops = stop_token_ids(self.model, self.tok)  # the tokenizer's EOS as well as generation_config's
        self.kw = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=self.tok.pad_token_id,
                       eos_token_id=self.stops or None)
        self.kw.update(dict(temperature=temperature, top_p=top_p) if temperature > 0 else
                       dict(temperature=None, top_p=None, top_k=None))
        self.said_context = False

    def _context(self) -> int | None:
        from ..drafters.base import base_context

        return base_context(self.model)

    @torch.no_grad()
    def answer(self, prompts: list) -> list[tuple[str, bool] | None]:
        """Chat prompts (message lists) -> answers; text prompts (strings) -> prompt + continuation; each with
        whether max_new_tokens or the base's context cut it (no stop token came). None for a prompt that alone fills
        the context. Rows whose prompt leaves less room than max_new_tokens generate apart, each to its own room,
        so one long prompt does not shorten a batch's other answers."""
        chat = isinstance(prompts[0], list)
        texts = ([self.tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
                 if chat else prompts)
        new, ctx = self.kw["max_new_tokens"], self._context()
        room = [new] * len(texts)
        if ctx:
            lengths = [len(ids) for ids in self.tok(texts, add_special_tokens=not chat).input_ids]
            room = [min(new, ctx - n) for n in lengths]
            if min(room) < new and not self.said_context:
                self.said_context = True
                what = "an answer" if chat else "a continuation"  # (text mode spoke of answers: walk-through)
                print(f"note: the base's context is {ctx} tokens: {what} stops where its prompt and it fill the "
                      f"context, before --max-new-tokens {new}, and counts as cut; a prompt that fills it alone is "
                      "skipped", file=sys.stderr)
        out: list = [None] * len(texts)
        for r in sorted(set(room)):
            rows = [j for j, m in enumerate(room) if m == r]
            if r >= 1:
                for j, got in zip(rows, self._generate([texts[j] for j in rows], chat, r)):
                    out[j] = got
        return out

    def _generate(self, texts: list[str], chat: bool, max_new_tokens: int) -> list[tuple[str, bool]]:
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=not chat).to(self.device)
        gen = self.model.generate(**enc, **{**self.kw, "max_new_tokens": max_new_tokens})[:, enc["input_ids"].shape[1]:]
        out = []
        for j, ids in enumerate(gen):
            cut = not any(t in self.stops for t in ids.tolist())
            if chat:
                out.append((self.tok.decode(ids, skip_special_tokens=True).strip(), cut))
            else:  # decoded with the prompt's ids, so word boundaries come out as the base made them
                own = enc["input_ids"][j][enc["attention_mask"][j].bool()].tolist()
                out.append((self.tok.decode(own + ids.tolist(), skip_special_tokens=True), cut))
        return out


class Endpoints:
    """OpenAI-compatible servers (`/v1/chat/completions`, `/v1/completions`), several requests at once.

    Requests go round-robin over the endpoints; a failed request (connection error, timeout, HTTP 429 or 5xx) is
    retried on the next endpoint after a backoff of 0.5 s doubling up to 30 s; other HTTP errors (a wrong model
    name, a prompt over the server's context) stop the run with the server's message.
    """

    def __init__(self, urls: list[str], model: str | None, max_new_tokens: int, temperature: float, top_p: float,
                 concurrency: int = 8, retries: int = 5, timeout: float = 600.0, seed: int = 0):
        self.urls = [u.rstrip("/") + ("" if u.rstrip("/").endswith("/v1") else "/v1") for u in urls]
        self.params = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
        self.concurrency, self.retries, self.timeout = concurrency, retries, timeout
        self.model = model or self._served_model()
        self.next = 0
        self.stopped = threading.Event()  # set when a batch fails or is interrupted: requests in flight end there

    def _served_model(self) -> str:
        for url in self.urls:
            try:
                with urllib.request.urlopen(url + "/models", timeout=30) as r:
                    return json.loads(r.read())["data"][0]["id"]
            except (OSError, KeyError, IndexError, ValueError):
                continue
        raise DataError(f"--endpoint {', '.join(self.urls)}: no server answered GET /v1/models; check the address, "
                        "or name the model with --model")

    def _post(self, start: int, route: str, body: dict) -> dict:
        last = None
        for attempt in range(self.retries + 1):
            if self.stopped.is_set():
                raise DataError("stopped: another request of the batch failed or the run was interrupted")
            url = self.urls[(start + attempt) % len(self.urls)] + route
            req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:300]
                if e.code != 429 and e.code < 500:
                    raise DataError(f"{url}: HTTP {e.code}: {detail}") from None
                last = f"HTTP {e.code} from {url}: {detail}"
            except (OSError, ValueError) as e:  # refused, reset, timed out, not JSON
                last = f"{url}: {type(e).__name__}: {e}"
            if attempt < self.retries:
                time.sleep(min(0.5 * 2 ** attempt, 30.0))
        raise DataError(f"request failed after {self.retries + 1} tries ({last}). Records written so far stay in the "
                        "output file; run the same command again to resume")

    def _one(self, job: tuple[int, object]) -> tuple[str, bool]:
        """(answer, whether max_tokens cut it: the server's finish_reason "length")."""
        start, prompt = job
        if isinstance(prompt, list):
            r = self._post(start, "/chat/completions", {"model": self.model, "messages": prompt, **self.params})
            return r["choices"][0]["message"]["content"].strip(), r["choices"][0].get("finish_reason") == "length"
        r = self._post(start, "/completions", {"model": self.model, "prompt": prompt, **self.params})
        return prompt + r["choices"][0]["text"], r["choices"][0].get("finish_reason") == "length"

    def answer(self, prompts: list) -> list[tuple[str, bool]]:
        jobs = [(self.next + j, p) for j, p in enumerate(prompts)]
        self.next += len(prompts)
        pool = ThreadPoolExecutor(max_workers=self.concurrency)
        try:
            futures = [pool.submit(self._one, job) for job in jobs]
            wait(futures, return_when=FIRST_EXCEPTION)  # (the first failure, not the first request's retries)
            for f in futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()
            return [f.result() for f in futures]
        except BaseException:  # Ctrl-C or a failed request: the requests not sent are dropped and those in flight
            self.stopped.set()  # are not retried, rather than each waited for (up to timeout x tries) before the
            raise  # error is raised
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


# --- the run ----------------------------------------------------------------------------------------

def _regenerate(source, items: list[tuple[int, object]], mode: str, all_turns: bool) -> list[dict]:
    """Records for a chunk of prompts: text continuations, first answers, or every assistant turn regenerated in
    order (each answer sees the base's own earlier answers), turn t of all conversations in one batch. A prompt the
    base cannot answer (it fills the context alone) gives no record; with all_turns, its conversation ends before
    that turn (no record if it has no answer)."""
    if mode == "text":
        return [{"source_index": i, "text": a[0], **_cut(a[1])}
                for (i, _), a in zip(items, source.answer([p for _, p in items])) if a is not None]
    if not all_turns:
        answers = source.answer([p for _, p in items])
        return [{"source_index": i, "conversations": _sharegpt(p + [{"role": "assistant", "content": a[0],
                                                                    **_cut(a[1])}])}
                for (i, p), a in zip(items, answers) if a is not None]
    convs = [[m for m in msgs if m["role"] == "system"] for _, msgs in items]
    users = [[m for m in msgs if m["role"] == "user"] for _, msgs in items]
    ended = set()
    for t in range(max(len(u) for u in users)):
        active = [j for j, u in enumerate(users) if t < len(u) and j not in ended]
        if not active:
            break
        answers = source.answer([plain_messages(convs[j] + [users[j][t]]) for j in active])
        for j, a in zip(active, answers):
            if a is None:
                ended.add(j)
            else:
                convs[j] += [users[j][t], {"role": "assistant", "content": a[0], **_cut(a[1])}]
    return [{"source_index": i, "conversations": _sharegpt(c)} for (i, _), c in zip(items, convs)
            if any(m["role"] == "assistant" for m in c)]


def _truncated(record: dict) -> int:
    """How many of a record's answers the length limit cut."""
    return sum(bool(t.get("truncated")) for t in record.get("conversations", [record]) if isinstance(t, dict))


def _cut(truncated: bool) -> dict:
    return {"truncated": True} if truncated else {}


def _sharegpt(msgs: list[dict]) -> list[dict]:
    return [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"],
             **_cut(m.get("truncated", False))} for m in msgs]


def distill_data(base_or_recipe: str | None, prompts_file: str, out_file: str, max_new_tokens: int = 512,
                 temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 8, max_records: int | None = None,
                 dtype: str | None = None, device: str | None = None, seed: int = 0, mode: str = "chat",
                 prompt_chars: int = 64, all_turns: bool = False, endpoints: list[str] | None = None,
                 model: str | None = None, concurrency: int = 8, retries: int = 5, timeout: float = 600.0,
                 chat_template: str | None = None) -> dict:
    """Generate with the base (in this process, or through `endpoints`) and append records to out_file; records
    already there are skipped, so a killed run resumes.

    mode chat: the base answers each record's messages before its first assistant turn (or, with all_turns,
    every user turn in order, seeing its own earlier answers) through its chat template; ShareGPT conversations
    out. mode text (bases without a chat format): the base continues the first prompt_chars characters of each
    text; {"text"} out. chat_template: what the base renders prompts with in this process (base.chat_template's
    values; default: a recipe's, else the tokenizer's own); servers render with their own."""
    if mode not in ("chat", "text"):
        raise DataError(f"--mode {mode!r}: use chat or text")
    if all_turns and mode != "chat":
        raise DataError("--all-turns regenerates the assistant turns of conversations; it needs --mode chat")
    if endpoints and chat_template:
        raise DataError("--chat-template renders prompts in this process; servers render with their own (vLLM, "
                        "SGLang: start them with --chat-template)")
    todo = prompts_of(prompts_file, max_records, mode, prompt_chars, all_turns)
    if mode == "chat" and todo and isinstance(todo[0][1], list) and str(prompts_file).endswith(".txt"):
        print(f"note: {prompts_file} holds plain text: in --mode chat each document is asked whole as one user turn; "
              "--mode text continues their openings instead", file=sys.stderr)
    if not todo:
        raise DataError(f"{prompts_file}: no prompts found (expected ShareGPT, Alpaca or text records)")
    out = Path(out_file)
    done, truncated = set(), 0
    for n, record in enumerate(resume_records(out), 1):  # (a line a killed run tore is dropped first)
        if not isinstance(record, dict) or "source_index" not in record:
            raise DataError(f"{out}: record {n} is not one this command wrote (no source_index); write to a new "
                            "--out file")
        done.add(record["source_index"])
        truncated += _truncated(record)  # (the file's count: a resumed run counted only its own records)
    todo = [(i, m) for i, m in todo if i not in done]
    torch.manual_seed(seed)
    if endpoints:
        source = Endpoints(endpoints, model, max_new_tokens, temperature, top_p, concurrency, retries, timeout, seed)
        name, chunk = f"{source.model} at {', '.join(source.urls)}", max(batch_size, 4 * concurrency)
    else:
        if not base_or_recipe:
            raise DataError("give the base (a model path / hub id or a recipe) or --endpoint URL")
        name, dt, template = _base_args(base_or_recipe, dtype, chat_template)
        source, chunk = LocalModel(name, dt, device, max_new_tokens, temperature, top_p, template), batch_size
    written = unanswered = 0
    with open(out, "a") as f, progress(total=len(todo) + len(done), initial=len(done), desc="distill",
                                       unit="prompt") as bar:
        for s in range(0, len(todo), chunk):
            items = todo[s:s + chunk]
            recs = _regenerate(source, items, mode, all_turns)
            unanswered += len(items) - len(recs)
            for rec in recs:
                f.write(json.dumps(rec) + "\n")
                written += 1
                truncated += _truncated(rec)
            f.flush()
            bar.update(len(items))
    return {"out": str(out), "written": written, "skipped_existing": len(done), "base": name,
            "truncated": truncated, "too_long": unanswered}
