"""Distributed speculative inference (DSI, Timor et al.) as processes: one drafter (this process) and `sp` target
servers (worker processes), greedy or sampling, lossless.

The drafter never waits for verification. From the last verified token on, a verification task goes to a free
target server at once (no drafts: the target's own next token) and again after every `lookahead` drafted
tokens (verifying all drafts so far), while the drafter keeps drafting as if everything is accepted. Results are
read in the order the tasks were sent; the first one that finds a draft different from the target's token (or
the target's token after its last draft, when the drafter has gone no further) decides: the drafts up to it and
the target's token are committed, every task and draft built past it is preempted (servers drop work of an old
epoch, including the one they are sleeping through), and drafting restarts from the corrected token. With R
tokens left the drafter drafts R - 1 at most (the target's token after them is the R-th) and the last task
verifies those, sent once they exist (off the lookahead grid unless it divides R - 1). Every committed token is
the target's greedy token, so the output equals plain greedy decoding. Sampling: the servers return the target's
distributions and each drafted position is decided once, in order, by the speculative sampling rule against the
distribution the drafter drew it from (`_decide_sampled`), so the output is a sample of the target's own
distribution.

The text ends at EOS or a stop string (`eos_token_id`, `stop`), as `draftlab generate`'s does. Worker processes
die with the drafter's process; a server that fails, dies or goes silent raises DSIError with its traceback and
closes the pool; every run starts a new epoch and task ids never repeat, so nothing of an interrupted run is
taken for the next run's. The drafter never blocks on a full server pool: a due task waits for a server while
drafting goes on, and preemption frees the servers at once (both as `draftlab simulate`'s event simulator has it).

Latencies can be injected (`target_latency_s`, `draft_latency_s`: each forward then lasts at least that long),
the way the DSI authors emulate a multi-GPU node on one machine; `draftlab simulate` predicts the same runs.
Each target server is one process with its own copy of the base on its own device (GPUs 1..SP when there are
more GPUs than servers, GPU 0 being the drafter's; else CPU) and its own KV cache, which keeps the longest common
prefix of consecutive tasks (CachedGreedy).
"""

from __future__ import annotations

import heapq
import multiprocessing as mp
import pickle
import time
from typing import Callable


class CachedGreedy:
    """A causal LM with a KV cache of the last sequence it saw: the greedy next tokens after a prefix and after
    each of the drafts that follow it, computing only what the cache does not already hold (its longest common
    prefix with the new sequence is kept; the rest is cropped and recomputed). DSI's target servers and drafter
    see sequences that mostly extend, or branch just behind, the previous one."""

    def __init__(self, model):
        self.model = model
        self.device = model.get_output_embeddings().weight.device
        self.tokens: list[int] = []
        self.cache = None
        self.computed = 0  # tokens run through the model (for tests and reports)

    def next_tokens(self, prefix: list[int], drafts: list[int] = ()) -> list[int]:
        """The greedy token after prefix + drafts[:i] for i = 0..len(drafts)."""
        return self.logits(prefix, drafts).argmax(-1).tolist()

    def logits(self, prefix: list[int], drafts: list[int] = ()):
        """The logits after prefix + drafts[:i] for i = 0..len(drafts), [len(drafts) + 1, V]."""
        import torch
        from transformers import DynamicCache

        from ..decode.cache import cache_arg, full_layers

        seq = list(prefix) + list(drafts)
        keep = self._reusable(seq, len(prefix))
        if keep == 0:  # (full layers: a sliding-window layer's cache could not be cropped behind its window)
            self.cache = full_layers(DynamicCache(config=self.model.config))
        else:
            self.cache.crop(keep - len(self.tokens))  # transformers' crop takes minus the tokens to drop
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([seq[keep:]], device=self.device),
                             **cache_arg(self.model, self.cache), use_cache=True)
        self.tokens, self.computed = seq, self.computed + len(seq) - keep
        return out.logits[0, len(prefix) - 1 - keep:]

    def _reusable(self, seq: list[int], n_prefix: int) -> int:
        """How many leading tokens of seq the cache holds already and may keep (the logits from position
        n_prefix - 1 on are needed, so at most n_prefix - 1); 0: start again."""
        keep = 0
        for a, b in zip(self.tokens, seq):
            if a != b:
                break
            keep += 1
        return 0 if self.cache is None else min(keep, n_prefix - 1)


class StaticGreedy(CachedGreedy):
    """CachedGreedy on the static-shape path (`--compile`): a preallocated KV cache (decode.cache.StaticSlotCache)
    and, after a sequence's first forward (its prompt, run eagerly), every forward `width` tokens wide (the new
    tokens in chunks, padded), so each has one shape and runs through the base's compiled forward (`backend`).
    The tokens are CachedGreedy's; the width is a speed setting (DSI's lookahead + 1: a task's drafts and one more
    in one forward). Its compiled forward fuses the model's projections where the device's default says so
    (decode.fuse)."""

    def __init__(self, model, width: int, backend: str, slots: int = 512):
        from ..decode.compiled import compiled_forward
        from ..decode.fuse import fuse_by_default, fuse_projections

        super().__init__(model)
        self.width, self.slots = width, slots
        self.forward = compiled_forward(model, backend)
        if fuse_by_default(self.device.type):
            fuse_projections(model)

    def logits(self, prefix: list[int], drafts: list[int] = ()):
        import torch

        from ..decode.cache import StaticSlotCache, causal_allowed, static_slots

        seq = list(prefix) + list(drafts)
        keep = self._reusable(seq, len(prefix))
        with torch.no_grad():
            if keep == 0:
                self.cache = StaticSlotCache(self.model, 1, static_slots(max(self.slots, len(seq) + self.width)),
                                             self.forward)
                ids = torch.tensor([seq], device=self.device)
                logits = self.cache.prefill(ids, torch.ones_like(ids, dtype=torch.bool))[0].logits[0]
            else:
                self.cache.rewind(keep)
                W, parts = self.width, []
                depth = torch.arange(W, device=self.device)[None]
                for i in range(keep, len(seq), W):
                    chunk = seq[i: i + W]
                    valid = depth < len(chunk)  # [1, W]
                    ids = torch.tensor([chunk + [0] * (W - len(chunk))], device=self.device)
                    out = self.cache.forward(ids, causal_allowed(valid), depth)
                    self.cache.keep(self.cache.length, depth[:, : len(chunk)], valid[:, : len(chunk)], in_place=True)
                    parts.append(out.logits[0, : len(chunk)])
                logits = torch.cat(parts)
        self.tokens, self.computed = seq, self.computed + len(seq) - keep
        return logits[len(prefix) - 1 - keep:]

    def warm_up(self) -> None:
        """Compile the chunk forward (a short sequence, then one that branches off it), then forget both."""
        self.logits([1, 2, 3], [4])
        self.logits([1, 2, 5], [6] * (self.width - 1))
        self.tokens, self.cache = [], None


def greedy_model(model, width: int = 1, backend: str | None = None) -> CachedGreedy:
    """The model's greedy continuations with a KV cache of the last sequence: on the eager path (backend None) or
    the compiled static-shape one (warmed up here, so no forward of a timed run compiles)."""
    if backend is None:
        return CachedGreedy(model)
    g = StaticGreedy(model, width, backend)
    g.warm_up()
    return g


def _server(index: int, base_path: str, dtype: str, device: str, tasks, results, epoch, latency: float,
            sampling, backend: str | None = None, width: int = 1) -> None:
    """A target server (one per device): for (task id, epoch, prefix, drafts) tasks of the current epoch, the
    target's greedy tokens or (sampling) its warped distributions after prefix + drafts[:i], i = 0..len(drafts).
    Replies ("result", index, task id, epoch, tokens or None when preempted); a failure replies ("error", ...)
    with the traceback and ends the server."""
    from multiprocessing.reduction import ForkingPickler

    from .workers import die_with_parent, error_message

    def send(msg) -> None:  # pickled here, in the try: the queue's feeder thread would drop a message that fails to
        results.put(bytes(ForkingPickler.dumps(msg)))  # pickle (a tensor's shared memory refused) and only print it

    die_with_parent()
    try:
        import torch

        from ..base import load_base
        from ..decode.acceptance import warp

        torch.set_num_threads(1)
        model, _ = load_base(base_path, dtype, device)
        target = greedy_model(model, width, backend)  # compiled: warmed up before it says it is ready
        send(("ready", index))
        while True:
            item = tasks.get()
            if item is None:
                return
            task_id, ep, prefix, drafts = item
            if ep != epoch.value:  # preempted while queued
                send(("result", index, task_id, ep, None))
                continue
            t0 = time.perf_counter()
            with torch.no_grad():
                logits = target.logits(prefix, drafts)
                toks = warp(logits, sampling).cpu() if sampling is not None else logits.argmax(-1).tolist()
            while time.perf_counter() - t0 < latency:  # the emulated forward; preemption cuts it short
                if ep != epoch.value:
                    break
                time.sleep(min(0.002, max(0.0, latency - (time.perf_counter() - t0))))
            send(("result", index, task_id, ep, toks if ep == epoch.value else None))
    except BaseException:  # noqa: BLE001 - reported to the drafter, which raises it
        send(error_message(f"target server {index} ({device})"))


def server_devices(sp: int) -> list[str]:
    """One device per target server: GPUs 1..sp when there are more than sp (GPU 0 is the drafter's), else CPU."""
    import torch

    n = torch.cuda.device_count()
    return [f"cuda:{i + 1}" for i in range(sp)] if n > sp else ["cpu"] * sp


class DSIError(RuntimeError):
    """A DSI target server failed or died (the message holds its traceback); the server pool is closed."""


class DSI:
    """`sp` target servers for one base; `generate` runs DSI with a drafter function.

    Servers are worker processes that die with this one. A server that fails (its traceback is raised here as a
    DSIError), dies or stays silent for `timeout_s` closes the pool. Task ids are unique over the object's life and
    every run starts a new epoch, so a result left over from an interrupted run is never taken for a new task's."""

    def __init__(self, base_path: str, sp: int, target_latency_s: float = 0.0, dtype: str = "float32",
                 devices: list[str] | None = None, sampling=None, timeout_s: float = 600.0, compile: str | None = None,
                 width: int = 1):
        """sampling: a draftlab Sampling with temperature > 0 makes the servers return the target's distributions
        and `generate` sample losslessly (then draft_next returns (token, q)); None: greedy. compile: a
        torch.compile backend: the servers verify on the static-shape path (StaticGreedy, `width` tokens a
        forward, compiled before they report ready)."""
        devices = devices or server_devices(sp)
        if len(devices) != sp:
            raise ValueError(f"{sp} target servers need {sp} devices, got {devices}")
        ctx = mp.get_context("spawn")
        self.sp, self.timeout_s, self.next_id, self.target_latency_s = sp, timeout_s, 0, target_latency_s
        # No lock: the servers read it every few ms, and one killed while holding a lock would leave the drafter's
        # next epoch waiting for good; this process is its only writer.
        self.epoch = ctx.Value("i", 0, lock=False)
        self.closed = False
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(sp)]
        self.sampling = sampling if sampling is not None and sampling.temperature > 0 else None
        self.procs = [ctx.Process(target=_server, args=(i, base_path, dtype, dev, q, self.results, self.epoch,
                                                          target_latency_s, self.sampling, compile, width),
                                  daemon=True, name=f"dsi-server-{i}")
                      for i, (q, dev) in enumerate(zip(self.tasks, devices))]
        from .workers import reading_end_only, start_workers

        try:
            start_workers(self.procs)
            reading_end_only(self.results)
            for _ in self.procs:  # every server has loaded the base
                self._receive(self.timeout_s)
        except BaseException:
            self.close()
            raise

    def _receive(self, timeout_s: float | None = None, block: bool = True, wait_s: float = 0.0):
        """The next server message (None when not blocking and none came within wait_s); a failed, dead or silent
        server closes the pool and raises DSIError."""
        from .workers import WorkerError, poll, receive

        try:
            if block:
                return receive(self.results, self.procs, timeout_s, "DSI", loads=pickle.loads)
            return poll(self.results, self.procs, wait_s, "DSI", loads=pickle.loads)
        except WorkerError as e:
            self.close()
            raise DSIError(str(e)) from None

    def close(self) -> None:
        """Stop the servers (asked first, then terminated); safe to call twice."""
        from .workers import stop_workers

        self.closed = True
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                q.put(None)
        stop_workers(self.procs, queues=tuple(self.tasks))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _new_epoch(self) -> None:
        self.epoch.value += 1  # preempts every task and draft of the last epoch

    def generate(self, prompt: list[int], max_new_tokens: int, draft_next: Callable, lookahead: int,
                 draft_latency_s: float = 0.0, seed: int = 0, eos_token_id=None, stop=None) -> dict:
        """DSI; draft_next(tokens) -> the drafter's next token (greedy), or (token, q [V]) with q the distribution
        it was drawn from (sampling; the drafter draws from its own random stream). The verifier's draws come from
        role_generator(seed, "verifier"). The text ends at an EOS token (kept) or where stop(0, tokens) -> cut
        index says, like `generate`. Returns tokens, wall time and counts: tasks sent, tasks preempted, tasks that
        waited for a free server and the seconds they waited.

        Also the run on the emulated clock, where a draft takes draft_latency_s, a target forward the pool's
        target_latency_s and nothing else takes time (`draftlab simulate`'s model), replayed along the tasks this
        run sent: each starts when it is due (at its drafts' emulated time) or when the earliest server is free, and
        a decision frees every server and restarts the drafter. emulated_s is the last decision's time; of the tasks
        that start before their stretch's decision (emulated_tasks; one sent only at or after it, the runtime having
        taken a reply a moment late, would have been preempted while queued), emulated_waits waited for a server,
        emulated_wait_s in all. Unlike wall_s these leave out the runtime's overheads and the machine's load, so
        they can be compared with the simulator's prediction exactly."""
        from ..decode.decoder import eos_set
        from ..decode.streams import role_generator

        if lookahead < 1:
            raise ValueError("DSI needs lookahead >= 1")
        if self.closed:
            raise DSIError("this DSI pool is closed (a server failed, died or went silent, or close() was called); "
                           "start a new one")
        sampling = self.sampling is not None
        gen = role_generator(seed, "verifier")
        eos = eos_set(eos_token_id)
        t_start = time.perf_counter()
        self._new_epoch()  # anything left in flight by an interrupted run is stale from here on
        committed = list(prompt)
        end = len(prompt) + max_new_tokens
        free = list(range(self.sp))  # servers still finishing preempted work take new tasks after it (FIFO)
        stats = {"tasks": 0, "preemptions": 0, "server_waits": 0, "wait_s": 0.0, "drafts": 0,
                 "emulated_tasks": 0, "emulated_waits": 0, "emulated_wait_s": 0.0}
        owner: dict[int, int] = {}  # task id of this epoch in flight -> its server
        finished = False
        tt, td = self.target_latency_s, draft_latency_s
        eps = 1e-9 * max(tt, td, 1e-30)  # emulated times this close are equal (rounding)
        clock = 0.0  # emulated time of the last decision (the run's start at first)
        while len(committed) < end and not finished:
            drafts: list[int] = []
            qs: list = []  # sampling: the distribution each draft was drawn from
            checked = 0  # sampling: drafts of this stretch already accepted (each position is decided once)
            sent: list[tuple[int, int]] = []  # (task id, drafts it verifies) of this stretch, in send order
            due: list[list] = []  # [drafts it verifies, when due, waited, emulated time due] of tasks not sent
            got: dict[int, list[int] | None] = {}
            next_n = 0  # drafts count at which the next task becomes due
            # The text has a use for one draft fewer than the tokens it still needs: the target's token after them
            # completes it. The drafter stops there and the stretch's last task verifies them all.
            cap = end - len(committed) - 1
            drafting, draft_done = None, 0.0  # the draft in progress (draft_next's answer) and when it is done
            last_done = None  # when this stretch's last draft was done: the next one, back to back, starts there
            decided = None
            # The emulated clock: when each server is next free (the last decision freed them all), the drafter's
            # time, and when each task of this stretch starts and finishes.
            vfree, vdraft, vready, vstart, vfinish = [clock] * self.sp, clock, {}, {}, {}
            while decided is None:
                if drafting is not None and time.perf_counter() >= draft_done:  # the draft in progress is done
                    d = drafting
                    if sampling:
                        d, q = d
                        qs.append(q)
                    drafts.append(d)
                    drafting, last_done = None, draft_done
                    stats["drafts"] += 1
                    vdraft += td
                # Tasks that are due: one at 0 drafts, then every `lookahead` drafts; the last one verifies the
                # `cap` drafts the text has a use for once they exist, even off the lookahead grid.
                while next_n is not None and min(next_n, cap) <= len(drafts):
                    due.append([min(next_n, cap), time.perf_counter(), False, vdraft])
                    next_n = next_n + lookahead if next_n < cap else None
                # Send them as servers free up; the drafter never waits for a server (a due task waits instead).
                while due and free:
                    n, t_due, waited, ready = due.pop(0)
                    w = free.pop(0)
                    self.tasks[w].put((self.next_id, self.epoch.value, committed, drafts[:n]))
                    if waited:
                        stats["server_waits"] += 1
                        stats["wait_s"] += time.perf_counter() - t_due
                    vready[self.next_id], vstart[self.next_id] = ready, max(ready, heapq.heappop(vfree))
                    vfinish[self.next_id] = vstart[self.next_id] + tt
                    heapq.heappush(vfree, vfinish[self.next_id])
                    sent.append((self.next_id, n))
                    owner[self.next_id] = w
                    self.next_id += 1
                    stats["tasks"] += 1
                for d in due:
                    d[2] = True
                # Draft the next token (the drafter never waits for verification); with an emulated draft latency it
                # is done draft_latency_s later.
                if drafting is None and len(drafts) < cap:
                    t0 = time.perf_counter()
                    drafting = draft_next(committed + drafts)
                    # Back-to-back drafts keep the emulated pace: one is done draft_latency_s after the last was
                    # due, not after the loop noticed it (a moment late, every draft), or when computing it ended.
                    draft_done = max((t0 if last_done is None else last_done) + draft_latency_s, time.perf_counter())
                # Take what the servers send back: until the draft in progress is done (a freed server gets the next
                # due task at once, a decision preempts the draft), or, with nothing left to draft, the next reply.
                if drafting is not None:
                    msg = self._receive(block=False, wait_s=draft_done - time.perf_counter())
                else:
                    msg = self._receive(self.timeout_s, block=bool(owner))
                    if msg is not None and msg[0] == "result" and msg[2] in vfinish:  # the drafter waited for it
                        vdraft = max(vdraft, vfinish[msg[2]])
                while msg is not None:
                    if msg[0] == "result":
                        _, _, tid, ep, toks = msg
                        if tid in owner:  # a task of this epoch (preempted ones were freed at the decision)
                            free.append(owner.pop(tid))
                            if toks is not None:
                                got[tid] = toks
                    msg = self._receive(block=False)
                # Decide in send order.
                for tid, n in sent:
                    decider = tid
                    if tid not in got:
                        break
                    if sampling:
                        decided, checked = _decide_sampled(got[tid], n, drafts, qs, checked, gen)
                        if decided is not None or checked <= n:
                            break
                        continue
                    toks = got[tid]
                    bad = next((i for i in range(n) if drafts[i] != toks[i]), None)
                    if bad is not None:
                        decided = drafts[:bad] + [toks[bad]]
                        break
                    if len(drafts) == n or drafts[n] != toks[n]:  # no draft past n yet (or ever, at the end)
                        decided = drafts[:n] + [toks[n]]
                        break
            self._new_epoch()
            # On the emulated clock tasks finish in send order, so the decision is the decider's finish. A task
            # sent but starting only then (the runtime took the reply a moment late) is never sent there: it is
            # preempted while queued, as in the simulator.
            clock = vfinish[decider]
            for tid, _ in sent:
                if tid == decider or vstart[tid] < clock - eps:
                    stats["emulated_tasks"] += 1
                    if vstart[tid] - vready[tid] > eps:
                        stats["emulated_waits"] += 1
                        stats["emulated_wait_s"] += vstart[tid] - vready[tid]
            # Preemption frees the servers at once, as the simulator has it: their preempted work is cut short and
            # reported with the old epoch, which is ignored.
            stats["preemptions"] += len(owner)
            free += owner.values()
            owner.clear()
            finished = _extend(committed, len(prompt), decided, eos, stop)
        stats["wait_s"], stats["emulated_wait_s"] = round(stats["wait_s"], 6), round(stats["emulated_wait_s"], 9)
        return {"tokens": committed[len(prompt):], "wall_s": time.perf_counter() - t_start, "emulated_s": clock,
                **stats}


def _extend(committed: list[int], n_prompt: int, new: list[int], eos: set, stop) -> bool:
    """Append decided tokens to the text, ending it at an EOS token (kept) or where stop(0, generated) -> cut
    index says (as the decoder's Verifier does); True when the text has ended."""
    cut = next((i + 1 for i, t in enumerate(new) if t in eos), None)
    committed += new[:cut]
    c = stop(0, committed[n_prompt:]) if stop is not None else None
    if c is not None:
        del committed[n_prompt + max(c, 0):]
    return cut is not None or c is not None


def _decide_sampled(p, n: int, drafts: list[int], qs: list, checked: int, gen):
    """Speculative sampling over one task's result p [n+1, V] (the target's distributions after the committed
    text + drafts[:i]): positions checked.. are decided once each, in order. A draft x drawn from q is accepted
    with probability min(1, p(x)/q(x)); the first rejection commits a token from normalize(max(p - q, 0)). The
    task also decides the position after its last verified draft: the drafter's token there if it has one (same
    rule), else (as at the end of the text, where the drafter stops) a token drawn from p. Returns (committed
    tokens or None, checked)."""
    import torch

    from ..decode.acceptance import sample, sample_residual, uniforms

    for i in range(checked, min(n + 1, len(drafts))):
        x, q = drafts[i], qs[i]
        if uniforms(1, generator=gen, device=p.device)[0] * q[x] < p[i, x]:
            checked = i + 1
            continue
        return drafts[:i] + [sample_residual(p[i], q, gen)], checked
    if checked == n + 1:  # every position this task covers accepted: the next task goes on
        return None, checked
    return drafts + [int(sample(p[n], 1, gen)[0])], checked  # no draft after the n verified


def si_generate(model, prompt: list[int], max_new_tokens: int, draft_next, lookahead: int,
                target_latency_s: float = 0.0, draft_latency_s: float = 0.0, eos_token_id=None, stop=None,
                target: CachedGreedy | None = None) -> dict:
    """Speculative inference with the same emulated latencies (draft `lookahead`, verify, repeat), greedy;
    lookahead 0 is plain (non-SI) decoding. For comparisons with DSI in one process; ends as DSI.generate does.
    target: the model's greedy continuations to verify with (greedy_model; default: the eager path's)."""
    from ..decode.decoder import eos_set

    clock = [time.perf_counter()]  # when the last forward was done: each one starts there, back to back

    def wait(latency):  # the forward just computed lasts `latency` from its start (or its computation, if longer)
        clock[0] = max(clock[0] + latency, time.perf_counter())
        while time.perf_counter() < clock[0]:
            time.sleep(clock[0] - time.perf_counter())

    target, eos = target or CachedGreedy(model), eos_set(eos_token_id)
    t_start = clock[0]
    committed, end = list(prompt), len(prompt) + max_new_tokens
    while len(committed) < end:
        drafts = []
        for _ in range(min(lookahead, end - len(committed) - 1)):  # the target's token after them ends the text
            drafts.append(draft_next(committed + drafts))
            wait(draft_latency_s)
        toks = target.next_tokens(committed, drafts)
        wait(target_latency_s)
        bad = next((i for i in range(len(drafts)) if drafts[i] != toks[i]), len(drafts))
        if _extend(committed, len(prompt), drafts[:bad] + [toks[bad]], eos, stop):
            break
    return {"tokens": committed[len(prompt):], "wall_s": time.perf_counter() - t_start}


def run_dsi(export: str, prompts: list, sp: int, max_new_tokens: int = 128, lookahead: int | None = None,
            target_latency_ms: float = 0.0, draft_latency_ms: float = 0.0, compare: bool = False,
            base: str | None = None, dtype: str | None = None, chat: bool = False, sampling=None,
            seed: int = 0, stops=(), eos: bool = True, pool: DSI | None = None, acceptance: float | None = None,
            lookahead_rule: str = "expected", compile: bool | str = False) -> dict:
    """`draftlab dsi`: DSI with an SSM export as the drafter (its own KV cache) and `sp` target servers of its
    base, greedy or sampling; optionally (greedy) SI and non-SI with the same latencies, and HF `generate` as the
    reference for the tokens. prompts: texts, or token id lists. The text ends at the base's stop tokens
    (base.stop_token_ids; unless eos=False) or a stop string, as `draftlab generate`'s does. Random streams: the
    drafter's from role_generator(seed, "drafter"), prompt j's verifier from role_generator(seed + j,
    "verifier"). When no lookahead is given it is chosen from measured (or emulated) forward times: with
    lookahead_rule "expected" and the drafter's expected acceptance rate given (`acceptance`), the one of least
    expected latency with the `sp` servers, waits included (simulate.best_dsi_lookahead, for max_new_tokens);
    otherwise ("no-wait", or no acceptance rate) the smallest with which no verification task waits for a server.
    pool: a running DSI server pool of the same base, latency and sampling to use (and leave running) instead of
    starting one. compile: the static-shape compiled path (True: inductor, or DRAFTLAB_COMPILE_BACKEND; a string
    names a backend) for the servers, the drafter and SI / non-SI, each compiled before anything is timed; the
    measured forward times that choose the lookahead are then the compiled path's."""
    import contextlib

    import torch

    from ..base import load_base, stop_token_ids
    from ..decode.acceptance import Sampling, sample, warp
    from ..decode.compiled import compile_backend
    from ..serve.generate import encode_prompt, plain_generate, stop_fn
    from ..decode.streams import role_generator
    from ..interop.export import load_export, read_meta, use_chat_template
    from .simulate import dsi_lookahead

    sp = pool.sp if pool is not None else sp
    meta = read_meta(export)
    kind = meta["head"]["type"]
    if kind != "ssm":  # (an ensemble was said to hold heads that need hidden states: walk-through)
        why = ({"ensemble": "an ensemble, whose drafting chooses among its members by the verified tokens; give one "
                            f"member's export (its training run's stages/memberN/export) to draft with it alone",
                "lookup": "a prompt-lookup drafter, which drafts from the text, not with a model"}.get(kind) or
               f"{kind} heads, which need the base's hidden states and so cannot draft ahead of verification")
        raise ValueError(f"draftlab dsi drafts with a small LM (an ssm export); {export} holds {why}")
    name, dtype = base or meta["base"]["name_or_path"], dtype or meta["base"]["dtype"]
    model, tok = load_base(name, dtype, "cpu")
    tok = use_chat_template(tok, export, meta)
    draft, _ = load_export(export, base=model)
    sampled = sampling is not None and sampling.temperature > 0
    if sampled and compare:
        raise ValueError("--compare runs SI and non-SI greedily; drop it or --temperature")
    backend = compile_backend(compile)
    drafter = greedy_model(draft.lm, 2, backend)  # the drafter's sequence grows a token at a time
    gen = role_generator(seed, "drafter")

    def draft_next(toks):
        if not sampled:
            return drafter.next_tokens(toks)[0]
        with torch.no_grad():
            q = warp(drafter.logits(toks)[0], sampling)
        return int(sample(q, 1, gen)[0]), q
    ids = [list(p) if isinstance(p, (list, tuple)) else encode_prompt(tok, p, chat) for p in prompts]
    eos_id = stop_token_ids(model, tok) if eos else None
    stop = stop_fn(tok, list(stops))
    # Forward times are measured only when the lookahead is to be derived from them (None: not measured).
    measure = lookahead is None
    t_target = target_latency_ms / 1000 or (_forward_s(model, ids[0], backend) if measure else None)
    t_draft = draft_latency_ms / 1000 or (_forward_s(draft.lm, ids[0], backend) if measure else None)
    rule = "given" if lookahead else lookahead_rule if acceptance is not None else "no-wait"
    k = lookahead or dsi_lookahead(rule, acceptance, t_draft, t_target, sp, max_new_tokens)
    ms = lambda t: None if t is None else round(1000 * t, 3)  # noqa: E731
    report = {"sp": sp, "lookahead": k, "lookahead_rule": rule, "t_target_ms": ms(t_target), "t_draft_ms": ms(t_draft),
              "emulated": bool(target_latency_ms or draft_latency_ms), "compiled": backend, "runs": []}
    if compare:  # SI verifies lookahead + 1 tokens a forward, non-SI one
        si_target, plain_target = greedy_model(model, k + 1, backend), greedy_model(model, 1, backend)
    with (contextlib.nullcontext(pool) if pool is not None else
          DSI(name, sp, target_latency_ms / 1000, dtype, sampling=sampling if sampled else None, compile=backend,
              width=k + 1)) as dsi:
        for j, p in enumerate(ids):
            r = dsi.generate(p, max_new_tokens, draft_next, k, draft_latency_ms / 1000, seed=seed + j,
                             eos_token_id=eos_id, stop=stop)
            run = {"text": tok.decode(r["tokens"], skip_special_tokens=True), "tokens": r["tokens"],
                   "dsi_s": round(r["wall_s"], 4), **{c: r[c] for c in ("tasks", "preemptions", "server_waits")}}
            if compare:
                kw = dict(target_latency_s=target_latency_ms / 1000, draft_latency_s=draft_latency_ms / 1000,
                          eos_token_id=eos_id, stop=stop)
                si = si_generate(model, p, max_new_tokens, draft_next, k, target=si_target, **kw)
                plain = si_generate(model, p, max_new_tokens, draft_next, 0, target=plain_target, **kw)
                hf = plain_generate(model, [p], max_new_tokens, Sampling(), eos_id)[0][0]
                if stop is not None:  # HF generate runs on past a stop string; `generate` cuts there, as DSI does
                    c = stop(0, hf)
                    hf = hf[:c] if c is not None else hf
                run.update(si_s=round(si["wall_s"], 4), non_si_s=round(plain["wall_s"], 4),
                           identical_to_greedy=r["tokens"] == si["tokens"] == plain["tokens"] == hf)
            report["runs"].append(run)
    report["dsi_s"] = round(sum(r["dsi_s"] for r in report["runs"]), 4)
    if compare:
        report["si_s"] = round(sum(r["si_s"] for r in report["runs"]), 4)
        report["non_si_s"] = round(sum(r["non_si_s"] for r in report["runs"]), 4)
        report["dsi_vs_si"] = round(report["si_s"] / report["dsi_s"], 3)
        report["dsi_vs_non_si"] = round(report["non_si_s"] / report["dsi_s"], 3)
        report["identical_to_greedy"] = all(r["identical_to_greedy"] for r in report["runs"])
    return report


def _forward_s(model, ids: list[int], backend: str | None = None, reps: int = 5) -> float:
    """Median time of one cached single-token forward after the prompt (what a decoding step costs), on the path
    that will run (backend None: eager; else the static-shape compiled one)."""
    import statistics

    g = greedy_model(model, 1, backend)
    times = []
    g.logits(ids)
    for i in range(reps):
        t0 = time.perf_counter()
        g.logits(ids + [i % 2])  # one token past the cached prompt (another one each time: no reuse)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
