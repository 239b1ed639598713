"""Reading JSON input files and writing output files, with one clear error each.

Every file optmem reads (chain files, plan files) goes through :func:`read_json`, and every
file it writes (``solve -o``, chain files, sweep tables, pictures) through
:func:`write_atomic`: a file that cannot be read, is not UTF-8, is not JSON or nests too
deeply gives one :class:`~optmem.errors.OptmemInputError` naming the file; an output that
cannot be written gives one naming the file and the reason, and leaves nothing behind (the
data goes to a temporary file in the same directory, renamed over the target only once
complete). Core module: imports nothing else of optmem but :mod:`optmem.errors`.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optmem.errors import OptmemInputError


def read_json(path: str | Path, *, error: type[OptmemInputError] = OptmemInputError,
              what: str = "file") -> Any:
    """Read and parse the JSON file ``path``.

    Parameters
    ----------
    path
        The file.
    error
        The exception class raised (``ChainError``, ``PlanError``, ...).
    what
        What the file is, for the message (``"chain file"``).

    Raises
    ------
    OptmemInputError
        (of class ``error``) naming ``path``: unreadable (missing, a directory, no
        permission), not UTF-8, not JSON, nested too deeply, or a number with too many digits.

    Examples
    --------
    >>> read_json("/nonexistent.json", what="chain file")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    optmem.errors.OptmemInputError: /nonexistent.json: cannot read chain file (No such file...)
    """
    if not isinstance(path, str | os.PathLike):
        raise error(f"expected the path of a {what}, got {type(path).__name__}")
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} ({exc.strerror or exc})", source=str(path)) from None
    except ValueError as exc:  # a NUL byte in the name
        raise error(f"cannot read {what} ({exc})", source=repr(str(path))) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                    f"a {what} is UTF-8 JSON", source=str(path)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
                    source=str(path)) from None
    except RecursionError:
        raise error("not valid JSON here: arrays or objects nested too deeply",
                    source=str(path)) from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise error(f"not valid JSON here ({exc})", source=str(path)) from None


def _temporary_name(target: Path) -> Path:
    """A fresh name beside ``target`` that keeps its suffix (short: never too long).

    The suffix is lower-cased: writers that pick a format by suffix (CP-SAT writes text
    for a name ending in ``txt``, not ``TXT``) see ``m.PBTXT`` as ``m.pbtxt``.
    """
    suffix = target.suffix.lower()
    return target.parent / f".optmem-{os.getpid()}-{secrets.token_hex(4)}.tmp{suffix}"


def _create(tmp: Path, path: str | Path, field: str) -> None:
    """Create ``tmp`` empty (mode 0666 minus the umask, unlike ``mkstemp``'s 0600).

    ``path`` itself is looked up first: ``tmp`` has a short name, so a name too long for
    the file system only failed at the final rename (``sweep --csv ok.csv --json
    <300 x>.json`` passed its check of every output, solved, wrote the CSV and then exited
    2 with the CSV left behind, until stop 53).
    """
    target = Path(path)
    if str(path).endswith(os.sep) or os.path.isdir(target):
        raise OptmemInputError("cannot write the file: it is a directory", source=str(path),
                               field=field)
    try:
        os.lstat(target)
    except FileNotFoundError:
        pass  # the usual case: a new file
    except OSError as exc:  # name too long, a loop, no permission to look
        raise OptmemInputError(f"cannot write the file ({exc.strerror or exc})",
                               source=str(path), field=field) from None
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:
        raise OptmemInputError(f"cannot write the file ({exc.strerror or exc})",
                               source=str(path), field=field) from None


def check_writable(path: str | Path, *, field: str = "output") -> None:
    """Fail now, before any work, if ``path`` could not be written.

    Creates and removes a temporary file beside ``path``; ``path`` itself is not touched.

    Raises
    ------
    OptmemInputError
        As :func:`write_atomic` would.
    """
    tmp = _temporary_name(Path(path))
    _create(tmp, path, field)
    tmp.unlink(missing_ok=True)


def write_atomic(path: str | Path, write: Callable[[Path], None], *,
                 field: str = "output") -> Path:
    """Write ``path`` all at once: ``write(tmp)`` fills a temporary file, renamed over it.

    The temporary file sits in the same directory and keeps the suffix (so writers that
    pick a format by suffix, such as matplotlib, still work). On any error the temporary
    file is removed and ``path`` is left as it was.

    Raises
    ------
    OptmemInputError
        Naming ``path`` and ``field`` when the file cannot be written (no such directory,
        a directory in the way, no permission, disk full, name too long).
    """
    target = Path(path)
    tmp = _temporary_name(target)
    _create(tmp, path, field)
    try:
        write(tmp)
        os.replace(tmp, target)
    except OSError as exc:
        raise OptmemInputError(f"cannot write the file ({exc.strerror or exc})",
                               source=str(path), field=field) from None
    except OptmemInputError as exc:  # the writer's own message names the target, not tmp
        raise OptmemInputError(exc.reason.replace(tmp.name, target.name), source=exc.source,
                               stage=exc.stage, field=exc.field) from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def write_text_atomic(path: str | Path, text: str, *, field: str = "output") -> Path:
    """Write ``text`` (UTF-8) to ``path`` with :func:`write_atomic`."""
    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    return write_atomic(path, write, field=field)
