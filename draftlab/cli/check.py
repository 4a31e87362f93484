"""`draftlab check EXPORT`: what would silently lower served acceptance (see draftlab.interop.check)."""

from __future__ import annotations

import json
from pathlib import Path

from .args import positive_int

MARK = {True: "PASS", False: "FAIL", None: "n/a "}


def add_check_args(p) -> None:
    p.add_argument("export", help="a draftlab export directory (eagle3 / dflash ones are also the engines' layout)")
    p.add_argument("--engine", choices=["vllm", "sglang"], default=None,
                   help="check the reading of this engine only (default: both)")
    p.add_argument("--base", default=None, help="the base served with it (default: the one draftlab.json names)")
    p.add_argument("--tokenizer", default=None, help="the tokenizer served (default: the base's)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the chat template the engine is given (vLLM / SGLang --chat-template), compared with "
                        "training's (default: the export's chat_template.jinja where it ships one, else the "
                        "tokenizer's own)")
    p.add_argument("--served", default=None, metavar="DIR",
                   help="the files the engine is given when they are not EXPORT itself (a `draftlab export --to "
                        "vllm-medusa` directory; default for Medusa: that layout converted in memory)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts to decode, one per line (default: three fixed ones)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="tokens decoded per prompt")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object on the last line")


def check_command(a) -> int:
    from ..interop.check import check_export

    prompts = None
    if a.prompts:
        prompts = [l for l in Path(a.prompts).read_text().splitlines() if l.strip()]
        if not prompts:
            raise ValueError(f"--prompts {a.prompts}: no non-empty line")
    rep = check_export(a.export, a.engine, a.base, a.tokenizer, prompts, a.served, a.max_new_tokens,
                       a.chat_template)
    if a.json:
        print(json.dumps(rep))
    else:
        print(f"{rep['export']} ({rep['kind']}) for base {rep['base']}; engines: {', '.join(rep['engines'])}; "
              f"served files: {rep['served']}")
        for c in rep["checks"]:
            print(f"{MARK[c['ok']]} {c['name']}: {c['message']}")
        bad = [c["name"] for c in rep["checks"] if c["ok"] is False]
        unchecked = next((c for c in rep["checks"] if c["name"] == "proposals" and c["ok"] is None), None)
        print(f"{len(bad)} check(s) failed: {', '.join(bad)}" if bad else
              f"no check failed, but no proposals were compared ({unchecked['message']})" if unchecked else
              "all checks passed")
        if rep.get("unserved"):
            print(f"note: no engine serves this {rep['kind']} export whole: {rep['unserved']}")
    return 0 if rep["ok"] else 1
