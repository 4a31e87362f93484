"""The `draftlab` command. Each subcommand parses its flags and calls one library function."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings
from pathlib import Path

from .args import DEVICE_HELP, apply_compile_cache, non_negative_float, positive_float, positive_int


def _print_json(obj: dict) -> None:
    print(json.dumps(obj))



def load_recipe_arg(a):
    """The recipe of a.recipe with a.overrides; a shipped recipe's name given in its place is answered with the copy
    that makes it a file (an installed draftlab has no recipes/ folder where the user runs)."""
    from ..config import ConfigError, load_recipe
    from ..shipped import ShippedFileError, recipe_names

    path = Path(a.recipe)
    if not path.is_file():
        try:
            names = recipe_names()
        except ShippedFileError:
            names = []
        stem = path.name.removesuffix(".yaml")
        if stem in names:
            raise ConfigError(a.recipe, [f"no such recipe file; {stem} is a shipped recipe: `draftlab recipes copy "
                                         f"{stem}` copies it to ./{stem}.yaml, then `draftlab {a.command} "
                                         f"{stem}.yaml`"])
    return load_recipe(a.recipe, a.overrides)


def cmd_validate(a) -> int:
    from ..config import ConfigError, accept_settings, dump_recipe, unread_settings
    from ..train.preflight import base_problems

    from .recipes import missing_paths

    recipe = load_recipe_arg(a)
    problems, base_notes = base_problems(recipe)  # (what train refused only after loading the base's weights)
    if problems:
        raise ConfigError(a.recipe, problems)
    if a.json:
        _print_json(recipe.model_dump(mode="json"))
    else:
        print(dump_recipe(recipe), end="")
    for m in missing_paths(recipe.model_dump(mode="json"), Path.cwd()):  # (valid, but training would stop there)
        print(f"note: not here (paths are relative to where you run draftlab): {m}", file=sys.stderr)
    unset = [f"train.{k} = {v}" for k, v in zip(("accept_prompts", "measure_accept_every"), accept_settings(recipe))
             if getattr(recipe.train, k) is None]  # (kept unset in the dump: their defaults follow the strategy)
    if unset:
        print(f"note: unset, so under distributed.strategy {recipe.distributed.strategy}: {', '.join(unset)}",
              file=sys.stderr)
    for n in base_notes:
        print(f"note: {n}", file=sys.stderr)
    unread = list(unread_settings(recipe.head.type))  # (dumped at their defaults, they read as if they applied)
    if unread:
        print(f"note: head.type {recipe.head.type} does not read {', '.join(unread)} (left at their defaults)",
              file=sys.stderr)
    return 0


def end_process_group() -> None:
    """The launch's processes leave together and take their process group down before exiting: torn down at exit
    instead, a process could abort ("terminate called without an active exception") once the first, which holds
    the rendezvous store, had gone, and Slurm then counted a finished run as failed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def cmd_train(a) -> int:
    from ..train import train

    summary = train(load_recipe_arg(a), overwrite=a.overwrite, stop_after_steps=a.stop_after_steps)
    end_process_group()
    if a.json:
        _print_json(summary)
    elif int(os.environ.get("RANK", "0")) != 0:  # (the launch's other processes say nothing)
        pass
    elif not summary.get("finished"):
        again = shlex.join(["draftlab", "train", a.recipe, *a.overrides])  # (the recipe alone lost the overrides)
        if summary.get("stopped"):  # (by a signal or a STOP file: the loop said where; the command is the CLI's)
            print(f"resume with `{again}` (without --overwrite)")
        else:
            stage = f" of stage {summary['stage']}" if "stage" in summary else ""
            print(f"stopped at step {summary['step']} of {summary['total_steps']}{stage} (--stop-after-steps), after "
                  f"a checkpoint; `{again}` (without --overwrite) resumes it")
    elif summary.get("export") and not summary.get("already_finished"):
        print(f"export written to {summary['export']}")
        tree = summary.get("default_tree")
        if tree and "held_out_accept_length" in tree:
            held = tree["held_out_accept_length"]
            if tree["source"] == "grown":
                print(f"default tree: grown from the heads' held-out ranks (held-out accept length {held['grown']:.2f} "
                      f"against {held['kind']:.2f} for the kind's tree, which --tree kind decodes with)")
            else:
                print(f"default tree: the kind's (one grown from the heads' held-out ranks decoded held-out text no "
                      f"better: accept length {held['grown']:.2f} against {held['kind']:.2f})")
    return 0


def cmd_import(a) -> int:
    from ..interop.llama2c import import_llama2c

    out = import_llama2c(a.model, a.tokenizer, a.out)
    print(f"wrote a Hugging Face Llama directory to {out}")
    return 0


def writable_out(out: str, force: bool, what: str) -> None:
    """Refuse an --out that is a file, or a directory holding files unless --force (its files are written over)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; {what} writes a directory: give a directory's path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} exists and holds files; {what} writes over them: pass --force, or another "
                         "--out")


def cmd_import_medusa(a) -> int:
    from ..interop.convert import import_medusa

    writable_out(a.out, a.force, "import-medusa")  # (an export there lost its kind: walk-through)
    rep = import_medusa(a.checkpoint, a.out, a.base, a.dtype)
    if a.json:
        _print_json(rep)
    else:
        note = (f" (its config says {rep['config_num_heads']}; counted from the tensors)"
                if rep["config_num_heads"] not in (None, rep["num_heads"]) else "")
        print(f"imported {rep['num_heads']} Medusa heads{note} x {rep['num_layers']} block(s), {rep['layout']} layout, "
              f"for base {rep['base']} -> {rep['export']}")
    return 0


def cmd_export(a) -> int:
    from ..interop.convert import export_to

    writable_out(a.out, a.force, "export --to")
    rep = export_to(a.export, a.to, a.out, a.eval, a.license, a.base_model)
    if a.json:
        _print_json(rep)
    else:
        print(f"wrote {', '.join(rep['files'])} ({rep['format']}) to {rep['out']}")
    return 0


def cmd_quickstart(a) -> int:
    from .quickstart import quickstart

    summary = quickstart(a.out, minutes=a.minutes, seed=a.seed, compile=a.compile,
                         search=a.compile if a.search is None else a.search)
    if a.json:
        _print_json(summary)
    return 143 if summary.get("stopped") else 0  # (stopped by SIGTERM or a STOP file: the signal's status)


def cmd_distill(a) -> int:
    from ..train.distill import distill_data

    summary = distill_data(a.base, a.prompts, a.out, a.max_new_tokens, a.temperature, a.top_p, a.batch_size,
                           a.max_records, a.dtype, a.device, a.seed, a.mode, a.prompt_chars, a.all_turns, a.endpoint,
                           a.model, a.concurrency, a.retries, a.timeout, a.chat_template)
    if a.json:
        _print_json(summary)
    else:
        print(f"wrote {summary['written']} records to {summary['out']} ({summary['skipped_existing']} already there)")
        if summary["truncated"]:  # (text mode spoke of answers and ends of turn: walk-through)
            what, end = ("continuations", "EOS") if a.mode == "text" else ("answers", "end of turn")
            print(f"{summary['truncated']} {what} in {summary['out']} reached the length limit "
                  f"(--max-new-tokens={a.max_new_tokens} in this run) before the base ended them: marked "
                  f"\"truncated\", so training learns no {end} there; raise --max-new-tokens to keep them whole")
        if summary["too_long"]:
            print(f"{summary['too_long']} prompts fill the base's context alone: no record for them (a conversation "
                  "of --all-turns ends before such a turn)")
    return 0


def cmd_generate(a) -> int:
    from .generate import generate_command

    return generate_command(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftlab", description="Train draft models for speculative decoding and run them.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("validate", help="check a recipe (with overrides) and print it resolved")
    s.add_argument("recipe")
    s.add_argument("overrides", nargs="*", help="dotted key=value, e.g. train.lr=3e-4")
    s.add_argument("--json", action="store_true", help="print the resolved recipe as one JSON object")
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser("train", help="train a draft model from a recipe (resumes a killed run)",
                       description="Train a draft model (heads, an SSM, EAGLE-3, DFlash or an ensemble). Run under "
                                   "`accelerate launch` for several processes.")
    s.add_argument("recipe")
    s.add_argument("overrides", nargs="*", help="dotted key=value, e.g. train.lr=3e-4 head.num_heads=5")
    s.add_argument("--overwrite", action="store_true", help="discard a run already in output_dir")
    s.add_argument("--stop-after-steps", type=int, default=None, help="stop (after a checkpoint) this many steps in")
    s.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("import-llama2c", help="convert a llama2.c checkpoint to a Hugging Face Llama directory")
    s.add_argument("model", help="llama2.c .bin checkpoint (legacy version-0 format)")
    s.add_argument("--tokenizer", required=True, help="SentencePiece .model file")
    s.add_argument("--out", required=True, help="output directory")
    s.set_defaults(func=cmd_import)

    s = sub.add_parser("import-medusa", help="convert FasterDecoding / Medusa-2 / vLLM Medusa heads into a draftlab export",
                       description="Read Medusa heads (medusa_lm_head.pt or .safetensors, a Medusa-2 checkpoint whose "
                                   "shards hold medusa_head.*, or vLLM's layout) and write a draftlab export that "
                                   "generate, search-tree and eval run on.")
    s.add_argument("checkpoint", help="a directory, a weights file, or a hub id (org/name: its head file, or "
                                      "Medusa-2's model shards, are downloaded into the hub cache)")
    s.add_argument("--base", default=None, help="the base model (default: the checkpoint's base_model_name_or_path; "
                                               "a Medusa-2 checkpoint is its own base)")
    s.add_argument("--out", required=True, help="export directory to write (refused if it holds files, unless --force)")
    s.add_argument("--force", action="store_true", help="write over the files --out holds")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the base is loaded in to check shapes")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_import_medusa)

    s = sub.add_parser("export", help="write an export in a serving engine's format (vLLM Medusa, FasterDecoding, HF)",
                       description="vllm-medusa: vLLM's Medusa draft layout; medusa: FasterDecoding's "
                                   "medusa_lm_head.pt; hf: an SSM as a plain Hugging Face model directory. Hydra "
                                   "heads have no engine format (no engine runs sequentially dependent heads).")
    s.add_argument("export", help="a draftlab export directory")
    s.add_argument("--to", required=True, choices=["vllm-medusa", "medusa", "hf"])
    s.add_argument("--out", required=True, help="the directory to write (refused if it holds files, unless --force)")
    s.add_argument("--force", action="store_true", help="write over the files --out holds")
    s.add_argument("--eval", default=None, help="an `eval mt-bench` run directory whose figures go into the model card")
    s.add_argument("--license", default="other", help="license field of the model card (the base's usually applies)")
    s.add_argument("--base-model", default=None, metavar="ID",
                   help="the base's hub id for the model card's base_model (default: the base the export names; one "
                        "that names a local directory is left out, with a comment)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("quickstart", help="build a small base, train Medusa, Hydra and Hydra++ heads and a 1-layer "
                                          "SSM, export and decode (CPU, offline)")
    s.add_argument("--out", default="runs/quickstart", help="where the base, data, runs and exports go")
    s.add_argument("--minutes", type=positive_float, default=3.0, help="time budget for pretraining the small base")
    s.add_argument("--seed", type=int, default=0, help="seed of the base's and the drafts' training")
    s.add_argument("--compile", action="store_true", help="decode on the compiled, static-shape path (each draft and "
                   "draftlab's plain decoding compiled and warmed up on every prompt first, a few minutes on a CPU)")
    s.add_argument("--search", action=argparse.BooleanOptionalAction, default=None,
                   help="search each draft's tree on this machine (draftlab search-tree, on the path decoding takes) "
                        "and decode with it beside the export's default tree; on by default with --compile (several "
                        "minutes on a CPU), where a verification's cost grows with the tree, off without it (about "
                        "a minute, and eager decoding's per-call overhead leaves tree size little to choose)")
    s.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    s.set_defaults(func=cmd_quickstart)

    s = sub.add_parser("distill-data", help="have the base answer a dataset's prompts (self-distilled training data)",
                       description="The base answers each record's prompt (or continues each text), in this process or "
                                   "through OpenAI-compatible servers (--endpoint, e.g. vLLM / SGLang / TGI), and the "
                                   "records are appended to --out; a killed run resumes where it stopped.")
    s.add_argument("base", nargs="?", default=None,
                   help="a recipe YAML (its base) or a base model path / hub id (not needed with --endpoint)")
    s.add_argument("--prompts", required=True, help="ShareGPT / Alpaca / text file whose prompts the base answers")
    s.add_argument("--out", required=True, help="JSONL of ShareGPT conversations; appended to and resumed")
    s.add_argument("--mode", default="chat", choices=["chat", "text"],
                   help="chat: answer the first user turn via the chat template (ShareGPT out); text: continue the "
                        "opening of each text (for bases without a chat format; {text} records out)")
    s.add_argument("--prompt-chars", type=int, default=64, help="text mode: characters of each text given as prompt")
    s.add_argument("--all-turns", action="store_true",
                   help="chat mode: regenerate every assistant turn, each seeing the base's own earlier answers")
    s.add_argument("--endpoint", action="append", default=[],
                   help="base URL of an OpenAI-compatible server (http://host:8000 or .../v1); repeat for several")
    s.add_argument("--model", default=None, help="model name the servers serve (default: the first of GET /v1/models)")
    s.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (--endpoint)")
    s.add_argument("--chat-template", default=None,
                   help="in-process: the template prompts are rendered with (vicuna, simple, a .jinja file or Jinja "
                        "text; default: the recipe's base.chat_template, else the tokenizer's own)")
    s.add_argument("--retries", type=int, default=5, help="tries per request after the first, rotating endpoints")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--max-new-tokens", type=positive_int, default=512, help="the longest answer the base writes")
    s.add_argument("--temperature", type=non_negative_float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--max-records", type=int, default=None)
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="in-process: the base's dtype (default: the recipe's, else bfloat16 on a GPU, float32 on a "
                        "CPU)")
    s.add_argument("--device", default=None, help="in-process: " + DEVICE_HELP)
    s.add_argument("--seed", type=int, default=0,
                   help="seed of the sampling at --temperature > 0 (in-process; sent to the endpoints as `seed`)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_distill)

    from .search_tree import add_search_args, search_command

    s = sub.add_parser("search-tree", help="find the fastest tree for an export on this machine (static trees; EAGLE-2 "
                                            "dynamic-tree settings for eagle3 exports)")
    add_search_args(s)
    s.set_defaults(func=lambda a: search_command(a))

    from .eval import add_eval_args, eval_command

    s = sub.add_parser("eval", help="MT-Bench speed / losslessness evaluation, and comparison of eval runs")
    add_eval_args(s.add_subparsers(dest="eval_cmd", required=True, metavar="{mt-bench,compare}"))
    s.set_defaults(func=eval_command)

    from .simulate import add_simulate_args, simulate_command

    s = sub.add_parser("simulate", help="expected latency of non-SI, SI and DSI (speculation parallelism) for a pair")
    add_simulate_args(s)
    s.set_defaults(func=simulate_command)

    from .dsi import add_dsi_args, dsi_command

    s = sub.add_parser("dsi", help="distributed speculative inference: an SSM drafting ahead of SP target servers",
                       description="DSI (Timor et al.): the drafter never waits for verification; tasks go to SP "
                                   "target-server processes, rejected work is preempted. Greedy or sampling, lossless.")
    add_dsi_args(s)
    s.set_defaults(func=dsi_command)

    from .recipes import add_recipes_args, recipes_command

    s = sub.add_parser("recipes", help="list the recipes that ship with draftlab, or copy one to edit",
                       description="The shipped recipes (recipes/ in the repository; package data in an install).")
    add_recipes_args(s.add_subparsers(dest="recipes_cmd", required=True, metavar="{list,copy}"))
    s.set_defaults(func=recipes_command)

    from .check import add_check_args, check_command

    s = sub.add_parser("check", help="check an export for what silently lowers served acceptance (vLLM / SGLang)",
                       description="Aux-layer ids, d2t / t2d, RoPE, quantization, tokenizer and chat template, and the "
                                   "proposals of fixed prompts read the engines' way vs draftlab's. Exit 1 if a check "
                                   "fails.")
    add_check_args(s)
    s.set_defaults(func=check_command)

    from .generate import add_generate_args

    s = sub.add_parser("generate", help="speculative decoding with an export (optionally compared with plain decoding)")
    add_generate_args(s)
    s.set_defaults(func=cmd_generate)
    _with_defaults(p)
    return p


class _DefaultsHelp(argparse.HelpFormatter):
    """Help that shows an option's default where it has one and its text does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if (action.option_strings and not any(d is x for x in (None, False, True, argparse.SUPPRESS))
                and d not in ([], ()) and "default" not in text and action.help != argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def _with_defaults(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsHelp
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _with_defaults(child)


def say_warnings(command: str):
    """draftlab's own warnings as one line a user reads, `draftlab COMMAND: warning: ...`, rather than Python's
    `path/to/file.py:61: UserWarning: ...` and the source line; other libraries' keep Python's format. (The format,
    not the display: warnings recorded by catch_warnings are untouched.) Returns the previous format, to restore."""
    previous, package = warnings.formatwarning, Path(__file__).resolve().parents[1]

    def fmt(message, category, filename, lineno, line=None):
        if category is not UserWarning or not Path(filename).resolve().is_relative_to(package):
            return previous(message, category, filename, lineno, line)
        return f"draftlab {command}: warning: {message}\n"

    warnings.formatwarning = fmt
    return previous


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll reports an error on its writing end)."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # (captured output: no descriptor)
        return False
    if not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


def main(argv: list[str] | None = None) -> int:
    from ..base import BaseModelError
    from ..config import ConfigError
    from ..data import DataError
    from ..interop.export import ExportError

    from ..progress import quiet_libraries

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:  # key=value overrides after an option (`train R.yaml --overwrite k=v`): argparse leaves them over
        if not (hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest)):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides += rest
    quiet_libraries()  # other libraries' bars only on a terminal; their noise never
    formatted = say_warnings(args.command)
    if getattr(args, "tp", False) and int(os.environ.get("RANK", "0")) != 0:
        sys.stdout = open(os.devnull, "w")  # tensor-parallel ranks other than 0 decode silently
    try:
        apply_compile_cache(args)  # before anything compiles (--compile-cache DIR)
        rc = args.func(args)
        sys.stdout.flush()  # (here, where a closed pipe is caught below, not at the interpreter's exit)
        return rc
    except (ConfigError, DataError, ExportError, BaseModelError, ValueError, FileNotFoundError) as e:
        if getattr(args, "json", False):
            _print_json({"error": str(e)})
        print(f"draftlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as other command-line tools do
        if not _stdout_closed():  # (another pipe or socket that broke is an error like any other)
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:  # (Ctrl-C: one line and the shell's status, not a traceback; workers end with us)
        hint = {"train": "; no checkpoint was saved now: the run resumes from its last one. To stop with a checkpoint "
                         "of the current step, press Ctrl-C once while it trains, `touch OUTPUT_DIR/STOP` or `kill "
                         "-TERM` the process",
                "distill-data": "; the records written so far are kept: the same command again answers the rest",
                "eval mt-bench": "; the answers written so far are kept: the same command again answers the rest"}.get(
                    " ".join([args.command, *([args.eval_cmd] if args.command == "eval" else [])]), "")
        if hint and getattr(args, "overwrite", False):  # (the same command would start again: review)
            hint += "; run it again without --overwrite, which would start again"
        # (distill-data said "interrupted" alone, of a run that resumes: walk-through)
        print(f"draftlab {args.command}: interrupted{hint}", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = formatted


if __name__ == "__main__":
    sys.exit(main())
