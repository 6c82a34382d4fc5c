"""trainmem.plaintext draws tables and lines to a pipe exactly as rich does: compared with rich itself on the
estimate reports and on random tables (rich is the reference, so a difference in wrapping, widths, justification,
box characters or markup fails here)."""

import io
import sys

import pytest
from hypothesis import given, settings, strategies as st
from rich.console import Console as RichConsole
from rich.table import Table as RichTable

from trainmem import plaintext
from trainmem.catalog import catalog_spec
from trainmem.stepmodel import estimate_model
from trainmem.hardware import GPUS
from trainmem.report import render_estimate
from trainmem.settings import make_settings


def _plain_output(width: int, draw) -> str:
    out = io.StringIO()
    old, sys.stdout = sys.stdout, out
    try:
        draw(plaintext.Console(width), plaintext.Table)
    finally:
        sys.stdout = old
    return out.getvalue()


def _rich_output(width: int, draw) -> str:
    out = io.StringIO()
    draw(RichConsole(file=out, width=width), RichTable)
    return out.getvalue()


@pytest.mark.parametrize("name, options, width", [
    ("llama-2-7b", {}, 120),
    ("llama-2-7b", {"recipe": "amp-bf16", "attention": "eager", "checkpointing": "full"}, 120),
    ("mixtral-8x7b", {"batch": 4, "seq": 4096}, 80),
    ("gpt2", {"recipe": "fp32"}, 200),
    ("llama-3-8b", {"checkpointing": "full"}, 100),
])
@pytest.mark.parametrize("explain", [False, True])
def test_estimate_report_matches_rich(name, options, width, explain):
    est = estimate_model(catalog_spec(name), make_settings(**options))
    gpu = GPUS["A100-80GB"]
    plain = _plain_output(width, lambda console, _: render_estimate(est, "GiB", console, gpu, explain))
    rich = _rich_output(width, lambda console, _: render_estimate(est, "GiB", console, gpu, explain))
    assert plain == rich
    assert "┏" in plain and "GiB" in plain  # (drawn by this module: no fallback to rich here)


_words = st.text(alphabet="abcdefgxyz0123456789.,()-+/ ", min_size=0, max_size=40)
_markup = st.sampled_from(["", "[bold]", "[dim]", "[green]"])


@st.composite
def _tables(draw):
    columns = draw(st.lists(st.tuples(_words, st.sampled_from(["left", "right", "center"])), min_size=1, max_size=6))
    rows = draw(st.lists(st.lists(st.tuples(_markup, _words), min_size=len(columns), max_size=len(columns)),
                         max_size=5))
    return (draw(st.one_of(st.none(), _words.filter(str.strip))), draw(st.one_of(st.none(), _words.filter(str.strip))),
            draw(st.booleans()), columns, rows)


@settings(max_examples=150, deadline=None)
@given(_tables(), st.integers(20, 140))
def test_random_tables_match_rich(spec, width):
    title, caption, show_header, columns, rows = spec

    def draw(console, table_class):
        table = table_class(title=title, caption=caption, show_header=show_header)
        for header, justify in columns:
            table.add_column(header, justify=justify)
        for row in rows:
            table.add_row(*(f"{tag}{text}{tag.replace('[', '[/')}" for tag, text in row))
        console.print(table)

    assert _plain_output(width, draw) == _rich_output(width, draw)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_markup, _words), max_size=8), st.integers(10, 130), st.booleans(),
       st.sampled_from([{}, {"markup": False}, {"markup": True}, {"style": "bold"}]))
def test_random_lines_match_rich(pieces, width, soft_wrap, options):
    text = "".join(f"{tag}{words}{tag.replace('[', '[/')}" for tag, words in pieces)

    def draw(console, _):
        console.print(text, highlight=False, soft_wrap=soft_wrap, **options)

    assert _plain_output(width, draw) == _rich_output(width, draw)


def test_what_it_does_not_draw_goes_to_rich(capsys):
    console = plaintext.Console(60)
    console.print("two", "objects", end="|")  # (options it does not take: rich prints them)
    assert capsys.readouterr().out == "two objects|"
    console.print("an emoji code :smile: and a wide character \u4e2d")
    table = plaintext.Table(title="t")
    table.add_column("a")
    table.add_row("\u4e2d\u6587")
    console.print(table)
    out = capsys.readouterr().out
    assert "\U0001f604" in out and "\u4e2d\u6587" in out  # rich replaced the emoji and measured the wide characters
