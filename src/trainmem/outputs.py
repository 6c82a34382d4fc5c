"""The files trainmem writes (``--plot``, ``--snapshot``, ``validate -o``, ``plan --out``): each path checked in one
line before any work, each file written whole or not at all.

:func:`check_output_file` and :func:`check_output_dir` refuse, before the command does anything slow, a path that
could not be written or that would write somewhere unexpected: an empty name, a name over 255 bytes, a dangling
symbolic link or a loop, a folder where a file goes (or a file where a folder goes), a FIFO or a device (opening a
FIFO blocks), anything under ``/proc``, ``/sys`` or ``/dev``, and a folder the user cannot create files in (tried
by creating one). :func:`replacing` then has the writer write a temporary file beside the target, which is renamed
over it (``os.replace``, atomic on one file system) only once it is complete, so an error or an interrupt leaves the
old file, never half a new one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Iterator

from .errors import ConfigError

NAME_MAX = 255
"""Bytes in one file name (Linux's NAME_MAX, macOS's too)."""
PATH_MAX = 4096
PSEUDO_FILE_SYSTEMS = ("/proc", "/sys", "/dev")
"""Kernel interfaces, not places for a report or a picture."""
READ_LIMIT = 64 * 2**20
"""The largest existing report read back (validate keeps its other sections)."""


def _shown(path: str) -> str:
    text = repr(path)
    return text if len(text) <= 80 else text[:60] + f"...({len(path)} characters)'"


def _common_checks(path: str | os.PathLike[str] | None, flag: str) -> Path:
    if path is None:
        raise ConfigError(f"{flag} needs a path")
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise ConfigError(f"{flag} must be a path, got {type(path).__name__}")
    if not path.strip():
        raise ConfigError(f"{flag} is empty: give a path to write")
    if "\0" in path:
        raise ConfigError(f"{flag} {_shown(path)}: a path cannot hold a NUL character")
    try:
        encoded = os.fsencode(path)
    except UnicodeError:
        raise ConfigError(f"{flag} {_shown(path)}: not a valid file name on this system") from None
    if len(encoded) > PATH_MAX:
        raise ConfigError(f"{flag}: a path of {len(encoded):,} bytes; at most {PATH_MAX:,} are accepted")
    for part in encoded.split(b"/"):
        if len(part) > NAME_MAX:
            raise ConfigError(f"{flag} {_shown(path)}: a file or folder name of {len(part)} bytes; at most "
                              f"{NAME_MAX} are accepted")
    target = Path(path).expanduser()
    if target.is_symlink():
        try:
            target.stat()
        except OSError as exc:
            what = ("a symbolic link loop" if exc.errno == errno.ELOOP
                    else "a dangling symbolic link (it points to nothing)")
            raise ConfigError(f"{flag} {_shown(path)} is {what}; give a path to a file that can be written") \
                from None
    real = os.path.realpath(target)
    for top in PSEUDO_FILE_SYSTEMS:
        if real == top or real.startswith(top + "/"):
            raise ConfigError(f"{flag} {_shown(path)} is under {top}, a kernel interface: give a path on a file "
                              "system")
    return Path(real)


def _probe(folder: Path, flag: str, path: str | os.PathLike[str]) -> None:
    """Create and remove a file in ``folder``: the one sure test that the command's write will be allowed."""
    probe = folder / f".trainmem-probe-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        raise ConfigError(f"{flag} {_shown(os.fspath(path))}: cannot write in the folder {_shown(str(folder))} "
                          f"({exc.strerror or exc})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def check_output_file(path: str | os.PathLike[str] | None, flag: str, suffix: str | None = None) -> Path:
    """The real path ``flag`` will write (a symbolic link to a file is followed), refused in one line if it cannot
    be written: see the module's docstring. ``suffix`` (e.g. ``.png``) is required when given."""
    target = _common_checks(path, flag)
    assert path is not None  # (_common_checks refused None)
    shown = _shown(os.fspath(path))
    if suffix is not None and target.suffix.lower() != suffix and Path(os.fspath(path)).suffix.lower() != suffix:
        raise ConfigError(f"{flag} writes a {suffix[1:].upper()} file: give a path ending in {suffix}, got {shown}")
    _check_folder(target.parent, flag, shown)
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise ConfigError(f"{flag} {shown}: {exc.strerror or exc}") from None
    if mode is not None:
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{flag} {shown} is a folder; give a file path")
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{flag} {shown} is not a regular file (a FIFO, a device or a socket); give a file "
                              "path")
        if not os.access(target, os.W_OK):
            raise ConfigError(f"{flag} {shown} is read-only")
    _probe(target.parent, flag, path)
    return target


def _check_folder(folder: Path, flag: str, shown: str) -> None:
    if folder.is_dir():
        return
    if folder.exists():
        raise ConfigError(f"{flag} {shown}: {_shown(str(folder))} is a file, not a folder")
    raise ConfigError(f"{flag} {shown}: the folder {_shown(str(folder))} does not exist")


def check_output_dir(path: str | os.PathLike[str] | None, flag: str) -> Path:
    """The real path of the folder ``flag`` will write files into (created if missing, in an existing folder),
    refused in one line if it cannot be."""
    target = _common_checks(path, flag)
    assert path is not None  # (_common_checks refused None)
    shown = _shown(os.fspath(path))
    if target.exists():
        if not target.is_dir():
            raise ConfigError(f"{flag} {shown} is a file; give a folder")
        _probe(target, flag, path)
        return target
    _check_folder(target.parent, flag, shown)
    _probe(target.parent, flag, path)
    return target


@contextlib.contextmanager
def replacing(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target`` (same suffix, so a writer that goes by it still does) for the writer
    to write; once the block ends without an error, move it over ``target``. An error removes it and leaves
    ``target`` as it was. A block that writes nothing leaves ``target`` untouched too."""
    target = Path(target)
    suffix = target.suffix if len(target.suffix) <= 16 else ""
    temporary = target.with_name(f".trainmem-{secrets.token_hex(6)}.tmp{suffix}")
    # Created by os.open with 0o666 so the file gets the umask's mode, as any new file does (tempfile's are 0600).
    try:
        os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except OSError as exc:
        raise ConfigError(f"{_shown(str(target))}: could not be written ({exc.strerror or exc})") from None
    try:
        yield temporary
        if temporary.stat().st_size == 0:
            temporary.unlink()
            return
        with contextlib.suppress(OSError):
            if target.exists():
                os.chmod(temporary, stat.S_IMODE(target.stat().st_mode))
        os.replace(temporary, target)
    except OSError as exc:  # (a full disk, a quota, the folder removed meanwhile)
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise ConfigError(f"{_shown(str(target))}: could not be written ({exc.strerror or exc}); "
                          f"{'the old file is kept' if target.exists() else 'nothing was written'}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def write_text(target: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``target`` whole or not at all."""
    with replacing(target) as temporary:
        temporary.write_text(text, encoding="utf-8")


def read_existing_text(target: str | os.PathLike[str], flag: str) -> str | None:
    """The UTF-8 text of a file about to be rewritten (None if there is none), refused in one line if it is not a
    regular file, is larger than READ_LIMIT or is not UTF-8."""
    target = Path(target)
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"{flag} {_shown(str(target))}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{flag} {_shown(str(target))} is not a regular file; give a file path")
    try:
        with open(target, "rb") as handle:
            data = handle.read(READ_LIMIT + 1)
    except OSError as exc:
        raise ConfigError(f"{flag} {_shown(str(target))}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > READ_LIMIT:
        raise ConfigError(f"{flag} {_shown(str(target))} is over {READ_LIMIT // 2**20} MiB: not a report trainmem "
                          "wrote")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag} {_shown(str(target))} exists and is not UTF-8 text (byte {exc.start}): not a report "
                          "trainmem wrote; give another path or remove it") from None
