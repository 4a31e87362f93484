"""Distributed speculative inference (DSI, Timor et al.) as processes: one drafter (this process) and `sp` target
servers (worker processes), greedy, lossless.

The drafter never waits for verification. From the last verified token on, a verification task goes to a free
target server at once (no drafts: the target's own next token) and again after every `lookahead` drafted
tokens (verifying all drafts so far), while the drafter keeps drafting as if everything is accepted. Results are
read in the order the tasks were sent; the first one that finds a draft different from the target's token (or
the target's token after its last draft, when the drafter has gone no further) decides: the drafts up to it and
the target's token are committed, every task and draft built past it is preempted (servers drop work of an old
epoch, including the one they are sleeping through), and drafting restarts from the corrected token. Every
committed token is the target's greedy token, so the output equals plain greedy decoding.

Latencies can be injected (`target_latency_s`, `draft_latency_s`: each forward then lasts at least that long),
the way the DSI authors emulate a multi-GPU node on one machine; `draftlab simulate` predicts the same runs.
Target servers here recompute the whole prefix each task (no KV cache): this module demonstrates the
orchestration and its losslessness; on GPUs each server would hold its own cached base.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Callable


def _server(base_path: str, dtype: str, tasks, results, epoch, latency: float) -> None:
    """A target server: greedy tokens for (prefix, drafts) tasks of the current epoch."""
    import torch

    from .base import load_base

    torch.set_num_threads(1)
    model, _ = load_base(base_path, dtype)
    while True:
        item = tasks.get()
        if item is None:
            return
        task_id, ep, prefix, drafts = item
        if ep != epoch.value:  # preempted while queued
            results.put((task_id, ep, None))
            continue
        t0 = time.perf_counter()
        with torch.no_grad():
            ids = torch.tensor([prefix + drafts])
            logits = model(input_ids=ids).logits[0, len(prefix) - 1:]
            toks = logits.argmax(-1).tolist()  # the target's token after prefix + drafts[:i], i = 0..len(drafts)
        while time.perf_counter() - t0 < latency:  # the emulated forward; preemption cuts it short
            if ep != epoch.value:
                break
            time.sleep(min(0.002, max(0.0, latency - (time.perf_counter() - t0))))
        results.put((task_id, ep, toks if ep == epoch.value else None))


class DSI:
    """`sp` target servers for one base; `generate` runs DSI with a drafter function."""

    def __init__(self, base_path: str, sp: int, target_latency_s: float = 0.0, dtype: str = "float32"):
        ctx = mp.get_context("spawn")
        self.epoch = ctx.Value("i", 0)
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(sp)]
        self.procs = [ctx.Process(target=_server, args=(base_path, dtype, q, self.results, self.epoch,
                                                          target_latency_s), daemon=True) for q in self.tasks]
        for p in self.procs:
            p.start()
        self.sp = sp
        self._warm()

    def _warm(self) -> None:
        """Wait until every server has loaded the base (one tiny task each)."""
        for i, q in enumerate(self.tasks):
            q.put((-1 - i, self.epoch.value, [0, 0], []))
        for _ in self.tasks:
            self.results.get(timeout=600)

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompt: list[int], max_new_tokens: int, draft_next: Callable[[list[int]], int],
                 lookahead: int, draft_latency_s: float = 0.0) -> dict:
        """Greedy DSI; draft_next(tokens) -> the drafter's next token. Returns tokens, wall time and counts."""
        if lookahead < 1:
            raise ValueError("DSI needs lookahead >= 1")
        t_start = time.perf_counter()
        committed = list(prompt)
        end = len(prompt) + max_new_tokens
        free = list(range(self.sp))
        stats = {"tasks": 0, "preemptions": 0, "server_waits": 0}
        next_id, owner = 0, {}  # task id -> the server running it (freed when it reports, preempted or not)
        while len(committed) < end:
            drafts: list[int] = []
            sent: list[tuple[int, int]] = []  # (task id, drafts it verifies) of this stretch, in send order
            got: dict[int, list[int] | None] = {}
            pending_send = 0  # drafts count at which the next task goes out
            decided = None
            while decided is None:
                # Send every task that is due, as servers allow.
                while True:
                    # The last task of the text verifies up to its end, even off the lookahead grid.
                    n_next = min(pending_send, end - len(committed))
                    if n_next > len(drafts) or (sent and n_next <= sent[-1][1]):
                        break
                    if not free:
                        stats["server_waits"] += 1
                        break
                    w = free.pop(0)
                    self.tasks[w].put((next_id, self.epoch.value, committed, drafts[:n_next]))
                    sent.append((next_id, n_next))
                    owner[next_id] = w
                    next_id += 1
                    stats["tasks"] += 1
                    pending_send += lookahead
                # Read what has come back (without blocking while there is drafting to do).
                block = len(committed) + len(drafts) >= end or (free == [] and pending_send <= len(drafts))
                block = block and bool(owner)  # something is in flight to wait for
                try:
                    item = self.results.get(timeout=0.5) if block else self.results.get_nowait()
                    while True:
                        tid, ep, toks = item
                        free.append(owner.pop(tid))
                        if ep == self.epoch.value and toks is not None:
                            got[tid] = toks
                        item = self.results.get_nowait()
                except queue.Empty:
                    pass
                # Decide in send order.
                for tid, n in sent:
                    if tid not in got:
                        break
                    toks = got[tid]
                    bad = next((i for i in range(n) if drafts[i] != toks[i]), None)
                    if bad is not None:
                        decided = drafts[:bad] + [toks[bad]]
                        break
                    if len(drafts) == n or drafts[n] != toks[n] or len(committed) + n + 1 >= end:
                        decided = drafts[:n] + [toks[n]]
                        break
                if decided is not None:
                    break
                # Draft one more token (the drafter never waits for verification).
                if len(committed) + len(drafts) < end:
                    t0 = time.perf_counter()
                    drafts.append(draft_next(committed + drafts))
                    while time.perf_counter() - t0 < draft_latency_s:
                        time.sleep(max(0.0, draft_latency_s - (time.perf_counter() - t0)))
            with self.epoch.get_lock():
                self.epoch.value += 1  # preempts every task and draft past the decision
            stats["preemptions"] += sum(1 for tid, _ in sent if tid not in got)
            committed += decided
            # Servers still busy with preempted tasks report back with the old epoch and are freed then.
        wall = time.perf_counter() - t_start
        while owner:  # preempted tasks still report back; collect them so the next call starts with free servers
            owner.pop(self.results.get(timeout=600)[0], None)
        return {"tokens": committed[len(prompt): end], "wall_s": wall, **stats}


def si_generate(model, prompt: list[int], max_new_tokens: int, draft_next, lookahead: int,
                target_latency_s: float = 0.0, draft_latency_s: float = 0.0) -> dict:
    """Speculative inference with the same emulated latencies (draft `lookahead`, verify, repeat), greedy;
    lookahead 0 is plain (non-SI) decoding. For comparisons with DSI in one process."""
    import torch

    def wait(t0, latency):
        while time.perf_counter() - t0 < latency:
            time.sleep(max(0.0, latency - (time.perf_counter() - t0)))

    t_start = time.perf_counter()
    committed, end = list(prompt), len(prompt) + max_new_tokens
    while len(committed) < end:
        drafts = []
        for _ in range(min(lookahead, end - len(committed))):
            t0 = time.perf_counter()
            drafts.append(draft_next(committed + drafts))
            wait(t0, draft_latency_s)
        t0 = time.perf_counter()
        with torch.no_grad():
            toks = model(input_ids=torch.tensor([committed + drafts])).logits[0, len(committed) - 1:].argmax(-1).tolist()
        wait(t0, target_latency_s)
        bad = next((i for i in range(len(drafts)) if drafts[i] != toks[i]), len(drafts))
        committed += drafts[:bad] + [toks[bad]]
    return {"tokens": committed[len(prompt): end], "wall_s": time.perf_counter() - t_start}
