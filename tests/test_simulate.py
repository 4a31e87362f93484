"""`draftlab simulate`: the closed forms against the event-by-event simulator, the limits they must reach, the
smallest-sufficient-lookahead rule, inputs from a generate report, and the command."""

import json
import random

import pytest

from draftlab.cli import main
from draftlab.parallel.simulate import (Config, best_si_lookahead, dsi_time_per_token, expected, from_generate,
                               min_lookahead, si_time_per_token, simulate_dsi, simulate_si)


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


def test_inputs_from_a_generate_report():
    a, depth = 0.7, 4
    tau = (1 - a ** (depth + 1)) / (1 - a)
    rep = {"steps": 100, "accept_length": tau, "time_split_s": {"draft": 0.8, "verify": 3.0, "accept": 0.1},
           "drafter": {"kind": "ssm", "depth": depth}}
    got = from_generate(rep)
    assert got["acceptance"] == pytest.approx(a, abs=1e-3)
    assert got["t_target"] == pytest.approx(0.03) and got["t_draft"] == pytest.approx(0.002)


def test_simulate_command(tmp_path, capsys):
    png = tmp_path / "h.png"
    assert main(["simulate", "--target-ms", "30", "--drafter-ratio", "0.1", "--acceptance", "0.8", "--sp", "7",
                 "--monte-carlo", "20", "--heatmap", str(png), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert png.is_file() and rep["inputs"]["lookahead"] == 2 and rep["sp_sufficient"]
    assert rep["monte_carlo"]["total"]["dsi"] == pytest.approx(rep["total"]["dsi"], rel=0.1)
    assert main(["simulate", "--target-ms", "30", "--acceptance", "0.8"]) == 2
    assert "--drafter-ms" in capsys.readouterr().err
