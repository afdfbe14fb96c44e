"""Writing the user's files: whole or not at all, with the user's own permissions.

Plans, reports, traces and profiles are written to a temp file beside the destination and
renamed over it, so a reader sees the old file or the new one and an interrupted write
leaves nothing; a path that cannot hold a file (a folder, a FIFO, a missing folder) is
refused before anything is written.
"""

from __future__ import annotations

import os
import tempfile

from autopar.errors import AutoparError, ErrorKind


def user_mode(mode: int) -> int:
    """``mode`` (0o666 for a file, 0o777 for a folder) under the process's umask: what any file
    the user writes gets (0644 under umask 022), for one made by mkstemp/mkdtemp (0600/0700).
    The umask can only be read by setting it: portable, and the instant it is 0 matters only
    to files another thread creates at that instant."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def output_problem(path: str | os.PathLike) -> str | None:
    """Why autopar cannot write a file at ``path`` (None when it can): an empty path, a folder,
    something that is not a regular file (a FIFO, a device), a missing or read-only folder.
    A symlink is followed: its target is written, the link kept."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        return f"output path {path!r} names no file; give a file path such as plan.json"
    target = os.path.realpath(os.fspath(path))
    if os.path.isdir(target):
        return f"output {os.fspath(path)} is a folder; give a file path, e.g. {os.path.join(os.fspath(path), 'plan.json')}"
    if os.path.exists(target) and not os.path.isfile(target):
        return (f"output {os.fspath(path)} is not a regular file (a FIFO, device or socket); autopar writes a file "
                "whole and renames it into place: give the path of a regular file")
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        return f"cannot write {os.fspath(path)}: folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write {os.fspath(path)}: folder {folder} is not writable"
    return None


def atomic_write_text(path: str | os.PathLike, text: str | bytes) -> None:
    """Write ``text`` (or bytes) to a temp file in the same directory, then rename it over
    ``path``: readers see the old file or the new one, never half of one, and an interrupted
    write leaves nothing behind.
    A symlink at ``path`` keeps pointing at the (new) file; a path that cannot hold a file is
    refused before anything is written (:func:`output_problem`)."""
    problem = output_problem(path)
    if problem:
        raise AutoparError(ErrorKind.BAD_INPUT, problem)
    path = os.path.realpath(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".autopar-", suffix=".tmp", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.chmod(tmp, user_mode(0o666))  # mkstemp makes the file 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
