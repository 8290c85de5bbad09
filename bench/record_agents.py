"""Record the requests the real coding-agent CLIs send (Claude Code on Messages, Codex on Responses).

Owns: a scripted stand-in server (stdlib `http.server`, no model) that answers each CLI with a minimal
valid stream — a shell tool call on the first turn that offers one, plain text once a tool result came
back — and saves every request (method, path, query, headers without credentials, JSON body) as one
JSON file; then `scrub()` rewrites local paths, user names and ids so the recordings can be committed
as tests/fixtures/agents/. Must not: talk to any real API, or keep a key in what it writes.

    .venv/bin/python bench/record_agents.py claude  /tmp/rec-claude   # needs ./dev setup's .tools/agents
    .venv/bin/python bench/record_agents.py codex   /tmp/rec-codex
    AGENTS_BIN=.tools/agents-older/node_modules/.bin .venv/bin/python bench/record_agents.py claude /tmp/rec-claude-old
    RECORD_HOME=/tmp/metrale-agent-clis RECORD_MODEL=SmolLM2-135M-Instruct \
      .venv/bin/python bench/record_agents.py claude /tmp/rec-claude "Say hello in five words"
    RECORD_CALL='{"name": "close_agent", "namespace": "multi_agent_v1", "arguments": "{}"}' \
      .venv/bin/python bench/record_agents.py codex /tmp/rec-ns     # the first turn's call, overridden

RECORD_HOME runs the CLI in that fixed folder (kept as is in the recording, not scrubbed) and
RECORD_MODEL names the model as the agent tests do (tests/e2e/test_agent_clis.py): with the tests' folder,
model and prompt, Claude Code's recorded first turn renders to the very tokens its live full-mode run
sends, so the server prefills that ~12k-token prompt once for both tests instead of twice.

Then copy the files worth keeping into tests/fixtures/agents/<agent>/ (drop the `host` and
`content-length` headers) and check them for anything local that `scrub()` missed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("AGENTS_BIN", ROOT / ".tools" / "agents" / "node_modules" / ".bin")).resolve()  # AGENTS_BIN: another install (./dev's older pins)
SECRET_HEADERS = {"authorization", "x-api-key", "cookie"}
SHELL_TOOLS = ("Bash", "shell", "exec_command", "shell_command", "local_shell")
REPLY = "Hello there, friend."


def _sse(event: str | None, data: dict[str, Any]) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def _has_tool_result(body: dict[str, Any]) -> bool:
    text = json.dumps(body.get("messages") or body.get("input") or [])
    return '"tool_result"' in text or '"function_call_output"' in text


def _tool_names(body: dict[str, Any]) -> list[str]:
    names = []
    for tool in body.get("tools") or []:
        names.append(tool.get("name") or (tool.get("function") or {}).get("name") or tool.get("type", ""))
    return names


def anthropic_frames(body: dict[str, Any]) -> list[bytes]:
    shell = next((n for n in _tool_names(body) if n in SHELL_TOOLS), None)
    usage = {"input_tokens": 10, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    message = {"id": "msg_rec", "type": "message", "role": "assistant", "model": body.get("model", "m"), "content": [], "stop_reason": None,
               "stop_sequence": None, "usage": usage}
    frames = [_sse("message_start", {"type": "message_start", "message": message})]
    if shell and not _has_tool_result(body):
        block = {"type": "tool_use", "id": "toolu_rec1", "name": shell, "input": {}}
        args = json.dumps({"command": "echo hi", "description": "Print hi"})
        frames += [
            _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
            _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": args}}),
        ]
        stop = "tool_use"
    else:
        frames += [
            _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": REPLY}}),
        ]
        stop = "end_turn"
    frames += [
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 5}}),
        _sse("message_stop", {"type": "message_stop"}),
    ]
    return frames


def anthropic_json(body: dict[str, Any]) -> dict[str, Any]:
    return {"id": "msg_rec", "type": "message", "role": "assistant", "model": body.get("model", "m"), "content": [{"type": "text", "text": REPLY}],
            "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 5}}


def responses_frames(body: dict[str, Any]) -> list[bytes]:
    shell = next((n for n in _tool_names(body) if n in SHELL_TOOLS), None)
    seq = iter(range(1000))
    base = {"id": "resp_rec", "object": "response", "created_at": int(time.time()), "status": "in_progress", "model": body.get("model", "m"), "output": []}
    events = [{"type": "response.created", "response": base}]
    if shell and not _has_tool_result(body):
        args = json.dumps({"cmd": "echo hi"} if shell == "exec_command" else {"command": ["bash", "-lc", "echo hi"]})
        item = {"type": "function_call", "id": "fc_rec1", "call_id": "call_rec1", "name": shell, "arguments": args, "status": "completed"}
        item.update(json.loads(os.environ.get("RECORD_CALL", "{}")))  # e.g. a namespaced call, to see what the CLI makes of it
        args = item["arguments"]
        events += [
            {"type": "response.output_item.added", "output_index": 0, "item": {**item, "arguments": "", "status": "in_progress"}},
            {"type": "response.function_call_arguments.delta", "output_index": 0, "item_id": "fc_rec1", "delta": args},
            {"type": "response.function_call_arguments.done", "output_index": 0, "item_id": "fc_rec1", "arguments": args},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
        ]
    else:
        part = {"type": "output_text", "text": REPLY, "annotations": []}
        item = {"type": "message", "id": "msg_rec1", "role": "assistant", "status": "completed", "content": [part]}
        events += [
            {"type": "response.output_item.added", "output_index": 0, "item": {**item, "content": [], "status": "in_progress"}},
            {"type": "response.content_part.added", "output_index": 0, "item_id": "msg_rec1", "content_index": 0, "part": {**part, "text": ""}},
            {"type": "response.output_text.delta", "output_index": 0, "item_id": "msg_rec1", "content_index": 0, "delta": REPLY},
            {"type": "response.output_text.done", "output_index": 0, "item_id": "msg_rec1", "content_index": 0, "text": REPLY},
            {"type": "response.content_part.done", "output_index": 0, "item_id": "msg_rec1", "content_index": 0, "part": part},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
        ]
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": 15}
    events.append({"type": "response.completed", "response": {**base, "status": "completed", "output": [item], "usage": usage}})
    return [_sse(e["type"], {**e, "sequence_number": next(seq)}) for e in events]


class Recorder(ThreadingHTTPServer):
    def __init__(self, out: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.out = out
        self.count = 0
        self.lock = threading.Lock()

    def save(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.count += 1
            name = re.sub(r"[^a-z0-9]+", "_", record["path"].lower()).strip("_")
            (self.out / f"{self.count:02d}_{record['method'].lower()}_{name}.json").write_text(json.dumps(record, indent=2, ensure_ascii=False))


class _Handler(BaseHTTPRequestHandler):
    server: Recorder
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        url = urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = {"undecodable_bytes": len(raw)}
        headers = {k.lower(): v for k, v in self.headers.items() if k.lower() not in SECRET_HEADERS}
        self.server.save({"method": self.command, "path": url.path, "query": dict(parse_qsl(url.query)), "headers": headers, "body": body})
        path = url.path.rstrip("/")
        if self.command == "POST" and path.endswith("/messages/count_tokens"):
            return self._json({"input_tokens": 100})
        if self.command == "POST" and path.endswith("/messages") and isinstance(body, dict):
            return self._stream(anthropic_frames(body)) if body.get("stream") else self._json(anthropic_json(body))
        if self.command == "POST" and path.endswith("/responses") and isinstance(body, dict):
            return self._stream(responses_frames(body))
        if self.command == "GET" and path.endswith("/models"):
            return self._json({"object": "list", "data": [{"id": "recorded-model", "object": "model", "created": 0, "owned_by": "metrale"}]})
        self._json({"error": {"message": "not recorded", "type": "not_found_error"}}, status=404)

    do_GET = do_POST = do_HEAD = _answer

    def _json(self, payload: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, frames: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        for frame in frames:
            self.wfile.write(frame)
            self.wfile.flush()
        self.close_connection = True


def agent_env(home: Path, base_url: str) -> dict[str, str]:
    """The environment both CLIs run under: a throwaway HOME, no telemetry, no updates, a dummy key. With
    RECORD_MODEL, the environment the agent tests give Claude Code instead (their `claude_env`: the model
    name, the window, and no DISABLE_* switches, which change Claude Code's system prompt)."""
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    common = {**keep, "HOME": str(home), "CODEX_HOME": str(home / ".codex"), "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "test",
              "METRALE_API_KEY": "test", "NO_COLOR": "1"}
    if model := os.environ.get("RECORD_MODEL"):
        return {**common, "LANG": "C.UTF-8", "ANTHROPIC_MODEL": model, "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "32768"}
    return {
        **common,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }


def codex_config(base_url: str, model: str) -> str:
    return (
        f'model = "{model}"\nmodel_provider = "metrale"\n\n'
        f'[model_providers.metrale]\nname = "Metrale"\nbase_url = "{base_url}/v1"\nwire_api = "responses"\nenv_key = "METRALE_API_KEY"\n'
    )


def claude_command(prompt: str) -> list[str]:
    return [str(BIN / "claude"), "-p", prompt, "--allowedTools", "Bash(echo:*)"]


def codex_command(prompt: str, workdir: Path) -> list[str]:
    return [str(BIN / "codex"), "exec", "--skip-git-repo-check", "-C", str(workdir), prompt]


def record(agent: str, out: Path, prompt: str = "Say hello") -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    server = Recorder(out)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    fixed = os.environ.get("RECORD_HOME")
    with tempfile.TemporaryDirectory(prefix="agent-home-") as tmp:
        home = Path(fixed or tmp)
        if fixed:
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
        env = agent_env(home, base)
        work = home / "work"
        work.mkdir()
        if agent == "claude":
            cmd = claude_command(prompt)
        else:
            (home / ".codex").mkdir()
            (home / ".codex" / "config.toml").write_text(codex_config(base, os.environ.get("RECORD_MODEL", "recorded-model")))
            cmd = codex_command(prompt, work)
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        server.shutdown()
        for path in out.glob("*.json"):
            path.write_text(scrub(path.read_text(), home=tmp))
    return done


def scrub(text: str, *, home: str) -> str:
    """Local paths, the user and machine names, and per-run ids → fixed placeholders (sizes stay realistic)."""
    text = text.replace(home, "/home/user")
    for name in {os.environ.get("USER", ""), os.environ.get("LOGNAME", ""), os.uname().nodename} - {"", "user", "root"}:
        text = re.sub(rf"\b{re.escape(name)}\b", "user", text)
    text = text.replace(str(ROOT), "/home/user/project")
    text = re.sub(r"/tmp/agent-home-[A-Za-z0-9_]+", "/home/user", text)
    text = re.sub(r"-tmp-agent-home-[A-Za-z0-9-]{8}-", "-home-user-", text)  # Claude Code's project folder name for the cwd
    text = re.sub(r"\b[0-9a-f]{64}\b", "0" * 64, text)  # Claude Code's device id (metadata.user_id)
    return re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "00000000-0000-4000-8000-000000000000", text)


if __name__ == "__main__":
    result = record(sys.argv[1], Path(sys.argv[2]), *(sys.argv[3:4]))
    print(f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-3000:]}")
