"""A small OpenAI-compatible server for tests: a model through transformers behind /v1/models, /v1/completions and
/v1/chat/completions, on 127.0.0.1 (a free port). `fail_every=n` answers every n-th request with HTTP 503."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def serve(model_dir: str, fail_every: int = 0):
    """Start the server in a thread; returns (base URL, server, stats). Stop it with server.shutdown()."""
    from draftlab.base import load_base, stop_token_ids

    model, tok = load_base(model_dir, "float32")
    stops = stop_token_ids(model, tok)
    lock = threading.Lock()
    stats = {"requests": 0, "failed": 0}

    def generate(ids: list[int], body: dict) -> list[int]:
        x = torch.tensor([ids])
        sample = body.get("temperature", 1.0) > 0
        kw = dict(do_sample=sample, max_new_tokens=body.get("max_tokens", 16), pad_token_id=tok.pad_token_id,
                  eos_token_id=stops)
        kw.update(dict(temperature=body["temperature"], top_p=body.get("top_p", 1.0)) if sample else
                  dict(temperature=None, top_p=None, top_k=None))
        with lock, torch.no_grad():
            return model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(ids):].tolist()

    def finish(gen: list[int]) -> str:  # as vLLM says it: a stop token came, or max_tokens ended the text
        return "stop" if any(t in stops for t in gen) else "length"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self.reply(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
            self.reply(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                stats["requests"] += 1
                fail = fail_every and stats["requests"] % fail_every == 0
                stats["failed"] += bool(fail)
            if fail:
                return self.reply(503, {"error": {"message": "overloaded, try again"}})
            if body.get("model") != "tiny":
                return self.reply(404, {"error": {"message": f"model {body.get('model')!r} does not exist"}})
            if self.path == "/v1/chat/completions":
                text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
                gen = generate(tok(text, add_special_tokens=False).input_ids, body)
                msg = {"role": "assistant", "content": tok.decode(gen, skip_special_tokens=True)}
                return self.reply(200, {"object": "chat.completion", "choices": [
                    {"index": 0, "message": msg, "finish_reason": finish(gen)}]})
            if self.path == "/v1/completions":
                ids = tok(body["prompt"]).input_ids
                gen = generate(ids, body)
                # Text of the continuation as it reads after the prompt (servers detokenize with the prompt).
                full, head = tok.decode(ids + gen, skip_special_tokens=True), tok.decode(ids, skip_special_tokens=True)
                return self.reply(200, {"object": "text_completion", "choices": [
                    {"index": 0, "text": full[len(head):], "finish_reason": finish(gen)}]})
            self.reply(404, {"error": {"message": f"no route {self.path}"}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server, stats
