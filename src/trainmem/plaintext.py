"""Tables and lines drawn in plain text exactly as rich draws them to a pipe or a file, without importing rich.

Why: importing rich and laying its tables out is about half of ``trainmem estimate``'s wall time (rich.console alone
imports logging, its theme and emoji tables). Output that is not a terminal carries no colour, so its text is all
that rich adds there; this module reproduces that text for the subset of rich the reports use: ``Table`` with
string cells (title, caption, header on or off, left / right / center columns, rows wrapped to the console width)
and ``print`` of markup strings. Anything else -- a terminal, FORCE_COLOR, an encoding other than UTF-8, a
renderable it does not know, text with characters whose width is not one cell, emoji codes, escaped markup, a
table that rich would squeeze evenly -- is handed to rich itself, so the output is always rich's.

The layout follows rich 15's code, cited per function (rich/table.py ``Table._calculate_column_widths``,
``_collapse_widths``, ``_render``; rich/_wrap.py ``divide_line``; rich/text.py ``Text.wrap``; rich/containers.py
``Lines.justify``; rich/_ratio.py ``ratio_reduce``); tests/test_plaintext.py compares both on estimates and on
random tables.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Sequence

# rich/markup.py RE_TAGS: a tag is [ followed by a letter, #, / or @ and anything up to the next ]
_TAG = r"((\\*)\[([a-z#/@][^[]*?)])"
# rich/_emoji_replace.py: :name: (with an optional -emoji / -text variant) may become an emoji
_EMOJI = r"(:(\S*?)(?:(?:\-)(emoji|text))?:)"
_WORD = r"\s*\S+\s*"  # rich/_wrap.py re_word: a word and the spaces after it

# rich/box.py HEAVY_HEAD (the default) and SQUARE (its get_plain_headed_box, used without a header):
# top, header row, header rule, body rows, bottom
_HEAVY_HEAD = ("┏━┳┓", "┃┃┃", "┡━╇┩", "│││", "└─┴┘")
_SQUARE = ("┌─┬┐", "│││", "├─┼┤", "│││", "└─┴┘")


class Unsupported(Exception):
    """Something this module does not draw as rich would: rich draws it instead."""


def _plain(text: str, markup: bool = True) -> str:
    """The text rich shows for a string: markup tags removed (rich/markup.py render) unless ``markup`` is off."""
    if re.search(_EMOJI, text) or markup and "\\" in text:
        raise Unsupported("escaped markup or an emoji code")  # (rich replaces emoji codes with markup off too)
    plain = re.sub(_TAG, "", text) if markup and "[" in text else text
    for ch in plain:
        # one cell each: ASCII, Latin-1 and the punctuation, arrows and math blocks (rich/cells.py cell_len)
        code = ord(ch)
        if code < 0x20 or 0x7F <= code < 0xA0 or 0x300 <= code < 0x2000 or code > 0x22FF:
            raise Unsupported(f"character {ch!r}")
    return plain


def _divide(text: str, width: int, fold: bool) -> list[str]:
    """rich/_wrap.py divide_line, then Text.divide: the pieces of one line of text."""
    if len(text) <= width:  # (every word fits where it is: no break, as the loop below finds)
        return [text]
    breaks: list[int] = []
    offset = 0
    for match in re.finditer(_WORD, text):
        start, word = match.start(), match.group(0)
        length = len(word.rstrip())
        if width - offset >= length:
            offset += len(word)
        elif length > width and fold:  # folded across lines (rich/cells.py chop_cells)
            pieces = [word[i:i + width] for i in range(0, len(word), width)]
            for i, piece in enumerate(pieces):
                if start:
                    breaks.append(start)
                if i == len(pieces) - 1:
                    offset = len(piece)
                else:
                    start += len(piece)
        elif length > width:  # on a line of its own, cropped below
            if start:
                breaks.append(start)
            offset = len(word)
        elif offset and start:
            breaks.append(start)
            offset = len(word)
    edges = [0, *breaks, len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:])]


def _truncate(line: str, width: int, overflow: str) -> str:
    """rich/text.py Text.truncate without padding."""
    if len(line) <= width:
        return line
    return line[:width - 1] + "…" if overflow == "ellipsis" else line[:width]


def wrap(text: str, width: int, justify: str, overflow: str = "fold") -> list[str]:
    """rich/text.py Text.wrap and rich/containers.py Lines.justify for plain text (justify "default": as divided)."""
    lines: list[str] = []
    for line in text.split("\n"):
        for piece in _divide(line, width, overflow == "fold"):
            excess = len(piece) - width  # Text.rstrip_end: trailing spaces beyond the width go
            if excess > 0:
                piece = piece[:len(piece) - min(len(piece) - len(piece.rstrip()), excess)]
            if justify == "left":
                piece = _truncate(piece, width, overflow).ljust(width)
            elif justify == "center":
                piece = _truncate(piece.rstrip(), width, overflow)
                piece = (" " * ((width - len(piece)) // 2) + piece).ljust(width)
            elif justify == "right":
                piece = _truncate(piece.rstrip(), width, overflow).rjust(width)
            lines.append(_truncate(piece, width, overflow))
    return lines


def _ratio_reduce(total: int, ratios: list[int], maximums: list[int], values: list[int]) -> list[int]:
    """rich/_ratio.py ratio_reduce: take ``total`` from ``values`` in proportion to ``ratios``."""
    ratios = [ratio if maximum else 0 for ratio, maximum in zip(ratios, maximums)]
    total_ratio = sum(ratios)
    if not total_ratio:
        return values[:]
    remaining, result = total, []
    for ratio, maximum, value in zip(ratios, maximums, values):
        if ratio and total_ratio > 0:
            distributed = min(maximum, round(ratio * remaining / total_ratio))
            result.append(value - distributed)
            remaining -= distributed
            total_ratio -= ratio
        else:
            result.append(value)
    return result


def _collapse(widths: list[int], max_width: int) -> list[int]:
    """rich/table.py Table._collapse_widths with every column wrappable: narrow the widest columns first."""
    total = sum(widths)
    excess = total - max_width
    while total and excess > 0:
        widest = max(widths)
        second = max((w for w in widths if w != widest), default=0)
        ratios = [1 if w == widest else 0 for w in widths]
        if not widest - second:
            break
        widths = _ratio_reduce(excess, ratios, [min(excess, widest - second)] * len(widths), widths)
        total = sum(widths)
        excess = total - max_width
    return widths


class Table:
    """The part of rich.table.Table that the reports use, drawn as rich draws it (box HEAVY_HEAD, padding 0 1)."""

    def __init__(self, title: str | None = None, caption: str | None = None, show_header: bool = True) -> None:
        self.title, self.caption, self.show_header = title, caption, show_header
        self.columns: list[tuple[str, str, dict[str, Any]]] = []
        self.rows: list[tuple[tuple[str, ...], dict[str, Any]]] = []

    def add_column(self, header: str = "", justify: str = "left", **kwargs: Any) -> None:
        if set(kwargs) - {"style"} or justify not in ("left", "right", "center"):
            raise TypeError(f"plaintext.Table.add_column: unsupported {sorted(kwargs)} or justify {justify!r}")
        self.columns.append((header, justify, kwargs))

    def add_row(self, *cells: str | None, **kwargs: Any) -> None:
        if set(kwargs) - {"style"}:
            raise TypeError(f"plaintext.Table.add_row: unsupported {sorted(kwargs)}")
        cells = cells + ("",) * (len(self.columns) - len(cells))
        if len(cells) > len(self.columns):
            raise Unsupported("more cells than columns")  # rich adds columns
        self.rows.append((tuple("" if c is None else c for c in cells), kwargs))

    def to_rich(self) -> Any:
        """The same table as a rich Table (the fallback)."""
        from rich.table import Table as RichTable

        table = RichTable(title=self.title, caption=self.caption, show_header=self.show_header)
        for header, justify, kwargs in self.columns:
            table.add_column(header, justify=justify, **kwargs)  # type: ignore[arg-type]
        for cells, kwargs in self.rows:
            table.add_row(*cells, **kwargs)
        return table

    def _grid(self) -> list[list[str]]:
        """Every cell's plain text, the header first when shown."""
        grid = [[_plain(c) for c in cells] for cells, _ in self.rows]
        if self.show_header:
            grid.insert(0, [_plain(header) for header, _, _ in self.columns])
        return grid

    def _widths(self, grid: list[list[str]], max_width: int) -> list[int]:
        """rich/table.py _calculate_column_widths (no expand, no fixed widths): cell widths with their padding."""
        if max_width < 3:
            raise Unsupported("no room for a column")
        # a cell measures its longest line plus its padding; the table's width limit caps it
        # (a column without cells, as without header and rows, takes the whole width: Table._measure_column)
        widths = [min(max(len(row[i]) for row in grid) + 2, max_width) if grid else max_width
                  for i in range(len(self.columns))]
        if sum(widths) > max_width:
            widths = _collapse(widths, max_width)
            if sum(widths) > max_width or any(w < 3 for w in widths):
                raise Unsupported("rich reduces every column evenly here")
        return widths

    def lines(self, width: int) -> list[str]:
        """The table's lines at console width ``width``."""
        if not self.columns:
            raise Unsupported("a table without columns")
        grid = self._grid()
        widths = self._widths(grid, width - (len(self.columns) + 1))
        table_width = sum(widths) + len(self.columns) + 1
        box = _HEAVY_HEAD if self.show_header else _SQUARE
        out = []
        if self.title:
            out += wrap(_plain(self.title), table_width, "center")
        top = box[0]
        out.append(top[0] + top[2].join(top[1] * w for w in widths) + top[3])
        for index, row in enumerate(grid):
            out += self._row_lines(row, widths, box[1] if index == 0 else box[3], self.show_header and index == 0)
            if index == 0 and self.show_header:
                rule = box[2]
                out.append(rule[0] + rule[2].join(rule[1] * w for w in widths) + rule[3])
        bottom = box[4]
        out.append(bottom[0] + bottom[2].join(bottom[1] * w for w in widths) + bottom[3])
        if self.caption:
            out += wrap(_plain(self.caption), table_width, "center")
        return out

    def _row_lines(self, row: Sequence[str], widths: Sequence[int], bars: str, header: bool) -> list[str]:
        """One row: each cell wrapped to its column (padding 1 each side), top-aligned (a header bottom-aligned)."""
        cells = [[f" {line} " for line in wrap(text, w - 2, justify, "ellipsis")]  # (rich Column's overflow)
                 for text, w, (_, justify, _) in zip(row, widths, self.columns)]
        height = max(len(c) for c in cells)
        for c, w in zip(cells, widths):
            blank = [" " * w] * (height - len(c))
            c[:] = blank + c if header else c + blank
        return [bars[0] + bars[1].join(c[i] for c in cells) + bars[2] for i in range(height)]


def _rich_width() -> int:
    """rich/console.py Console.size for a console that is not a terminal: the first standard stream's terminal
    width, COLUMNS when set, else 80."""
    width = None
    for fd in (0, 1, 2):
        try:
            width = os.get_terminal_size(fd).columns
        except (AttributeError, ValueError, OSError):
            continue
        break
    columns = os.environ.get("COLUMNS")
    if columns is not None and columns.isdigit():
        width = int(columns)
    return width or 80


class Console:
    """Prints tables and markup lines to sys.stdout as a rich Console(width=...) prints them to a pipe; hands
    anything else to one."""

    Table = Table

    def __init__(self, width: int) -> None:
        self.width = width
        self._rich: Any = None

    def _fallback(self) -> Any:
        if self._rich is None:
            from rich.console import Console as RichConsole

            self._rich = RichConsole(width=self.width)
        return self._rich

    def print(self, *objects: Any, **options: Any) -> None:
        """rich's Console.print for one table or string with ``highlight``, ``soft_wrap``, ``style`` (no colour
        here) or ``markup``; anything else goes to rich as given."""
        try:
            if len(objects) > 1 or set(options) - {"highlight", "soft_wrap", "style", "markup"}:
                raise Unsupported("several objects or other options")
            obj = objects[0] if objects else ""
            if isinstance(obj, Table):
                lines = obj.lines(self.width)
            elif isinstance(obj, str):
                text = _plain(obj, markup=options.get("markup") is not False)
                lines = [text] if options.get("soft_wrap") else wrap(text, self.width, "default")
            else:
                raise Unsupported(type(obj).__name__)
        except Unsupported:
            self._fallback().print(*(o.to_rich() if isinstance(o, Table) else o for o in objects), **options)
            return
        sys.stdout.write("".join(line + "\n" for line in lines))


def console(minimum_width: int) -> Any:
    """A console for the reports, at least ``minimum_width`` wide: this module's when stdout is not a terminal
    (and rich would print no colour: no FORCE_COLOR or TTY_COMPATIBLE; UTF-8), else rich's."""
    stream = sys.stdout
    isatty = getattr(stream, "isatty", None)
    try:
        terminal = bool(isatty and isatty())
    except ValueError:  # a closed stream: rich treats it as no terminal too
        terminal = False
    encoding = (getattr(stream, "encoding", None) or "utf-8").lower().replace("-", "")
    if terminal or os.environ.get("FORCE_COLOR") is not None or os.environ.get("TTY_COMPATIBLE", "") == "1" \
            or encoding != "utf8" or "idlelib" in sys.modules:
        from rich.console import Console as RichConsole

        return RichConsole(width=max(minimum_width, RichConsole().width))
    return Console(max(minimum_width, _rich_width()))


def table_class(target: Any) -> Any:
    """The Table class that goes with a console: this module's for its Console, else rich's."""
    if isinstance(target, Console):
        return Table
    from rich.table import Table as RichTable

    return RichTable
