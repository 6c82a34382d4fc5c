"""Progress of the long commands (trace, amp-demo, plan --min-gpus, validate, precision-check) on stderr.

A rich progress line (description, bar when the total is known, count, elapsed time) is drawn on stderr, and only
when stderr is a terminal and the command is not printing JSON: stdout carries the command's result alone, and a
pipe, a file, a test or ``--json`` get no progress at all. The line is transient: it is erased when the work ends,
so the result tables print as without it. Counting works whether or not anything is drawn (``Progress.count``).
"""

from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import logging


def _isatty(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed or detached stream
        return False


class Progress:
    """``with Progress("tracing", total=3) as p: ... p.advance()``; ``total=None`` is a spinner and the time."""

    def __init__(self, description: str, total: int | None = None, *, as_json: bool = False,
                 stream: IO[str] | None = None, force: bool | None = None) -> None:
        self.description = description
        self.total = total
        self.count = 0
        """Units of work reported so far (advance() calls, weighted)."""
        self.stream = stream if stream is not None else sys.stderr
        if force is None:
            force = not as_json and _isatty(self.stream)
        self.enabled = force and not as_json
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            from rich.console import Console
            from rich.markup import escape
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, SpinnerColumn, TextColumn, \
                TimeElapsedColumn

            columns = [SpinnerColumn(), TextColumn("{task.description}")]
            if self.total:  # without a total (one opaque call: a trace, a search) the spinner and the time
                columns += [BarColumn(), MofNCompleteColumn()]
            columns.append(TimeElapsedColumn())
            console = Console(file=self.stream, force_terminal=True)
            # Lines the command prints on stdout go above the bar when both are the same terminal; to a pipe or a
            # file they go straight there (rich would otherwise route them through the bar's stream, stderr).
            self._bar = Bar(*columns, console=console, transient=True, redirect_stdout=_isatty(sys.stdout),
                            redirect_stderr=False)
            self._bar.start()
            self._task = self._bar.add_task(escape(self.description), total=self.total)
        return self

    def advance(self, amount: int = 1, description: str | None = None) -> None:
        self.count += amount
        if self._bar is not None:
            from rich.markup import escape

            self._bar.update(self._task, advance=amount,
                             **({"description": escape(description)} if description is not None else {}))

    def print(self, console: Any, *objects: Any, **kwargs: Any) -> None:
        """Print a line of the command's own output on ``console`` (stdout) while the progress line runs: through the
        progress line's console when stdout is the same terminal, so that the line lands above the bar instead of
        inside it."""
        if self._bar is not None and _isatty(sys.stdout):
            self._bar.console.print(*objects, **kwargs)
        else:
            console.print(*objects, **kwargs)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


LIBRARIES = ("torch", "transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "safetensors",
             "huggingface_hub", "matplotlib")
"""The third-party packages the commands run, whose warnings are noise at the command line."""
_LIBRARY_LOGGERS = ("DeepSpeed", "bitsandbytes", "transformers", "peft", "accelerate", "torch", "huggingface_hub")


class _BelowError:
    """A logging filter that keeps ERROR and above."""

    def filter(self, record: logging.LogRecord) -> bool:
        import logging

        return bool(record.levelno >= logging.ERROR)


def quiet_libraries() -> None:
    """Silence what the libraries print that is not trainmem's answer, before they are imported (the CLI calls it
    first): their FutureWarnings and DeprecationWarnings (transformers' renamed methods), their UserWarnings, and
    their loggers below ERROR: DeepSpeed's "Setting accelerator to CPU" (deepspeed/utils/logging.py gives its logger
    its own level and a handler on stdout, where it would corrupt --json, so a filter on the logger drops it),
    bitsandbytes' "Failed to load CPU gemm_4bit_forward" (on CPUs with AVX512-BF16) and transformers' notes.
    Errors and exceptions are untouched, and so are trainmem's own notes and warnings (printed, not logged).

    The loggers are set when the first library is imported (``_QuietOnImport``), so that a command that imports
    none (``trainmem estimate``) does not import logging; at once where logging is loaded already (every library
    imports it, so one may have been imported before)."""
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers configures its logger
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", category=UserWarning, module=rf"({'|'.join(LIBRARIES)})(\.|$)")
    if "logging" in sys.modules:
        quiet_loggers()
    elif not any(isinstance(finder, _QuietOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _QuietOnImport())


class _QuietOnImport:
    """An import finder that finds nothing: on the first import of one of ``LIBRARIES`` it quiets their loggers
    (``quiet_loggers``, before the library's own code runs) and leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.partition(".")[0] in LIBRARIES:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            quiet_loggers()
        return None


def quiet_loggers() -> None:
    """The libraries' loggers (``_LIBRARY_LOGGERS``) at ERROR, with a filter that drops what is below it."""
    import logging

    for name in _LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level < logging.ERROR:
            logger.setLevel(logging.ERROR)
        if not any(isinstance(f, _BelowError) for f in logger.filters):
            logger.addFilter(_BelowError())
