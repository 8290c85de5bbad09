"""`met top`: a live dashboard of a Metrale deployment (Textual), read from Redis only.

Shows each worker (dead ones marked), the queue, decode throughput over the last minutes, the active
requests, batch jobs in progress, recent errors and dead letters; refreshes about once a second. Keys: arrows + enter open a
request (its prompt head, streamed text and timings), c cancels the selected request, p pauses the
refresh, q (or Ctrl-C) quits. `met serve` on a terminal runs this as its screen (see cli/serve.py).

Owns: the widgets, key bindings and the refresh timer. Must not: read or write Redis itself (every
query and the cancel flag live in cli/top_snapshot.py, which is tested without a terminal), or
show a password (the URL is shown through redact_url).
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, ClassVar

from redis.exceptions import RedisError
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Sparkline, Static

from bus.connect import connect
from cli.top_snapshot import RequestDetail, Snapshot, ThroughputHistory, WorkerView, cancel, take_request_detail, take_snapshot
from shared.redact import redact_url
from shared.settings import Settings

REFRESH_S = 1.0
REDIS_TIMEOUT_S = 5.0  # a Redis that stops answering shows as unreachable instead of freezing the refresh

# The worker id is `<host>-<pid>-<hex>`, so host and pid need no columns of their own. Both tables are
# built to fit a 140-column terminal: free-text cells are cut to CAPS, and the columns are rebuilt on
# every refresh (a DataTable column only ever widens, so one long value would otherwise keep it wide).
WORKER_COLUMNS = (
    "worker",
    "model",
    "device",
    "run/wait",
    "claimed",
    "routing",
    "KV tokens/upstream",
    "prefill/s",
    "decode/s",
    "heartbeat",
    "state",
)
REQUEST_COLUMNS = ("request", "status", "protocol", "model", "worker", "age", "tokens", "tok/s", "client")
CAPS = {"worker": 24, "model": 16, "device": 8, "client": 21, "request": 26, "upstream": 32}


def fit(value: str, column: str) -> str:
    """`value` cut to its column's cap, with an ellipsis where cut."""
    cap = CAPS.get(column)
    return value if cap is None or len(value) <= cap else value[: cap - 1] + "…"


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        minutes, secs = divmod(int(seconds), 60)
        return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m"


def queue_line(snap: Snapshot) -> Text:
    q = snap.queue
    undelivered = f"{'≈' if q.undelivered_estimated else ''}{q.undelivered}"
    line = Text.assemble(
        ("queue  ", "bold"),
        f"in flight {q.inflight} · undelivered {undelivered} · pending (claimed) {q.pending} · ",
        f"running {snap.running} · oldest wait {fmt_age(q.oldest_wait)} · consumers {q.consumers}",
    )
    if snap.adapters:  # LoRA adapters (docs/api.md#lora-adapters): requests per adapter, running and waiting
        line.append("\nadapters  ", style="bold")
        line.append(" · ".join(f"{name} {r} running" + (f", {w} waiting" if w else "") for name, r, w in snap.adapters))
    return line


def problems_text(snap: Snapshot) -> Text:
    text = Text()
    if snap.batches:
        text.append(f"batches in progress ({len(snap.batches)})", style="bold")
        for b in snap.batches:
            done = b.succeeded + b.failed
            text.append(f"\n  {b.id}  {b.protocol}  {b.status}  {done}/{b.total} done · {b.succeeded} ok · {b.failed} failed")
        text.append("\n")
    text.append(f"recent errors ({len(snap.errors)})", style="bold")
    for p in snap.errors:
        text.append(f"\n  {fmt_age(p.age)} ago  {p.request_id}  {p.detail}", style="red")
    text.append(f"\ndead letters ({snap.dead_letter_total})", style="bold")
    for p in snap.dead_letters:
        text.append(f"\n  {fmt_age(p.age)} ago  {p.request_id}  {p.detail}", style="magenta")
    return text


def detail_text(detail: RequestDetail) -> Text:
    meta = detail.meta
    text = Text()
    text.append(f"{detail.id}\n", style="bold")
    fields = ("status", "outcome", "protocol", "model", "endpoint", "worker", "attempt", "deliveries", "client")
    text.append("  ".join(f"{name}: {meta[name]}" for name in fields if meta.get(name)))
    text.append(f"\ntokens so far: {detail.tokens}" + ("   cancel requested" if detail.cancel_requested else ""))
    text.append("\n" + "  ".join(f"{label}: {fmt_age(value)}" for label, value in detail.timings))
    return text


class RequestScreen(Screen[None]):
    """One request: its prompt head, the text streamed so far, its timings. Esc goes back."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("backspace", "app.pop_screen", "Back", show=False),
        Binding("c", "cancel", "Cancel request"),
    ]

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id
        self.detail: RequestDetail | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="detail-head")
        yield Static(id="prompt", classes="box")
        with VerticalScroll(id="text-box", classes="box"):
            yield Static(id="text")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#prompt").border_title = "prompt (head)"
        self.query_one("#text-box").border_title = "streamed so far"
        self.set_interval(REFRESH_S, self.refresh_detail)
        self.call_later(self.refresh_detail)

    @property
    def top(self) -> TopApp:
        app = self.app
        assert isinstance(app, TopApp)
        return app

    async def refresh_detail(self) -> None:
        if self.top.paused:
            return
        try:
            self.detail = await take_request_detail(self.top.redis, self.request_id)
        except (RedisError, OSError) as exc:
            self.query_one("#detail-head", Static).update(Text(f"Redis unreachable: {redact_url(str(exc))}", style="red"))
            return
        self.query_one("#detail-head", Static).update(detail_text(self.detail))
        self.query_one("#prompt", Static).update(Text(self.detail.prompt_head))
        box = self.query_one("#text-box", VerticalScroll)
        following = box.scroll_y >= box.max_scroll_y  # at the bottom: keep following the stream
        self.query_one("#text", Static).update(Text(self.detail.text))
        if following:
            box.call_after_refresh(box.scroll_end, animate=False)

    async def action_cancel(self) -> None:
        await self.top.cancel_request(self.request_id)
        await self.refresh_detail()


class TopApp(App[None]):
    """The dashboard. `snapshot` holds the latest Snapshot (tests read it)."""

    TITLE = "met top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #header { height: 1; background: $primary-background; }
    #workers { height: auto; max-height: 12; }
    #queue { height: 1; margin-top: 1; }
    #spark-label { height: 1; margin-top: 1; }
    #throughput { height: 3; }
    #requests { height: 1fr; margin-top: 1; }
    #problems { height: auto; max-height: 12; margin-top: 1; }
    .box { border: round $secondary; height: auto; max-height: 10; }
    #text-box { height: 1fr; max-height: 100%; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
        Binding("p", "toggle_pause", "Pause"),
        Binding("c", "cancel_selected", "Cancel request"),
    ]

    def __init__(self, redis_url: str, *, settings: Settings, title: str = "") -> None:
        super().__init__()
        self.redis_url = redis_url
        self.heartbeat_ttl = settings.heartbeat_ttl
        self.banner = title
        self.redis = connect(redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
        self.snapshot: Snapshot | None = None
        self.history = ThroughputHistory()
        self.paused = False
        self.problem = ""
        self.handle_sigterm = False  # run_top sets it: a parent `met serve` stops us with SIGTERM

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        workers: DataTable[str | Text] = DataTable(id="workers", cursor_type="none", zebra_stripes=True)
        workers.can_focus = False
        yield workers
        yield Static(id="queue")
        yield Static(id="spark-label")
        yield Sparkline([], id="throughput")
        yield DataTable(id="requests", cursor_type="row", zebra_stripes=True)
        yield Static(id="problems")
        yield Footer()

    async def on_mount(self) -> None:
        for table_id, columns in (("#workers", WORKER_COLUMNS), ("#requests", REQUEST_COLUMNS)):
            _reset(self.query_one(table_id, DataTable), columns)
        self.query_one("#requests", DataTable).focus()
        if self.handle_sigterm:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.exit)
        self.render_header()
        self.set_interval(REFRESH_S, self.refresh_snapshot)
        self.call_later(self.refresh_snapshot)

    async def on_unmount(self) -> None:
        await self.redis.aclose()

    # ---- refresh ------------------------------------------------------------------------------

    async def refresh_snapshot(self) -> None:
        if self.paused:
            return
        try:
            snap = await take_snapshot(self.redis, heartbeat_ttl=self.heartbeat_ttl)
        except (RedisError, OSError) as exc:
            self.problem = f"Redis unreachable: {type(exc).__name__}: {redact_url(str(exc))}"
            self.render_header()
            return
        self.problem = ""
        self.snapshot = snap
        self.history.add(snap.taken_at, snap.decode_tps)
        self.render_snapshot(snap)

    def render_header(self) -> None:
        text = Text.assemble(("met top", "bold"), f"  {redact_url(self.redis_url)}")
        if self.banner:
            text.append(f"  {self.banner}")
        if self.paused:
            text.append("  PAUSED (p resumes)", style="bold yellow")
        if self.problem:
            text.append(f"  {self.problem}", style="bold red")
        self.query_one("#header", Static).update(text)

    def render_snapshot(self, snap: Snapshot) -> None:
        self.render_header()
        self.render_workers(snap)
        self.query_one("#queue", Static).update(queue_line(snap))
        values = self.history.values()
        span = self.history.span_label(snap.taken_at)
        label = f"decode tok/s (all workers, {span}): now {snap.decode_tps:.1f} · peak {max(values, default=0):.1f}"
        self.query_one("#spark-label", Static).update(f"{label} · prefill now {snap.prefill_tps:.1f}")
        self.query_one("#throughput", Sparkline).data = values
        self.render_requests(snap)
        self.query_one("#problems", Static).update(problems_text(snap))

    def render_workers(self, snap: Snapshot) -> None:
        table: DataTable[str | Text] = self.query_one("#workers", DataTable)
        _reset(table, WORKER_COLUMNS)
        for w in snap.workers:
            kv = f"{w.kv_used_tokens}/{w.kv_total_tokens}"
            if w.kv_total_tokens:
                kv += f" ({100 * w.kv_used_tokens / w.kv_total_tokens:.0f}%)"
            if w.upstream:  # a gateway worker: its upstream stands where the KV pool would
                kv = fit(w.upstream, "upstream")
            state = (
                Text("DEAD", style="bold red")
                if w.dead
                else Text("draining", style="yellow")
                if w.draining
                else Text("upstream down", style="bold red")
                if not w.upstream_healthy
                else Text("alive", style="green")
            )
            row = (fit(w.id, "worker"), fit(w.model, "model"), fit(w.device, "device"), f"{w.running}/{w.waiting}", str(w.claimed), routing_cell(w), kv)
            table.add_row(*row, f"{w.prefill_tps:.1f}", decode_cell(w), f"{fmt_age(w.heartbeat_age)} ago", state, key=w.id)

    def render_requests(self, snap: Snapshot) -> None:
        table: DataTable[str] = self.query_one("#requests", DataTable)
        selected = self.selected_request_id()
        _reset(table, REQUEST_COLUMNS)
        for r in snap.active:
            row = (
                fit(r.id, "request"),
                r.status,
                r.protocol,
                fit(r.model, "model"),
                fit(r.worker or "-", "worker"),
                fmt_age(r.age),
                str(r.tokens),
                f"{r.tokens_per_s:.1f}",
                fit(r.client or "-", "client"),
            )
            table.add_row(*row, key=r.id)
        ids = [r.id for r in snap.active]
        if selected in ids:
            table.move_cursor(row=ids.index(selected), animate=False)

    def selected_request_id(self) -> str | None:
        table: DataTable[str] = self.query_one("#requests", DataTable)
        if not table.row_count:
            return None
        return str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)

    # ---- actions ------------------------------------------------------------------------------

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "requests" and event.row_key.value:
            self.push_screen(RequestScreen(str(event.row_key.value)))

    async def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.render_header()

    async def action_cancel_selected(self) -> None:
        request_id = self.selected_request_id()
        if request_id:
            await self.cancel_request(request_id)

    async def cancel_request(self, request_id: str) -> None:
        try:
            await cancel(self.redis, request_id)
        except (RedisError, OSError) as exc:
            self.notify(f"could not cancel {request_id}: {type(exc).__name__}", severity="error")
            return
        self.notify(f"cancel requested: {request_id}")


def routing_cell(w: WorkerView) -> str:
    """Prefix routing's column (README "Routing"): claims off its routed stream / the shared one (+ taken over from
    gone workers' routed streams; routed to it and not read yet in brackets), its prefix cache's hit rate, and
    `i` the block keys in its routing index: `12/3 +1 (2) 84% i640`."""
    cell = f"{w.routed_claims}/{w.shared_claims}"
    if w.adopted_claims:
        cell += f" +{w.adopted_claims}"
    if w.routed_queue:
        cell += f" ({w.routed_queue})"
    rate = w.cache_hit_rate
    return f"{cell} {'-' if rate is None else f'{100 * rate:.0f}%'} i{w.index_size}"


def decode_cell(w: WorkerView) -> str:
    """Decode tokens/s, and where speculative decoding checked guesses the share it kept: `41.3 s62%`."""
    cell = f"{w.decode_tps:.1f}"
    return f"{cell} s{100 * w.spec_accepted / w.spec_proposed:.0f}%" if w.spec_proposed else cell


def _reset(table: DataTable[Any], columns: tuple[str, ...]) -> None:
    """Empty the table and give it fresh columns, sized to the rows about to be added."""
    table.clear(columns=True)
    for label in columns:
        table.add_column(label, key=label)


def run_top(redis_url: str, *, settings: Settings, title: str = "") -> None:
    """Run the dashboard in this terminal until q / Ctrl-C (or SIGTERM from a parent `met serve`)."""
    app = TopApp(redis_url, settings=settings, title=title)
    app.handle_sigterm = True
    app.run()
