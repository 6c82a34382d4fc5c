"""Progress of the long commands (trace, amp-demo, plan --min-gpus, validate, precision-check) on stderr.

A rich progress line (description, bar when the total is known, count, elapsed time) is drawn on stderr, and only
when stderr is a terminal and the command is not printing JSON: stdout carries the command's result alone, and a
pipe, a file, a test or ``--json`` get no progress at all. The line is transient: it is erased when the work ends,
so the result tables print as without it. Counting works whether or not anything is drawn (``Progress.count``).
"""

from __future__ import annotations

import sys
from typing import IO


class Progress:
    """``with Progress("tracing", total=3) as p: ... p.advance()``; ``total=None`` is a spinner with a count."""

    def __init__(self, description: str, total: int | None = None, *, as_json: bool = False,
                 stream: IO[str] | None = None, force: bool | None = None) -> None:
        self.description = description
        self.total = total
        self.count = 0
        """Units of work reported so far (advance() calls, weighted)."""
        self.stream = stream if stream is not None else sys.stderr
        if force is None:
            isatty = getattr(self.stream, "isatty", None)
            force = not as_json and bool(isatty and isatty())
        self.enabled = force and not as_json
        self._bar = None
        self._task = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, SpinnerColumn, TextColumn, \
                TimeElapsedColumn

            columns = [SpinnerColumn(), TextColumn("{task.description}")]
            columns += [BarColumn(), MofNCompleteColumn()] if self.total else [TextColumn("{task.completed:,.0f}")]
            columns.append(TimeElapsedColumn())
            console = Console(file=self.stream, force_terminal=True)
            self._bar = Bar(*columns, console=console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total)
        return self

    def advance(self, amount: int = 1, description: str | None = None) -> None:
        self.count += amount
        if self._bar is not None:
            self._bar.update(self._task, advance=amount,
                             **({"description": description} if description is not None else {}))

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
