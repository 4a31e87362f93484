from pathlib import Path

import pytest
import yaml

from draftlab.config import ConfigError, build_recipe, diff_recipes, dump_recipe, load_recipe, parse_overrides

REPO = Path(__file__).resolve().parents[1]
MIN = {"base": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}, "output_dir": "out"}


def test_overrides_apply_and_parse_scalars():
    r = build_recipe(MIN, ["train.lr=3e-4", "head.num_heads=5", "log.trackers=[tensorboard]", "train.betas=[0.9, 0.95]"])
    assert r.train.lr == 3e-4 and r.head.num_heads == 5
    assert r.log.trackers == ["tensorboard"] and r.train.betas == (0.9, 0.95)


def test_recipe_is_frozen():
    r = build_recipe(MIN)
    with pytest.raises(Exception):
        r.train.lr = 1.0


def test_every_problem_reported_at_once_golden():
    raw = {"base": {"name_or_pat": "x", "dtype": "fp32"}, "head": {"num_heads": 0}, "data": {"path": "a"},
           "output_dir": "o"}
    with pytest.raises(ConfigError) as e:
        build_recipe(raw, ["train.lr=-1", "trian.lr=1", "oops"], source="r.yaml")
    assert str(e.value) == (
        "r.yaml: 7 problems\n"
        "  - override `oops`: expected dotted.key=value, e.g. train.lr=3e-4\n"
        "  - `base.name_or_path`: missing; add it (Hugging Face hub id or local directory of a causal LM), "
        "e.g. base.name_or_path=lmsys/vicuna-7b-v1.3\n"
        "  - `base.dtype` = 'fp32': use 'float32', 'bfloat16' or 'float16'\n"
        "  - `base.name_or_pat`: unknown key; did you mean `base.name_or_path`?\n"
        "  - `head.num_heads` = 0: Input should be greater than or equal to 1 "
        "(draft heads; head k predicts k+1 tokens past the base)\n"
        "  - `train.lr` = -1: Input should be greater than 0 (peak learning rate)\n"
        "  - `trian`: unknown key; did you mean `train`?"
    )


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        build_recipe(MIN, ["loss.zzz=1"])
    assert "`loss.zzz`: unknown key; valid keys here: head_decay, distill_weight, divergence, chunk_size, topk" in str(e.value)


def test_a_key_at_the_wrong_level_names_where_it_belongs():
    """`max_steps=10` listed the top-level sections (found by a new user's walkthrough); it belongs in train."""
    with pytest.raises(ConfigError) as e:
        build_recipe(MIN, ["max_steps=10"])
    assert "`max_steps`: unknown key; did you mean `train.max_steps`?" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_recipe(MIN, ["train.num_heads=3"])
    assert "`train.num_heads`: unknown key; did you mean `head.num_heads`?" in str(e.value)


def test_cross_field_rule_names_the_fix():
    with pytest.raises(ConfigError) as e:
        build_recipe(MIN, ["head.prefix_attention=true"])
    assert "head.prefix_attention=true needs head.type=hydra" in str(e.value)


@pytest.mark.parametrize("kind, setting, reads", [
    ("dflash", "head.num_layers=2", "shaped by head.dflash"), ("ssm", "head.num_heads=3", "shaped by head.ssm"),
    ("eagle3", "loss.distill_weight=0.5", "always trains towards the base's distribution"),
    ("eagle3", "loss.head_decay=0.5", "head.eagle.step_decay"), ("dflash", "loss.head_decay=0.5", "loss_decay_gamma")])
def test_a_setting_the_head_type_does_not_read_is_refused(kind, setting, reads):
    """Settings a kind reads nothing of were trained past in silence (walk-through: EAGLE-3's loss identical at
    distill_weight 0 and 0.5); given other than their default they are refused, naming what the kind reads. A
    recipe dumped whole (every field at its default) validates again."""
    with pytest.raises(ConfigError, match=f"{setting}: .*{reads}.*this setting is not read"):
        build_recipe(MIN, [f"head.type={kind}", setting])
    ok = build_recipe(MIN, [f"head.type={kind}"])
    assert build_recipe(yaml.safe_load(dump_recipe(ok))) == ok
    assert build_recipe(MIN, ["head.type=medusa", setting.replace("head_decay=0.5", "head_decay=0.7")])


@pytest.mark.parametrize("layers", ["[16, 2, 29]", "[2, 2, 2]"])
def test_eagle_layers_out_of_order_or_repeated_are_refused_before_training(layers):
    """The engines capture each base layer once, in ascending order; such ids were accepted, trained on, and only
    `draftlab check` refused the export afterwards (found by review)."""
    with pytest.raises(ConfigError, match="three distinct base layer ids >= 0 in ascending order"):
        build_recipe(MIN, ["head.type=eagle3", f"head.eagle.layers={layers}"])
    ok = build_recipe(MIN, ["head.type=eagle3", "head.eagle.layers=[2, 16, 29]"])
    assert list(ok.head.eagle.layers) == [2, 16, 29]


def test_yaml_syntax_error_names_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("base:\n  name_or_path: [x\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(p)
    assert "not valid YAML at line" in str(e.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="no such recipe file; `draftlab recipes list` lists the shipped ones"):
        load_recipe("nope.yaml")


def test_parse_overrides_nested():
    tree, problems = parse_overrides(["a.b.c=1", "a.d=x"])
    assert tree == {"a": {"b": {"c": 1}, "d": "x"}} and problems == []


def test_diff_recipes():
    a, b = build_recipe(MIN), build_recipe(MIN, ["train.lr=0.5", "train.max_steps=9"])
    assert diff_recipes(a, b, ignore={"train.max_steps"}) == ["train.lr: 0.001 -> 0.5"]


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate_and_start_with_their_command(path):
    load_recipe(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and ("draftlab" in first or "accelerate launch" in first)


def test_distributed_section_golden():
    with pytest.raises(ConfigError) as e:
        build_recipe(MIN, ["distributed.strategy=fsdp2", "distributed.zero_stage=1"], source="r.yaml")
    assert str(e.value) == (
        "r.yaml: 2 problems\n"
        "  - `distributed.strategy` = 'fsdp2': use 'ddp', 'deepspeed' or 'fsdp'\n"
        "  - `distributed.zero_stage` = 1: use 2 or 3")
    with pytest.raises(ConfigError, match="zero_stage, offload and zero_extra are DeepSpeed settings; set "
                                          "distributed.strategy: deepspeed"):
        build_recipe(MIN, ["distributed.offload=cpu"])
    r = build_recipe(MIN, ["distributed.strategy=deepspeed", "distributed.zero_stage=3", "distributed.offload=cpu"])
    assert (r.distributed.strategy, r.distributed.zero_stage, r.distributed.offload) == ("deepspeed", 3, "cpu")


def test_ensemble_covered_test_defaults_to_spec_infers_with_its_threshold():
    """ensemble.score: generation (SpecInfer's output match, threshold 1.0 unless set) by default; coverage
    (per-position agreement, 0.8) on request; a bad value names the key and the choices."""
    ens = {**MIN, "head": {"type": "ssm"}}
    e = build_recipe({**ens, "ensemble": {}}).ensemble
    assert (e.score, e.threshold, e.match_tokens) == ("generation", 1.0, 32)
    assert build_recipe({**ens, "ensemble": {"score": "coverage"}}).ensemble.threshold == 0.8
    assert build_recipe(ens, ["ensemble.score=coverage", "ensemble.threshold=0.6"]).ensemble.threshold == 0.6
    with pytest.raises(ConfigError, match=r"`ensemble.score` = 'match': use 'generation' or 'coverage'"):
        build_recipe({**ens, "ensemble": {"score": "match"}})
    with pytest.raises(ConfigError, match=r"`ensemble.match_tokens` = 0"):
        build_recipe({**ens, "ensemble": {"match_tokens": 0}})
