"""Progress for the steps that take seconds to minutes: GGUF conversion, the layer-profile
measurement, prefill, decode.

On a terminal (stderr is a TTY) each step is a rich progress bar (or a spinner with the
elapsed time when its length is unknown); a step done in under `SHOW_AFTER_S` seconds
leaves no row. In a log (stderr redirected) a step that is still running after
`SHOW_AFTER_S` writes a line, then one line after 15, 30 and then every 60 seconds, and
one when it ends: a log never fills with bar redraws. `quiet_bars_in_logs` turns off the
tqdm bars of transformers there for the same reason.

Library code reports through `step()`. It shows nothing unless progress is on: the CLI
turns it on (`enable()`); elsewhere it is on when stderr is a TTY. FLASHMEM_PROGRESS=0
or 1 overrides both.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "Step",
    "enable",
    "forward_tokens",
    "is_enabled",
    "quiet_bars_in_logs",
    "step",
    "stderr_is_tty",
    "stdout_is_tty",
]

SHOW_AFTER_S = 2.0  # steps quicker than this show nothing (bar rows are removed)
LOG_EVERY_S = (15.0, 15.0, 30.0, 60.0)  # in a log: gaps between a running step's lines, the last repeated

_enabled: bool | None = None  # None: on when stderr is a TTY
_live: Any = None  # the rich Progress shown now (steps inside a step add a row to it)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


def stderr_is_tty() -> bool:
    return _isatty(sys.stderr)


def stdout_is_tty() -> bool:
    return _isatty(sys.stdout)


def enable(on: bool | None = True) -> bool | None:
    """Show progress (as bars on a TTY, as lines in a log), hide it (False), or follow
    stderr (None: on when it is a TTY). Returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, on
    return previous


def is_enabled() -> bool:
    env = os.environ.get("FLASHMEM_PROGRESS", "").strip()
    if env in ("0", "1"):
        return env == "1"
    return _enabled if _enabled is not None else stderr_is_tty()


def quiet_bars_in_logs() -> None:
    """When stderr is not a TTY, turn off tqdm bars (transformers' GGUF conversion and
    weight loading): redrawn bars are dozens of lines in a log. Takes effect when set
    before tqdm is first imported; the CLI calls it first thing."""
    if not stderr_is_tty():
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m} min {sec:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


class Step:
    """One running step: `advance(n)` as work is done (in `unit`s, of `total` if known)."""

    def __init__(self, description: str, total: float | None, unit: str, mode: str) -> None:
        self.description, self.total, self.unit, self.mode = description, total, unit, mode
        self.done = 0.0
        self.start = time.perf_counter()
        self._task: Any = None
        self._stop = threading.Event()
        self._shown = False  # lines mode: the start line was written

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def advance(self, n: float = 1) -> None:
        self.done += n
        if self.mode == "bar" and _live is not None:
            _live.advance(self._task, n)

    def _count(self) -> str:
        if self.total:
            return f"{self.done:,.0f}/{self.total:,.0f} {self.unit} ({self.done / self.total:.0%})"
        return f"{self.done:,.0f} {self.unit}" if self.done else ""

    def _left(self) -> str:
        if not self.total or self.done <= 0:
            return ""
        return f", about {_duration(self.elapsed * (self.total - self.done) / self.done)} left"

    def _log(self) -> None:
        """Lines mode, on a helper thread: the start line once the step has run SHOW_AFTER_S,
        then a line per LOG_EVERY_S gap until the step ends."""
        if self._stop.wait(SHOW_AFTER_S):
            return
        what = f" ({self.total:,.0f} {self.unit})" if self.total else ""
        _line(f"{self.description}{what}...")
        self._shown = True
        for i in range(1 << 30):
            if self._stop.wait(LOG_EVERY_S[min(i, len(LOG_EVERY_S) - 1)]):
                return
            count = self._count()
            _line(f"{self.description}: {count + ', ' if count else ''}{_duration(self.elapsed)}{self._left()}")

    def summary(self) -> str:
        s = _duration(self.elapsed)
        if self.done > 0 and self.unit:
            s = f"{self.done:,.0f} {self.unit} in {s}"
        return s


def _line(text: str) -> None:
    if _live is not None:  # a bar is on screen: print above it
        _live.console.print(text, markup=False, highlight=False)
        return
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # closed or broken stderr: progress is not worth failing for
        pass


def _new_progress() -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Count(ProgressColumn):  # "2,048/8,192 tokens", or nothing when the length is unknown
        def render(self, task: Any) -> Text:
            unit = task.fields.get("unit", "")
            if task.total is None or not task.fields.get("known", True):
                return Text("")
            return Text(f"{task.completed:,.0f}/{task.total:,.0f} {unit}".rstrip())

    class Left(ProgressColumn):  # "0:02:10 left" once a known-length step has advanced
        def render(self, task: Any) -> Text:
            if not task.fields.get("known", True) or not task.completed or task.finished or task.total is None:
                return Text("")
            left = int((task.elapsed or 0.0) * (task.total - task.completed) / task.completed)
            return Text(f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d} left")  # as the elapsed column

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        Count(),
        TimeElapsedColumn(),
        Left(),
        console=Console(stderr=True),
        redirect_stdout=False,  # generated text goes to stdout untouched
        transient=False,
    )


@contextmanager
def step(description: str, total: float | None = None, unit: str = "", *, show: bool = True) -> Iterator[Step]:
    """Report a step: a bar on a TTY, start/progress/end lines in a log, nothing when
    progress is off or `show` is False (e.g. decode while the tokens stream to the same
    terminal: the text is the progress)."""
    global _live
    mode = "off" if not (show and is_enabled()) else "bar" if stderr_is_tty() else "lines"
    s = Step(description, total, unit, mode)
    own = False
    logger = None
    if mode == "bar":
        if _live is None:
            _live, own = _new_progress(), True
            _live.start()
        s._task = _live.add_task(description, total=total, unit=unit, known=total is not None)
    elif mode == "lines":
        logger = threading.Thread(target=s._log, name="flashmem-progress", daemon=True)
        logger.start()
    ok = False
    try:
        yield s
        ok = True
    finally:
        if mode == "bar" and _live is not None:
            if s.elapsed < SHOW_AFTER_S:
                _live.remove_task(s._task)
            elif ok and total is not None:
                _live.update(s._task, completed=total)
            elif total is None:
                _live.update(s._task, total=1, completed=1 if ok else 0)
            if own:
                _live.stop()
                _live = None
        elif logger is not None:
            s._stop.set()
            logger.join()
            if s._shown:
                _line(f"{description}: {'done, ' + s.summary() if ok else 'stopped after ' + _duration(s.elapsed)}")


@contextmanager
def forward_tokens(model: Any, shown: Step) -> Iterator[None]:
    """Advance `shown` by the tokens of each forward of `model` while it runs: T/L as each
    of its L decoder layers finishes a forward of T tokens (input_ids [b, T]); T at the
    end of the forward when the layers cannot be found. One forward over a long prompt
    then moves the bar too."""
    try:
        blocks = list(model.get_decoder().layers)
    except (AttributeError, TypeError):
        blocks = []
    tokens = [0]

    def started(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args else kwargs.get("input_ids")
        tokens[0] = int(x.shape[-1]) if x is not None else 0

    def layer_done(*_: Any) -> None:  # returns None: the layer's output is left as it is
        shown.advance(tokens[0] / len(blocks))

    def model_done(*_: Any) -> None:
        if not blocks:
            shown.advance(tokens[0])

    handles = [model.register_forward_pre_hook(started, with_kwargs=True), model.register_forward_hook(model_done)]
    handles += [b.register_forward_hook(layer_done) for b in blocks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
