"""`draftlab check`: each check against an export broken in exactly one way, a correct export, and the command."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import STORY_TEXT, tiny_llama
from draftlab.drafters import build_draft
from draftlab.interop.check import check_export, check_quant
from draftlab.interop.export import save_export

STATIC = ("aux-layer-ids", "target", "vocab-maps", "rope", "quantization", "tokenizer")


@pytest.fixture(scope="module")
def base_dir(tiny_base_dir, tmp_path_factory):
    """A 7-layer tiny Llama (EAGLE-3's default layers 2, 3, 4 are distinct) with tiny_base_dir's tokenizer."""
    d = tmp_path_factory.mktemp("base7")
    for f in tiny_base_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, d / f.name)
    src = json.loads((tiny_base_dir / "config.json").read_text())
    m = tiny_llama(vocab=src["vocab_size"], layers=7, dtype=torch.float32)
    m.config.bos_token_id, m.config.eos_token_id, m.config.pad_token_id = (
        src["bos_token_id"], src["eos_token_id"], src["pad_token_id"])
    m.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def eagle_dir(base_dir, tmp_path_factory):
    """draftlab's EAGLE-3 export (40-token draft vocabulary, random weights), as draftlab writes it."""
    from draftlab.base import load_base

    base, tok = load_base(str(base_dir), "float32")
    torch.manual_seed(0)
    d = build_draft({"type": "eagle3", "eagle": {"draft_vocab_size": 40}}, base).eval()
    d.fit_vocab([{"input_ids": tok.encode(STORY_TEXT)}])
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    recipe = {"base": {"name_or_path": str(base_dir)}, "data": {"format": "sharegpt"}}
    return save_export(d, base, tmp_path_factory.mktemp("eagle") / "export", str(base_dir),
                       extra={"training": {"recipe": recipe}})


def variant(src, dst, cfg=None, tensors=None):
    """A copy of export `src` with config.json / model.safetensors edited in place by the given functions."""
    shutil.copytree(src, dst)
    if cfg:
        c = json.loads((dst / "config.json").read_text())
        cfg(c)
        (dst / "config.json").write_text(json.dumps(c))
    if tensors:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def sglang_ids(c):  # eagle_config in SGLang's convention (decoder-layer outputs: hidden_states index - 1)
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in c["eagle_aux_hidden_state_layer_ids"]]


@pytest.fixture(scope="module")
def good_dir(eagle_dir, tmp_path_factory):
    return variant(eagle_dir, tmp_path_factory.mktemp("good") / "export", cfg=sglang_ids)


def by_name(rep):
    return {c["name"]: c for c in rep["checks"]}


def only_fails(rep, *names):
    """The named checks fail; every other static check passes."""
    c = by_name(rep)
    assert [n for n in STATIC if c[n]["ok"] is False] == [n for n in STATIC if n in names], rep
    assert rep["ok"] is False
    return c


def test_a_correct_export_passes_every_check(good_dir):
    rep = check_export(good_dir)
    c = by_name(rep)
    assert rep["ok"] and all(x["ok"] is True for x in rep["checks"]), rep
    assert "vLLM captures hidden_states [2, 3, 4]" in c["aux-layer-ids"]["message"]
    assert "SGLang captures hidden_states [2, 3, 4]" in c["aux-layer-ids"]["message"]
    msg = c["proposals"]["message"]
    assert "vLLM: the same 4-token chains at all" in msg and "SGLang: the same 4-token chains" in msg


def test_an_eagle3_draft_for_a_target_the_engine_captures_no_layers_of_fails(good_dir, tmp_path):
    """Both engines refuse an EAGLE-3 draft when the target's model code does not capture the draft's layers (vLLM
    0.34.0's Gemma-2 and Gemma-3, SGLang 0.5.23's Gemma-2); check passed such a draft (walk-through)."""
    from draftlab.interop.check import check_target

    assert "vLLM 0.34.0's LlamaForCausalLM captures" in by_name(check_export(good_dir))["target"]["message"]
    meta = {"head": {"type": "eagle3"}}
    c = check_target(meta, {"architectures": ["Gemma2ForCausalLM"]}, ["vllm", "sglang"])
    assert c.ok is False and "vLLM 0.34.0's Gemma2ForCausalLM does not capture" in c.message
    assert "SGLang 0.5.23's Gemma2ForCausalLM does not capture EAGLE-3's auxiliary layers, so SGLang refuses" in \
        c.message
    assert check_target(meta, {"architectures": ["Gemma3ForCausalLM"]}, ["sglang"]).ok is True
    assert check_target(meta, {"architectures": ["Gemma3ForCausalLM"]}, ["vllm"]).ok is False
    assert check_target({"head": {"type": "dflash"}}, {"architectures": ["Gemma2ForCausalLM"]}, ["vllm"]).ok is None
    assert check_target(meta, {}, ["vllm"]).ok is None  # (a config without architectures: not known)


def test_draftlab_exports_write_each_engines_layer_ids(eagle_dir):
    """draftlab writes hidden_states indices at the top level (vLLM) and one less under eagle_config (SGLang adds 1):
    its own export passes both engines' checks, proposals included."""
    for engine in ("vllm", "sglang"):
        rep = check_export(eagle_dir, engine=engine)
        assert rep["ok"], rep


def test_hidden_states_indices_under_eagle_config_are_read_one_layer_late_by_sglang(good_dir, tmp_path):
    """The nested key in vLLM's convention (what draftlab wrote before): right for vLLM, one layer late for SGLang."""
    def same_ids(c):
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(c["eagle_aux_hidden_state_layer_ids"])

    bad = variant(good_dir, tmp_path / "x", cfg=same_ids)
    assert check_export(bad, engine="vllm")["ok"]
    rep = check_export(bad, engine="sglang")
    c = only_fails(rep, "aux-layer-ids")
    msg = c["aux-layer-ids"]["message"]
    assert "eagle_config.eagle_aux_hidden_state_layer_ids: SGLang captures hidden_states [3, 4, 5]" in msg
    assert "set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 2, 3] (SGLang adds 1)" in msg
    assert "PR #25454" not in msg  # (a Llama target: SGLang's llama.py adds 1 always)
    assert c["proposals"]["ok"] is False and "SGLang: first difference at prompt 0" in c["proposals"]["message"]


def test_aux_ids_shifted_by_one(good_dir, tmp_path):
    def shift(c):
        c["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in c["eagle_aux_hidden_state_layer_ids"]]

    rep = check_export(variant(good_dir, tmp_path / "x", cfg=shift))
    c = only_fails(rep, "aux-layer-ids")
    assert c["aux-layer-ids"]["message"].startswith("eagle_aux_hidden_state_layer_ids: vLLM captures hidden_states "
                                                    "[3, 4, 5], draftlab trained on [2, 3, 4]; set")
    assert "SGLang captures hidden_states [2, 3, 4]" in c["aux-layer-ids"]["message"]  # the nested ids are right
    # Decoding names the first proposal that differs, for the engine that reads the shifted key only.
    assert c["proposals"]["ok"] is False
    assert "vLLM: first difference at prompt 0 ('Once upon a time'), step " in c["proposals"]["message"]
    assert "SGLang: the same" in c["proposals"]["message"]


def test_missing_aux_ids_are_named_with_the_default_the_engine_takes(good_dir, tmp_path):
    rep = check_export(variant(good_dir, tmp_path / "x", cfg=lambda c: c.pop("eagle_aux_hidden_state_layer_ids")),
                       engine="vllm")  # vLLM's fallback (2, 7 // 2, 7 - 3) happens to be the layers trained on
    msg = by_name(rep)["aux-layer-ids"]["message"]
    assert rep["ok"] and "vLLM (no top-level ids: its silent default) captures hidden_states [2, 3, 4]" in msg


@pytest.mark.parametrize("how", ["zeros", "dropped"])
def test_d2t_corrupted(good_dir, tmp_path, how):
    def corrupt(t):
        if how == "zeros":
            t["d2t"] = torch.zeros_like(t["d2t"])  # draft id i -> target id i: the first 40 ids
        else:
            del t["d2t"]

    rep = check_export(variant(good_dir, tmp_path / "x", tensors=corrupt))
    c = only_fails(rep, "vocab-maps")
    msg = c["vocab-maps"]["message"]
    assert ("t2d marks" in msg and "d2t and t2d disagree" in msg) if how == "zeros" else \
        msg.startswith("no d2t in model.safetensors with draft_vocab_size 40 < vocab_size")
    if how == "dropped":  # the engines would map draft ids onto the first 40 ids; draftlab refuses to load it
        assert c["proposals"]["ok"] is False and "missing ['d2t']" in c["proposals"]["message"]
    else:  # both read the same (wrong) map
        assert c["proposals"]["ok"] is True


def test_d2t_out_of_range(good_dir, tmp_path):
    def corrupt(t):
        t["d2t"][-1] += 10_000

    c = only_fails(check_export(variant(good_dir, tmp_path / "x", tensors=corrupt)), "vocab-maps")
    assert "d2t maps draft ids to target ids" in c["vocab-maps"]["message"] and "outside the base's" in \
        c["vocab-maps"]["message"]


def test_d2t_in_any_order_passes(good_dir, tmp_path):
    """The engines place draft logit i at target i + d2t[i] whatever the order (found by review: maps whose
    targets were not ascending failed, "export again", though vLLM and SGLang serve them as meant)."""
    def swap(t):
        target = torch.arange(len(t["d2t"])) + t["d2t"]
        target[[0, 1]] = target[[1, 0]]
        t["d2t"] = target - torch.arange(len(target))

    rep = check_export(variant(good_dir, tmp_path / "x", tensors=swap))
    assert by_name(rep)["vocab-maps"]["ok"] is True, by_name(rep)["vocab-maps"]["message"]


def test_rope_theta_changed(good_dir, tmp_path):
    def theta(c):
        c["rope_theta"] = c["rope_parameters"]["rope_theta"] = 500000.0

    c = only_fails(check_export(variant(good_dir, tmp_path / "x", cfg=theta)), "rope")
    assert c["rope"]["message"].startswith("rope_theta 500000.0 != the base's 10000.0; set rope_theta")
    assert c["proposals"]["ok"] is False and "vLLM: first difference" in c["proposals"]["message"]
    # Only the top-level key: engines on transformers < 5 and >= 5 read different values.
    c = by_name(check_export(variant(good_dir, tmp_path / "y", cfg=lambda c: c.update(rope_theta=5e5))))
    assert c["rope"]["ok"] is False and "rope_parameters.rope_theta 10000.0" in c["rope"]["message"]


def test_quantization_config_added(good_dir, tmp_path):
    q = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    c = only_fails(check_export(variant(good_dir, tmp_path / "x", cfg=lambda c: c.update(quantization_config=q))),
                   "quantization")
    assert c["quantization"]["message"].startswith("config.json has quantization_config (fp8)")
    assert c["proposals"]["ok"] is True
    # A quantized base: SGLang quantizes the draft like it unless told otherwise; vLLM does not.
    base = {"quantization_config": {"quant_method": "awq"}}
    sg = check_quant({}, base, ["sglang"])
    assert sg.ok is False and "--speculative-draft-model-quantization unquant" in sg.message
    assert check_quant({}, base, ["vllm"]).ok is True


def edit_chat_template(tok_dir):
    """Change the chat template of the tokenizer files in tok_dir, in place."""
    jinja = tok_dir / "chat_template.jinja"
    if jinja.is_file():
        jinja.write_text(jinja.read_text().replace("Assistant", "Bot"))
    else:
        cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
        cfg["chat_template"] = cfg["chat_template"].replace("Assistant", "Bot")
        (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_chat_template_changed(good_dir, base_dir, tmp_path):
    served = tmp_path / "tok"
    shutil.copytree(base_dir, served)
    edit_chat_template(served)
    c = only_fails(check_export(good_dir, tokenizer=str(served)), "tokenizer")
    assert "chat_template differs from training's" in c["tokenizer"]["message"]
    assert f"serve with the recipe's base's template ({base_dir})" in c["tokenizer"]["message"]


def test_a_template_edited_in_place_since_training_is_seen(base_dir, tmp_path):
    """save_export records the training tokenizer's fingerprint; the same path, edited since, fails the check."""
    from test_interop import random_heads

    from draftlab.base import load_base

    moved = tmp_path / "base"
    shutil.copytree(base_dir, moved)
    base, tok = load_base(str(moved), "float32")
    export = save_export(random_heads(base, K=2, L=1), base, tmp_path / "m", str(moved), tokenizer=tok)
    assert by_name(check_export(export))["tokenizer"]["ok"] is True
    edit_chat_template(moved)
    c = by_name(check_export(export))["tokenizer"]
    assert c["ok"] is False and "differs from the one used in training in chat_template" in c["message"]


def test_the_chat_template_the_engine_is_given_is_the_one_compared(base_dir, tmp_path, capsys):
    """check --chat-template FILE: the template an engine is started with (vLLM / SGLang --chat-template) replaces the
    tokenizer's own in the comparison, both ways: training's template given back passes a tokenizer edited since,
    another one fails the very tokenizer training used."""
    from test_interop import random_heads
    from transformers import AutoTokenizer

    from draftlab.base import load_base
    from draftlab.cli import main

    moved = tmp_path / "base"
    shutil.copytree(base_dir, moved)
    base, tok = load_base(str(moved), "float32")
    export = save_export(random_heads(base, K=2, L=1), base, tmp_path / "m", str(moved), tokenizer=tok)
    trained = tmp_path / "trained.jinja"
    trained.write_text(AutoTokenizer.from_pretrained(str(moved)).chat_template)
    edit_chat_template(moved)
    assert by_name(check_export(export))["tokenizer"]["ok"] is False
    c = by_name(check_export(export, chat_template=str(trained)))["tokenizer"]
    assert c["ok"] is True and f"served with --chat-template {trained}" in c["message"], c
    other = tmp_path / "other.jinja"
    other.write_text(trained.read_text().replace("Assistant", "Model"))
    assert other.read_text() != trained.read_text()
    c = by_name(check_export(export, chat_template=str(other)))["tokenizer"]
    assert c["ok"] is False and "in chat_template" in c["message"], c
    # A draft trained on plain text alone never went through a template: another one passes, with a word (it failed
    # such a draft: walk-through); one that also read conversations still fails.
    for formats, ok in (({"text": 8}, True), ({"text": 8, "sharegpt": 2}, False)):
        read = save_export(random_heads(base, K=2, L=1), base, tmp_path / f"t{ok}", str(moved), tokenizer=tok,
                           extra={"training": {"data_formats": formats}})
        c = by_name(check_export(read, chat_template=str(other)))["tokenizer"]
        assert c["ok"] is ok and ("which training never applied (it read plain text alone)" in c["message"]) is ok, c
    # The CLI takes it, and a missing file is one line, exit 2.
    assert main(["check", str(export), "--engine", "vllm", "--chat-template", str(trained)]) == 0
    assert main(["check", str(export), "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_a_base_without_a_chat_template_ships_the_one_training_used(base_dir, tmp_path):
    """A tokenizer with no chat template: training renders conversations with draftlab's simple one and says so, the
    export keeps it (chat_template.jinja) and check passes the base it was trained on, served with that file. (It
    kept none, and check failed the very base it was trained on, advising a retrain: walk-through.)"""
    from test_interop import random_heads

    from draftlab.base import load_base, template_to_ship
    from draftlab.data import tokenize_chat

    bare = tmp_path / "bare"
    shutil.copytree(base_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    base, tok = load_base(str(bare), "float32")
    with pytest.warns(UserWarning, match="has no chat template: conversations are rendered with draftlab's simple"):
        tokenize_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tok, 64)
    export = save_export(random_heads(base, K=2, L=1), base, tmp_path / "m", str(bare), tokenizer=tok,
                         chat_template=template_to_ship(tok, None))
    assert (export / "chat_template.jinja").read_text() == tok.chat_template
    c = by_name(check_export(export))["tokenizer"]
    assert c["ok"] is True and "which the engine must be given" in c["message"], c
    # An export without the fingerprint (made before it was recorded): training's side is read with the shipped
    # template too, so giving the engine that very file passes (it failed as "differs": review)
    meta = json.loads((export / "draftlab.json").read_text())
    meta.pop("tokenizer")
    (export / "draftlab.json").write_text(json.dumps(meta))
    c = by_name(check_export(export, chat_template=str(export / "chat_template.jinja")))["tokenizer"]
    assert c["ok"] is True, c
    # A tokenizer with its own template ships none: it serves as it is.
    assert template_to_ship(load_base(str(base_dir), "float32")[1], None) is None


def test_medusa_in_vllm_layout(base_dir, tmp_path, capsys):
    from test_interop import random_heads

    from draftlab.base import load_base
    from draftlab.interop.convert import export_to

    base = load_base(str(base_dir), "float32")[0]
    save_export(random_heads(base, K=3, L=1), base, tmp_path / "m", str(base_dir))
    export_to(tmp_path / "m", "vllm-medusa", tmp_path / "v")
    rep = check_export(tmp_path / "m", engine="vllm", served=str(tmp_path / "v"))
    assert rep["ok"], rep
    assert by_name(rep)["proposals"]["message"].startswith("vLLM: the same 3-token chains at all")
    # (the PASS named vLLM alone; walk-through)
    assert "vLLM 0.33.0 and 0.34.0 have none" in by_name(rep)["proposals"]["message"]
    # A served config without medusa_fc_bias: vLLM builds no biases and drops them, and drafts other tokens.
    variant(tmp_path / "v", tmp_path / "nobias", cfg=lambda c: c.update(medusa_fc_bias=False))
    c = by_name(check_export(tmp_path / "m", engine="vllm", served=str(tmp_path / "nobias")))
    assert c["proposals"]["ok"] is False and "vLLM: first difference at prompt 0" in c["proposals"]["message"]
    assert "config.json has no `medusa_fc_bias: true`, so vLLM builds the blocks without biases and drops the 3" in \
        c["proposals"]["message"]  # (the cause named, not only the difference: walk-through)
    with pytest.raises(FileNotFoundError, match="--served .*nope: no such directory"):
        check_export(tmp_path / "m", engine="vllm", served=str(tmp_path / "nope"))
    assert check_export(tmp_path / "m")["checks"][-1]["message"].endswith("SGLang serves no Medusa heads: not compared")
    # With SGLang alone nothing is compared, and the command does not say "all checks passed" (found by a new user).
    from draftlab.cli import main

    assert main(["check", str(tmp_path / "m"), "--engine", "sglang"]) == 0
    assert "no check failed, but no proposals were compared" in capsys.readouterr().out
    # FasterDecoding's layout is no engine layout check reads: a clear error, not a KeyError (found by review).
    export_to(tmp_path / "m", "medusa", tmp_path / "fd")
    with pytest.raises(ValueError, match="vllm-medusa"):
        check_export(tmp_path / "m", engine="vllm", served=str(tmp_path / "fd"))
    # ... nor is a Hugging Face model directory (an SSM's `export --to hf`): it was a KeyError (walk-through)
    with pytest.raises(ValueError, match=r"config.json has no num_heads, so it is not the layout vLLM's Medusa model "
                                         r"loads \(it holds an SSM or another causal LM \(model_type 'llama'\)\)"):
        check_export(tmp_path / "m", engine="vllm", served=str(base_dir))


@pytest.fixture(scope="module")
def dflash_dir(base_dir, tmp_path_factory):
    """draftlab's DFlash export (blocks of 4, two layers, random weights), as draftlab writes it."""
    from draftlab.base import load_base, load_tokenizer

    base = load_base(str(base_dir), "float32")[0]
    torch.manual_seed(0)
    d = build_draft({"type": "dflash", "dflash": {"block_size": 4, "num_layers": 2}}, base).eval()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return save_export(d, base, tmp_path_factory.mktemp("dflash") / "export", str(base_dir),
                       tokenizer=load_tokenizer(str(base_dir)))  # (as training saves it: the mask token named)


def test_a_correct_dflash_export_drafts_the_same_blocks_read_both_engines_ways(dflash_dir):
    rep = check_export(dflash_dir)
    c = by_name(rep)
    assert rep["ok"] and c["proposals"]["ok"] is True, rep
    assert c["aux-layer-ids"]["ok"] is True and "SGLang captures hidden_states" in c["aux-layer-ids"]["message"]
    assert "vLLM captures hidden_states" in c["aux-layer-ids"]["message"]
    msg = c["proposals"]["message"]
    assert msg.startswith("vLLM: the same 3-token chains at all") and "; SGLang: the same 3-token chains at" in msg
    assert "given num_speculative_tokens 3, block_size - 1" in msg  # (vLLM reads no block_size; it was not modelled)
    assert by_name(check_export(dflash_dir, engine="vllm"))["proposals"]["ok"] is True


def test_layer_choices_the_engines_read_otherwise_in_a_dflash_export(base_dir, dflash_dir, tmp_path):
    """Both engines capture the base layers in layer order (z-lab's reference code: in the order given), vLLM reads a
    top-level eagle_aux_hidden_state_layer_ids before dflash_config's ids, and neither gives the last layer's output
    after the base's final norm (vLLM takes it before, SGLang not at all): the check fails each, with the fix, and
    the proposals differ or are refused where the features do."""
    from draftlab.base import load_base

    base = load_base(str(base_dir), "float32")[0]
    L = base.config.num_hidden_layers
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="ascending"):
        d = build_draft({"type": "dflash", "dflash": {"block_size": 4, "num_layers": 2, "layers": [3, 1]}}, base)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.3 * torch.randn_like(p))
    out = save_export(d.eval(), base, tmp_path / "desc", str(base_dir))
    c = by_name(check_export(out))
    assert c["aux-layer-ids"]["ok"] is False and c["aux-layer-ids"]["message"].count("in layer order") == 2
    msg = c["proposals"]["message"]
    assert c["proposals"]["ok"] is False and "vLLM: first difference at prompt" in msg and "SGLang: first diff" in msg
    top = variant(dflash_dir, tmp_path / "top", cfg=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2]))
    c = by_name(check_export(top))["aux-layer-ids"]
    assert "vLLM captures hidden_states [1, 2] (from eagle_aux_hidden_state_layer_ids" in c["message"]
    assert "no top-level eagle_aux_hidden_state_layer_ids" in c["message"] and "SGLang captures" in c["message"]
    with pytest.warns(UserWarning, match="final norm"):
        last = build_draft({"type": "dflash", "dflash": {"block_size": 4, "num_layers": 2, "layers": [1, L]}}, base)
    out = save_export(last.eval(), base, tmp_path / "last", str(base_dir))
    c = by_name(check_export(out))
    for part in (f"vLLM: hidden_states {L}, the last decoder layer's output, is read before the base's final norm",
                 f"SGLang: hidden_states {L} is never captured"):
        assert c["aux-layer-ids"]["ok"] is False and part in c["aux-layer-ids"]["message"]
        assert c["proposals"]["ok"] is False and part in c["proposals"]["message"]


def test_a_dflash_draft_without_qk_norms_is_not_served_as_trained(base_dir, tmp_path):
    """The engines' DFlash layers always apply q/k norms (SGLang loads unit weights where the files have none), so a
    draft made without them (head.dflash.qk_norm: false, as a Llama base's drafts were until 2026-11-30) fails the
    check with the reason (found by review: the check applied the norms only where present, and passed)."""
    from draftlab.base import load_base

    base = load_base(str(base_dir), "float32")[0]
    d = build_draft({"type": "dflash", "dflash": {"block_size": 4, "num_layers": 1, "qk_norm": False}}, base).eval()
    out = save_export(d, base, tmp_path / "export", str(base_dir))
    c = by_name(check_export(out, engine="sglang"))["proposals"]
    assert c["ok"] is False and "no q/k norms" in c["message"] and "qk_norm: true" in c["message"]


def test_dflash_target_layer_ids_as_hidden_states_indices(dflash_dir, tmp_path):
    """target_layer_ids written without the -1 (draftlab's own indexing): DFlash reads each layer one late."""
    def late(c):
        c["dflash_config"]["target_layer_ids"] = [i + 1 for i in c["dflash_config"]["target_layer_ids"]]

    c = only_fails(check_export(variant(dflash_dir, tmp_path / "x", cfg=late), engine="sglang"), "aux-layer-ids")
    assert c["proposals"]["ok"] is False
    assert "SGLang: first difference at prompt 0 ('Once upon a time'), step " in c["proposals"]["message"]
    assert ", block position " in c["proposals"]["message"]


@pytest.mark.parametrize("how", ["mask", "permuted"])
def test_dflash_files_that_load_and_draft_other_blocks(dflash_dir, tmp_path, how):
    """The proposals see these: another mask token id in config.json (its token string, no longer that id's, is
    what SGLang refuses to start on), or served weights with layer 0's gate and up projections swapped (same
    shapes: it loads; only the proposals see it)."""
    if how == "mask":
        rep = check_export(variant(dflash_dir, tmp_path / "x", cfg=lambda c: c["dflash_config"].update(
            mask_token_id=c["dflash_config"]["mask_token_id"] + 7)), engine="sglang")
        assert "SGLang refuses to start" in only_fails(rep, "vocab-maps")["vocab-maps"]["message"]
    else:
        def swap(t):
            t["layers.0.mlp.gate_proj.weight"], t["layers.0.mlp.up_proj.weight"] = (
                t["layers.0.mlp.up_proj.weight"], t["layers.0.mlp.gate_proj.weight"])

        served = variant(dflash_dir, tmp_path / "x", tensors=swap)
        rep = check_export(dflash_dir, engine="sglang", served=str(served))
        c = only_fails(rep)
    c = by_name(rep)
    assert c["proposals"]["ok"] is False and "SGLang: first difference at prompt " in c["proposals"]["message"]


def test_the_dflash_mask_token_is_named_as_sglang_resolves_it(dflash_dir, base_dir, tmp_path):
    """SGLang looks dflash_config.mask_token (default "<|MASK|>") up in the served tokenizer: the export names the
    trained mask id's own token, so every SGLang reading lands on that id; an export without the name (saved with no
    tokenizer) fails, as does a served tokenizer holding "<|MASK|>" at another id (SGLang refuses to start)."""
    from draftlab.base import load_tokenizer
    from draftlab.interop.check import _mask_token_problems

    tok = load_tokenizer(str(base_dir))
    dc = json.loads((dflash_dir / "config.json").read_text())["dflash_config"]
    assert tok.get_vocab()[dc["mask_token"]] == dc["mask_token_id"]
    assert "mask token" in by_name(check_export(dflash_dir, engine="sglang"))["vocab-maps"]["message"]
    unnamed = variant(dflash_dir, tmp_path / "x", cfg=lambda c: c["dflash_config"].pop("mask_token"))
    msg = only_fails(check_export(unnamed, engine="sglang"), "vocab-maps")["vocab-maps"]["message"]
    assert "no dflash_config.mask_token" in msg and "new id the draft never trained with" in msg

    class MaskAt3:  # a served tokenizer holding "<|MASK|>" at id 3 (the tiny one has no spare id for it)
        def get_vocab(self):
            return {**tok.get_vocab(), "<|MASK|>": 3}

    V = len(tok)
    assert "refuses to start" in _mask_token_problems({"mask_token_id": 5}, V, MaskAt3())[0]
    assert _mask_token_problems({"mask_token_id": 3}, V, MaskAt3()) == []  # (the default string finds the id)
    assert _mask_token_problems({"mask_token_id": 3, "mask_token": "<|MASK|>"}, V, MaskAt3()) == []
    assert "outside the base's vocabulary" in _mask_token_problems({"mask_token_id": V}, V, MaskAt3())[0]


def test_ssm_and_ensemble_members_are_read_as_hugging_face_models(base_dir, tmp_path, capsys):
    from draftlab.base import load_base
    from draftlab.drafters import EnsembleDraft, LookupDraft

    base, tok = load_base(str(base_dir), "float32")
    torch.manual_seed(0)
    ssm = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 16}}, base).eval()
    with torch.no_grad():  # a layer that matters: fresh ones barely move the embeddings' predictions
        for name, p in ssm.named_parameters():
            if ".layers." in name:
                p.add_(0.3 * torch.randn_like(p))
    exp = save_export(ssm, base, tmp_path / "ssm", str(base_dir), tokenizer=tok)
    rep = check_export(exp)
    msg = by_name(rep)["proposals"]["message"]
    assert rep["ok"] and by_name(rep)["proposals"]["ok"] is True, rep
    assert "as a Hugging Face causal LM" in msg and "transformers: the same 4-token chains at all" in msg

    def swap(t):  # a served copy with layer 0's gate and up projections swapped
        p = "model.layers.0.mlp."
        t[p + "gate_proj.weight"], t[p + "up_proj.weight"] = t[p + "up_proj.weight"], t[p + "gate_proj.weight"]

    c = by_name(check_export(exp, served=str(variant(exp, tmp_path / "bad", tensors=swap))))["proposals"]
    assert c["ok"] is False and "transformers: first difference at prompt " in c["message"], c
    ens = save_export(EnsembleDraft([ssm, LookupDraft()], ["small", "ngram"]), base, tmp_path / "ens", str(base_dir),
                      tokenizer=tok)
    c = by_name(check_export(ens))["proposals"]
    assert c["ok"] is True and "member small (ssm, decoded alone): " in c["message"], c
    assert "transformers: the same 4-token chains" in c["message"]
    assert "member ngram (lookup): not a Hugging Face model, not compared" in c["message"]
    # ... and the command says no engine serves the ensemble whole ("all checks passed" beside "engines: vllm,
    # sglang" read as servable: walk-through)
    from draftlab.cli import main

    assert main(["check", str(ens)]) == 0
    assert "note: no engine serves this ensemble export whole: vLLM and SGLang take one draft model" in \
        capsys.readouterr().out


def test_hydra_and_lookup_say_no_engine_loads_them(base_dir, tmp_path):
    """Hydra: draftlab's decode against its own uncached second reading of the files, said to be no engine check;
    lookup: no weights, nothing compared."""
    from draftlab.base import load_base
    from draftlab.drafters import LookupDraft

    base = load_base(str(base_dir), "float32")[0]
    torch.manual_seed(0)
    d = build_draft({"type": "hydra", "num_heads": 3, "num_layers": 1, "prefix_attention": True}, base)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_export(d, base, tmp_path / "h", str(base_dir))
    c = by_name(check_export(tmp_path / "h"))["proposals"]
    assert c["ok"] is True and c["message"].startswith("no engine loads hydra drafts") and "not an engine check" in \
        c["message"], c
    assert "the reload: the same 3-token chains at all" in c["message"]
    save_export(LookupDraft(), base, tmp_path / "l", str(base_dir))
    c = by_name(check_export(tmp_path / "l"))["proposals"]
    assert c["ok"] is None and c["message"].startswith("no engine loads lookup drafts"), c


def test_cli_exit_code_and_json(good_dir, tmp_path, capsys):
    from draftlab.cli import main

    assert main(["check", str(good_dir), "--json", "--max-new-tokens", "4"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["ok"] is True and [c["name"] for c in rep["checks"]] == [*STATIC, "proposals"]
    assert all(set(c) == {"name", "ok", "message"} for c in rep["checks"])
    bad = variant(good_dir, tmp_path / "x", cfg=lambda c: c.update(quantization_config={"quant_method": "fp8"}))
    (tmp_path / "p.txt").write_text("The dog\n\nOnce upon a time\n")
    assert main(["check", str(bad), "--engine", "sglang", "--prompts", str(tmp_path / "p.txt")]) == 1
    out = capsys.readouterr().out
    assert "FAIL quantization: config.json has quantization_config (fp8)" in out
    assert "PASS aux-layer-ids" in out and "1 check(s) failed: quantization" in out


def test_an_eagle31_draft_is_read_with_its_switches_by_vllm_and_without_them_by_an_older_vllm(base_dir, tmp_path):
    """vLLM 0.33.0's EAGLE-3 model reads `norm_output` and `fc_norm`, so the check passes an EAGLE-3.1 draft there
    (found by review: it failed them, as the vLLM of an earlier review, 00bd149, read neither). Read the older way
    (EngineEagle3's eagle31=False), the same draft gives other proposals, or fc_norm weights it cannot load."""
    from draftlab.interop.engine_read import EngineEagle3
    from draftlab.base import load_base

    base, tok = load_base(str(base_dir), "float32")
    recipe = {"base": {"name_or_path": str(base_dir)}, "data": {"format": "sharegpt"}}
    for switch in ("norm_output", "fc_norm"):
        torch.manual_seed(0)
        d = build_draft({"type": "eagle3", "eagle": {"draft_vocab_size": 40, switch: True}}, base).eval()
        d.fit_vocab([{"input_ids": tok.encode(STORY_TEXT)}])
        with torch.no_grad():
            for p in d.parameters():
                p.add_(0.3 * torch.randn_like(p))
        ex = save_export(d, base, tmp_path / switch, str(base_dir), extra={"training": {"recipe": recipe}})
        c = by_name(check_export(ex, engine="vllm"))
        assert c["proposals"]["ok"] is True, (switch, c["proposals"])
        t, cfg = load_file(ex / "model.safetensors"), json.loads((ex / "config.json").read_text())
        if switch == "fc_norm":
            with pytest.raises(ValueError, match="fc_norm"):
                EngineEagle3(t, cfg, base, list(d.base_layers), eagle31=False)


def test_check_names_the_option_and_the_files_it_was_given(good_dir, tmp_path):
    """--tokenizer pointing at a file was reported as base.name_or_path with llama2.c advice, and an engine's
    directory given as the export got no hint (found by a new user's walkthrough)."""
    from draftlab.base import BaseModelError
    from draftlab.interop.export import ExportError

    f = tmp_path / "tok" / "tokenizer.model"
    f.parent.mkdir()
    f.write_bytes(b"x")
    with pytest.raises(BaseModelError, match=r"^--tokenizer='.*tokenizer.model': a file: give the directory"):
        check_export(good_dir, tokenizer=str(f))
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text("{}")
    with pytest.raises(ExportError, match=r"a model directory, as `draftlab export --to` writes; .* --served"):
        check_export(served)
    # A --base that is no directory: one line, as generate says it (a traceback from the hub client: walk-through)
    with pytest.raises(BaseModelError, match=r"^--base='.*nonexist': no such directory"):
        check_export(good_dir, base=str(tmp_path / "nonexist"))


def test_a_first_layer_of_one_is_said_to_be_unservable_by_sglang_since_the_first_id_rule():
    """Layers (1, 2, 4), the small-base default, written for SGLang as [0, 1, 3]: right before PR #25454, and
    since then read as they are, for the DeepSeek-V2/V3 and GLM4-MoE-Lite targets that PR covers. The fix offered
    was to set the ids to the value they had (found by a new user's walkthrough); no value serves such a draft
    there, and the message says so and what to retrain with. SGLang's Llama and Qwen models add 1 always, so the
    same ids pass there (found by review: the rule was applied to every target, and its fix would have shifted
    a Llama draft's layers by one)."""
    from draftlab.interop.check import check_aux

    small = ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}},
             {"head": {"type": "eagle3", "layers": [1, 2, 4]}}, ["sglang"], 5)
    c = check_aux(*small, "deepseek_v3")
    assert c.ok is False and "no value serves this draft there" in c.message
    assert "set eagle_config.eagle_aux_hidden_state_layer_ids to [0, 1, 3]" not in c.message
    large = ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}},
             {"head": {"type": "eagle3", "layers": [3, 5, 7]}}, ["sglang"], 9)
    c = check_aux(*large, "deepseek_v2")
    assert "set eagle_config.eagle_aux_hidden_state_layer_ids to [3, 5, 7] for SGLang since the PR" in c.message
    for base_type in ("llama", "qwen3"):
        assert check_aux(*small, base_type).ok is True and check_aux(*large, base_type).ok is True
