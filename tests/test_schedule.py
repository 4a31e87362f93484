"""Speculation schedules per batch size (draftlab/serve/schedule.py): the choice from given costs, the three files
it writes, and `search-tree --batch-sizes` end to end on a tiny export."""

import json
from pathlib import Path

import pytest

from draftlab.decode.tree import Tree
from draftlab.serve.schedule import (choose_schedule, engine_paths, is_chain, parse_sglang_flags, sglang_settings,
                                     sglang_text, tree_for_batch, vllm_config, write_schedule)
from test_search import search_inputs

WIDE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
CANDIDATES = [{"name": "chain-1", "paths": [[0]], "accept_length": 1.6},
              {"name": "chain-3", "paths": [[0], [0, 0], [0, 0, 0]], "accept_length": 2.2},
              {"name": "greedy-7", "paths": WIDE, "accept_length": 2.8}]
# Seconds per verification step: at batch 1 the base is latency-bound (bigger trees cost little more); at 4 a tree
# costs more per token verified; at 16 even one drafted token costs more than it saves.
STEP_S = {1: {"chain-1": 1.05, "chain-3": 1.1, "greedy-7": 1.2},
          4: {"chain-1": 1.3, "chain-3": 2.0, "greedy-7": 3.0},
          16: {"chain-1": 4.5, "chain-3": 6.0, "greedy-7": 9.0}}
PLAIN_S = {1: 1.0, 4: 1.0, 16: 2.0}


def test_each_batch_size_gets_the_tree_with_the_highest_expected_throughput_and_the_cutoff():
    sched = choose_schedule([16, 1, 4], CANDIDATES, STEP_S, PLAIN_S)
    got = {e["batch_size"]: e for e in sched["entries"]}
    assert [e["batch_size"] for e in sched["entries"]] == [1, 4, 16]
    # batch 1: 2.8 / 1.2 = 2.33 tokens per second beats 2.2 / 1.1 = 2.0, 1.6 / 1.05 and plain's 1.0
    assert got[1]["tree"] == "greedy-7" and got[1]["paths"] == WIDE and got[1]["tree_size"] == 8
    assert got[1]["estimated_tokens_per_s"] == pytest.approx(2.8 / 1.2, abs=0.01)
    assert got[1]["chain_length"] == 3  # the best chain there (for vLLM): 2.0 against 1.52
    # batch 4: 4 x 1.6 / 1.3 = 4.92 beats 4 x 2.2 / 2 = 4.4, 4 x 2.8 / 3 = 3.73 and plain's 4 / 1 = 4
    assert got[4]["tree"] == "chain-1" and got[4]["chain_length"] == 1 and got[4]["speculate"]
    # batch 16: plain's 16 / 2 = 8 beats chain-1's 16 x 1.6 / 4.5 = 5.7
    assert not got[16]["speculate"] and got[16]["tree"] == "plain" and got[16]["paths"] == []
    assert got[16]["chain_length"] == 0 and got[16]["estimated_tokens_per_s"] == pytest.approx(8.0)
    assert sched["no_speculation_above"] == 4


def test_the_cutoff_says_when_speculation_always_or_never_pays():
    fast = {B: {n: 0.5 for n in STEP_S[1]} for B in (1, 4, 16)}
    assert choose_schedule([1, 4, 16], CANDIDATES, fast, PLAIN_S)["no_speculation_above"] is None
    slow = {B: {n: 10.0 for n in STEP_S[1]} for B in (1, 4, 16)}
    sched = choose_schedule([1, 4, 16], CANDIDATES, slow, PLAIN_S)
    assert sched["no_speculation_above"] == 0 and not any(e["speculate"] for e in sched["entries"])
    with pytest.raises(ValueError, match="batch size 8"):
        choose_schedule([1, 8], CANDIDATES, STEP_S, PLAIN_S)


def test_vllm_config_gives_the_chain_length_per_batch_size_range():
    entries = choose_schedule([1, 4, 16], CANDIDATES, STEP_S, PLAIN_S)["entries"]
    cfg = vllm_config(entries, "medusa", "serve/medusa")
    assert set(cfg) == {"method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size"}
    assert cfg["method"] == "medusa" and cfg["model"] == "serve/medusa"
    assert cfg["num_speculative_tokens_per_batch_size"] == [[1, 3, 3], [4, 15, 1], [16, 16, 0]]
    assert cfg["num_speculative_tokens"] == 3  # the largest K: vLLM sizes its buffers by it
    same = [{**e, "chain_length": 2} for e in entries]  # equal neighbours merge into one range
    assert vllm_config(same, "eagle3", "d")["num_speculative_tokens_per_batch_size"] == [[1, 16, 2]]


def test_sglang_settings_follow_the_tree_and_a_chain_has_one_more_draft_token_than_steps():
    entries = choose_schedule([1, 4, 16], CANDIDATES, STEP_S, PLAIN_S)["entries"]
    assert sglang_settings(entries[0]) == {"num_steps": 3, "eagle_topk": 3, "num_draft_tokens": 8}
    chain = sglang_settings(entries[1])
    assert chain["eagle_topk"] == 1 and chain["num_draft_tokens"] == chain["num_steps"] + 1 == 2
    assert sglang_settings(entries[2]) is None
    flags = parse_sglang_flags(sglang_text(entries[1], "STANDALONE", "draft", cutoff=4))
    assert flags == {"--speculative-algorithm": "STANDALONE", "--speculative-draft-model-path": "draft",
                     "--speculative-num-steps": "1", "--speculative-eagle-topk": "1",
                     "--speculative-num-draft-tokens": "2"}
    assert parse_sglang_flags(sglang_text(entries[2], "STANDALONE", "draft", cutoff=4)) == {}
    assert is_chain([[0], [0, 0]]) and not is_chain([[0], [1]]) and not is_chain([[0], [0, 0], [0, 1]])


def test_dflash_exports_get_engine_chains_of_whole_blocks(tmp_path):
    """SGLang serves DFlash drafts (--speculative-algorithm DFLASH, one chain a step, steps and top-k fixed at 1):
    the flags give --speculative-num-draft-tokens = the chain + 1 (search-tree wrote no SGLang file for DFlash
    exports before). The engines draft a block num_speculative_tokens + 1 long, and a shorter block drafts other
    tokens than the trained block's first positions (which draftlab measured): the engines' chains are whole blocks
    (engine_chains), or none where plain decoding beats them."""
    sched = choose_schedule([1, 4, 16], CANDIDATES, STEP_S, PLAIN_S)
    assert [e["chain_length"] for e in sched["entries"]] == [3, 1, 0]  # any chain: the best by the estimate
    whole = choose_schedule([1, 4, 16], CANDIDATES, STEP_S, PLAIN_S, engine_chains={3})
    assert [e["chain_length"] for e in whole["entries"]] == [3, 3, 0]  # batch 4: chain-3 beats plain, not chain-1
    assert [e["tree"] for e in whole["entries"]] == [e["tree"] for e in sched["entries"]]  # draftlab's own: as before
    assert parse_sglang_flags(sglang_text(whole["entries"][0], "DFLASH", "draft", cutoff=4)) == {
        "--speculative-algorithm": "DFLASH", "--speculative-draft-model-path": "draft",
        "--speculative-num-draft-tokens": "4"}
    assert parse_sglang_flags(sglang_text(whole["entries"][2], "DFLASH", "draft", cutoff=4)) == {}
    files = write_schedule(tmp_path / "d.json", whole, {}, "dflash", "exp")
    text = Path(files["sglang"]).read_text()
    assert parse_sglang_flags(text)["--speculative-num-draft-tokens"] == "4"
    assert "stopped paying above batch size 4" in text  # (the whole block's cutoff, not the best tree's)
    cfg = json.loads(Path(files["vllm"]).read_text())
    assert cfg["method"] == "dflash" and cfg["num_speculative_tokens_per_batch_size"] == [[1, 15, 3], [16, 16, 0]]


def test_the_schedule_file_is_a_tree_file_and_gives_each_batch_size_its_tree(tmp_path):
    from draftlab.serve.generate import resolve_tree

    sched = choose_schedule([1, 4, 16], CANDIDATES, STEP_S, PLAIN_S)
    out = tmp_path / "sched" / "s.json"
    files = write_schedule(out, sched, {"name": "s", "hardware": "test"}, "ssm", "exp")
    tree = Tree.load(out)  # what `generate --tree FILE` reads: the smallest batch size's tree
    assert tree.paths == Tree.from_paths(WIDE).paths and tree.metadata["no_speculation_above"] == 4
    assert resolve_tree(str(out), {"head": {"type": "ssm"}}).paths == tree.paths
    assert tree_for_batch(out, 1).paths == tree.paths and tree_for_batch(out, 3).paths == tree.paths
    assert tree_for_batch(out, 8).paths == ((0,),)
    assert tree_for_batch(out, 16) is None and tree_for_batch(out, 64) is None  # plain decoding, said explicitly
    vllm, sglang = engine_paths(out)
    assert files == {"tree": str(out), "vllm": str(vllm), "sglang": str(sglang)}
    assert json.loads(vllm.read_text())["method"] == "draft_model"
    assert parse_sglang_flags(sglang.read_text())["--speculative-algorithm"] == "STANDALONE"
    slow = {B: {n: 10.0 for n in STEP_S[1]} for B in (1, 4, 16)}  # plain wins at batch 1: keep its fastest tree
    write_schedule(out, choose_schedule([1, 4, 16], CANDIDATES, slow, PLAIN_S), {}, "ssm", "exp")
    assert Tree.load(out).paths == Tree.from_paths(WIDE).paths and Tree.load(out).metadata["plain_is_faster"]
    assert tree_for_batch(out, 1) is None
    files = write_schedule(tmp_path / "h.json", sched, {}, "hydra", "exp")  # no engine serves Hydra heads
    assert files["vllm"].startswith("not written") and files["sglang"].startswith("not written")
    assert not engine_paths(tmp_path / "h.json")[0].exists()


def test_search_tree_batch_sizes_writes_the_schedule_in_three_syntaxes(tiny_base_dir, tmp_path, capsys, monkeypatch):
    from draftlab.cli import main
    from draftlab.serve.generate import load_decoder, run_generate

    exp, data = search_inputs(tiny_base_dir, tmp_path, "ssm")
    out = tmp_path / "sched.json"
    monkeypatch.chdir(exp.parent)  # the export given relative: the engines' files name it absolute (they run elsewhere)
    assert main(["search-tree", exp.name, "--data", str(data), "--out", str(out), "--batch-sizes", "1,2",
                 "--max-nodes", "4", "--max-depth", "3", "--calibration-prompts", "6", "--timing-prompts", "2",
                 "--max-new-tokens", "8", "--timing-rounds", "1", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [e["batch_size"] for e in rep["schedule"]] == [1, 2]
    names = {r["name"] for r in rep["candidates"]}
    assert {"chain-2", "chain-3"} <= names  # chains of every length beside the grown trees (vLLM's choices)
    assert {(m["batch_size"], m["name"]) for m in rep["measured"]} >= {(1, "plain"), (2, "plain"), (2, "chain-3")}
    for e in rep["schedule"]:
        assert e["tokens_per_s"] > 0 and e["plain_tokens_per_s"] > 0
    tree, first = Tree.load(out), rep["schedule"][0]
    # the batch-1 tree; where plain decoding won there, the fastest tree (an SSM drafter needs one)
    assert [list(p) for p in tree.paths] == (first["paths"] if first["speculate"] else first["fastest_tree_paths"])
    assert tree.metadata.get("plain_is_faster", False) == (not first["speculate"])
    assert tree.metadata["batch_sizes"] == [1, 2] and len(json.loads(out.read_text())["schedule"]) == 2
    vllm, sglang = engine_paths(out)
    cfg = json.loads(vllm.read_text())
    assert cfg["method"] == "draft_model" and cfg["model"] == str(exp)
    ranges = cfg["num_speculative_tokens_per_batch_size"]
    assert ranges[0][0] == 1 and ranges[-1][1] == 2 and all(0 <= k <= 3 for _, _, k in ranges)
    flags = parse_sglang_flags(sglang.read_text())
    if rep["schedule"][0]["speculate"]:
        steps, topk = int(flags["--speculative-num-steps"]), int(flags["--speculative-eagle-topk"])
        assert flags["--speculative-draft-model-path"] == str(exp)
        assert steps == tree.depth and (topk > 1 or int(flags["--speculative-num-draft-tokens"]) == steps + 1)
    else:
        assert flags == {}
    # generate --tree FILE follows the schedule: batch 1's tree, or plain steps where plain decoding won; lossless
    decoder, tok, _ = load_decoder(str(exp), tree=str(out))
    assert decoder.drafter.max_nodes == (tree.size if first["speculate"] else 1)
    assert run_generate(decoder, tok, ["Once upon a time"], 8, compare=True)["identical_to_baseline"]


def test_full_batches_repeat_the_prompts_cyclically_to_whole_batches():
    from draftlab.serve.schedule import full_batches

    ps = [[1], [2], [3], [4], [5]]
    assert full_batches(ps, 2) == ps + [[1]]
    assert full_batches(ps, 3, at_least=8) == ps + [[1], [2], [3], [4]]
    assert full_batches(ps, 8) == ps + [[1], [2], [3]]
    assert full_batches(ps, 1) == ps and full_batches(ps, 5) == ps


def test_every_timed_batch_has_exactly_batch_size_rows(tiny_base_dir, tmp_path, monkeypatch):
    """Batch sizes 2 and 3 over 2 timing prompts: repeated whole to 4 prompts, batch size 3 timed a batch of 3
    and a batch of 1, whose cheaper steps biased its step time low."""
    from draftlab.serve import tree_search
    from draftlab.serve.schedule import search_schedule

    exp, data = search_inputs(tiny_base_dir, tmp_path, "ssm")
    timed, measure = [], tree_search.measure

    def spy(decoder, prompts, batch_size, max_new_tokens, eos, warm=True):
        if warm:  # the warm-up, outside the timing, is not a timed batch
            decoder.warm_up(prompts[:batch_size], max_new_tokens, eos_token_id=eos)
        generate = decoder.generate

        def counted(batch, **kw):
            timed.append((batch_size, len(batch)))
            return generate(batch, **kw)
        decoder.generate = counted
        try:
            return measure(decoder, prompts, batch_size, max_new_tokens, eos, warm=False)
        finally:
            del decoder.generate
    monkeypatch.setattr(tree_search, "measure", spy)
    rep = search_schedule(str(exp), str(data), str(tmp_path / "s.json"), [2, 3], max_nodes=2, max_depth=2,
                          calibration_prompts=6, timing_prompts=2, max_new_tokens=4, timing_rounds=1)
    assert {B for B, _ in timed} == {2, 3} and all(rows == B for B, rows in timed), timed
    assert Tree.load(tmp_path / "s.json").metadata["timed_rows"] == {"2": 4, "3": 3}
    assert [e["batch_size"] for e in rep["schedule"]] == [2, 3]


def test_a_dflash_schedule_times_the_whole_block_for_the_engines(tiny_base_dir, tmp_path):
    """DFlash's engine chain is its whole block: timed even where --max-nodes is below it, so the engines' files
    are decided by its figures (without it they said "no drafting" at every batch size)."""
    from draftlab.serve.schedule import search_schedule

    exp, data = search_inputs(tiny_base_dir, tmp_path, "dflash")  # blocks of 4: a chain of 3
    rep = search_schedule(str(exp), str(data), str(tmp_path / "s.json"), [1], max_nodes=2, max_rank=10_000,
                          calibration_prompts=6, timing_prompts=2, max_new_tokens=4, timing_rounds=1)
    assert max(c["tree_size"] for c in rep["candidates"]) == 4  # the chain of 3 beside those of --max-nodes 2
    sched = json.loads((tmp_path / "s.json").read_text())["schedule"]
    assert sched[0]["chain_length"] in (0, 3) and sched[0]["estimated_chain_tokens_per_s"] is not None


def test_plain_batch_sizes_decode_plain_steps_with_an_ssm_drafter(tiny_base_dir, tmp_path):
    """Where the schedule says plain decoding, the decoder for that batch size runs plain steps: a root-only tree
    (what tree_for_batch gave) is refused by an SSM drafter. Every batch size's decoder gives plain greedy's tokens."""
    from draftlab.decode.acceptance import Sampling
    from draftlab.decode.decoder import NoDraft
    from draftlab.drafters import make_drafter
    from draftlab.interop.export import load_export
    from draftlab.base import load_base
    from draftlab.serve.generate import plain_generate
    from draftlab.serve.schedule import decoder_for_batch, drafter_for_batch

    exp, _ = search_inputs(tiny_base_dir, tmp_path, "ssm")
    base, tok = load_base(str(tiny_base_dir), "float32")
    draft, _ = load_export(str(exp), base=base, device="cpu")
    out = tmp_path / "s.json"
    write_schedule(out, choose_schedule([1, 4, 16], CANDIDATES, STEP_S, PLAIN_S), {}, "ssm", "exp")
    with pytest.raises(ValueError, match="depth >= 1"):
        make_drafter(draft, Tree.from_paths([]))  # why plain decoding cannot be a root-only tree
    assert isinstance(drafter_for_batch(draft, out, 16), NoDraft) and isinstance(drafter_for_batch(draft, out, 40),
                                                                                  NoDraft)
    assert drafter_for_batch(draft, out, 4).max_nodes == 2  # chain-1 there
    prompts = [tok(t, add_special_tokens=False).input_ids for t in
               ["Once upon a time", "The cat", "A dog ran", "She said"]]
    reference, _ = plain_generate(base, prompts, 10, Sampling(), tok.eos_token_id)
    for B in (1, 4, 16):
        dec = decoder_for_batch(base, draft, out, B)
        res = dec.generate(prompts, max_new_tokens=10, eos_token_id=tok.eos_token_id)
        assert res.tokens == reference, B
    # load_decoder(--tree FILE) follows the schedule call by call: each batch size's drafter, the same tokens.
    from draftlab.serve.generate import load_decoder
    from draftlab.serve.schedule import ScheduledDecoder

    dec, _, _ = load_decoder(str(exp), tree=str(out))
    assert isinstance(dec, ScheduledDecoder)
    many = prompts * 4  # 16 rows: plain steps there
    want, _ = plain_generate(base, many, 10, Sampling(), tok.eos_token_id)
    for rows, ref, drafter in ((prompts[:1], reference[:1], "SSMDrafter"), (prompts, reference, "SSMDrafter"),
                               (many, want, "NoDraft")):
        res = dec.generate(rows, max_new_tokens=10, eos_token_id=tok.eos_token_id)
        assert res.tokens == ref and type(dec.for_batch(len(rows)).drafter).__name__ == drafter, len(rows)
    assert dec.for_batch(1).drafter.max_nodes != dec.for_batch(4).drafter.max_nodes  # two trees, two decoders
    # generate's report on 4 prompts is the batch-4 decoder's, warmed up before the timed run (review: it described
    # the batch-1 tree, and a compiled batch-4 decoder compiled inside the timed run)
    from draftlab.serve.generate import run_generate

    dec, tok, _ = load_decoder(str(exp), tree=str(out))
    rep = run_generate(dec, tok, ["Once upon a time", "The cat", "A dog ran", "She said"], max_new_tokens=10)
    assert rep["batch_size"] == 4 and rep["tree_size"] == 2 and rep["drafter"]["tree"].endswith("@b4")
    assert list(dec._by_batch) == [4]


# Measured tokens/s of decoding the timing prompts in static batches (rows end at different steps): at batch 1 the
# 3-chain beats the 7-node tree the estimate picks; at 4 plain decoding beats both finalists (greedy-7's 9.0 is not
# a finalist with 2 of them: its estimate is the lowest there); at 16 the 1-chain beats plain decoding.
TIMED = {1: {"greedy-7": 1.5, "chain-3": 1.9, "chain-1": 1.4, "plain": 1.0},
         4: {"chain-1": 3.5, "chain-3": 3.2, "greedy-7": 9.0, "plain": 3.9},
         16: {"chain-1": 9.0, "chain-3": 5.0, "greedy-7": 1.0, "plain": 8.0}}


def test_schedule_by_timed_chooses_among_the_estimates_finalists_by_measured_tokens_per_s(tmp_path):
    est = choose_schedule([1, 4, 16], CANDIDATES, STEP_S, PLAIN_S)
    assert choose_schedule([1, 4, 16], CANDIDATES, STEP_S, PLAIN_S, by="estimate", tokens_per_s=TIMED) == est
    sched = choose_schedule([1, 4, 16], CANDIDATES, STEP_S, PLAIN_S, by="timed", tokens_per_s=TIMED, finalists=2)
    got = {e["batch_size"]: e for e in sched["entries"]}
    assert got[1]["finalists"] == ["greedy-7", "chain-3", "plain"] and got[1]["tree"] == "chain-3"
    assert got[1]["paths"] == [[0], [0, 0], [0, 0, 0]] and got[1]["tree_size"] == 4 and got[1]["speculate"]
    assert got[1]["estimated_tokens_per_s"] == pytest.approx(2.2 / 1.1, abs=0.01)  # the estimate of the chosen one
    assert got[4]["finalists"] == ["chain-1", "chain-3", "plain"]
    assert not got[4]["speculate"] and got[4]["tree"] == "plain" and got[4]["paths"] == []
    assert got[4]["fastest_tree"] == "chain-1"  # the fastest drafting finalist, timed
    assert got[16]["tree"] == "chain-1" and got[16]["speculate"]
    assert sched["schedule_by"] == "timed" and sched["no_speculation_above"] is None
    # the engines keep their batches full: their choices stay the estimate's
    assert sched["estimate_no_speculation_above"] == est["no_speculation_above"] == 4
    assert [e["estimate_tree"] for e in sched["entries"]] == [e["tree"] for e in est["entries"]]
    assert vllm_config(sched["entries"], "draft_model", "d") == vllm_config(est["entries"], "draft_model", "d")
    assert sglang_settings(got[1]) == sglang_settings(est["entries"][0]) == {"num_steps": 3, "eagle_topk": 3,
                                                                             "num_draft_tokens": 8}
    out = tmp_path / "t.json"
    files = write_schedule(out, sched, {}, "ssm", "exp")
    tree = Tree.load(out)  # draftlab's own decoder gets the timed choice
    assert tree.paths == Tree.from_paths([[0], [0, 0], [0, 0, 0]]).paths and tree.metadata["schedule_by"] == "timed"
    assert tree_for_batch(out, 4) is None and tree_for_batch(out, 20).paths == ((0,),)
    sglang = open(files["sglang"]).read()
    assert parse_sglang_flags(sglang)["--speculative-eagle-topk"] == "3" and "above batch size 4" in sglang
    with pytest.raises(ValueError, match="schedule-by"):
        choose_schedule([1], CANDIDATES, STEP_S, PLAIN_S, by="fastest")
    with pytest.raises(ValueError, match="tokens/s"):
        choose_schedule([1], CANDIDATES, STEP_S, PLAIN_S, by="timed")


def test_search_tree_schedule_by_timed_decodes_like_plain_greedy_at_every_batch_size(tiny_base_dir, tmp_path,
                                                                                      capsys):
    from draftlab.base import load_base
    from draftlab.cli import main
    from draftlab.decode.acceptance import Sampling
    from draftlab.interop.export import load_export
    from draftlab.serve.generate import plain_generate
    from draftlab.serve.schedule import TIMED_FINALISTS, decoder_for_batch

    exp, data = search_inputs(tiny_base_dir, tmp_path, "ssm")
    out = tmp_path / "timed.json"
    assert main(["search-tree", str(exp), "--data", str(data), "--out", str(out), "--batch-sizes", "1,2,3",
                 "--schedule-by", "timed", "--max-nodes", "4", "--max-depth", "3", "--calibration-prompts", "6",
                 "--timing-prompts", "2", "--max-new-tokens", "8", "--timing-rounds", "1", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["schedule_by"] == "timed" and Tree.load(out).metadata["schedule_by"] == "timed"
    for e in rep["schedule"]:
        fin = e["finalists"]
        assert fin[-1] == "plain" and 2 <= len(fin) <= TIMED_FINALISTS + 1 and e["tree"] in fin
        timed = e["timed_finalists_tokens_per_s"]
        assert timed[e["tree"]] == max(timed.values())  # the choice is the finalist that decoded fastest here
    base, tok = load_base(str(tiny_base_dir), "float32")
    draft, _ = load_export(str(exp), base=base, device="cpu")
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    prompts = [tok(t[:24], add_special_tokens=False).input_ids for t in texts[:6]]
    reference, _ = plain_generate(base, prompts, 8, Sampling(), tok.eos_token_id)
    for B in (1, 2, 3, 5):  # static batches of B with the schedule's choice there
        dec = decoder_for_batch(base, draft, out, B)
        toks = []
        for s in range(0, len(prompts), B):
            toks += dec.generate(prompts[s:s + B], max_new_tokens=8, eos_token_id=tok.eos_token_id).tokens
        assert toks == reference, B
