"""Distributed speculative inference (DSI, Timor et al.) as processes: one drafter (this process) and `sp` target
servers (worker processes), greedy or sampling, lossless.

The drafter never waits for verification. From the last verified token on, a verification task goes to a free
target server at once (no drafts: the target's own next token) and again after every `lookahead` drafted
tokens (verifying all drafts so far), while the drafter keeps drafting as if everything is accepted. Results are
read in the order the tasks were sent; the first one that finds a draft different from the target's token (or
the target's token after its last draft, when the drafter has gone no further) decides: the drafts up to it and
the target's token are committed, every task and draft built past it is preempted (servers drop work of an old
epoch, including the one they are sleeping through), and drafting restarts from the corrected token. Every
committed token is the target's greedy token, so the output equals plain greedy decoding. Sampling: the servers
return the target's distributions and each drafted position is decided once, in order, by the speculative
sampling rule against the distribution the drafter drew it from (`_decide_sampled`), so the output is a sample
of the target's own distribution.

Latencies can be injected (`target_latency_s`, `draft_latency_s`: each forward then lasts at least that long),
the way the DSI authors emulate a multi-GPU node on one machine; `draftlab simulate` predicts the same runs.
Each target server is one process with its own copy of the base on its own device (GPUs 1..SP when there are
more GPUs than servers, GPU 0 being the drafter's; else CPU) and its own KV cache, which keeps the longest common
prefix of consecutive tasks (CachedGreedy).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
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

        seq = list(prefix) + list(drafts)
        keep = 0
        for a, b in zip(self.tokens, seq):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(prefix) - 1)  # the logits from position len(prefix) - 1 on are needed
        if self.cache is None or keep == 0:
            self.cache, keep = DynamicCache(config=self.model.config), 0
        else:
            self.cache.crop(keep - len(self.tokens))  # transformers' crop takes minus the tokens to drop
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([seq[keep:]], device=self.device), past_key_values=self.cache,
                             use_cache=True)
        self.tokens, self.computed = seq, self.computed + len(seq) - keep
        return out.logits[0, len(prefix) - 1 - keep:]


def _server(base_path: str, dtype: str, device: str, tasks, results, epoch, latency: float, sampling) -> None:
    """A target server (one per device): for (prefix, drafts) tasks of the current epoch, the target's greedy tokens
    or (sampling) its warped distributions after prefix + drafts[:i], i = 0..len(drafts)."""
    import torch

    from .base import load_base
    from .decode.acceptance import warp

    torch.set_num_threads(1)
    model, _ = load_base(base_path, dtype, device)
    target = CachedGreedy(model)
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
            logits = target.logits(prefix, drafts)
            toks = warp(logits, sampling).cpu() if sampling is not None else logits.argmax(-1).tolist()
        while time.perf_counter() - t0 < latency:  # the emulated forward; preemption cuts it short
            if ep != epoch.value:
                break
            time.sleep(min(0.002, max(0.0, latency - (time.perf_counter() - t0))))
        results.put((task_id, ep, toks if ep == epoch.value else None))


def server_devices(sp: int) -> list[str]:
    """One device per target server: GPUs 1..sp when there are more than sp (GPU 0 is the drafter's), else CPU."""
    import torch

    n = torch.cuda.device_count()
    return [f"cuda:{i + 1}" for i in range(sp)] if n > sp else ["cpu"] * sp


class DSI:
    """`sp` target servers for one base; `generate` runs DSI with a drafter function."""

    def __init__(self, base_path: str, sp: int, target_latency_s: float = 0.0, dtype: str = "float32",
                 devices: list[str] | None = None, sampling=None):
        """sampling: a draftlab Sampling with temperature > 0 makes the servers return the target's distributions
        and `generate` sample losslessly (then draft_next returns (token, q)); None: greedy."""
        devices = devices or server_devices(sp)
        if len(devices) != sp:
            raise ValueError(f"{sp} target servers need {sp} devices, got {devices}")
        ctx = mp.get_context("spawn")
        self.epoch = ctx.Value("i", 0)
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(sp)]
        self.sampling = sampling if sampling is not None and sampling.temperature > 0 else None
        self.procs = [ctx.Process(target=_server, args=(base_path, dtype, dev, q, self.results, self.epoch,
                                                          target_latency_s, self.sampling), daemon=True)
                      for q, dev in zip(self.tasks, devices)]
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

    def generate(self, prompt: list[int], max_new_tokens: int, draft_next: Callable, lookahead: int,
                 draft_latency_s: float = 0.0, seed: int = 0) -> dict:
        """DSI; draft_next(tokens) -> the drafter's next token (greedy), or (token, q [V]) with q the distribution
        it was drawn from (sampling). Returns tokens, wall time and counts."""
        import torch

        if lookahead < 1:
            raise ValueError("DSI needs lookahead >= 1")
        sampling = self.sampling is not None
        gen = torch.Generator().manual_seed(seed)
        t_start = time.perf_counter()
        committed = list(prompt)
        end = len(prompt) + max_new_tokens
        free = list(range(self.sp))
        stats = {"tasks": 0, "preemptions": 0, "server_waits": 0}
        next_id, owner = 0, {}  # task id -> the server running it (freed when it reports, preempted or not)
        while len(committed) < end:
            drafts: list[int] = []
            qs: list = []  # sampling: the distribution each draft was drawn from
            checked = 0  # sampling: drafts of this stretch already accepted (each position is decided once)
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
                    if sampling:
                        decided, checked = _decide_sampled(got[tid], n, drafts, qs, checked, gen,
                                                           len(committed) + n + 1 >= end)
                        if decided is not None or checked <= n:
                            break
                        continue
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
                    d = draft_next(committed + drafts)
                    if sampling:
                        d, q = d
                        qs.append(q)
                    drafts.append(d)
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


def _decide_sampled(p, n: int, drafts: list[int], qs: list, checked: int, gen, at_end: bool):
    """Speculative sampling over one task's result p [n+1, V] (the target's distributions after the committed
    text + drafts[:i]): positions checked.. are decided once each, in order. A draft x drawn from q is accepted
    with probability min(1, p(x)/q(x)); the first rejection commits a token from normalize(max(p - q, 0)). The
    task also decides the position after its last verified draft: the drafter's token there if it has one (same
    rule), else (or at the end of the text) a token drawn from p. Returns (committed tokens or None, checked)."""
    import torch

    from .decode.acceptance import residual

    for i in range(checked, min(n + 1, len(drafts))):
        x, q = drafts[i], qs[i]
        if torch.rand((), generator=gen) * q[x] < p[i, x]:
            checked = i + 1
            continue
        return drafts[:i] + [int(torch.multinomial(residual(p[i], q), 1, generator=gen))], checked
    if checked == n + 1:  # every position this task covers accepted: the next task goes on (or the text ends)
        return (drafts[:n + 1] if at_end else None), checked
    return drafts + [int(torch.multinomial(p[n], 1, generator=gen))], checked  # no draft after the n verified


def si_generate(model, prompt: list[int], max_new_tokens: int, draft_next, lookahead: int,
                target_latency_s: float = 0.0, draft_latency_s: float = 0.0) -> dict:
    """Speculative inference with the same emulated latencies (draft `lookahead`, verify, repeat), greedy;
    lookahead 0 is plain (non-SI) decoding. For comparisons with DSI in one process."""
    def wait(t0, latency):
        while time.perf_counter() - t0 < latency:
            time.sleep(max(0.0, latency - (time.perf_counter() - t0)))

    target = CachedGreedy(model)
    t_start = time.perf_counter()
    committed, end = list(prompt), len(prompt) + max_new_tokens
    while len(committed) < end:
        drafts = []
        for _ in range(min(lookahead, end - len(committed))):
            t0 = time.perf_counter()
            drafts.append(draft_next(committed + drafts))
            wait(t0, draft_latency_s)
        t0 = time.perf_counter()
        toks = target.next_tokens(committed, drafts)
        wait(t0, target_latency_s)
        bad = next((i for i in range(len(drafts)) if drafts[i] != toks[i]), len(drafts))
        committed += drafts[:bad] + [toks[bad]]
    return {"tokens": committed[len(prompt): end], "wall_s": time.perf_counter() - t_start}


def run_dsi(export: str, prompts: list[str], sp: int, max_new_tokens: int = 128, lookahead: int | None = None,
            target_latency_ms: float = 0.0, draft_latency_ms: float = 0.0, compare: bool = False,
            base: str | None = None, dtype: str | None = None, chat: bool = False, sampling=None,
            seed: int = 0) -> dict:
    """`draftlab dsi`: DSI with an SSM export as the drafter (its own KV cache) and `sp` target servers of its
    base, greedy or sampling; optionally (greedy) SI and non-SI with the same latencies for comparison. The
    lookahead defaults to the smallest with which no verification task waits for a server, from measured (or
    emulated) forward times."""
    import torch

    from .base import load_base
    from .decode.acceptance import warp
    from .decode.generate import encode_prompt
    from .export import load_export, read_meta
    from .simulate import min_lookahead

    meta = read_meta(export)
    if meta["head"]["type"] != "ssm":
        raise ValueError(f"draftlab dsi drafts with a small LM (an ssm export); {export} holds {meta['head']['type']} "
                         "heads, which need the base's hidden states and so cannot draft ahead of verification")
    name, dtype = base or meta["base"]["name_or_path"], dtype or meta["base"]["dtype"]
    model, tok = load_base(name, dtype, "cpu")
    draft, _ = load_export(export, base=model)
    sampled = sampling is not None and sampling.temperature > 0
    if sampled and compare:
        raise ValueError("--compare runs SI and non-SI greedily; drop it or --temperature")
    drafter = CachedGreedy(draft.lm)
    gen = torch.Generator().manual_seed(seed)

    def draft_next(toks):
        if not sampled:
            return drafter.next_tokens(toks)[0]
        with torch.no_grad():
            q = warp(drafter.logits(toks)[0], sampling)
        return int(torch.multinomial(q, 1, generator=gen)), q
    ids = [encode_prompt(tok, p, chat) for p in prompts]
    t_target = target_latency_ms / 1000 or _forward_s(model, ids[0])
    t_draft = draft_latency_ms / 1000 or _forward_s(draft.lm, ids[0])
    k = lookahead or min_lookahead(t_draft, t_target, sp)
    report = {"sp": sp, "lookahead": k, "t_target_ms": round(1000 * t_target, 3),
              "t_draft_ms": round(1000 * t_draft, 3), "emulated": bool(target_latency_ms or draft_latency_ms),
              "runs": []}
    with DSI(name, sp, target_latency_ms / 1000, dtype, sampling=sampling if sampled else None) as dsi:
        for j, p in enumerate(ids):
            r = dsi.generate(p, max_new_tokens, draft_next, k, draft_latency_ms / 1000, seed=seed + j)
            run = {"text": tok.decode(r["tokens"], skip_special_tokens=True), "tokens": r["tokens"],
                   "dsi_s": round(r["wall_s"], 4), "tasks": r["tasks"], "preemptions": r["preemptions"],
                   "server_waits": r["server_waits"]}
            if compare:
                kw = dict(target_latency_s=target_latency_ms / 1000, draft_latency_s=draft_latency_ms / 1000)
                si = si_generate(model, p, max_new_tokens, draft_next, k, **kw)
                plain = si_generate(model, p, max_new_tokens, draft_next, 0, **kw)
                run.update(si_s=round(si["wall_s"], 4), non_si_s=round(plain["wall_s"], 4),
                           identical_to_greedy=r["tokens"] == plain["tokens"] == si["tokens"])
            report["runs"].append(run)
    report["dsi_s"] = round(sum(r["dsi_s"] for r in report["runs"]), 4)
    if compare:
        report["si_s"] = round(sum(r["si_s"] for r in report["runs"]), 4)
        report["non_si_s"] = round(sum(r["non_si_s"] for r in report["runs"]), 4)
        report["dsi_vs_si"] = round(report["si_s"] / report["dsi_s"], 3)
        report["dsi_vs_non_si"] = round(report["non_si_s"] / report["dsi_s"], 3)
        report["identical_to_greedy"] = all(r["identical_to_greedy"] for r in report["runs"])
    return report


def _forward_s(model, ids: list[int], reps: int = 5) -> float:
    """Median time of one cached single-token forward after the prompt (what a decoding step costs)."""
    import statistics

    import torch
    from transformers import DynamicCache

    times = []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        for _ in range(reps):
            t0 = time.perf_counter()
            model(input_ids=torch.tensor([ids[-1:]]), past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-1)
    return statistics.median(times)
