"""distill-data through OpenAI-compatible servers: the same records as in-process, retries across endpoints,
resume, every assistant turn regenerated, clear errors."""

import json
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
