"""Writing an output file so that it is either the old one or complete, never partial.

Three kinds of path, told apart by `OutputTarget`:

- an ordinary file (or a path that does not exist yet): written to a temporary file
  beside it and renamed over it at the end. A symlink is written through: the file it
  points to is replaced, the link stays. Missing parent folders are created.
- a special file (`/dev/null`, `/dev/full`, a FIFO, a terminal): written directly,
  never renamed over (run as root, a rename would turn a device node into a file).
- the process's own streams (`/dev/stdout`, `/dev/stderr`, `/dev/fd/N`,
  `/proc/self/fd/N`): written to that file descriptor, so that the output lands where
  the stream goes (a pipe, a terminal, or the file of a shell redirection, at its
  current position) and nothing is truncated or replaced.

`check_output_path` tells before any work whether a path can be written (and why
not); the CLI calls it for every output flag first.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_STREAM = re.compile(r"^/(?:dev/(?:stdout|stderr|fd/\d+)|proc/self/fd/\d+)$")


class OutputPathError(ValueError):
    """The path cannot be written; the message says why (the caller adds which flag)."""


def _stream_fd(path: Path) -> int | None:
    text = os.path.abspath(path)
    if not _STREAM.match(text):
        return None
    name = text.rsplit("/", 1)[-1]
    return {"stdout": 1, "stderr": 2}.get(name) if not name.isdigit() else int(name)


def _special(path: Path) -> bool:
    """An existing path (after symlinks) that is not a regular file or a folder: a device, FIFO, socket."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_output_path(path: str | os.PathLike[str]) -> None:
    """Raise `OutputPathError` if `write_atomically(path, ...)` cannot succeed; changes nothing.

    Ordinary files are probed by creating (and removing) a temporary file or folder where
    the output would go, so that read-only file systems and permissions are found too.
    """
    path = Path(path)
    fd = _stream_fd(path)
    if fd is not None:
        try:
            os.fstat(fd)
        except OSError:
            raise OutputPathError(f"file descriptor {fd} is not open") from None
        return
    if path.is_dir():
        raise OutputPathError("is a directory; give a file name")
    if _special(path):
        if not os.access(path, os.W_OK):
            raise OutputPathError("special file not writable")
        return
    try:
        target = Path(os.path.realpath(path))
    except OSError as error:
        raise OutputPathError(error.strerror or str(error)) from None
    if target.is_dir():
        raise OutputPathError(f"points to a directory ({target})")
    folder = target.parent
    ancestor = folder
    while not ancestor.exists():
        if ancestor == ancestor.parent:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"{ancestor} is not a directory")
    try:
        if ancestor == folder:
            fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=folder)
            os.close(fd)
            os.unlink(probe)
        else:  # the folder would be created: probe its nearest existing ancestor
            os.rmdir(tempfile.mkdtemp(prefix=".marsched.", suffix=".probe", dir=ancestor))
    except OSError as error:
        where = folder if ancestor == folder else ancestor
        raise OutputPathError(f"cannot write in {where}: {error.strerror or error}") from None
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputPathError("file not writable")


def check_output_folder(path: str | os.PathLike[str]) -> None:
    """Raise OutputPathError unless files can be written in the folder `path`: a writable directory,
    or one that can be made (checked as for a file in it; nothing is left behind)."""
    check_output_path(Path(path) / ".marsched-probe")


class AtomicFile:
    """A binary output file that appears complete at `commit`, or not at all at `discard`.

    See the module docstring for how ordinary files, special files and the process's
    streams are written.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._temporary: Path | None = None
        self._target: Path | None = None
        fd = _stream_fd(self.path)
        if fd is not None:
            for stream in (sys.stdout, sys.stderr):  # keep the order of what was printed before
                try:
                    stream.flush()
                except (OSError, ValueError, AttributeError):
                    pass
            self.file: BinaryIO = os.fdopen(os.dup(fd), "wb")
        elif _special(self.path):
            self.file = open(self.path, "wb")
        else:
            self._target = Path(os.path.realpath(self.path))  # through symlinks: the link stays
            self._target.parent.mkdir(parents=True, exist_ok=True)
            self._temporary = self._target.with_name(f".{self._target.name}.{secrets.token_hex(6)}.tmp")
            # os.open with 0o666 lets the umask decide the mode of a new file, as for any ordinary file.
            descriptor = os.open(self._temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            self.file = os.fdopen(descriptor, "wb")

    def commit(self) -> Path:
        """Finish the file: flush it and (an ordinary file) rename it into place."""
        try:
            self.file.flush()
            if self._temporary is not None:
                os.fsync(self.file.fileno())
            self.file.close()
            if self._temporary is not None and self._target is not None:
                try:  # an existing file keeps its permissions
                    os.chmod(self._temporary, stat.S_IMODE(os.stat(self._target).st_mode))
                except FileNotFoundError:
                    pass
                os.replace(self._temporary, self._target)
        except BaseException:
            self.discard()
            raise
        return self.path

    def discard(self) -> None:
        """Give up: close, and remove the temporary file (a special file keeps what was written)."""
        try:
            self.file.close()
        except OSError:
            pass
        if self._temporary is not None:
            self._temporary.unlink(missing_ok=True)


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Write `path` with `write(file)`: complete or (on any failure) left as it was.

    A failure (in `write` or on the disk) removes the temporary file and leaves `path` as it was.
    """
    output = AtomicFile(path)
    try:
        write(output.file)
    except BaseException:
        output.discard()
        raise
    return output.commit()
