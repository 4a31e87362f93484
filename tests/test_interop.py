"""Reading published Medusa checkpoints and writing engine formats, through the exact key names those tools use."""

import json

import pytest
import torch
from torch import nn

from draftlab.interop.convert import ConvertError, export_to, import_medusa
from draftlab.decode.decoder import SpeculativeDecoder
from draftlab.decode.search import default_tree
from draftlab.decode.tree import Tree
from draftlab.drafters import build_draft, make_drafter
from draftlab.drafters.heads import MedusaHeads
from draftlab.interop.export import load_export, save_export


@pytest.fixture(scope="module")
def base(tiny_base_dir):
    from draftlab.base import load_base

    return load_base(str(tiny_base_dir), "float32")[0]


def random_heads(base, K=3, L=1, seed=0):
    torch.manual_seed(seed)
    H, V = base.config.hidden_size, base.config.vocab_size
    heads = MedusaHeads(H, V, K, L)
    heads.init_from_base(base)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return heads.eval()


def faster_decoding_state(heads, shared_blocks=False):
    """The state dict FasterDecoding's MedusaModel.medusa_head saves: nn.Sequential(*[ResBlock] * L, Linear)."""
    state = {}
    for h in range(heads.num_heads):
        for l in range(heads.num_layers):
            src = heads.blocks[h][0 if shared_blocks else l].linear
            state[f"{h}.{l}.linear.weight"] = src.weight.detach().clone()
            state[f"{h}.{l}.linear.bias"] = src.bias.detach().clone()
        state[f"{h}.{heads.num_layers}.weight"] = heads.lm_heads[h].weight.detach().clone()
    return state


def same_decoding(base, a, b, tree):
    prompts = [[1, 5, 9, 2], [7, 7]]
    ra = SpeculativeDecoder(base, make_drafter(a, tree)).generate(prompts, max_new_tokens=16)
    rb = SpeculativeDecoder(base, make_drafter(b, tree)).generate(prompts, max_new_tokens=16)
    return ra.tokens == rb.tokens and ra.committed == rb.committed


def test_import_faster_decoding_checkpoint(base, tiny_base_dir, tmp_path):
    heads = random_heads(base, K=3, L=2)
    with torch.no_grad():  # FasterDecoding's heads share one block across a head's layers
        for h in range(3):
            heads.blocks[h][1].load_state_dict(heads.blocks[h][0].state_dict())
    ck = tmp_path / "medusa-ckpt"
    ck.mkdir()
    torch.save(faster_decoding_state(heads), ck / "medusa_lm_head.pt")
    # A published config that names fewer heads than the file holds: heads are counted from the tensors.
    (ck / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2,
                                                "base_model_name_or_path": str(tiny_base_dir)}))
    rep = import_medusa(ck, tmp_path / "exp")
    assert rep["num_heads"] == 3 and rep["config_num_heads"] == 2 and rep["layout"] == "medusa"
    imported, meta = load_export(tmp_path / "exp", base=base)
    assert meta["imported_from"]["num_layers"] == 2
    for k, v in heads.state_dict().items():
        torch.testing.assert_close(imported.state_dict()[k], v)
    assert same_decoding(base, imported, heads, default_tree(3, 12))


def test_import_safetensors_and_medusa2_shards(base, tiny_base_dir, tmp_path):
    from safetensors.torch import save_file

    heads = random_heads(base, K=2, L=1, seed=1)
    st = tmp_path / "medusa_lm_head.safetensors"
    save_file(faster_decoding_state(heads), st)
    import_medusa(st, tmp_path / "a", base=str(tiny_base_dir))
    assert same_decoding(base, load_export(tmp_path / "a", base=base)[0], heads, Tree.chain(2))
    # Medusa-2: the heads live in the model's own shards under medusa_head.*; the checkpoint is the base.
    m2 = tmp_path / "medusa2"
    base.save_pretrained(m2)
    for f in tiny_base_dir.glob("tokenizer*"):
        (m2 / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file

    shard = load_file(m2 / "model.safetensors")
    shard.update({f"medusa_head.{k}": v for k, v in faster_decoding_state(heads).items()})
    save_file(shard, m2 / "model.safetensors", metadata={"format": "pt"})
    rep = import_medusa(m2, tmp_path / "b")
    assert rep["medusa2"] and rep["base"] == str(m2) and rep["num_heads"] == 2
    assert same_decoding(base, load_export(tmp_path / "b", base=base)[0], heads, Tree.chain(2))


def test_import_from_a_hub_id_reads_the_hub_cache(base, tiny_base_dir, tmp_path, monkeypatch):
    """docs/interop.md's first example gives a hub id (FasterDecoding/medusa-vicuna-7b-v1.3), which import-medusa
    took for a path ("no such file or directory"): a hub id is read through the hub cache (offline here), and one that
    is not there is said to be so."""
    import huggingface_hub.constants as hub

    heads = random_heads(base, K=2, L=1, seed=2)
    snap = tmp_path / "cache" / "models--org--medusa-tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("a" * 40)
    torch.save(faster_decoding_state(heads), snap / "medusa_lm_head.pt")
    (snap / "config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_base_dir)}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    rep = import_medusa("org/medusa-tiny", tmp_path / "exp")
    assert rep["path"] == "org/medusa-tiny" and rep["num_heads"] == 2
    assert same_decoding(base, load_export(tmp_path / "exp", base=base)[0], heads, Tree.chain(2))
    with pytest.raises(ConvertError, match="as a hub id it could not be read .HF_HUB_OFFLINE is set and it is not in"):
        import_medusa("org/absent", tmp_path / "exp2")


def test_import_errors_name_the_key(base, tiny_base_dir, tmp_path):
    heads = random_heads(base, K=2)
    state = faster_decoding_state(heads)
    bad = dict(state, **{"0.0.linear.scale": torch.ones(1)})
    torch.save(bad, tmp_path / "x.pt")
    with pytest.raises(ConvertError, match=r"key '0.0.linear.scale' is not a Medusa head weight"):
        import_medusa(tmp_path / "x.pt", tmp_path / "e", base=str(tiny_base_dir))
    wide = {k: torch.zeros(v.shape[0], 48) if "linear" not in k else v for k, v in state.items()}  # lm_heads 48 wide
    torch.save(wide, tmp_path / "w.pt")
    with pytest.raises(ConvertError, match=r"head 0's lm_head is \(\d+, 48\), the base"):
        import_medusa(tmp_path / "w.pt", tmp_path / "e", base=str(tiny_base_dir))
    torch.save(state, tmp_path / "nobase.pt")
    with pytest.raises(ConvertError, match="no --base given"):
        import_medusa(tmp_path / "nobase.pt", tmp_path / "e")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConvertError, match="not a readable PyTorch state dict"):
        import_medusa(tmp_path / "junk.pt", tmp_path / "e", base=str(tiny_base_dir))


class VllmMedusaMirror(nn.Module):
    """vLLM's Medusa module structure (vllm/model_executor/models/medusa.py): parameter names and shapes only."""

    def __init__(self, cfg):
        super().__init__()
        H, V = cfg["hidden_size"], cfg["truncated_vocab_size"]
        self.blocks = nn.ModuleList(nn.Module() for _ in range(cfg["num_heads"]))
        for block in self.blocks:
            block.layers = nn.ModuleList(nn.Linear(H, H, bias=cfg.get("medusa_fc_bias", False))
                                         for _ in range(cfg["num_hidden_layers"]))
        self.lm_heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(cfg["num_heads"]))

    def logits(self, h):
        out = []
        for block, lm in zip(self.blocks, self.lm_heads):
            x = h
            for layer in block.layers:
                x = x + nn.functional.silu(layer(x))
            out.append(lm(x))
        return torch.stack(out, dim=-2)


def test_export_for_vllm_loads_into_its_structure_with_the_same_logits(base, tiny_base_dir, tmp_path):
    from safetensors.torch import load_file

    heads = random_heads(base, K=3, L=2)
    save_export(heads, base, tmp_path / "exp", str(tiny_base_dir))
    rep = export_to(tmp_path / "exp", "vllm-medusa", tmp_path / "vllm", license_id="apache-2.0")
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 3 and cfg["num_hidden_layers"] == 2
    assert cfg["medusa_fc_bias"] is True and cfg["truncated_vocab_size"] == cfg["vocab_size"] == base.config.vocab_size
    state = load_file(tmp_path / "vllm" / "model.safetensors")
    mirror = VllmMedusaMirror(cfg)
    assert set(state) == set(mirror.state_dict())  # exactly the loader's names: nothing missing, nothing ignored
    mirror.load_state_dict(state, strict=True)
    h = torch.randn(5, base.config.hidden_size)
    torch.testing.assert_close(mirror.logits(h), heads.logits(h))
    # `draftlab check` reads the served files by the same rules.
    from draftlab.interop.engine_read import vllm_medusa_logits

    torch.testing.assert_close(vllm_medusa_logits(state, cfg, h), mirror.logits(h))
    # Without medusa_fc_bias the loader has no bias parameters and would drop them silently: the names differ.
    assert set(state) != set(VllmMedusaMirror({**cfg, "medusa_fc_bias": False}).state_dict())
    card = (tmp_path / "vllm" / "README.md").read_text()
    # A base trained from a local directory: no path in the hub's base_model metadata (walk-through), a comment
    # instead; --base-model names the hub id.
    assert "\nbase_model:" not in card and f"# base_model: the base's hub id (the export names a local directory, " \
        f"{tiny_base_dir}" in card
    from draftlab.cli import main

    assert main(["export", str(tmp_path / "exp"), "--to", "vllm-medusa", "--out", str(tmp_path / "named"),
                 "--base-model", "org/tiny"]) == 0
    assert "\nbase_model: org/tiny\n" in (tmp_path / "named" / "README.md").read_text()
    assert "license: apache-2.0" in card and "Not measured" in card and rep["files"] == ["README.md", "config.json",
                                                                                        "model.safetensors"]
    # And draftlab reads vLLM's layout back.
    import_medusa(tmp_path / "vllm" / "model.safetensors", tmp_path / "back", base=str(tiny_base_dir))
    for k, v in heads.state_dict().items():
        torch.testing.assert_close(load_export(tmp_path / "back")[0].state_dict()[k], v)


def test_export_faster_decoding_round_trip_and_shared_blocks(base, tiny_base_dir, tmp_path, capsys):
    heads = random_heads(base, K=2, L=1)
    save_export(heads, base, tmp_path / "exp", str(tiny_base_dir))
    export_to(tmp_path / "exp", "medusa", tmp_path / "fd")
    # FasterDecoding's current loader builds 5 heads for a heads-only directory (found by review): heads 2..4 would
    # stay random there, said on stderr and in the model card.
    note = "builds 5 heads for a heads-only directory"
    assert note in capsys.readouterr().err and note in (tmp_path / "fd" / "README.md").read_text()
    state = torch.load(tmp_path / "fd" / "medusa_lm_head.pt", weights_only=True)
    assert set(state) == set(faster_decoding_state(heads))
    cfg = json.loads((tmp_path / "fd" / "config.json").read_text())
    assert cfg == {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": str(tiny_base_dir)}
    import_medusa(tmp_path / "fd", tmp_path / "back")
    assert same_decoding(base, load_export(tmp_path / "back", base=base)[0], heads, Tree.chain(2))
    deep = random_heads(base, K=2, L=2)  # distinct blocks: FasterDecoding's shared block cannot hold them
    save_export(deep, base, tmp_path / "deep", str(tiny_base_dir))
    with pytest.raises(ConvertError, match="distinct residual blocks.*--to vllm-medusa"):
        export_to(tmp_path / "deep", "medusa", tmp_path / "fd2")


def test_export_hf_for_ssms_and_refusals(base, tiny_base_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftlab.base import load_tokenizer

    ssm = build_draft({"type": "ssm", "ssm": {"num_layers": 1, "hidden_size": 16}}, base).eval()
    save_export(ssm, base, tmp_path / "ssm", str(tiny_base_dir), tokenizer=load_tokenizer(str(tiny_base_dir)))
    export_to(tmp_path / "ssm", "hf", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert len(AutoTokenizer.from_pretrained(tmp_path / "hf")) == base.config.vocab_size
    ids = torch.randint(0, base.config.vocab_size, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ssm.lm(ids).logits)
    assert not (tmp_path / "hf" / "draftlab.json").exists() and (tmp_path / "hf" / "README.md").is_file()
    with pytest.raises(ConvertError, match="is a Medusa heads format"):
        export_to(tmp_path / "ssm", "vllm-medusa", tmp_path / "x")
    save_export(random_heads(base), base, tmp_path / "med", str(tiny_base_dir))
    with pytest.raises(ConvertError, match="writes a standalone model"):
        export_to(tmp_path / "med", "hf", tmp_path / "x")
    hydra = build_draft({"type": "hydra", "num_heads": 2, "num_layers": 1}, base)
    save_export(hydra, base, tmp_path / "hy", str(tiny_base_dir))
    with pytest.raises(ConvertError, match="sequentially dependent.*no serving engine implements them"):
        export_to(tmp_path / "hy", "vllm-medusa", tmp_path / "x")
    eagle = build_draft({"type": "eagle3"}, base)  # already an engine's layout: no format sends it elsewhere
    save_export(eagle, base, tmp_path / "e3", str(tiny_base_dir))
    for fmt in ("hf", "vllm-medusa", "medusa"):
        with pytest.raises(ConvertError, match="already in the layout vLLM and SGLang load.*nothing to convert"):
            export_to(tmp_path / "e3", fmt, tmp_path / "x")


def test_trees_in_the_formats_medusa_and_eagle_write(tmp_path):
    from draftlab.decode.tree import TreeError

    (tmp_path / "choices.py").write_text("mc_sim_7b_63 = [(0,), (1,), (0, 0), (0, 1)]\nother = [[0]]\n")
    assert Tree.parse(f"{tmp_path / 'choices.py'}:mc_sim_7b_63").paths == ((0,), (1,), (0, 0), (0, 1))
    assert Tree.parse("[(0,), (0, 0)]").paths == ((0,), (0, 0))
    assert Tree.parse("[[0], [1]]").size == 3
    # A tree file's mapping given inline (it was looked up as a file name: walk-through)
    assert Tree.parse('{"paths": [[0], [0, 0]]}').paths == ((0,), (0, 0))
    assert Tree.parse("{dynamic: 'dynamic:3,2,8'}").total_tokens == 8
    with pytest.raises(TreeError, match="a mapping needs a 'paths'"):
        Tree.parse('{"a": 1}')
    (tmp_path / "t.txt").write_text("[(0,), (1,), (1, 0)]")
    assert Tree.load(tmp_path / "t.txt").size == 4
    with pytest.raises(TreeError, match="no list named 'missing'.*mc_sim_7b_63, other"):
        Tree.parse(f"{tmp_path / 'choices.py'}:missing")
    with pytest.raises(TreeError, match="not a list of paths"):
        Tree.parse("[(0,), (0 0)]")
    with pytest.raises(TreeError, match="no such tree file.*inline paths"):
        Tree.parse("nothere.json")
    with pytest.raises(TreeError, match=r"defualt: no such tree file \(did you mean default\? .*dynamic:DEPTH"):
        Tree.parse("defualt")


def test_vllm_layout_is_read_as_vllm_reads_it(base, tiny_base_dir, tmp_path):
    """vLLM's layout with one lm_head shared by every head (original_lm_head) lost every head but the first,
    silently; block biases in a file whose config does not set medusa_fc_bias (vLLM builds no bias parameters and
    passes over them) were imported, so the import drafted otherwise than vLLM serves (found by review)."""
    from safetensors.torch import save_file

    from draftlab.interop.engine_read import vllm_medusa_logits
    from draftlab.interop.convert import vllm_medusa_state

    heads = random_heads(base, K=3, L=1)
    state, cfg = vllm_medusa_state(heads)
    shared = {k: v for k, v in state.items() if not k.startswith("lm_heads.") or k == "lm_heads.0.weight"}
    d = tmp_path / "shared"
    d.mkdir()
    save_file(shared, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({**cfg, "original_lm_head": False}))
    with pytest.raises(ConvertError, match=r"heads \[1, 2\] have residual blocks but no lm_head"):
        import_medusa(d, tmp_path / "x", base=str(tiny_base_dir))
    (d / "config.json").write_text(json.dumps({**cfg, "original_lm_head": True}))
    rep = import_medusa(d, tmp_path / "shared_import", base=str(tiny_base_dir))
    got = load_export(tmp_path / "shared_import")[0]
    assert rep["num_heads"] == 3
    for h in range(3):
        torch.testing.assert_close(got.lm_heads[h].weight, heads.lm_heads[0].weight)
    # Biases without medusa_fc_bias: what vLLM serves has none, and so has the import.
    d2 = tmp_path / "nobias"
    d2.mkdir()
    save_file(state, d2 / "model.safetensors")
    served = {**cfg, "medusa_fc_bias": False}
    (d2 / "config.json").write_text(json.dumps(served))
    import_medusa(d2, tmp_path / "nobias_import", base=str(tiny_base_dir))
    h = torch.randn(4, base.config.hidden_size)
    got = load_export(tmp_path / "nobias_import")[0]
    torch.testing.assert_close(got.logits(h), vllm_medusa_logits(state, served, h))


def test_an_export_finds_its_base_from_any_working_directory(base, tiny_base_dir, tmp_path, monkeypatch):
    """A base given as a relative path (runs/stories260k-base) was recorded as given, so the export could not be
    decoded from another directory: a minute of hub retries, then an error about llama2.c (found by a new user's
    walkthrough). A local base is recorded whole; a relative one that is missing is refused at once."""
    import shutil

    from draftlab.base import BaseModelError, load_base
    from draftlab.serve.generate import load_decoder

    (tmp_path / "runs").mkdir()
    shutil.copytree(tiny_base_dir, tmp_path / "runs" / "base")
    monkeypatch.chdir(tmp_path)
    save_export(random_heads(base), base, "runs/exp", "runs/base")
    monkeypatch.chdir(tmp_path / "runs")
    assert read_meta_base(tmp_path / "runs" / "exp") == str(tmp_path / "runs" / "base")
    decoder, _, _ = load_decoder(str(tmp_path / "runs" / "exp"), device="cpu")
    assert decoder.generate([[1, 5, 7]], max_new_tokens=3).new_tokens == 3
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BaseModelError, match=r"'runs/elsewhere': no such directory .*take another with --base"):
        load_base("runs/elsewhere", "float32")


def read_meta_base(d):
    return json.loads((d / "draftlab.json").read_text())["base"]["name_or_path"]


def test_a_draft_that_reads_only_tokens_serves_any_base_of_its_vocabulary():
    """An SSM (or lookup, or an ensemble of them) reads nothing of the base but its tokens: a base of another shape
    with the same vocabulary serves it, as a small draft model serves a family of bases (it was refused for any other
    hidden size or depth). Heads still need the base's shape, and a base of their shape with other weights is a
    warning (it was accepted silently, acceptance then collapsing: walk-through)."""
    import warnings

    from conftest import tiny_llama

    from draftlab.base import base_identity
    from draftlab.interop.export import ExportError, check_base

    trained = tiny_llama(vocab=64, hidden=32, layers=2, seed=0, dtype=torch.float32)
    meta = lambda head: {"head": head, "base": base_identity(trained, "runs/trained")}
    ssm, heads = {"type": "ssm"}, {"type": "medusa"}
    ensemble = {"type": "ensemble", "members": [{"head": ssm}, {"head": {"type": "lookup"}}]}
    deeper = tiny_llama(vocab=64, hidden=48, layers=4, seed=1, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_base(meta(ssm), deeper)
        check_base(meta(ensemble), deeper)
        for dtype in (torch.bfloat16, torch.float16):  # the same weights in another dtype: no warning
            check_base(meta(heads), tiny_llama(vocab=64, hidden=32, layers=2, seed=0, dtype=torch.float32).to(dtype))
    with pytest.raises(ExportError, match="hidden_size: export has 32, base has 48; num_hidden_layers"):
        check_base(meta(heads), deeper)
    with pytest.raises(ExportError, match="vocab_size: export has 64, base has 80"):
        check_base(meta(ensemble), tiny_llama(vocab=80, seed=1, dtype=torch.float32))
    with pytest.warns(UserWarning, match="has its shape but other weights"):
        check_base(meta(heads), tiny_llama(vocab=64, hidden=32, layers=2, seed=7, dtype=torch.float32))


def test_a_token_only_draft_on_a_base_of_another_tokenizer_of_its_size_is_warned():
    """An SSM is loaded on any base of its vocabulary size, so a tokenizer of that size mapping ids otherwise (Llama-2's
    and Mistral's 32,000) is caught by the training tokenizer's fingerprint: a warning (review)."""
    import warnings

    from draftlab.interop.export import check_tokens, tokenizer_fingerprint

    class Tok:
        bos_token_id, eos_token_id, pad_token_id, chat_template, name_or_path = 1, 2, 0, None, "other"

        def __init__(self, words):
            self.vocab = {w: i for i, w in enumerate(words)}

        def get_vocab(self):
            return self.vocab

        def __len__(self):
            return len(self.vocab)

    mine, theirs = Tok(["<unk>", "<s>", "</s>", "a", "b"]), Tok(["<unk>", "<s>", "</s>", "b", "a"])
    meta = {"head": {"type": "ssm"}, "tokenizer": tokenizer_fingerprint(mine)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_tokens(meta, mine)
        check_tokens({**meta, "head": {"type": "medusa"}}, theirs)  # heads: the base's shape and embedding tell
    with pytest.warns(UserWarning, match="trained with another tokenizer than the base's"):
        check_tokens(meta, theirs)


def test_the_fasterdecoding_note_names_the_heads_it_leaves_out():
    """The note on FasterDecoding's 5-head loader read "heads 4..4 keep their random initialisation" (walk-through)."""
    from draftlab.interop.convert import fasterdecoding_note

    assert fasterdecoding_note(5) is None
    assert "these are 4: head 4 keeps its random initialisation: decode there with a tree no deeper than 4" \
        in fasterdecoding_note(4)
    assert "these are 2: heads 2..4 keep their random initialisation" in fasterdecoding_note(2)
    assert "these are 6: head 5 is not loaded: trees deeper than 5 lose it." in fasterdecoding_note(6)
    assert "these are 8: heads 5..7 are not loaded: trees deeper than 5 lose them." in fasterdecoding_note(8)


def test_the_card_says_a_parameter_count_as_it_is():
    from draftlab.interop.convert import params_text

    assert [params_text(n) for n in (78_336, 1_234_567, 6_738_415_616, 512)] == ["78.3K", "1.23M", "6.74B", "512"]


def test_an_exports_content_digest_is_read_again_only_when_its_files_moved(tmp_path, monkeypatch):
    """eval's resume and `export --eval` know an export by its files' contents; the recorded digest stands while
    the files' stat digest does, so an unchanged 4-10 GB export is not read again (found by review)."""
    import os
    import shutil

    from draftlab.interop import export as ex

    d = tmp_path / "e"
    d.mkdir()
    (d / "draftlab.json").write_text("{}")
    (d / "draft.safetensors").write_bytes(bytes(range(256)) * 64)
    recorded = {"export_content": ex.files_fingerprint(str(d), content=True), "export_stat": ex.files_stat(str(d))}
    reads = []
    real = ex.files_fingerprint
    monkeypatch.setattr(ex, "files_fingerprint", lambda p, content=False: reads.append(p) or real(p, content))
    assert ex.content_fingerprint(str(d), recorded) == recorded["export_content"] and reads == []
    # A copy (other inodes; copytree keeps the modification times), and a file rewritten in place with the same size
    # and modification time, are read again: the copy's digest is the original's, the rewrite's another.
    copy = shutil.copytree(d, tmp_path / "copy")
    assert ex.content_fingerprint(str(copy), recorded) == recorded["export_content"] and reads == [str(copy)]
    st = (d / "draft.safetensors").stat()
    (d / "draft.safetensors").write_bytes(bytes(range(1, 256)) * 64 + bytes(64))
    os.utime(d / "draft.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ex.files_fingerprint(str(d)) == real(str(copy))  # (names, sizes and times: no change seen)
    assert ex.content_fingerprint(str(d), recorded) != recorded["export_content"] and reads[-1] == str(d)
    assert ex.content_fingerprint(str(d), None) == real(str(d), content=True)  # (nothing recorded: read)
