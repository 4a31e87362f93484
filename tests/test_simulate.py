"""`draftlab simulate`: the closed forms against the event-by-event simulator, the limits they must reach, the
smallest-sufficient-lookahead rule, inputs from a generate report, and the command."""

import json
import random

import numpy as np
import pytest

from draftlab.cli import main
from draftlab.parallel.simulate import (Config, best_dsi_lookahead, best_si_lookahead, drafts_ahead_note,
                                        dsi_expected_total, dsi_pool_time_per_token, dsi_time_per_token, expected,
                                        from_generate, grid_expectations, min_lookahead, si_expected_total,
                                        si_time_per_token, simulate_dsi, simulate_si)


@pytest.mark.parametrize("a,k,td", [(0.5, 2, 3.0), (0.8, 5, 1.0), (0.9, 3, 6.0)])
def test_si_closed_form_matches_simulation(a, k, td):
    rng, n, runs = random.Random(0), 3000, 20
    sim = sum(simulate_si(n, a, k, td, 30.0, rng) for _ in range(runs)) / runs
    closed = 30.0 + (n - 1) * si_time_per_token(a, k, td, 30.0)
    assert sim == pytest.approx(closed, rel=0.02)


@pytest.mark.parametrize("a,k,td", [(0.5, 2, 3.0), (0.8, 5, 1.0), (0.9, 1, 6.0), (0.3, 4, 2.0)])
def test_dsi_closed_form_matches_simulation_with_enough_servers(a, k, td):
    rng, n, runs = random.Random(1), 3000, 20
    sims = [simulate_dsi(n, a, k, td, 30.0, sp=64, rng=rng) for _ in range(runs)]
    assert all(s["waited"] == 0 for s in sims)
    closed = 30.0 + (n - 1) * dsi_time_per_token(a, k, td, 30.0)
    assert sum(s["time"] for s in sims) / runs == pytest.approx(closed, rel=0.02)


def test_limits():
    # Nothing accepted: DSI is non-SI (its target-only task decides every token); SI pays its drafts on top.
    assert dsi_time_per_token(0.0, 4, 2.0, 30.0) == 30.0
    assert si_time_per_token(0.0, 4, 2.0, 30.0) == 38.0
    # Everything accepted: DSI runs at the drafter's pace, SI at (k drafts + 1 verify) per k + 1 tokens.
    assert dsi_time_per_token(1.0, 4, 2.0, 30.0) == 2.0
    assert si_time_per_token(1.0, 4, 2.0, 30.0) == pytest.approx(38.0 / 5)
    assert best_si_lookahead(0.0, 2.0, 30.0) == 0  # SI's fair baseline falls back to non-SI


def test_dsi_is_never_slower_than_si_or_non_si_with_enough_servers():
    """Over a grid of drafter latencies (below the target's) and acceptance rates, DSI at its smallest sufficient
    lookahead is at least as fast as non-SI and as SI at SI's best lookahead."""
    for i in range(1, 20):
        for j in range(0, 20):
            td, a = 30.0 * i / 20, j / 20
            e = expected(Config(30.0, td, a, min_lookahead(td, 30.0, 7), 7, 256))
            assert e["sp_sufficient"]
            assert e["speedup"]["dsi_vs_non_si"] >= 1 - 1e-9, (td, a)
            assert e["speedup"]["dsi_vs_si"] >= 1 - 1e-9, (td, a)


@pytest.mark.parametrize("n,a,k,td,sp", [(50, 0.8, 2, 0.05, 7), (50, 0.9, 1, 0.02, 7), (30, 0.6, 3, 0.1, 2),
                                         (40, 0.7, 4, 0.2, 1), (19, 1.0, 8, 2 / 30, 2)])
def test_exact_expectations_match_the_event_simulator(n, a, k, td, sp):
    """dsi_expected_total / si_expected_total are the simulators' exact means (waits for a server and the text's
    end included): within 4 standard errors of 4,000 seeded runs."""
    rng, runs = random.Random(3), 4000
    for sim, exact in (([simulate_dsi(n, a, k, td, 1.0, sp, rng)["time"] for _ in range(runs)],
                        dsi_expected_total(n, a, k, td, 1.0, sp)),
                       ([simulate_si(n, a, k, td, 1.0, rng) for _ in range(runs)], si_expected_total(n, a, k, td, 1.0))):
        mean = sum(sim) / runs
        se = (sum((x - mean) ** 2 for x in sim) / (runs - 1) / runs) ** 0.5
        assert abs(mean - exact) <= 4 * se + 1e-9 * n, (mean, exact, se)


@pytest.mark.parametrize("a,k,td,sp", [(0.8, 1, 0.05, 7), (0.9, 2, 0.02, 7), (0.6, 1, 0.1, 3), (0.95, 3, 0.01, 7)])
def test_pool_closed_form_per_token_with_waits(a, k, td, sp):
    """With too few servers for the lookahead (tasks wait), the per-token closed form is the long-text limit of the
    exact expectation, and above the enough-servers form; with enough servers it is that form."""
    n = 20000  # the text's end adds O(1) to the total
    per_token = (dsi_expected_total(n, a, k, td, 1.0, sp) - 1.0) / (n - 1)
    assert dsi_pool_time_per_token(a, k, td, 1.0, sp) == pytest.approx(per_token, rel=1e-3)
    assert dsi_pool_time_per_token(a, k, td, 1.0, sp) > dsi_time_per_token(a, k, td, 1.0)
    k_min = min_lookahead(td, 1.0, sp)
    assert dsi_pool_time_per_token(a, k_min, td, 1.0, sp) == pytest.approx(dsi_time_per_token(a, k_min, td, 1.0))


@pytest.mark.parametrize("a,td,sp,n", [(0.3, 0.01, 7, 50), (0.6, 0.02, 7, 64), (0.9, 0.05, 3, 40), (1.0, 0.03, 7, 50),
                                       (0.0, 0.1, 2, 30), (0.8, 0.3, 1, 50)])
def test_best_lookahead_is_never_worse_than_the_no_wait_one(a, td, sp, n):
    """best_dsi_lookahead's expected latency (exact for the text, per token in closed form) is at most
    min_lookahead's, and strictly less where the no-wait rule loses to SI (drafts of 0.01 t_target on 7 servers:
    no-wait takes 15 and any accepted draft waits for the task after 15 drafts)."""
    k_min = min_lookahead(td, 1.0, sp)
    k = best_dsi_lookahead(a, td, 1.0, sp, n)
    assert dsi_expected_total(n, a, k, td, 1.0, sp) <= dsi_expected_total(n, a, k_min, td, 1.0, sp) * (1 + 1e-12)
    kt = best_dsi_lookahead(a, td, 1.0, sp)
    assert kt <= k_min
    assert dsi_pool_time_per_token(a, kt, td, 1.0, sp) <= dsi_pool_time_per_token(a, k_min, td, 1.0, sp) * (1 + 1e-12)
    if (a, td) == (0.3, 0.01):
        assert (k, kt) == (1, 1) and k_min == 15
        si = min(si_expected_total(n, a, j, td, 1.0) for j in range(n - 1))
        assert dsi_expected_total(n, a, k_min, td, 1.0, sp) > si > dsi_expected_total(n, a, k, td, 1.0, sp)
    if (a, td) == (1.0, 0.03):  # the text's last task waits at min_lookahead (5), not at 6
        assert k == 6 and dsi_expected_total(n, a, 6, td, 1.0, sp) < dsi_expected_total(n, a, 5, td, 1.0, sp)


def test_dsi_with_the_best_lookahead_is_never_slower_on_a_coarse_grid():
    """Over the paper's grid at a coarser step (drafter latency 0.05..1, acceptance 0..1, SP 7), DSI at the chosen
    lookahead is never slower than SI at its best lookahead or non-SI: per token in closed form and exactly for a
    30-token text; the no-wait rule is slower at some of these points. The event simulator (common random numbers,
    paired) agrees at a few of them."""
    ratios = [0.01] + [round(0.05 * i, 2) for i in range(1, 21)]
    acc = [round(0.05 * i, 2) for i in range(21)]
    for n in (None, 30):
        g = grid_expectations(acc, ratios, 1.0, 7, n_tokens=n)
        worst = (g["dsi"] / np.minimum(g["si"], g["non_si"])).max()
        assert worst <= 1 + 1e-9, (n, worst)
        nw = grid_expectations(acc, ratios, 1.0, 7, n_tokens=n, rule="no-wait")
        assert (nw["dsi"] / np.minimum(nw["si"], nw["non_si"])).max() > 1.001
        assert (g["dsi"] <= nw["dsi"] * (1 + 1e-12)).all()
    runs = 300
    for i, j in [(6, 0), (12, 2), (16, 5), (19, 10)]:
        a, td = acc[i], ratios[j]
        k, ks = int(g["dsi_lookahead"][i, j]), int(g["si_lookahead"][i, j])
        assert g["dsi"][i, j] == pytest.approx(dsi_expected_total(30, a, k, td, 1.0, 7))
        diff = [simulate_dsi(30, a, k, td, 1.0, 7, random.Random(r))["time"] - simulate_si(30, a, ks, td, 1.0,
                random.Random(r)) for r in range(runs)]
        mean = sum(diff) / runs
        se = (sum((x - mean) ** 2 for x in diff) / (runs - 1) / runs) ** 0.5
        assert mean < 4 * se, (a, td, mean, se)


def test_smallest_sufficient_lookahead():
    td, tt, sp = 2.0, 30.0, 4  # tasks last 30, go out every 2k: ceil(30 / 8) = 4 lookahead
    k = min_lookahead(td, tt, sp)
    assert k == 4
    rng = random.Random(2)
    # At k no task on the lookahead grid waits. The text's last task goes out as soon as the drafts it verifies
    # exist, off the grid: it alone may wait, never past the grid's time for it ((k - 1) drafts' time at most).
    runs = [simulate_dsi(400, 0.95, k, td, tt, sp, rng) for _ in range(20)]
    assert all(r["waits"] <= 1 and r["waited"] <= (k - 1) * td for r in runs)
    assert sum(simulate_dsi(400, 0.95, k - 1, td, tt, sp, rng)["waits"] for _ in range(20)) > 20


def test_simulation_drafts_no_more_than_the_text_needs():
    """With R tokens left a stretch drafts R - 1 at most (the target's token after them is the R-th) and its last
    task verifies them once they exist, off the lookahead grid; before, the simulator drafted one more and sent that
    task on the grid (and SI drafted a full lookahead at the end)."""
    td, tt, k = 2.0, 30.0, 4
    # Everything accepted, one stretch of 11 tokens after the prefill's: 10 drafts, tasks at 0, 4, 8 and 10 drafts,
    # the last deciding at 10 t_draft + t_target.
    one = simulate_dsi(12, 1.0, k, td, tt, sp=8, rng=random.Random(0), t_prefill=0.0)
    assert one == {"time": 10 * td + tt, "tasks": 4, "waits": 0, "waited": 0.0, "preempted": 0}
    # Nothing accepted, drafts slower than above: every token is decided by a target-only task at t_target, the
    # task sent after 1 draft (at 20 < 30) is preempted, but the last token has no use for a draft: its stretch
    # sends one task.
    none = simulate_dsi(12, 0.0, 1, 20.0, tt, sp=8, rng=random.Random(0), t_prefill=0.0)
    assert none == {"time": 11 * tt, "tasks": 2 * 11 - 1, "waits": 0, "waited": 0.0, "preempted": 10}
    # A replayed stretch that runs past the end is cut there: 3 accepted (decided by the task at 4 drafts; the one
    # at 6, all the text could use, is preempted), then 3 tokens left of a stretch that would accept 8: 2 drafts,
    # tasks at 0 and 2 drafts, the second deciding.
    cut = simulate_dsi(8, 0.0, k, td, tt, sp=8, rng=random.Random(0), t_prefill=0.0, accepts=[3, 8])
    assert cut == {"time": (4 * td + tt) + (2 * td + tt), "tasks": 3 + 2, "waits": 0, "waited": 0.0, "preempted": 1}
    # At the no-wait lookahead of 2 servers (8) the last task, due at 17 drafts (off the grid, which would send it
    # at 24), finds both servers busy and waits for the one the task at 8 drafts frees at 8 t_draft + t_target.
    assert min_lookahead(td, tt, 2) == 8
    late = simulate_dsi(19, 1.0, 8, td, tt, sp=2, rng=random.Random(0), t_prefill=0.0)
    assert late == {"time": 8 * td + 2 * tt, "tasks": 4, "waits": 1, "waited": 8 * td + tt - 17 * td, "preempted": 0}
    # SI likewise: 11 tokens after the prefill's, everything accepted: 4 drafts and a verification twice, then the
    # last token from a verification of no drafts.
    assert simulate_si(12, 1.0, k, td, tt, random.Random(0)) == tt + 2 * (k * td + tt) + tt


def test_inputs_from_a_generate_report(tiny_base_dir, tmp_path, capsys):
    """The depth comes from the drafter's own description (a static tree's tree_depth; EAGLE-3's depth). Found by
    review: only EAGLE-3's key was read, so a heads', SSM's or DFlash report was solved at depth 1."""
    from draftlab.base import load_base
    from draftlab.decode.tree import Tree
    from draftlab.drafters import build_draft, make_drafter

    base, _ = load_base(str(tiny_base_dir), "float32")
    a, depth = 0.7, 4
    tau = (1 - a ** (depth + 1)) / (1 - a)
    for head in ({"type": "ssm", "ssm": {"num_layers": 1, "init": "truncate"}}, {"type": "eagle3"}):
        draft = build_draft(head, base)
        drafter = make_drafter(draft, Tree.chain(depth) if head["type"] == "ssm" else None)
        if head["type"] == "eagle3":
            drafter.depth = depth
        rep = {"steps": 100, "accept_length": tau, "time_split_s": {"draft": 0.8, "verify": 3.0, "accept": 0.1},
               "drafter": drafter.describe()}
        got = from_generate(rep)
        assert got["depth"] == depth and got["acceptance"] == pytest.approx(a, abs=1e-3)
        # the target's step is all of a step but drafting: acceptance and commit too (review: verify alone)
        assert got["t_target"] == pytest.approx(0.031) and got["t_draft"] == pytest.approx(0.002)
        assert got["path"] == "eager"
    assert from_generate({**rep, "compiled": True})["path"] == "compiled"
    assert from_generate({**rep, "compiled": True, "compile_failed": "no C compiler"})["path"] == \
        "eager (the compile fell back: no C compiler)"
    with pytest.raises(ValueError, match="names no tree depth"):
        from_generate({**rep, "drafter": {"kind": "ensemble"}})
    # A report whose drafting ran inside its verification calls (the chained step) has no drafting time to read.
    with pytest.raises(ValueError, match="DRAFTLAB_CHAINED_STEP=0"):
        from_generate({**rep, "chained_steps": 40})

    # The table said nothing of where its latencies came from (the path and batch size were in --json only).
    from draftlab.cli import main

    (tmp_path / "r.json").write_text(json.dumps({**rep, "compiled": True, "batch_size": 2}) + "\n")
    assert main(["simulate", "--from-report", str(tmp_path / "r.json")]) == 0
    out, err = capsys.readouterr()
    assert (f"from {tmp_path / 'r.json'}: the target's latency, the drafter's, the acceptance rate, of its compiled "
            "path at batch size 2") in out
    # An EAGLE-3 drafter cannot draft ahead of verification, which DSI's model assumes (a Medusa report was modelled
    # without a word: walk-through); an SSM's report gets no such note.
    assert "its drafter (eagle3) reads the base's hidden states of the verified tokens, so it cannot draft ahead" in err
    assert drafts_ahead_note("ssm") is None and "in one forward" in drafts_ahead_note("medusa")
    # Figures given on the command line are not the report's (it was named as their source: walk-through)
    assert main(["simulate", "--from-report", str(tmp_path / "r.json"), "--acceptance", "0.5"]) == 0
    assert "r.json: the target's latency, the drafter's, of its" in capsys.readouterr().out
    assert main(["simulate", "--from-report", str(tmp_path / "r.json"), "--acceptance", "0.5", "--target-ms", "30",
                 "--drafter-ms", "3"]) == 0
    assert "r.json: not read, every figure was given on the command line" in capsys.readouterr().out


def test_simulate_command(tmp_path, capsys):
    png = tmp_path / "h.png"
    assert main(["simulate", "--target-ms", "30", "--drafter-ratio", "0.1", "--acceptance", "0.8", "--sp", "7",
                 "--monte-carlo", "20", "--heatmap", str(png), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert png.is_file() and rep["inputs"]["lookahead"] == 2 and rep["sp_sufficient"]
    assert rep["monte_carlo"]["total"]["dsi"] == pytest.approx(rep["total"]["dsi"], rel=0.1)
    # Without --json the simulated runs are printed too (they were computed and dropped: walk-through)
    assert main(["simulate", "--target-ms", "30", "--drafter-ratio", "0.1", "--acceptance", "0.8", "--sp", "7",
                 "--monte-carlo", "20"]) == 0
    assert "simulated event by event, mean of 20 runs: total ms non-SI" in capsys.readouterr().out
    # The default lookahead is the one of least expected latency (waits included); --lookahead-rule no-wait keeps
    # the smallest with which no task waits (15 here, slower than SI).
    for rule, k in (("expected", 1), ("no-wait", 15)):
        assert main(["simulate", "--target-ms", "30", "--drafter-ratio", "0.01", "--acceptance", "0.3", "--tokens",
                     "50", "--lookahead-rule", rule, "--json"]) == 0
        rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rep["inputs"]["lookahead"] == k and rep["inputs"]["lookahead_rule"] == rule
        assert (rep["exact_total"]["dsi"] < rep["exact_total"]["si"]) == (rule == "expected")
    assert main(["simulate", "--target-ms", "30", "--acceptance", "0.8"]) == 2
    assert "--drafter-ms" in capsys.readouterr().err
    # Two drafter latencies (the ratio was dropped in silence), and a negative run count (a ZeroDivisionError):
    # walk-through.
    assert main(["simulate", "--target-ms", "30", "--drafter-ms", "3", "--drafter-ratio", "0.5", "--acceptance",
                 "0.8"]) == 2
    assert "--drafter-ms and --drafter-ratio both give the drafter's latency" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--target-ms", "30", "--drafter-ms", "3", "--acceptance", "0.8", "--monte-carlo", "-5"])
    assert "-5 is not >= 0" in capsys.readouterr().err
    # The speedups are the exact totals' ratios, which the lookaheads are chosen by: a short text's DSI at its best
    # lookahead read as slower than SI (0.85x) by the closed form's per-token figures, and SI took a lookahead of 25
    # for a text of 8 tokens (walk-through).
    assert main(["simulate", "--target-ms", "30", "--drafter-ms", "1", "--acceptance", "0.95", "--tokens", "8",
                 "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ex = rep["exact_total"]
    assert rep["speedup"]["dsi_vs_si"] == pytest.approx(ex["si"] / ex["dsi"]) and ex["dsi"] <= ex["si"]
    assert rep["speedup_per_token"]["dsi_vs_si"] == pytest.approx(rep["total"]["si"] / rep["total"]["dsi"])
    assert rep["si_lookahead"] <= 6
    # Negative latencies printed negative latencies, and a failed run's report was a KeyError (walk-through).
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--target-ms", "-30", "--drafter-ms", "3", "--acceptance", "0.8"])
    assert e.value.code == 2 and "-30.0 is not > 0" in capsys.readouterr().err
    assert main(["simulate", "--target-ms", "30", "--drafter-ms", "40", "--acceptance", "0.9"]) == 2
    assert "drafter 40 ms > target 30 ms: this model (the DSI paper's) has a drafter no slower" in \
        capsys.readouterr().err
    assert main(["simulate", "--target-ms", "30", "--drafter-ms", "30", "--acceptance", "0.9"]) == 0  # (the grid's end)
    capsys.readouterr()
    (tmp_path / "err.json").write_text(json.dumps({"error": "x: not a draftlab export"}) + "\n")
    assert main(["simulate", "--from-report", str(tmp_path / "err.json")]) == 2
    assert "the run it holds failed (x: not a draftlab export)" in capsys.readouterr().err
