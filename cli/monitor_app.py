"""The Textual app of ``pivot monitor``: a run's events (an ``EventSource``) on one screen.

The app keeps every event it has seen, in time order, and a cursor into them: the screen
shows ``Watch.of(events[:cursor])``. Live, the cursor follows the newest event until a time key
moves it; replay, it starts at the end and the keys play, pause and step through the run.
Leaving (``q``) only closes the source: the job is never told anything.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import Footer, Static

from pivot.cli.event_sources import EventSource
from pivot.events import Event, JobPhase, StepDone
from pivot.watch import (
    UNKNOWN,
    Watch,
    clock_text,
    compact,
    duration_text,
    lane_cells,
    sparkline,
)

#: each role's glyph and colour in a lane (the glyph tells roles apart without colour)
ROLE_STYLE: dict[str, tuple[str, str]] = {
    "rollout": ("█", "green"),
    "reward": ("▒", "magenta"),
    "training": ("░", "dodger_blue1"),
    "free": ("·", "grey62"),
    UNKNOWN: ("╌", "grey30"),  # before the first device map (the job was starting)
}
ENDED = ("finished", "stopped", "failed")
PLAY_TICK_S = 0.1  # playing redraws this often; a second of play is a second of run, or more
PLAY_SPAN_S = 60.0  # a whole run plays in about this long


def _style(role: str) -> tuple[str, str]:
    return ROLE_STYLE.get(role, ("?", "yellow"))


def _num(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


class Panel(Widget):
    """A bordered box whose text ``draw`` makes from the app's current ``Watch``."""

    DEFAULT_CSS = """
    Panel {
        border: round $primary-darken-1; padding: 0 1; height: 1fr; width: 1fr;
        text-wrap: nowrap; text-overflow: ellipsis;
    }
    """

    def __init__(self, title: str, draw: Callable[[Watch, int, int], Text], **kw) -> None:
        super().__init__(**kw)
        self.border_title = title
        self._draw = draw

    def render(self) -> Text:
        size = self.content_size
        return self._draw(self.app.view, size.width, size.height)  # type: ignore[attr-defined]


def draw_lanes(w: Watch, width: int, height: int) -> Text:
    text = Text(no_wrap=True, overflow="crop")
    moving = {d for s in w.shifts.values() if not s.ended for d in s.devices}
    label = 3 + 3 + 9 + 10  # device, shift mark, role, replica
    cells = max(0, width - label)
    lanes = [w.lanes[d] for d in sorted(w.lanes)]
    if not lanes:
        text.append("no device map yet", style="dim")
    for i, lane in enumerate(lanes):  # the panel is as high as the lanes
        if i:
            text.append("\n")
        glyph, colour = _style(lane.role)
        mark = "⇄" if lane.device in moving else " "
        text.append(f"{lane.device:>3} {mark} ")
        text.append(f"{lane.role or '?':<9}", style=colour)
        text.append(f"{lane.replica[:9]:<9} ", style="dim")
        for role in lane_cells(lane, 0.0, w.t, cells):
            glyph, colour = _style(role)
            text.append(glyph, style=colour)
    return text


def draw_roles(w: Watch, width: int, height: int) -> Text:
    text = Text(no_wrap=True, overflow="crop")
    if not w.roles:
        text.append("no rates yet", style="dim")
        return text
    text.append("role      tok/s  run queue", style="dim")
    for name in sorted(w.roles)[: max(0, height - 1)]:
        r = w.roles[name]
        _, colour = _style(name)
        text.append("\n")
        text.append(f"{name:<8}", style=colour)
        text.append(f"{r.tokens_per_s:>7.0f} {r.running:>4} {r.queued:>5} ")
        text.append(sparkline(r.history, max(0, width - 27)), style=colour)
    return text


def draw_training(w: Watch, width: int, height: int) -> Text:
    text = Text(no_wrap=True, overflow="crop")
    last = w.step_figures[-1] if w.step_figures else None
    text.append(f"trainer {w.trainer_phase or '-'}, policy v{w.policy_version}")
    if last is None:
        text.append("\nno step yet", style="dim")
        return text
    text.append(f"\nstep {last.step}: reward {_num(last.reward)} acc {_num(last.accuracy, '.2f')}")
    evals = [f for f in w.step_figures if f.eval_accuracy is not None]
    text.append(f"\nloss {_num(last.loss, '.4f')}")
    if evals:
        text.append(f"  eval acc {_num(evals[-1].eval_accuracy, '.2f')} @{evals[-1].step}")
    spark = max(0, width - 7)
    if height > 3:
        text.append("\nreward ", style="dim")
        text.append(sparkline([f.reward for f in w.step_figures], spark), style="green")
    if height > 4:
        text.append("\nloss   ", style="dim")
        text.append(sparkline([f.loss for f in w.step_figures], spark), style="cyan")
    return text


def draw_shifts(w: Watch, width: int, height: int) -> Text:
    """Two lines a shift: what and how long in all, then each phase's own time."""
    text = Text(no_wrap=True, overflow="crop")
    log = w.shift_log()[-(height // 2) :] if height > 1 else []
    if not log:
        text.append("no shift yet", style="dim")
    for i, s in enumerate(log):
        if i:
            text.append("\n")
        devices = ",".join(str(d) for d in s.devices)
        style = "red" if s.phase == "aborted" else ("" if s.ended else "bold yellow")
        text.append(
            f"#{s.txn} {clock_text(s.t)} {s.kind} [{devices}] {s.phase} {duration_text(s.seconds)}",
            style=style,
        )
        parts = [f"{phase} {duration_text(seconds)}" for phase, seconds in s.steps()]
        if parts:
            text.append("\n  " + " · ".join(parts), style="dim")
    return text


def draw_planner(w: Watch, width: int, height: int) -> Text:
    text = Text(no_wrap=True, overflow="crop")
    d = w.decision
    if d is None:
        text.append("no decision yet", style="dim")
        return text
    text.append(f"{clock_text(d.t)} bottleneck {d.bottleneck or '-'}: ")
    text.append("acted" if d.acted else "held", style="bold green" if d.acted else "yellow")
    text.append(f"\n{d.candidate or '-'}")
    text.append(
        f"\nL {compact(d.value)} = H {compact(d.horizon_s)}s"
        f" x dT {compact(d.throughput_gain)} - Phi {compact(d.cost)}"
    )
    text.append(f"\n{d.why}", style="dim")
    return text


def draw_alerts(w: Watch, width: int, height: int) -> Text:
    text = Text(no_wrap=True, overflow="crop")
    alerts = w.alerts[-height:] if height > 0 else []
    if not alerts:
        text.append("none", style="dim")
    for i, a in enumerate(alerts):
        if i:
            text.append("\n")
        text.append(f"{clock_text(a.t):>5} {a.kind} ", style="bold red")
        text.append(a.message)
    return text


class MonitorApp(App):
    """See the module docstring; ``run_name`` is shown in the header. Playing advances the
    view every ``play_tick_s`` by ``play_tick_s`` times the play speed (``advance``)."""

    TITLE = "pivot monitor"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #header { height: 1; background: $primary-darken-2; color: $text; padding: 0 1; }
    #lanes { height: auto; max-height: 12; }
    #lanes Panel { height: auto; min-height: 3; }
    #middle { height: 7; }
    #bottom { height: 1fr; }
    #side { width: 1fr; }
    #planner { height: 6; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("space", "toggle_play", "play/pause"),
        Binding("left", "back", "back"),
        Binding("right", "forward", "fwd"),
        Binding("pageup", "prev_step", "-step"),
        Binding("pagedown", "next_step", "+step"),
        Binding("home", "start", "start"),
        Binding("end", "end", "latest"),
    ]

    def __init__(
        self, source: EventSource, run_name: str = "", *, play_tick_s: float = PLAY_TICK_S
    ) -> None:
        super().__init__()
        self.source = source
        self.play_tick_s = play_tick_s  # how often playing advances the view (wall clock)
        self.run_name = run_name
        self.live = source.live
        self.events: list[Event] = []
        self.cursor = 0
        self.view = Watch()
        self.following = True  # the cursor stays at the newest event
        self.playing = False
        self._play_timer = None
        self.loaded = False  # the snapshot is in
        self.problem = ""  # why the source stopped, when it failed
        self._mounted = False

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        with Vertical(id="lanes"):
            yield Panel(
                "devices  █ rollout ▒ reward ░ training · free", draw_lanes, id="lane-panel"
            )
        with Horizontal(id="middle"):
            yield Panel("roles", draw_roles, id="roles")
            yield Panel("steps", draw_training, id="training")
        with Horizontal(id="bottom"):
            yield Panel("shifts", draw_shifts, id="shifts")
            with Vertical(id="side"):
                yield Panel("planner", draw_planner, id="planner")
                yield Panel("alerts", draw_alerts, id="alerts")
        yield Footer(compact=True)

    async def on_mount(self) -> None:
        self._mounted = True
        self.redraw()
        self.run_worker(self._follow(), exclusive=True, group="source")

    async def _follow(self) -> None:
        from pivot.bus import BusError

        try:
            self.add(await self.source.snapshot())
            self.loaded = True
            if not self.live:
                self.redraw()
                return
            async for batch in self.source:
                self.add(batch)
        except BusError as exc:  # the job went away, or its Monitor does not answer
            self.problem = str(exc)
        self.live = False  # the job's stream ended
        self.redraw()

    async def on_unmount(self) -> None:
        self._mounted = False
        self._stop_playing()
        await self.source.close()

    # -- the timeline

    def add(self, batch: list[Event]) -> None:
        """New events (from the source): kept in time order; the screen follows them when
        the cursor is at the end."""
        for event in batch:
            if self.events and event.t < self.events[-1].t:
                at = bisect.bisect_right([e.t for e in self.events], event.t)
                self.events.insert(at, event)
                if at < self.cursor:
                    self.cursor += 1
                    self.view = Watch.of(self.events[: self.cursor])
            else:
                self.events.append(event)
            if isinstance(event, JobPhase) and event.phase in ENDED:
                self.live = False
        if self.following:
            self.move_to(len(self.events))
        else:
            self.redraw()

    def move_to(self, cursor: int) -> None:
        cursor = max(0, min(cursor, len(self.events)))
        if cursor >= self.cursor:
            for event in self.events[self.cursor : cursor]:
                self.view.feed(event)
        else:
            self.view = Watch.of(self.events[:cursor])
        self.cursor = cursor
        self.following = cursor == len(self.events)
        self.redraw()

    def advance(self, seconds: float) -> None:
        """Play ``seconds`` of run time: every event up to the view's time plus that."""
        until = self.view.t + seconds
        cursor = self.cursor
        while cursor < len(self.events) and self.events[cursor].t <= until:
            cursor += 1
        self.move_to(cursor)
        if self.cursor == len(self.events):
            self._stop_playing()

    def _play_speed(self) -> float:
        span = self.events[-1].t - self.events[0].t if self.events else 0.0
        return max(1.0, span / PLAY_SPAN_S)

    def _tick(self) -> None:
        self.advance(self.play_tick_s * self._play_speed())

    def _stop_playing(self) -> None:
        self.playing = False
        if self._play_timer is not None:
            self._play_timer.stop()
            self._play_timer = None
        self.redraw()

    # -- keys

    def action_toggle_play(self) -> None:
        if self.playing:
            self._stop_playing()
            return
        if self.cursor == len(self.events):
            self.move_to(0)  # play from the start, as a player does at the end
        self.playing = True
        self._play_timer = self.set_interval(self.play_tick_s, self._tick)
        self.redraw()

    def action_back(self) -> None:
        """To before the latest moment shown (every event of one time is one moment)."""
        if self.cursor == 0:
            return
        t = self.events[self.cursor - 1].t
        self.move_to(bisect.bisect_left([e.t for e in self.events], t, hi=self.cursor))

    def action_forward(self) -> None:
        if self.cursor == len(self.events):
            return
        t = self.events[self.cursor].t
        self.move_to(bisect.bisect_right([e.t for e in self.events], t, lo=self.cursor))

    def action_prev_step(self) -> None:
        """To just after the latest step before the moment shown (or the start)."""
        for i in range(self.cursor - 2, -1, -1):
            if isinstance(self.events[i], StepDone):
                self.move_to(i + 1)
                return
        self.move_to(0)

    def action_next_step(self) -> None:
        for i in range(self.cursor, len(self.events)):
            if isinstance(self.events[i], StepDone):
                self.move_to(i + 1)
                return
        self.move_to(len(self.events))

    def action_start(self) -> None:
        self.move_to(0)

    def action_end(self) -> None:
        self.move_to(len(self.events))

    # -- drawing

    def header_text(self) -> str:
        w = self.view
        steps = f"step {w.steps_done}/{w.steps}" if w.steps else f"step {w.steps_done}"
        phase = w.phase or "-"
        if w.detail and phase == "starting":
            phase = f"{phase}: {w.detail}"
        if self.problem:
            mode = f"stream lost: {self.problem}"
        elif not self.loaded:
            mode = "connecting"
        elif self.live and self.following:
            mode = "LIVE"
        elif self.playing:
            mode = "▶ replay"
        else:
            mode = "⏸ live, paused" if self.live else "⏸ replay"
        alerts = f" │ {len(w.alerts)} alerts" if w.alerts else ""
        return f"{self.run_name} │ {phase} │ {steps} │ {clock_text(w.t)} │ {mode}{alerts}"

    def redraw(self) -> None:
        if not self._mounted:
            return
        self.query_one("#header", Static).update(self.header_text())
        for panel in self.query(Panel):
            # the lanes' panel is as high as there are lanes: its layout may change
            panel.refresh(layout=panel.id == "lane-panel")
