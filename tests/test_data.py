import json

import pytest

from conftest import write_jsonl
from draftlab.base import load_tokenizer
from draftlab.config import DataSection
from draftlab.data import DataError, collate, load_examples, to_messages, tokenize_chat


@pytest.fixture(scope="module")
def tok(tiny_base_dir):
    return load_tokenizer(str(tiny_base_dir))


def decoded_masked(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_sharegpt_from_value_and_role_content_are_the_same():
    a = to_messages({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, "sharegpt")
    b = to_messages({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "sharegpt")
    assert a == b == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_alpaca_with_input_and_history():
    m = to_messages({"instruction": "Add", "input": "1+1", "output": "2", "history": [["q", "a"]]}, "alpaca")
    assert [x["role"] for x in m] == ["user", "assistant", "user", "assistant"]
    assert m[2]["content"] == "Add\n\n1+1"


def test_loss_mask_covers_exactly_the_assistant_turns(tok):
    msgs = [{"role": "user", "content": "what is a cat?"}, {"role": "assistant", "content": "It is an animal."},
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = tokenize_chat(msgs, tok, 512)
    assert len(ids) == len(mask)
    text = decoded_masked(tok, ids, mask)
    assert "It is an animal." in text and "Hello" in text
    assert "what is a cat" not in text and "User" not in text
    # The mask includes each turn's EOS so the heads learn where answers stop.
    assert sum(1 for i, m in zip(ids, mask) if m and i == tok.eos_token_id) == 2


def test_truncation_and_examples_without_assistant_tokens_are_counted(tmp_path, tok):
    long_q = "cat " * 300
    f = write_jsonl(tmp_path / "c.jsonl", [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello"}]},
        {"conversations": [{"from": "human", "value": long_q}, {"from": "gpt", "value": "Hello"}]},
    ] * 5)
    train, held, stats = load_examples(DataSection(path=str(f), max_len=32, eval_size=0), tok)
    assert all(len(e["input_ids"]) <= 32 for e in train)
    assert stats.skipped == {"no assistant tokens left after truncation to data.max_len": 5}
    assert len(train) == 5 and stats.cut_at_max_len == 0
    # A conversation max_len cuts but keeps answer tokens of is kept and counted (it was not: a recipe whose max_len
    # cut most conversations said nothing), the same tokens as a max_len that fits it, cut.
    long_a = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "cat " * 40}]}]
    g = write_jsonl(tmp_path / "a.jsonl", long_a * 3)
    cut, _, cut_stats = load_examples(DataSection(path=str(g), max_len=24, eval_size=0), tok)
    whole = load_examples(DataSection(path=str(g), max_len=1024, eval_size=0), tok)[0]
    assert cut_stats.cut_at_max_len == 3 and cut[0]["input_ids"] == whole[0]["input_ids"][:24]
    assert cut[0]["loss_mask"] == whole[0]["loss_mask"][:24]
    line = cut_stats.summary(24)
    assert "3 training examples" in line and "3 conversations (100%) longer than data.max_len=24" in line
    assert "skipped" in stats.summary(32) and "5 (no assistant tokens left" in stats.summary(32)


def test_malformed_record_names_file_and_record(tmp_path, tok):
    f = write_jsonl(tmp_path / "bad.jsonl", [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "ok"}]},
    ])
    with pytest.raises(DataError) as e:
        load_examples(DataSection(path=str(f)), tok)
    msg = str(e.value)
    assert f"{f} record 1: turn 1 has unknown role 'robot'" in msg and "data.on_malformed=skip" in msg
    # A text recipe pointed at chat data says which format the records read as, and how to read them so
    with pytest.raises(DataError, match=r"record 0: text records need a string 'text' field; this one reads as "
                                        r"sharegpt \(data.format=text was given: data.format=auto"):
        load_examples(DataSection(path=str(f), format="text"), tok)


def test_malformed_records_skipped_and_counted_when_asked(tmp_path, tok):
    good = {"instruction": "say hi", "output": "hi"}
    f = tmp_path / "a.json"
    f.write_text(json.dumps([good, {"instruction": 3}, good, "junk", good]))
    train, held, stats = load_examples(DataSection(path=str(f), on_malformed="skip", eval_size=0), tok)
    assert len(train) == 3 and sum(stats.skipped.values()) == 2


def test_bad_json_line_is_named(tmp_path, tok):
    f = tmp_path / "x.jsonl"
    f.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(DataError, match=r"x.jsonl line 2: not valid JSON"):
        load_examples(DataSection(path=str(f)), tok)
    # data.on_malformed=skip drops and counts such lines too (it stopped on them: walk-through)
    f.write_text('{"text": "a b c"}\n{oops\n{"text": "d e f"}\n[1,\n')
    train, _, stats = load_examples(DataSection(path=str(f), on_malformed="skip", eval_size=0), tok)
    assert stats.records == 4 and stats.skipped == {"a JSONL line that is not valid JSON": 2} and train


def test_plain_text_is_packed_with_loss_everywhere(tmp_path, tok):
    f = tmp_path / "t.txt"
    f.write_text("Once upon a time there was a cat.<|endoftext|>The dog ran.<|endoftext|>" * 20)
    train, held, stats = load_examples(DataSection(path=str(f), max_len=16, eval_size=0.25, eval_pick="tail"), tok)
    assert all(len(e["input_ids"]) <= 16 and all(e["loss_mask"]) for e in train)
    assert held and stats.eval_examples == len(held)


def test_held_out_split_is_disjoint_and_seeded(tmp_path, tok):
    recs = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(40)]
    f = write_jsonl(tmp_path / "a.jsonl", recs)
    t1, h1, _ = load_examples(DataSection(path=str(f), eval_size=0.25), tok, seed=1)
    t2, h2, _ = load_examples(DataSection(path=str(f), eval_size=0.25), tok, seed=1)
    assert len(h1) == 10 and len(t1) == 30 and h1 == h2
    as_key = lambda e: tuple(e["input_ids"])
    assert not set(map(as_key, t1)) & set(map(as_key, h1))


def test_missing_path_and_folder(tmp_path, tok):
    with pytest.raises(DataError, match="no such file"):
        load_examples(DataSection(path=str(tmp_path / "none.jsonl")), tok)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no .json"):
        load_examples(DataSection(path=str(tmp_path / "empty")), tok)


def test_collate_pads_right_and_masks_padding():
    b = collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [5], "loss_mask": [1]}], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


R1_STYLE = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
            "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}Assistant: <think>\n{% endif %}")
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
               "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def test_the_whole_answer_carries_loss_when_the_generation_prompt_is_not_a_rendered_turns_start(tok):
    """A generation prompt holding more than the rendered turn starts with (DeepSeek-R1's "<think>\\n"): the answer's
    first characters carried no loss, silently (found by review). The answer now starts where the two renderings
    part."""
    import copy

    t = copy.copy(tok)
    t.chat_template = R1_STYLE
    msgs = [{"role": "user", "content": "what is a cat?"}, {"role": "assistant", "content": "It is an animal."}]
    ids, mask = tokenize_chat(msgs, t, 512)
    text = decoded_masked(t, ids, mask)
    assert text.lstrip().startswith("It is an animal.") and "Assistant" not in text and "cat" not in text


def test_a_record_the_chat_template_refuses_is_named_or_skipped(tmp_path, tok):
    """A template that raises on some records (roles that do not alternate) named neither the file nor the record,
    and stopped a load that asked to skip malformed records (found by review)."""
    import copy

    t = copy.copy(tok)
    t.chat_template = ALTERNATING
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello"}]}
    bad = {"conversations": [{"from": "human", "value": "hi"}, {"from": "human", "value": "again"},
                             {"from": "gpt", "value": "Hello"}]}
    f = write_jsonl(tmp_path / "c.jsonl", [good, good, bad, good])
    with pytest.raises(DataError, match=f"{f} record 2: the chat template"):
        load_examples(DataSection(path=str(f), eval_size=0), t)
    train, _, stats = load_examples(DataSection(path=str(f), eval_size=0, on_malformed="skip"), t)
    assert len(train) == 3 and sum(stats.skipped.values()) == 1


def test_a_conversation_with_an_empty_answer_is_counted_not_an_error(tmp_path, tok):
    """An empty answer (a base that ended its turn at once, in self-distilled data) leaves nothing to learn: it is
    skipped and counted like a conversation truncated to no answer, not taken as malformed (found by review: the
    default on_malformed: error stopped training on it)."""
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello"}]}
    empty = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": " "}]}
    f = write_jsonl(tmp_path / "c.jsonl", [good, empty, good])
    train, _, stats = load_examples(DataSection(path=str(f), eval_size=0), tok)
    assert len(train) == 2 and stats.skipped == {"no non-empty assistant turn": 1}


LAST_THINKS = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
               "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
               "{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n{% else %}Assistant:"
               "{% if loop.index0 == ns.last %} <think> </think>{% endif %} {{ m['content'] }}{{ eos_token }}\n"
               "{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def test_every_answer_carries_loss_under_a_template_that_renders_the_last_answer_otherwise(tok):
    """Qwen3's template shows a thinking block in the last answer only, so a conversation is not rendered as its
    own prefixes are: such conversations were refused (found by review: multi-turn data of such a base could not be
    trained). An earlier answer is now found in the whole conversation, its end of turn with it."""
    import copy

    t = copy.copy(tok)
    t.chat_template = LAST_THINKS
    msgs = [{"role": "user", "content": "what is a cat?"}, {"role": "assistant", "content": "It is an animal."},
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = tokenize_chat(msgs, t, 512)
    text = decoded_masked(t, ids, mask)
    assert "It is an animal." in text and "Hello" in text and "cat" not in text and "User" not in text
    assert sum(1 for i, m in zip(ids, mask) if m and i == t.eos_token_id) == 2  # each answer's end of turn too


QWEN3_LIKE = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
              "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
              "{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n{% else %}Assistant: "
              "{% if loop.index0 < ns.last %}{{ m['content'].split('</think>')[-1].lstrip('\n') }}"
              "{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}Assistant: {% endif %}")


def test_an_earlier_answer_s_thinking_the_template_drops_is_left_out(tok):
    """Qwen3's template drops the thinking of answers before the last user turn (the text up to `</think>`): such
    conversations were refused, the earlier answer's text not being found. The answer is now found by the text the
    template keeps, which carries the loss (the thinking is in no context the model is served), end of turn too."""
    import copy

    t = copy.copy(tok)
    t.chat_template = QWEN3_LIKE
    msgs = [{"role": "user", "content": "what is a cat?"},
            {"role": "assistant", "content": "<think>\nan animal question</think>\n\nIt is an animal."},
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\ngreet</think>\n\nHello"}]
    ids, mask = tokenize_chat(msgs, t, 512)
    text = decoded_masked(t, ids, mask)
    assert "It is an animal." in text and "an animal question" not in t.decode(ids)
    assert "greet" in text and "Hello" in text and "cat" not in text and "User" not in text
    assert sum(1 for i, m in zip(ids, mask) if m and i == t.eos_token_id) == 2


def test_copies_of_a_record_stay_on_one_side_of_the_split(tmp_path, tok):
    """Ten records four times each: no held-out example is also a training example (found by review: copies were
    split like any records, so every held-out example was trained on and the held-out figures were inflated). Data
    without copies splits as before (the last n of the seeded shuffle)."""
    import random

    from draftlab.data import _split

    recs = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(10)] * 4
    f = write_jsonl(tmp_path / "a.jsonl", recs)
    train, held, _ = load_examples(DataSection(path=str(f), eval_size=0.25), tok, seed=1)
    as_key = lambda e: tuple(e["input_ids"])
    assert held and len(train) + len(held) == 40 and not set(map(as_key, train)) & set(map(as_key, held))
    items = list(range(40))
    shuffled = items[:]
    random.Random(1).shuffle(shuffled)
    assert _split(items, 0.25, "random", 1) == (shuffled[:30], shuffled[30:])
    assert _split(items, 3, "tail", 1) == (items[:37], items[37:])


def test_one_document_holds_out_its_last_blocks(tmp_path, tok):
    """A .txt without document separators is one document: the held-out split was empty, silently (found by review:
    no held-out loss, no accept-length figure, the export falling back to the last step). Its last blocks are held
    out now."""
    from conftest import STORY_TEXT

    f = tmp_path / "one.txt"
    f.write_text(STORY_TEXT * 3)
    train, held, stats = load_examples(DataSection(path=str(f), max_len=16, eval_size=0.2), tok)
    assert held and stats.eval_examples == len(held) and len(train) > len(held)
    every = train + held
    assert [e["input_ids"] for e in every] == [e["input_ids"] for e in load_examples(
        DataSection(path=str(f), max_len=16, eval_size=0), tok)[0]]  # the blocks in order, the last ones held out


@pytest.mark.slow  # 26 s on 2 cores (worker processes start and import); CI runs the slow set too
def test_num_proc_tokenizes_in_processes_to_the_same_examples(tmp_path, tok, monkeypatch, capfd):
    """data.num_proc tokenizes the conversations in that many processes (found by review: it was read by nothing),
    giving the same examples in the same order, and a record the chat template refuses is named or skipped as in
    one process. A tokenizer on draftlab's fallback template is warned about once, by this process, not in raw
    format by every worker (walk-through)."""
    import copy

    import draftlab.data as data
    from draftlab.procs import die_with_parent

    monkeypatch.setattr(data, "PARALLEL_MIN", 1)
    t = copy.copy(tok)
    t.chat_template = ALTERNATING
    recs = [{"conversations": [{"from": "human", "value": f"cat {i}?"}, {"from": "gpt", "value": f"It is {i}."}]}
            for i in range(12)]
    recs[5] = {"conversations": [{"from": "human", "value": "hi"}, {"from": "human", "value": "again"},
                                 {"from": "gpt", "value": "Hello"}]}
    f = write_jsonl(tmp_path / "c.jsonl", recs)
    one = load_examples(DataSection(path=str(f), eval_size=0.25, on_malformed="skip"), t)
    calls = []
    from concurrent import futures

    class Counted(futures.ProcessPoolExecutor):
        def __init__(self, *a, **k):
            calls.append(a[0])
            super().__init__(*a, **k)
    monkeypatch.setattr(futures, "ProcessPoolExecutor", Counted)
    t.draftlab_fallback_template = True
    capfd.readouterr()
    with pytest.warns(UserWarning, match="has no chat template") as said:
        two = load_examples(DataSection(path=str(f), eval_size=0.25, on_malformed="skip", num_proc=2), t,
                            worker_init=die_with_parent)
    assert len([w for w in said if "has no chat template" in str(w.message)]) == 1
    assert "has no chat template" not in capfd.readouterr().err  # (the workers' stderr is this process's)
    assert calls == [2]  # (the tokenizing ran in two processes)
    assert one[0] == two[0] and one[1] == two[1] and one[2].skipped == two[2].skipped and sum(two[2].skipped.values())
    with pytest.raises(DataError, match=f"{f} record 5: the chat template"):
        load_examples(DataSection(path=str(f), eval_size=0, num_proc=2), t, worker_init=die_with_parent)


def test_a_json_file_of_one_conversation_is_one_record(tmp_path, tok):
    """{"conversations": [turns]} as a whole file is one conversation (found by review: its turns were read as
    records, each refused)."""
    f = tmp_path / "one.json"
    f.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello"}]}))
    train, _, _ = load_examples(DataSection(path=str(f), eval_size=0), tok)
    assert len(train) == 1 and "Hello" in decoded_masked(tok, train[0]["input_ids"], train[0]["loss_mask"])


def test_examples_are_held_as_flat_arrays_and_read_as_lists(tmp_path, tok):
    """Training's examples are two flat arrays, 5 bytes a token (Python lists of ints took about 45: 4.5 GB a
    process at 100k conversations of 1k tokens); an item still reads as lists, and slices, take and + keep the
    examples' contents."""
    from draftlab.data import Examples

    recs = [{"conversations": [{"from": "human", "value": f"story {i}"},
                               {"from": "gpt", "value": "Once upon a time " * (1 + i % 4)}]} for i in range(9)]
    # (an answer of more than 255 supervised tokens: a byte mask must not be summed as bytes)
    recs.append({"conversations": [{"from": "human", "value": "go"}, {"from": "gpt", "value": "cat dog " * 200}]})
    f = write_jsonl(tmp_path / "c.jsonl", recs)
    train, held, stats = load_examples(DataSection(path=str(f), max_len=1024, eval_size=0.2), tok)
    assert isinstance(train, Examples) and isinstance(held, Examples) and len(train) + len(held) == 10
    as_lists = [tokenize_chat([{"role": "user", "content": r["conversations"][0]["value"]},
                               {"role": "assistant", "content": r["conversations"][1]["value"]}], tok, 1024)
                for r in recs]
    every = train + held
    assert sorted((e["input_ids"], e["loss_mask"]) for e in every) == sorted(as_lists)
    assert every.ids.dtype.itemsize + every.mask.dtype.itemsize == 5 and every.ids.size == every.tokens()
    assert stats.train_tokens == sum(len(e["input_ids"]) for e in train)
    assert stats.loss_tokens == sum(sum(e["loss_mask"]) for e in train)
    assert every.loss_tokens() == sum(sum(e["loss_mask"]) for e in every) > 256
    assert list(train[1:3]) == [train[1], train[2]] and list(train.take([4, 0])) == [train[4], train[0]]
    assert train.take([0, 1]) == [train[0], train[1]] and train.take([0, 1]) != train.take([1, 0])


def test_a_slice_of_examples_pickles_its_own_tokens_only():
    """Examples sent to another process as a slice of a larger set carry that slice's tokens, not the whole arrays;
    every form reads back the same."""
    import pickle

    from draftlab.data import Examples

    every = Examples.of(([i] * 100, [i % 2] * 100) for i in range(50))
    part = every[10:12]
    back = pickle.loads(pickle.dumps(part))
    assert back == part and list(back) == list(part) and back.ids.size == 200
    assert len(pickle.dumps(part)) < len(pickle.dumps(every)) / 10
    for ex in (every, every.take([3, 3, 1]), every[:0]):
        assert list(pickle.loads(pickle.dumps(ex))) == list(ex)
