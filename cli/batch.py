"""`met batch`: submit, follow, list, show, cancel and fetch batch jobs of a running server over HTTP.

A JSONL file of OpenAI batch lines (`{custom_id, method, url, body}`) goes through the Files and Batches
APIs; a file of Anthropic requests (`{custom_id, params}`) through Message Batches. Ids starting with
`msgbatch_` are Anthropic batches, the rest OpenAI's. The progress bar is rich's (typer's own dependency).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(help="Batch jobs: the OpenAI Batch API and Anthropic Message Batches of a running server.", no_args_is_help=True)
console = Console()

Url = Annotated[str, typer.Option("--url", envvar="MET_URL", help="The server's base URL.")]
Key = Annotated[str | None, typer.Option("--api-key", envvar="MET_CLIENT_API_KEY", help="API key, if the server asks for one.")]
ENDED = {"completed", "failed", "expired", "cancelled", "ended"}


def _client(url: str, key: str | None) -> httpx.Client:
    headers = {"authorization": f"Bearer {key}", "x-api-key": key} if key else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=120)


def _check(reply: httpx.Response) -> Any:
    if reply.status_code >= 400:
        console.print(f"[red]{reply.status_code}[/red] {reply.text}")
        raise typer.Exit(1)
    return reply.json()


def _anthropic(batch_id: str) -> bool:
    return batch_id.startswith("msgbatch_")


def _path(batch_id: str) -> str:
    return f"/v1/messages/batches/{batch_id}" if _anthropic(batch_id) else f"/v1/batches/{batch_id}"


def _progress(batch: dict[str, Any]) -> tuple[int, int, int, int, str]:
    """(succeeded, failed, total, output tokens, status) of either protocol's batch object."""
    if batch.get("type") == "message_batch":
        c = batch["request_counts"]
        return c["succeeded"], c["errored"] + c["canceled"] + c["expired"], sum(c.values()), 0, batch["processing_status"]
    c = batch["request_counts"]
    return c["completed"], c["failed"], c["total"], (batch.get("usage") or {}).get("output_tokens", 0), batch["status"]


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="A JSONL file of batch lines.", exists=True, dir_okay=False)],
    endpoint: Annotated[str | None, typer.Option(help="OpenAI endpoint of the lines (default: the first line's url).")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the batch with a progress bar until it ends.")] = False,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="With --wait: write the results here (- for stdout).")] = None,
    url: Url = "http://127.0.0.1:8000",
    api_key: Key = None,
) -> None:
    """Submit a batch file; prints the batch id."""
    raw = file.read_bytes()
    first = json.loads(next(line for line in raw.splitlines() if line.strip()))
    with _client(url, api_key) as http:
        if "params" in first:
            requests = [json.loads(line) for line in raw.splitlines() if line.strip()]
            batch = _check(http.post("/v1/messages/batches", json={"requests": requests}))
        else:
            uploaded = _check(http.post("/v1/files", files={"file": (file.name, raw)}, data={"purpose": "batch"}))
            body = {"input_file_id": uploaded["id"], "endpoint": endpoint or first.get("url"), "completion_window": "24h"}
            batch = _check(http.post("/v1/batches", json=body))
            if batch["status"] == "failed":
                for err in batch["errors"]["data"]:
                    console.print(f"[red]line {err['line']}[/red] {err['code']}: {err['message']}")
                raise typer.Exit(1)
        console.print(batch["id"])
        if wait:
            _follow(http, batch["id"])
            if output is not None:
                _write_results(http, batch["id"], output)


def _follow(http: httpx.Client, batch_id: str) -> None:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[detail]}"), TimeElapsedColumn())
    started = time.monotonic()
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(batch_id, total=None, detail="")
        while True:
            done, failed, total, tokens, status = _progress(_check(http.get(_path(batch_id))))
            rate = tokens / max(time.monotonic() - started, 1e-6)
            bar.update(task, total=total, completed=done + failed, detail=f"{status} · {done} ok · {failed} failed · {rate:.0f} tok/s")
            if status in ENDED:
                return
            time.sleep(0.5)


def _write_results(http: httpx.Client, batch_id: str, output: Path) -> int:
    if _anthropic(batch_id):
        reply = http.get(f"{_path(batch_id)}/results")
        if reply.status_code >= 400:
            _check(reply)
        data = reply.content
    else:
        batch = _check(http.get(_path(batch_id)))
        data = b"".join(http.get(f"/v1/files/{batch[key]}/content").content for key in ("output_file_id", "error_file_id") if batch.get(key))
    lines = sum(1 for line in data.splitlines() if line.strip())
    if str(output) == "-":  # `-o -`: the lines on stdout, the count on stderr
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        Console(stderr=True).print(f"{lines} result lines → stdout")
        return lines
    output.write_bytes(data)
    console.print(f"{lines} result lines → {output}")
    return lines


@app.command("list")
def list_batches(url: Url = "http://127.0.0.1:8000", api_key: Key = None) -> None:
    """The newest batches of both APIs."""
    table = Table("id", "status", "done", "failed", "total")
    with _client(url, api_key) as http:
        rows = _check(http.get("/v1/batches"))["data"] + _check(http.get("/v1/messages/batches"))["data"]
    for batch in rows:
        done, failed, total, _tokens, status = _progress(batch)
        table.add_row(batch["id"], status, str(done), str(failed), str(total))
    console.print(table)


@app.command()
def show(batch_id: str, url: Url = "http://127.0.0.1:8000", api_key: Key = None) -> None:
    """One batch object, as the API returns it."""
    with _client(url, api_key) as http:
        console.print_json(data=_check(http.get(_path(batch_id))))


@app.command()
def cancel(batch_id: str, url: Url = "http://127.0.0.1:8000", api_key: Key = None) -> None:
    """Cancel a batch: finished lines are kept, the rest end cancelled."""
    with _client(url, api_key) as http:
        _, _, _, _, status = _progress(_check(http.post(f"{_path(batch_id)}/cancel")))
    console.print(f"{batch_id}: {status}")


@app.command()
def results(
    batch_id: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the result lines (JSONL); - for stdout.")],
    url: Url = "http://127.0.0.1:8000",
    api_key: Key = None,
) -> None:
    """Write an ended batch's result lines (OpenAI: output then error file; Anthropic: the results JSONL)."""
    with _client(url, api_key) as http:
        _write_results(http, batch_id, output)
