"""Recipe schema: YAML + dotted `key=value` overrides -> one frozen, validated `Recipe`."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """Every problem of a recipe at once; each line names the dotted key, the value and the fix."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        n = len(problems)
        head = f"{source}: {n} problem{'s' if n > 1 else ''}"
        super().__init__(head + "\n" + "\n".join(f"  - {p}" for p in problems))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BaseSection(_Section):
    name_or_path: str = Field(
        description="Hugging Face hub id or local directory of a causal LM",
        examples=["lmsys/vicuna-7b-v1.3", "runs/stories260k-base"],
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype the frozen base is loaded in"
    )
    revision: str | None = Field(None, description="the hub revision (branch, tag or commit) the base is loaded at")
    trust_remote_code: bool = Field(False, description="run the base repository's own modelling code (transformers' "
                                    "trust_remote_code)")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = Field(
        None, description="transformers' attention kernels for the base (unset: transformers' default)")
    chat_template: str | None = Field(
        None, description="the chat template conversations are rendered with, in place of the tokenizer's: a "
        "built-in name (vicuna: FastChat's vicuna_v1.1, for Vicuna bases, which ship none; simple: User:/Assistant:), "
        "a .jinja file, or Jinja text; unset: the tokenizer's own (simple when it has none, with a warning). The export "
        "keeps it, and the simple fallback, as chat_template.jinja, and draftlab serves with it",
        examples=["vicuna", "templates/my_chat.jinja"])


class SSMSection(_Section):
    name_or_path: str | None = Field(
        None, description="hub id or directory of a small causal LM with the base's vocabulary; unset: build one "
        "from the base's own config class with the fields below",
        examples=["JackFram/llama-68m"])
    num_layers: int = Field(2, ge=1, le=128, description="decoder layers of an SSM built from the base's config")
    hidden_size: int | None = Field(None, ge=8, description="width of a built SSM (unset: the base's)")
    num_attention_heads: int | None = Field(None, ge=1, description="attention heads of a built SSM (unset: the "
                                            "base's head width is kept)")
    num_key_value_heads: int | None = Field(None, ge=1, description="key-value heads of a built SSM (unset: as "
                                            "the base's, capped by the heads)")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width of a built SSM (unset: the base's MLP "
                                          "ratio)")
    init: Literal["auto", "embeddings", "project", "truncate", "random"] = Field(
        "auto", description="from the base: embeddings (copy embeddings, lm_head, final norm; same width), project "
        "(the same projected onto the embeddings' top principal directions; narrower), truncate (also copy the "
        "base's first num_layers layers), random; auto = embeddings if the widths match, else project (a "
        "pretrained name_or_path keeps its own weights)")
    trust_remote_code: bool = Field(False, description="run the SSM repository's own modelling code")

    @model_validator(mode="after")
    def _pretrained_keeps_its_shape(self):
        # (a recipe's num_layers: 1 beside a 2-layer pretrained model trained the 2 layers without a word; walk-through)
        if self.name_or_path:
            shaped = [f"{f}={getattr(self, f)}" for f in ("num_layers", "hidden_size", "num_attention_heads",
                                                           "num_key_value_heads", "intermediate_size")
                      if getattr(self, f) != type(self).model_fields[f].default]
            if shaped:
                raise ValueError(f"head.ssm.{', '.join(shaped)}: these shape an SSM built from the base's config; a "
                                 f"pretrained head.ssm.name_or_path ({self.name_or_path}) keeps its own shape, so they "
                                 "are not read: leave them unset, or drop name_or_path to build one")
        return self


class EagleSection(_Section):
    layers: list[int] | None = Field(
        None, description="base layer ids whose input states are fused (Hugging Face output_hidden_states "
        "indexing: id i = hidden_states[i], the input of decoder layer i, 0 = embeddings); unset: EAGLE-3's "
        "(2, L // 2, L - 3) for a base of L >= 7 layers, (2, 3, 4) for 6, (1, L // 2, L - 1) below",
        examples=[[2, 16, 29]])
    draft_vocab_size: int | None = Field(
        None, ge=2, description="size of the draft vocabulary (the most frequent tokens the training data supervises); "
        "unset: the base's whole vocabulary", examples=[32000])
    ttt_steps: int = Field(7, ge=1, le=16, description="training-time test: steps the layer is unrolled on its own "
                           "outputs")
    step_decay: float = Field(0.8, gt=0, le=1, description="step k's loss is weighted step_decay^k")
    fc_norm: bool = Field(False, description="EAGLE-3.1: an RMSNorm on each base layer's features before they are "
                          "concatenated and fused (fc_norm.{i}.weight); false: EAGLE-3")
    norm_output: bool = Field(False, description="EAGLE-3.1: the layer's normalised output is both what lm_head reads "
                              "and what the next step is fed; false: EAGLE-3 feeds the output before the final norm")

    @field_validator("layers")
    @classmethod
    def _layers(cls, v):
        if v is not None and (len(v) != 3 or min(v) < 0 or list(v) != sorted(set(v))):
            raise ValueError("head.eagle.layers: three distinct base layer ids >= 0 in ascending order (low, middle, "
                             "high): the engines capture each layer once, in that order")
        return v


class DFlashSection(_Section):
    block_size: int = Field(16, ge=2, le=64, description="tokens per block: the last verified token and "
                            "block_size - 1 drafted in one forward (DFlash's default: 16)")
    num_layers: int = Field(5, ge=1, le=16, description="draft decoder layers (the base's block type); 5 in DFlash's "
                            "released Qwen3 drafts")
    layers: list[int] | None = Field(
        None, description="base layer ids whose states are fused into the context (hidden_states indexing, as "
        "head.eagle.layers: id i = the output of decoder layer i - 1); unset: DFlash's, one per draft layer spread "
        "evenly from the output of layer 1 to that of layer L - 3", examples=[[2, 10, 18, 26, 34]])
    mask_token_id: int | None = Field(None, ge=0, description="the token id whose (base) embedding fills the block "
                                      "past its first position; unset: the base config's pad_token_id, else its "
                                      "unk_token_id, else the last id")
    num_anchors: int = Field(512, ge=1, description="training: blocks per sequence, at random anchor positions")
    qk_norm: bool = Field(True, description="RMS norms on each head's queries and keys in the draft's attention, as "
                          "Qwen3 layers and the engines' DFlash models (z-lab, SGLang, vLLM) always have; false only "
                          "for drafts matching a base without them, which those engines do not serve as trained")
    loss_decay_gamma: float | None = Field(
        None, gt=0, description="training: block position k's loss is weighted exp(-(k - 1) / gamma); unset: the "
        "paper's 7 for blocks of 16, 5 for 10, 4 for 8 (other sizes interpolated)")

    @field_validator("layers")
    @classmethod
    def _layers(cls, v):
        if v is not None and (not v or min(v) < 1):
            raise ValueError("head.dflash.layers: one or more base layer ids >= 1 (outputs of decoder layers)")
        return v


class HeadSection(_Section):
    type: Literal["medusa", "hydra", "ssm", "eagle3", "dflash"] = Field(
        "medusa", description="the draft model: medusa / hydra heads on the base's hidden state, ssm (a small "
        "causal LM, see head.ssm), eagle3 (one decoder layer over three base layers, see head.eagle) or dflash (a "
        "block drafter: a few layers drafting a block in one forward, see head.dflash)")
    num_heads: int = Field(4, ge=1, le=16, description="draft heads; head k predicts k+1 tokens past the base")
    num_layers: int = Field(
        1, ge=0, le=8, description="residual blocks per Medusa head / hidden layers per Hydra MLP"
    )
    prefix_attention: bool = Field(False, description="Hydra++: one extra decoder layer feeding the heads")
    dropout: float = Field(0.0, ge=0, lt=1, description="Hydra heads: dropout on each head's input, between its "
                           "blocks and before its lm_head, in training (Hydra++'s reference script: 0.2)")
    ssm: SSMSection | None = Field(None, description="the small LM, for head.type: ssm")
    eagle: EagleSection | None = Field(None, description="the EAGLE-3-style drafter, for head.type: eagle3")
    dflash: DFlashSection | None = Field(None, description="the DFlash-style block drafter, for head.type: dflash")

    @model_validator(mode="before")
    @classmethod
    def _section_defaults(cls, data):
        """head.type ssm / eagle3 / dflash without its section: the section's defaults."""
        section = ({"ssm": "ssm", "eagle3": "eagle", "dflash": "dflash"}.get(data.get("type"))
                   if isinstance(data, dict) else None)
        if section and data.get(section) is None:
            data = {**data, section: {}}
        return data

    @model_validator(mode="after")
    def _kind_options(self) -> "HeadSection":
        if self.prefix_attention and self.type != "hydra":
            raise ValueError("head.prefix_attention=true needs head.type=hydra (it is a Hydra++ option)")
        if self.dropout and self.type != "hydra":
            raise ValueError("head.dropout is a Hydra option; set head.type=hydra or head.dropout=0")
        if self.ssm is not None and self.type != "ssm":
            raise ValueError("head.ssm configures a small draft LM; set head.type: ssm or remove head.ssm")
        if self.eagle is not None and self.type != "eagle3":
            raise ValueError("head.eagle configures an EAGLE-3 drafter; set head.type: eagle3 or remove head.eagle")
        if self.dflash is not None and self.type != "dflash":
            raise ValueError("head.dflash configures a block drafter; set head.type: dflash or remove head.dflash")
        return self


class LossSection(_Section):
    head_decay: float = Field(0.8, gt=0, le=1, description="lambda: head k's loss is weighted lambda^k")
    distill_weight: float = Field(
        0.0, ge=0, le=1, description="0 = CE on data tokens, 1 = match the base's distribution, between = mix"
    )
    divergence: Literal["fkl", "rkl", "tvd", "jsd"] = Field(
        "fkl", description="what distillation minimises towards the base: fkl = forward KL (soft CE), rkl = reverse "
        "KL, tvd = total variation, jsd = Jensen-Shannon")
    chunk_size: int = Field(512, ge=1, description="positions per logits chunk (bounds loss memory)")
    topk: int = Field(5, ge=1, le=100, description="k of the top-k accuracy reported per head")


class DataSection(_Section):
    path: str = Field(description="local .json/.jsonl/.txt file, a folder of them, or a hub dataset id")
    format: Literal["auto", "sharegpt", "alpaca", "text"] = Field(
        "auto", description="how records are read: sharegpt (conversations), alpaca (instruction / input / output), "
        "text (plain text); auto: each record by its fields")
    split: str = Field("train", description="split to read from a hub dataset")
    max_len: int = Field(2048, ge=8, description="tokens per example after the chat template")
    eval_size: float = Field(
        0.05, ge=0, description="held-out records: a fraction if < 1, else a count (of records, before a .txt's "
                               "documents are cut into blocks; of blocks for a single document)"
    )
    eval_pick: Literal["random", "tail"] = Field(
        "random", description="held-out records: a seeded random subset, or the last ones in file order"
    )
    max_records: int | None = Field(None, ge=1, description="read at most this many records")
    on_malformed: Literal["error", "skip"] = Field(
        "error", description="'skip' drops malformed records and counts them instead of stopping"
    )
    num_proc: int = Field(1, ge=1, description="processes that tokenize conversations (used from 2,000 "
                          "conversations on; in a multi-process run, the main process's)")
    cache: bool = Field(True, description="keep the tokenized examples in OUTPUT_DIR/tokenized: made once by the main "
                        "process, read by the others and by every resume (keyed by the data files, the data "
                        "section, the tokenizer and its template; made again when any changes)")


class TrainSection(_Section):
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's betas")
    warmup_steps: int = Field(40, ge=0, description="linear warmup, in optimizer steps")
    final_lr_ratio: float = Field(0.0, ge=0, le=1, description="the cosine schedule decays to this fraction of the "
                                  "peak lr (Hydra++'s reference script: 0.33)")
    epochs: float = Field(1.0, gt=0, description="passes over the training examples (a fraction allowed)")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; overrides epochs when set")
    batch_size: int = Field(4, ge=1, description="examples per process per micro-batch")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    max_grad_norm: float = Field(1.0, ge=0, description="0 disables clipping")
    mixed_precision: Literal["no", "bf16", "fp16"] = Field("no", description="Accelerate's mixed precision for the "
                                                         "draft's forward and backward")
    seed: int = Field(0, description="data order, the split and the draft's initial weights (the same on every rank); "
                      "dropout and DFlash's anchors draw from each rank's own stream derived from it")
    save_every_steps: int = Field(500, ge=1, description="a checkpoint every N optimizer steps (and at the end or a "
                                  "stop)")
    eval_every_steps: int = Field(500, ge=1, description="an evaluation on the held-out split every N optimizer "
                                  "steps (and at the end)")
    log_every_steps: int = Field(10, ge=1, description="a metrics.jsonl record (and trackers' log) every N optimizer "
                                 "steps")
    keep_checkpoints: int = Field(2, ge=1, description="the newest checkpoints kept; older ones are deleted")
    cache_hidden: bool = Field(False, description="store the base's hidden states on disk in epoch 1 and reuse them")
    hidden_cache_dir: str | None = Field(None, description="where the cache goes (default OUTPUT_DIR/hidden_cache); "
                                                           "needs H x dtype bytes per training token, "
                                                           "x (layers read + 1) for eagle3 and dflash")
    accept_prompts: int | None = Field(
        None, ge=0, le=4096, description="held-out prompts (the prompt part of the first eval examples) on which "
        "every evaluation computes expected_accept_length (the default tree's) and expected_accept_length_chain: "
        "the base's greedy continuations, the draft's rank statistics along them, greedy decoding replayed; "
        "0 turns it off; unset: 8 (under DeepSpeed ZeRO-3 read from a gathered copy of the draft)")
    accept_max_new_tokens: int = Field(64, ge=1, le=4096, description="tokens of each accept prompt's greedy "
                                       "continuation (and of the measured decoding)")
    measure_accept_every: int | None = Field(
        None, ge=0, description="every this many evaluations, also decode the accept prompts with the draft "
        "(SpeculativeDecoder, greedy, the default tree) -> measured_accept_length; EAGLE-3 (dynamic default trees) "
        "measures at every evaluation; 0 = never; unset: 4, or 0 under FSDP (no whole base on one process)")
    export: Literal["best", "last"] = Field(
        "best", description="which weights the final export holds: best = the evaluation with the highest "
        "expected_accept_length (EAGLE-3: measured_accept_length; the last weights when no evaluation had one), "
        "last = the last step's")
    grow_tree: bool = Field(
        True, description="Medusa and Hydra heads: the export's default tree is grown from the exported "
        "evaluation's held-out rank statistics (the kind's node count), where it decodes held-out texts better "
        "than the kind's prior tree (two-fold check); false: the kind's tree")


class DistributedSection(_Section):
    strategy: Literal["ddp", "deepspeed", "fsdp"] = Field(
        "ddp", description="ddp: base and heads replicated (Accelerate DDP); deepspeed: heads under ZeRO through "
        "Accelerate's plugin; fsdp: the frozen base's decoder layers sharded across ranks (bases too big for one "
        "GPU), heads replicated")
    zero_stage: Literal[2, 3] = Field(2, description="DeepSpeed ZeRO stage (deepspeed only)")
    offload: Literal["none", "cpu"] = Field(
        "none", description="DeepSpeed offload of optimizer state (and of parameters at stage 3) to CPU")
    zero_extra: dict = Field(default_factory=dict, description="more keys of DeepSpeed's zero_optimization section, "
                             "over draftlab's (e.g. reduce_bucket_size, stage3_param_persistence_threshold)")
    timeout_minutes: int = Field(60, ge=1, description="how long a process waits in a collective before the run "
                                 "fails (torch's default is 10 minutes for NCCL): the others wait while the main "
                                 "process tokenizes the data, loads a sharded base's checkpoint or exports")

    @model_validator(mode="after")
    def _deepspeed_only(self):
        if self.strategy != "deepspeed":
            if self.zero_stage != 2 or self.offload != "none" or self.zero_extra:
                raise ValueError("zero_stage, offload and zero_extra are DeepSpeed settings; set "
                                 "distributed.strategy: deepspeed")
        return self


class EnsembleSection(_Section):
    members: int = Field(3, ge=1, le=16, description="SSMs in the ensemble, trained one after another (stages)")
    architectures: list[dict] = Field(
        default_factory=list, description="per-member overrides of head.ssm (stage i uses entry i, the rest "
        "head.ssm as it is), e.g. [{num_layers: 1}, {num_layers: 2, hidden_size: 32}]")
    boost: bool = Field(True, description="collective boost-tuning: stage i trains on the examples members 1..i-1 "
                        "do not cover; false: every member trains on all data (an independent ensemble)")
    score: Literal["generation", "coverage"] = Field(
        "generation", description="the test of whether the members already cover an example. generation "
        "(SpecInfer's): every member generates greedily from the example's prompt part (text blocks: their first "
        "half, at most 32 tokens) and the score is the longest share of the base's greedy output (its first "
        "match_tokens tokens, up to EOS) that some member reproduces from the start; 1.0 = the member's output "
        "is the base's. coverage (draftlab's, teacher-forced): the share of the example's supervised positions "
        "where some member's top-1 token is the base's top-1 token")
    threshold: float | None = Field(
        None, gt=0, le=1, description="examples scoring at least this are covered; unset: 1.0 with score "
        "generation (SpecInfer: the output matches), 0.8 with score coverage")
    match_tokens: int = Field(
        32, ge=1, le=4096, description="score generation: tokens of the base's greedy output compared (fewer when "
        "the example's own continuation is shorter); the paper compares whole outputs, the cap bounds the cost "
        "at match_tokens batched greedy steps per model")
    weighting: Literal["remove", "downweight"] = Field(
        "remove", description="covered examples are dropped for the next stages, or kept at the downweight rate")
    downweight: float = Field(0.25, gt=0, lt=1, description="share of covered examples kept (weighting: downweight)")
    lookup: bool = Field(False, description="add a retrieval member (prompt lookup + the training data as datastore)")
    lookup_datastore_tokens: int = Field(2_000_000, ge=0, description="cap on the datastore's size, in tokens")
    mode: Literal["merge", "vote"] = Field("merge", description="default decoding of the export: merged trees "
                                           "(SpecInfer) or weighted-majority vote (Minions)")
    node_budget: int = Field(32, ge=1, description="tokens per merged tree (merge mode)")
    tau_prompts: int = Field(16, ge=0, description="held-out prompts decoded after each stage to record tau")

    @model_validator(mode="before")
    @classmethod
    def _default_threshold(cls, data):
        # The threshold's default depends on the test: an exact match for SpecInfer's, 80% for the per-position one.
        if isinstance(data, dict) and data.get("threshold") is None:
            data = {**data, "threshold": 0.8 if data.get("score") == "coverage" else 1.0}
        return data


class LoraSection(_Section):
    """Medusa-2: the heads trained together with a LoRA adapter on the base (peft)."""

    r: int = Field(8, ge=1, description="LoRA rank")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (the update is scaled by alpha / r)")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the LoRA input")
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj"],
                                      description="names of the base's linear layers that get an adapter")
    lr: float | None = Field(None, gt=0, description="the adapter's learning rate; unset: train.lr / 4 (the Medusa-2 "
                             "code gives the heads 4x the base's learning rate)")
    heads_weight: float = Field(0.2, gt=0, description="lambda_0 of Medusa-2's combined loss: base loss + "
                                "heads_weight * heads loss (the Medusa-2 code's medusa_heads_coefficient)")
    heads_warmup_steps: int = Field(0, ge=0, description="first steps train the heads only (base loss off, "
                                    "adapter frozen), then both")
    self_distill: bool = Field(True, description="base loss = KL from the original base (the adapter disabled in "
                               "the same step) to the adapted one, which keeps it close to the original; false: "
                               "CE on the data tokens")


class LogSection(_Section):
    trackers: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="where metrics go besides metrics.jsonl, which is always written")
    project: str = Field("draftlab", description="the trackers' project")
    run_name: str | None = Field(None, description="wandb's run name (unset: output_dir's last part)")


class Recipe(_Section):
    base: BaseSection
    head: HeadSection = HeadSection()
    loss: LossSection = LossSection()
    data: DataSection
    train: TrainSection = TrainSection()
    distributed: DistributedSection = DistributedSection()
    log: LogSection = LogSection()
    ensemble: EnsembleSection | None = Field(None, description="train an ensemble of SSMs in stages (head.type: ssm)")
    lora: LoraSection | None = Field(None, description="Medusa-2: also train a LoRA adapter on the base (head.type: "
                                     "medusa)")
    output_dir: str = Field(description="where checkpoints, metrics.jsonl and the export go")

    @model_validator(mode="after")
    def _ensemble_members(self) -> "Recipe":
        t, d = self.train, self.distributed
        if d.strategy == "fsdp" and t.measure_accept_every:  # (unset is 0 here)
            raise ValueError(f"train.measure_accept_every={t.measure_accept_every}: decoding needs the whole base in "
                             "one process and FSDP shards it; set train.measure_accept_every: 0 (the expected accept "
                             "length is still computed) or use distributed.strategy: ddp")
        if self.lora is not None:
            if self.head.type != "medusa":
                raise ValueError("lora (Medusa-2 joint training) trains Medusa heads with the adapter; set head.type: "
                                 "medusa or remove the lora section")
            if self.train.cache_hidden:
                raise ValueError("lora: the adapted base changes every step, so its hidden states cannot be cached; "
                                 "set train.cache_hidden: false")
            if self.distributed.strategy == "fsdp":
                raise ValueError("lora: joint training runs the base inside the trained module; use "
                                 "distributed.strategy ddp or deepspeed, not fsdp")
            if d.strategy == "deepspeed" and d.zero_stage == 3:
                raise ValueError("lora: ZeRO-3 would partition the adapter inside the base, which the accept "
                                 "estimate and the export read outside the engine's forward; use "
                                 "distributed.zero_stage: 2")
        self._unread_settings()
        if self.head.type in ("eagle3", "dflash") and self.distributed.strategy == "fsdp":
            raise ValueError(f"head.type {self.head.type} reads the base's token embeddings and rotary table outside the base's "
                             "forward, which an FSDP-sharded base does not allow: use distributed.strategy ddp or "
                             "deepspeed")
        if self.ensemble is None:
            return self
        if self.head.type != "ssm":
            raise ValueError("ensemble: trains SSMs; set head.type: ssm (head.ssm is every member's default)")
        if len(self.ensemble.architectures) > self.ensemble.members:
            raise ValueError(f"ensemble.architectures lists {len(self.ensemble.architectures)} members but "
                             f"ensemble.members is {self.ensemble.members}")
        for i, arch in enumerate(self.ensemble.architectures):
            try:
                SSMSection.model_validate({**self.head.ssm.model_dump(), **arch})
            except ValidationError as e:
                raise ValueError(f"ensemble.architectures[{i}] = {arch!r}: {e.errors()[0]['msg']}") from None
        return self


    def _unread_settings(self) -> None:
        """Settings that the head type reads nothing of, given other than their defaults: refused, naming what the
        kind reads instead (they were trained past in silence: walk-through). Defaults pass, so a dumped recipe,
        which holds every field, validates again."""
        for key, why in unread_settings(self.head.type).items():
            section, f = key.split(".")
            section = getattr(self, section)
            value, default = getattr(section, f), type(section).model_fields[f].default
            if value != default:
                raise ValueError(f"{key}={value}: {why}; this setting is not read (leave it at its default, "
                                 f"{default})")


def unread_settings(kind: str) -> dict[str, str]:
    """The settings that head type `kind` reads nothing of (a recipe keeps their defaults), each with what the kind
    reads instead."""
    unread = {}
    if kind in ("ssm", "eagle3", "dflash"):
        where = {"ssm": "head.ssm", "eagle3": "head.eagle (ttt_steps: the unrolled steps)",
                 "dflash": "head.dflash (block_size, num_layers)"}[kind]
        for f in ("num_heads", "num_layers"):
            unread[f"head.{f}"] = f"Medusa / Hydra settings; a {kind} draft is shaped by {where}"
    if kind == "eagle3":
        unread["loss.distill_weight"] = "an eagle3 draft always trains towards the base's distribution, as EAGLE-3 does"
        unread["loss.head_decay"] = "an eagle3 draft weighs its steps by head.eagle.step_decay"
    if kind == "dflash":
        unread["loss.head_decay"] = "a dflash draft weighs block positions by head.dflash.loss_decay_gamma"
    return unread


def accept_settings(recipe: Recipe) -> tuple[int, int]:
    """train.accept_prompts and train.measure_accept_every with their strategy-dependent defaults resolved: FSDP
    shards the base, so no process has a whole base to decode with. (Unset stays unset in config.yaml, so a
    recipe dumped and moved to another strategy keeps its defaults.)"""
    t, d = recipe.train, recipe.distributed
    prompts = t.accept_prompts if t.accept_prompts is not None else 8
    every = t.measure_accept_every if t.measure_accept_every is not None else (0 if d.strategy == "fsdp" else 4)
    return prompts, every


# Keys whose change does not make a different run: a resumed run may extend or re-log.
RESUMABLE_KEYS = {"train.max_steps", "train.epochs", "train.save_every_steps", "train.eval_every_steps",
                  "train.log_every_steps", "train.keep_checkpoints", "log.trackers", "log.run_name",
                  "data.num_proc", "data.cache", "train.cache_hidden", "train.hidden_cache_dir",
                  "ensemble.tau_prompts", "train.export", "train.grow_tree", "distributed.timeout_minutes"}


def _model_of(annotation):
    """The pydantic model inside an annotation (`X` or `X | None`), else None."""
    for t in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _yaml_value(value) -> str:
    """A default as a recipe writes it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    return str(value)


def key_reference() -> str:
    """Every recipe key with its default and description, as a markdown table (docs/recipes.md holds it between
    `<!-- keys:begin -->` and `<!-- keys:end -->`; `python -m draftlab.config` prints it)."""
    from pydantic_core import PydanticUndefined

    rows = []

    def walk(model, prefix: str) -> None:
        for name, field in model.model_fields.items():
            section = _model_of(field.annotation)
            if section is not None:
                walk(section, f"{prefix}{name}.")
                continue
            if field.default_factory is not None:
                default = _yaml_value(field.default_factory())
            else:
                default = "required" if field.default is PydanticUndefined else _yaml_value(field.default)
            what = (field.description or "").replace("|", "\\|")
            rows.append(f"| `{prefix}{name}` | `{default}` | {what} |")

    walk(Recipe, "")
    return "\n".join(["| key | default | what it sets |", "|---|---|---|", *rows])


def _section_fields(loc: tuple) -> list[str]:
    """Names valid at the location of an unknown key (for 'did you mean')."""
    model: Any = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        model = _model_of(field.annotation) if field is not None else None
        if model is None:
            return []
    return list(model.model_fields)


def _elsewhere(name: str) -> list[str]:
    """Dotted keys of the recipe whose last part is `name` (or close to it): where a key given at the wrong level
    (max_steps for train.max_steps) belongs."""
    found, close = [], []

    def walk(model, prefix):
        for f, info in model.model_fields.items():
            sub = _model_of(info.annotation)
            if sub is not None:
                walk(sub, prefix + (f,))
            elif f == name:
                found.append(".".join(prefix + (f,)))
            elif difflib.get_close_matches(name, [f], n=1, cutoff=0.8):
                close.append(".".join(prefix + (f,)))
    walk(Recipe, ())
    return found or close


def _field_info(loc: tuple):
    model: Any = Recipe
    info = None
    for part in loc:
        if model is None:
            return None
        info = model.model_fields.get(part)
        if info is None:
            return None
        model = _model_of(info.annotation)
    return info


def _describe(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if isinstance(p, str))
    key = ".".join(loc) or "<recipe>"
    kind = err["type"]
    if kind == "extra_forbidden":
        options = _section_fields(loc)
        close = difflib.get_close_matches(loc[-1], options, n=1, cutoff=0.6)
        other = [] if close else _elsewhere(loc[-1])
        hint = f"did you mean `{'.'.join(loc[:-1] + (close[0],))}`?" if close else (
            f"did you mean `{'` or `'.join(other[:3])}`?" if other else
            f"valid keys here: {', '.join(options)}" if options else "remove it")
        return f"`{key}`: unknown key; {hint}"
    info = _field_info(loc)
    what = f" ({info.description})" if info is not None and info.description else ""
    if kind == "missing":
        ex = f", e.g. {key}={info.examples[0]}" if info is not None and info.examples else ""
        return f"`{key}`: missing; add it{what}{ex}"
    value = err.get("input")
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:  # a check across sections: its message names the keys (the whole recipe is no help)
        return msg
    if kind == "literal_error":
        return f"`{key}` = {value!r}: {msg.replace('Input should be', 'use')}"
    return f"`{key}` = {value!r}: {msg}{what}"


def parse_overrides(overrides: list[str]) -> tuple[dict, list[str]]:
    """`a.b=c` strings -> nested dict (values parsed as YAML scalars) and a list of problems."""
    tree: dict = {}
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            problems.append(f"override `{item}`: expected dotted.key=value, e.g. train.lr=3e-4")
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = tree
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                problems.append(f"override `{item}`: `{p}` is not a section")
                break
        else:
            node[parts[-1]] = value
    return tree, problems


def _merge(dst: dict, src: dict) -> dict:
    out = dict(dst)
    for k, v in src.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_recipe(raw: dict, overrides: list[str] = (), source: str = "<recipe>") -> Recipe:
    """Validate a raw mapping plus overrides; raise ConfigError listing every problem."""
    if not isinstance(raw, dict):
        raise ConfigError(source, [f"the recipe must be a mapping of sections, got {type(raw).__name__}"])
    tree, problems = parse_overrides(list(overrides))
    merged = _merge(raw, tree)
    try:
        recipe = Recipe.model_validate(merged)
    except ValidationError as e:
        problems += [_describe(err) for err in e.errors()]
        recipe = None
    if problems:
        raise ConfigError(source, problems)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe file and apply dotted overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), ["no such recipe file; `draftlab recipes list` lists the shipped ones and "
                                      "`draftlab recipes copy NAME` copies one"])
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(str(path), [f"not valid YAML{where}: {getattr(e, 'problem', e)}"]) from None
    return build_recipe(raw, overrides, source=str(path))


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (what is written to output_dir/config.yaml)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def diff_recipes(a: Recipe, b: Recipe, ignore: set[str] = frozenset()) -> list[str]:
    """Dotted keys whose values differ, as 'key: a -> b'."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            out.update(flat(v, key + ".") if isinstance(v, dict) else {key: v})
        return out
    fa, fb = flat(a.model_dump(mode="json")), flat(b.model_dump(mode="json"))
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(set(fa) | set(fb))
            if k not in ignore and fa.get(k) != fb.get(k)]


if __name__ == "__main__":
    print(key_reference())
