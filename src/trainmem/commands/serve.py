"""`trainmem serve`: the web calculator and its API."""

from __future__ import annotations

import click

from ..cli import _console


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Port to listen on.")
def serve(host: str, port: int) -> None:
    """Serve the web calculator and its API (/docs) on HOST:PORT until interrupted (needs the web extra).

    \b
    Example: trainmem serve              # then open http://127.0.0.1:8000
    """
    from ..web import serve as run

    _console().print(f"trainmem: http://{host}:{port} (API documentation: /docs); Ctrl-C stops")
    run(host, port)
