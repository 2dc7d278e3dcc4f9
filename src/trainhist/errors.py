"""One exception hierarchy for everything trainhist raises on purpose.

Every error has a stable ``code`` (a short snake_case string that scripts and the conformance suite match on),
and, where it concerns a file, the ``path`` and byte ``offset`` it was found at. Messages say what was expected,
what was found, where, and how to fix it.
"""

from __future__ import annotations

import errno
import os

__all__ = [
    "TrainhistError",
    "FormatError",
    "CorruptError",
    "UnsupportedError",
    "LimitError",
    "SchemaError",
    "MergeError",
    "UsageError",
    "ReadOnlyError",
    "NotFoundError",
    "NotAFileError",
    "DirectoryError",
    "PermissionDeniedError",
    "truncation_hint",
]


class TrainhistError(Exception):
    """Base class of every error trainhist raises deliberately."""

    code: str = "error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        path: str | None = None,
        offset: int | None = None,
    ) -> None:
        self.code = code or type(self).code
        self.path = None if path is None else str(path)
        self.offset = offset
        self.message = message
        where = []
        if self.path is not None:
            where.append(self.path)
        if offset is not None:
            where.append(f"offset {offset}")
        prefix = f"[{self.code}] " + (f"{', '.join(where)}: " if where else "")
        super().__init__(prefix + message)


class FormatError(TrainhistError):
    """The bytes are not a valid trainhist file (base of all file-content errors)."""

    code = "format"


class CorruptError(FormatError):
    """Committed data fails a check (CRC, salt, sequence, bounds): the file was damaged after it was written."""

    code = "corrupt"


class UnsupportedError(FormatError):
    """The file needs a newer reader: a newer read version, a required feature, record type or column."""

    code = "unsupported"


class LimitError(FormatError):
    """A declared size exceeds a limit of the spec (section 'Limits'); nothing was allocated for it."""

    code = "limit"


class SchemaError(FormatError):
    """A JSON manifest does not validate against its published schema."""

    code = "schema"


class MergeError(TrainhistError):
    """Inputs cannot be merged or coarsened as asked (overlapping writers, incompatible grids, replica divergence)."""

    code = "merge"


class UsageError(TrainhistError, ValueError):
    """The caller asked for something the API does not allow (bad argument, unknown site, closed writer)."""

    code = "usage"


class ReadOnlyError(TrainhistError):
    """The file may be read but not appended to: a newer writer version wrote it (``read_only``), or it has no run
    manifest for a resumed writer to continue (``no_run_manifest``)."""

    code = "read_only"


class _PathError(TrainhistError):
    """A trainhist error that is also the :class:`OSError` the operating system would have raised for its path:
    ``errno`` (:attr:`ERRNO`), ``strerror`` and ``filename`` set as it sets them, and ``str()`` the trainhist
    message (not OSError's "[Errno 2] ...")."""

    ERRNO = errno.EINVAL
    errno: int | None  # (as OSError declares them)
    strerror: str | None
    filename: str | None

    def __init__(self, message: str, *, code: str | None = None, path: str | None = None,
                 offset: int | None = None) -> None:
        super().__init__(message, code=code, path=path, offset=offset)
        self.errno, self.strerror, self.filename = self.ERRNO, os.strerror(self.ERRNO), self.path

    def __str__(self) -> str:
        return str(self.args[0])


class NotFoundError(_PathError, FileNotFoundError):
    """The path names no file (code ``not_found``). Also a :class:`FileNotFoundError` (``errno`` ENOENT,
    ``filename`` the path), so that ``except FileNotFoundError`` keeps catching it."""

    code = "not_found"
    ERRNO = errno.ENOENT


class NotAFileError(_PathError, OSError):
    """The path names a directory, pipe, socket or device where a regular file is needed (code ``not_a_file``).
    Also an :class:`OSError` (an :class:`IsADirectoryError` for a directory: see :func:`not_a_file`), with ``errno``
    and ``filename`` set as the OS error would have them."""

    code = "not_a_file"


class DirectoryError(NotAFileError, IsADirectoryError):
    """A :class:`NotAFileError` whose path is a directory."""

    ERRNO = errno.EISDIR


class PermissionDeniedError(_PathError, PermissionError):
    """The operating system denies this process the access to the path that is needed (code
    ``permission_denied``). Also a :class:`PermissionError` (``errno`` EACCES, ``filename`` the path)."""

    code = "permission_denied"
    ERRNO = errno.EACCES


def path_problem(path: str, e: OSError | ValueError, doing: str) -> TrainhistError | None:
    """The trainhist error of an ``open`` of ``path`` that failed with ``e`` while ``doing`` (e.g. "write the
    history"), for the failures whose cause is the path: a folder of it that is a file, a denied permission, a NUL
    character; None for the others."""
    if isinstance(e, NotADirectoryError):
        part = os.path.abspath(path)
        while part != os.path.dirname(part) and not os.path.isfile(part):
            part = os.path.dirname(part)
        return NotFoundError(f"cannot {doing}: {part} is a file, not a folder, so nothing can be found under it; give "
                             "a path whose folders are folders", path=path)
    if isinstance(e, PermissionError):
        return PermissionDeniedError(f"cannot {doing}: permission denied (this process may not open the file, or "
                                     "search or write its folder); give a path it may use, or change the "
                                     "permissions", path=path)
    if isinstance(e, ValueError):  # (os.open: "embedded null byte")
        return UsageError(f"cannot {doing}: the path holds a NUL character ({e}); a path cannot hold one",
                          code="bad_path", path=repr(path))
    return None


def not_a_file(message: str, *, path: str, directory: bool) -> NotAFileError:
    """The :class:`NotAFileError` of ``path`` (a :class:`DirectoryError` when it is a directory)."""
    return (DirectoryError if directory else NotAFileError)(message, path=path)


def truncation_hint(offset: int) -> str:
    """What to append to the message of a record that fails its CRC at ``offset``: how to recover the commits
    before it (spec/crash-safety.md: truncating the file at the offset the error names gives them back)."""
    return (f"; the commits before this record can be recovered: truncate a copy of the file to {offset} bytes, the "
            f"offset named here (e.g. truncate -s {offset} FILE), and read that: it keeps every commit before this "
            "record and drops this record, its commit and every later one; should the copy report another damaged "
            "record, truncate it again at the offset that one names (spec/crash-safety.md; a machine that lost "
            "power while the record was written leaves it so, and then nothing after it was committed)")
