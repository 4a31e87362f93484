"""distill-data through OpenAI-compatible servers: the same records as in-process, retries across endpoints,
resume, every assistant turn regenerated, clear errors."""

import json
import time
import socket

import pytest

from draftlab.data import DataError
from draftlab.train.distill import distill_data
from openai_server import serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tiny_base_dir):
    url, srv, stats = serve(str(tiny_base_dir), fail_every=3)
    yield url, stats
    srv.shutdown()


def chats(path, n=6):
    recs = [{"conversations": [{"from": "human", "value": f"Tell me about cat {i}."},
                               {"from": "gpt", "value": "old answer"},
                               {"from": "human", "value": f"And dog {i}?"},
                               {"from": "gpt", "value": "old answer 2"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def lines(path):
    return sorted((json.loads(l) for l in path.read_text().splitlines()), key=lambda r: r["source_index"])


@pytest.mark.parametrize("mode,all_turns", [("chat", False), pytest.param("chat", True, marks=pytest.mark.slow),
                                            ("text", False)])
def test_endpoint_records_equal_in_process_records(tiny_base_dir, server, tmp_path, mode, all_turns):
    url, stats = server
    src = chats(tmp_path / "p.jsonl")
    if mode == "text":
        src.write_text("".join(json.dumps({"text": f"Once upon a time there was a cat number {i} who"}) + "\n"
                               for i in range(6)))
    kw = dict(max_new_tokens=8, mode=mode, all_turns=all_turns, prompt_chars=30)
    local = distill_data(str(tiny_base_dir), str(src), str(tmp_path / "local.jsonl"), batch_size=4, **kw)
    # A dead endpoint first: its requests fail and move to the live one; the live one also answers 503 now and then.
    remote = distill_data(None, str(src), str(tmp_path / "remote.jsonl"), endpoints=[f"http://127.0.0.1:{free_port()}", url],
                          concurrency=3, retries=6, **kw)
    assert local["written"] == remote["written"] == 6 and stats["failed"] > 0
    assert lines(tmp_path / "local.jsonl") == lines(tmp_path / "remote.jsonl")
    recs = lines(tmp_path / "remote.jsonl")
    if all_turns:  # both assistant turns regenerated, in order, the second seeing the base's own first answer
        conv = recs[0]["conversations"]
        assert [t["from"] for t in conv] == ["human", "gpt", "human", "gpt"] and "old answer" not in json.dumps(conv)
    elif mode == "chat":
        assert len(recs[0]["conversations"]) == 2
    else:
        assert recs[0]["text"].startswith("Once upon a time")


def test_endpoint_run_resumes_and_reports_errors(server, tmp_path):
    url, _ = server
    src = chats(tmp_path / "p.jsonl")
    out = tmp_path / "o.jsonl"
    distill_data(None, str(src), str(out), max_new_tokens=4, max_records=2, endpoints=[url], retries=5)
    again = distill_data(None, str(src), str(out), max_new_tokens=4, endpoints=[url], retries=5)
    assert again["skipped_existing"] == 2 and again["written"] == 4
    assert [r["source_index"] for r in lines(out)] == list(range(6))
    # A run killed mid-write leaves its last line torn: the next run drops it and writes that record again (it was
    # refused as "not a record this command wrote", and resuming was impossible).
    text = out.read_text().splitlines()
    out.write_text("\n".join(text[:-1]) + "\n" + text[-1][: len(text[-1]) // 2])
    torn = distill_data(None, str(src), str(out), max_new_tokens=4, endpoints=[url], retries=5)
    assert torn["skipped_existing"] == 5 and torn["written"] == 1
    assert [r["source_index"] for r in lines(out)] == list(range(6))
    with pytest.raises(DataError, match=r"HTTP 404: .*model 'nope' does not exist"):
        distill_data(None, str(src), str(tmp_path / "x.jsonl"), endpoints=[url], model="nope")
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DataError, match="no server answered GET /v1/models"):
        distill_data(None, str(src), str(tmp_path / "x.jsonl"), endpoints=[dead])
    with pytest.raises(DataError, match=r"failed after 2 tries.*run the same command again to resume"):
        distill_data(None, str(src), str(tmp_path / "x.jsonl"), endpoints=[dead], model="tiny", retries=1)
    with pytest.raises(DataError, match="--all-turns .* needs --mode chat"):
        distill_data(None, str(src), str(tmp_path / "x.jsonl"), endpoints=[url], mode="text", all_turns=True)


def test_a_failed_request_stops_the_batch_without_waiting_for_the_others_retries(monkeypatch):
    """A request that fails for good (or Ctrl-C) ends the batch: the requests in flight are not retried and those not
    sent are dropped (found by review: the thread pool's `with` block waited for every request, each up to timeout x
    tries, an hour by default, before the error or the interrupt reached the caller)."""
    import io
    import threading
    import urllib.error

    import draftlab.train.distill as distill

    calls = {"slow": 0}

    def urlopen(req, timeout):
        prompt = json.loads(req.data)["prompt"]
        if prompt == "bad":
            raise urllib.error.HTTPError(req.full_url, 400, "bad", {}, io.BytesIO(b"context too long"))
        calls["slow"] += 1
        time.sleep(0.2)
        raise OSError("connection reset")  # (retried after a backoff)

    monkeypatch.setattr(distill.urllib.request, "urlopen", urlopen)
    ep = distill.Endpoints(["http://127.0.0.1:1"], "tiny", 4, 0.0, 1.0, concurrency=2, retries=6, timeout=1.0)
    before = set(threading.enumerate())
    with pytest.raises(DataError, match="HTTP 400: context too long"):
        ep.answer(["slow", "bad", "slow", "slow"])
    for t in set(threading.enumerate()) - before:
        t.join(timeout=60)
    assert calls["slow"] <= 2  # (the one in flight, and at most one try more; 7 tries and 31 s of backoff before)


def test_a_folder_of_prompts_alone_resumes_record_by_record(tiny_base_dir, tmp_path):
    """Records numbered across a folder's files (found by review: each file's own numbering, so the second file's
    records were taken as done on resume), and records that hold prompts alone, no answer (found by review: none
    were read, "no prompts found")."""
    folder = tmp_path / "prompts"
    folder.mkdir()
    for name in ("a", "b"):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"conversations": [
            {"from": "human", "value": f"Tell me about cat {name}{i}."}]}) + "\n" for i in range(3)))
    out = tmp_path / "o.jsonl"
    first = distill_data(str(tiny_base_dir), str(folder), str(out), max_new_tokens=4, batch_size=2, max_records=4)
    again = distill_data(str(tiny_base_dir), str(folder), str(out), max_new_tokens=4, batch_size=2)
    assert (first["written"], again["skipped_existing"], again["written"]) == (4, 4, 2)
    recs = lines(out)
    assert [r["source_index"] for r in recs] == list(range(6))
    assert [r["conversations"][0]["value"] for r in recs] == [f"Tell me about cat {n}{i}." for n in "ab" for i in range(3)]


def _with_stop_token(tiny_base_dir, tmp_path, prompt: str) -> tuple[str, int, int]:
    """A copy of the tiny base whose generation_config.json adds, beside the tokenizer's EOS, a token its greedy
    answer to `prompt` meets early (as Llama-3's <|eot_id|>, Gemma's <end_of_turn>); (its path, the token, the
    answer's length with it)."""
    import shutil

    import torch

    from draftlab.base import load_base

    base, tok = load_base(str(tiny_base_dir), "float32")
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    gen = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, temperature=None,
                        top_p=None, top_k=None, eos_token_id=None, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    gen = gen.tolist()
    k = next(k for k in range(2, len(gen)) if gen[k] not in gen[:k] and gen[k] != tok.eos_token_id)
    d = tmp_path / "stop_base"
    shutil.copytree(tiny_base_dir, d)
    cfg = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**cfg, "eos_token_id": [tok.eos_token_id, gen[k]]}))
    return str(d), gen[k], k + 1


def test_answers_the_length_limit_cut_are_marked_and_teach_no_end_of_turn(tiny_base_dir, server, tmp_path):
    """An answer cut at --max-new-tokens was stored as if the base had ended it, and training then supervised the
    end of turn the chat template adds after it: the drafter learned to end answers where the base does not. Such
    answers are now marked `truncated` (in-process: no stop token came; through a server: finish_reason "length")
    and their end of turn is left out of the loss."""
    from draftlab.base import load_tokenizer
    from draftlab.data import to_messages, tokenize_chat

    url, _ = server
    src = chats(tmp_path / "p.jsonl", n=3)
    local = distill_data(str(tiny_base_dir), str(src), str(tmp_path / "l.jsonl"), max_new_tokens=5, batch_size=3)
    remote = distill_data(None, str(src), str(tmp_path / "r.jsonl"), max_new_tokens=5, endpoints=[url], retries=6)
    recs = lines(tmp_path / "l.jsonl")
    assert local["truncated"] == remote["truncated"] == 3 and recs == lines(tmp_path / "r.jsonl")
    assert all(r["conversations"][-1]["truncated"] is True for r in recs)

    tok = load_tokenizer(str(tiny_base_dir))
    msgs = to_messages(recs[0], "sharegpt")
    ids, mask = tokenize_chat(msgs, tok, 512)
    whole_ids, whole_mask = tokenize_chat([{k: v for k, v in m.items() if k != "truncated"} for m in msgs], tok, 512)
    assert ids == whole_ids and sum(mask) < sum(whole_mask)
    last = lambda ids, mask: ids[max(i for i, m in enumerate(mask) if m)]
    assert last(whole_ids, whole_mask) != last(ids, mask)
    assert tok.eos_token_id in [t for t, m in zip(whole_ids, whole_mask) if m]
    assert tok.eos_token_id not in [t for t, m in zip(ids, mask) if m]
    # The answer's own tokens stay supervised: the mask is the whole one up to the end of turn.
    assert sum(mask) >= 5 - 1 and all(a <= b for a, b in zip(mask, whole_mask))
    # Training counts them (its start record says how many answers it read as cut).
    from draftlab.config import DataSection
    from draftlab.data import load_examples

    assert load_examples(DataSection(path=str(tmp_path / "l.jsonl"), eval_size=0), tok)[2].truncated == 3


def test_texts_the_length_limit_cut_get_no_eos(tiny_base_dir, tmp_path, capsys):
    from draftlab.base import load_tokenizer
    from draftlab.data import pack_text

    tok = load_tokenizer(str(tiny_base_dir))
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"text": "Once upon a time there was a cat who"}) + "\n")
    s = distill_data(str(tiny_base_dir), str(src), str(tmp_path / "o.jsonl"), max_new_tokens=4, mode="text")
    rec = lines(tmp_path / "o.jsonl")[0]
    assert s["truncated"] == 1 and rec["truncated"] is True
    # A resumed run counts the file's cut answers, not only its own (walk-through: it said none after a resume).
    with open(src, "a") as f:
        f.write(json.dumps({"text": "The dog ran to the park and"}) + "\n")
    again = distill_data(str(tiny_base_dir), str(src), str(tmp_path / "o.jsonl"), max_new_tokens=4, mode="text")
    assert (again["skipped_existing"], again["written"], again["truncated"]) == (1, 1, 2)
    from draftlab.cli import main

    assert main(["distill-data", str(tiny_base_dir), "--prompts", str(src), "--out", str(tmp_path / "o.jsonl"),
                 "--max-new-tokens", "4", "--mode", "text"]) == 0
    assert (f"2 continuations in {tmp_path / 'o.jsonl'} reached the length limit (--max-new-tokens=4 in this run) "
            "before the base ended them: marked \"truncated\", so training learns no EOS there") in capsys.readouterr().out
    [(ids, _)] = pack_text([(rec["text"], True)], tok, 512)
    [(whole, _)] = pack_text([rec["text"]], tok, 512)
    assert whole.tolist() == ids.tolist() + [tok.eos_token_id]


def _short_context(tiny_base_dir, tmp_path):
    """A copy of the tiny base whose context is 16 tokens, and its original config."""
    import shutil

    d = tmp_path / "short"
    shutil.copytree(tiny_base_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16}))
    return d, cfg


def _spied(d, max_new_tokens, record):
    """LocalModel over d, and the list where each generate call's record(kwargs) goes."""
    from draftlab.train.distill import LocalModel

    lm = LocalModel(str(d), "float32", "cpu", max_new_tokens, 0.0, 1.0)
    asked, generate = [], lm.model.generate
    lm.model.generate = lambda **kw: asked.append(record(kw)) or generate(**kw)
    return lm, asked


def test_answers_stop_at_the_base_s_context(tiny_base_dir, tmp_path, capsys):
    """--max-new-tokens past the base's context ran generation on past it with only transformers' warning
    (walk-through: stories260K's 512 and the default 512): answers stop where prompt and answer fill the context,
    count as cut, and a note says so once."""
    d, _ = _short_context(tiny_base_dir, tmp_path)
    lm, asked = _spied(d, 40, lambda kw: kw["max_new_tokens"])
    prompt = "Once upon a time there was a cat who"
    n = len(lm.tok(prompt).input_ids)
    for _ in range(2):
        [(text, cut)] = lm.answer([prompt])
        assert cut and text.startswith(prompt)
    assert asked == [16 - n] * 2
    assert lm.answer(["Once"]) and asked[-1] == 16 - len(lm.tok("Once").input_ids) < 40  # (short prompts too)
    assert capsys.readouterr().err.count("note: the base's context is 16 tokens: a continuation stops where") == 1


def test_each_answer_gets_the_room_its_own_prompt_leaves_and_a_prompt_that_fills_the_context_none(
        tiny_base_dir, tmp_path):
    """A batch was cut at its longest prompt's room, so one long prompt shortened the others' answers, and a prompt
    that filled the context alone still got a token past it. Now each row gets its own room, such a prompt gets no
    record (all turns: its conversation ends there), and dynamic RoPE scaling (no hard limit) caps nothing."""
    from draftlab.train.distill import LocalModel

    d, cfg = _short_context(tiny_base_dir, tmp_path)
    lm, asked = _spied(d, 6, lambda kw: (len(kw["input_ids"]), kw["max_new_tokens"]))
    short, mid, full = "Once", "Once upon a time there was a cat who", "cat " * 20
    n = len(lm.tok(mid).input_ids)
    got = lm.answer([short, mid, full, short])
    assert got[2] is None and all(g is not None for j, g in enumerate(got) if j != 2)
    assert sorted(asked) == sorted([(2, 6), (1, 16 - n)])  # (the two short rows together, to the full 6)
    assert got[0] == got[3]

    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in [mid, full]))
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16}))
    s = distill_data(str(d), str(src), str(tmp_path / "o.jsonl"), max_new_tokens=6, mode="text", prompt_chars=200)
    assert s["written"] == 1 and s["too_long"] == 1 and [r["source_index"] for r in lines(tmp_path / "o.jsonl")] == [0]

    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16,
                                               "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                   "rope_theta": cfg.get("rope_theta", 10000.0)}}))
    dyn = LocalModel(str(d), "float32", "cpu", 6, 0.0, 1.0)
    assert dyn._context() is None and all(g is not None for g in dyn.answer([full, short]))


def test_all_turns_ends_a_conversation_at_a_turn_past_the_context():
    from draftlab.train.distill import _regenerate

    class Source:  # answers while a conversation's messages stay under 3
        def answer(self, prompts):
            return [("ok", False) if len(p) < 3 else None for p in prompts]

    items = [(0, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
                  {"role": "user", "content": "b"}]),
             (1, [{"role": "system", "content": "s"}, {"role": "user", "content": "c"},
                  {"role": "user", "content": "d"}]),
             (2, [{"role": "system", "content": "s"}, {"role": "system", "content": "t"},
                  {"role": "user", "content": "e"}])]
    recs = _regenerate(Source(), items, "chat", all_turns=True)
    assert [r["source_index"] for r in recs] == [0, 1]
    assert [m["value"] for m in recs[0]["conversations"]] == ["a", "ok"]  # (the turn past it and after: none)
    assert [m["value"] for m in recs[1]["conversations"]] == ["s", "c", "ok"]


def test_the_base_s_generation_config_stop_tokens_end_answers(tiny_base_dir, tmp_path):
    """generation_config.json's eos_token_id list (a chat base's end of turn) ends a turn, as HF generate and vLLM
    stop there; the tokenizer's EOS alone ran answers on to the length limit and past the end of turn."""
    from draftlab.base import load_base, stop_token_ids
    from draftlab.serve.generate import run_generate

    prompt = "Tell me about cat 0."
    d, stop, n = _with_stop_token(tiny_base_dir, tmp_path, prompt)
    base, tok = load_base(d, "float32")
    assert stop_token_ids(base, tok) == [tok.eos_token_id, stop]
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"conversations": [{"from": "human", "value": prompt}]}) + "\n")
    s = distill_data(d, str(src), str(tmp_path / "o.jsonl"), max_new_tokens=8)
    rec = lines(tmp_path / "o.jsonl")[0]["conversations"][-1]
    assert s["truncated"] == 0 and "truncated" not in rec
    from draftlab.decode.decoder import NoDraft, SpeculativeDecoder

    res = run_generate(SpeculativeDecoder(base, NoDraft(), check_base=False), tok, [prompt], max_new_tokens=8,
                       compare=True, chat=True)
    assert res["tokens"][0][-1] == stop and len(res["tokens"][0]) == n and res["identical_to_baseline"]


def test_plain_text_in_chat_mode_is_said(tiny_base_dir, tmp_path, capsys):
    """A .txt file in the default --mode chat has each whole document asked as a user turn, silently (found by a
    new user's walkthrough); the command says so and names --mode text."""
    src = tmp_path / "stories.txt"
    src.write_text("Once upon a time there was a cat.")
    distill_data(str(tiny_base_dir), str(src), str(tmp_path / "o.jsonl"), max_new_tokens=2)
    assert "holds plain text: in --mode chat each document is asked whole" in capsys.readouterr().err
