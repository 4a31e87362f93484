"""`draftlab simulate`: the closed forms against the event-by-event simulator, the limits they must reach, the
smallest-sufficient-lookahead rule, inputs from a generate report, and the command."""

import json
import random

import pytest

from draftlab.cli import main
from draftlab.simulate import (Config, best_si_lookahead, dsi_time_per_token, expected, from_generate,
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
    assert all(simulate_dsi(400, 0.95, k, td, tt, sp, rng)["waited"] == 0 for _ in range(20))
    assert sum(simulate_dsi(400, 0.95, k - 1, td, tt, sp, rng)["waited"] for _ in range(20)) > 0


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
