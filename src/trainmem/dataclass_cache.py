"""The bytecode of trainmem's dataclass methods, kept between runs as Python keeps a module's bytecode in ``.pyc``.

``@dataclass`` writes each class's ``__init__``, ``__repr__``, ``__eq__``, ``__hash__`` and (frozen) ``__setattr__``
and ``__delattr__`` as source text and runs it with ``exec`` (dataclasses.py, ``_create_fn``; Python 3.13's
``_FuncBuilder.add_fns_to_class`` likewise). Parsing and compiling that text is most of the time it takes to import
trainmem: about 190 of the 300 million instructions of ``import trainmem`` on CPython 3.11 (callgrind, 2026-12-02),
the parser alone 142 million. A ``.pyc`` cannot hold it, since the text is made at import time.

``install()`` gives the dataclasses module an ``exec`` of its own (a module global, found before the builtin; nothing
else in the process sees it) that compiles a text once and keeps the code object, keyed by the exact text, in a
marshal file beside the package's ``.pyc`` files. The code object is the one ``exec`` would compile (the same text,
file name ``"<string>"``, no inherited ``__future__`` flags), so the classes are the same; only texts run in the
namespace of a trainmem module are kept (other libraries' dataclasses are compiled as before). The file is written
at exit, whole and renamed, only where new texts were compiled and bytecode may be written (``sys.dont_write_bytecode``
as for ``.pyc``); a file of another interpreter, or one that cannot be read, is ignored.
"""

from __future__ import annotations

import builtins
import marshal
import os
import sys
from pathlib import Path
from typing import Any

_HEADER = f"trainmem dataclass code 1 {sys.implementation.cache_tag} {sys.version}"
"""The file's first entry: code objects are read only by the interpreter that wrote them."""
MAX_ENTRIES = 4000
"""Beyond this many texts (old versions of the classes pile up while the code is edited), the file is rewritten
with only the texts the writing process used."""

_codes: dict[str, Any] = {}
_used: set[str] = set()
_state = {"new": 0, "loaded": False}


def cache_path() -> Path:
    return Path(__file__).parent / "__pycache__" / f"dataclasses.{sys.implementation.cache_tag}.marshal"


def _load() -> None:
    _state["loaded"] = True
    try:
        with open(cache_path(), "rb") as f:
            header, codes = marshal.loads(f.read())  # (marshal.load reads a file a few bytes at a time)
    except (OSError, EOFError, ValueError, TypeError):
        return
    if header == _HEADER and isinstance(codes, dict):
        _codes.update(codes)


def _exec(source: Any, globals: dict[str, Any] | None = None, locals: dict[str, Any] | None = None) -> None:
    """``exec`` for the dataclasses module: a text run in a trainmem module's namespace is compiled once."""
    if isinstance(source, str) and globals is not None and str(globals.get("__name__", "")).startswith("trainmem"):
        if not _state["loaded"]:
            _load()
        code = _codes.get(source)
        if code is None:
            code = _codes[source] = compile(source, "<string>", "exec", dont_inherit=True)
            _state["new"] += 1
        _used.add(source)
        source = code
    builtins.exec(source, globals, locals)


def save() -> None:
    """Write the cache if this process compiled texts it did not hold (atexit)."""
    if not _state["new"] or sys.dont_write_bytecode:
        return
    path = cache_path()
    codes = _codes if len(_codes) <= MAX_ENTRIES else {k: _codes[k] for k in _used}
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(exist_ok=True)
        with open(temporary, "wb") as f:
            marshal.dump((_HEADER, codes), f)
        os.replace(temporary, path)
    except OSError:  # (a read-only install: the texts are compiled each time, as without the cache)
        try:
            temporary.unlink()
        except OSError:
            pass
    _state["new"] = 0


def install() -> None:
    """Route the dataclasses module's ``exec`` through the cache (once per process)."""
    import atexit
    import dataclasses

    if getattr(dataclasses, "exec", None) is not _exec:
        setattr(dataclasses, "exec", _exec)
        atexit.register(save)
