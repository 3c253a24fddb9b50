"""Checks of the paths a user gives, before anything is loaded: a regular file where a directory is needed, a
directory under a regular file, a directory that cannot be written (permissions, a read-only file system), a file
to read that is missing. Each failure is one line naming the option, the path and why (``PathError``).

The argparse actions (``WritableDir`` ...) run the check while the command line is parsed and end the command with
that line (exit status 2, no usage text); the ``check_*`` functions are the same checks for paths given in code
(``LLM(kv_disk=...)``). The checks create nothing (a writable check creates and removes one temporary file in the
deepest directory that exists: the only test that holds for root and every file system); ``WritableFile`` then
makes the file's missing folders.
"""

from __future__ import annotations

import argparse
import errno
import os
import tempfile


class PathError(ValueError):
    """A path that cannot be used, with the one line that says why."""


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _deepest_existing(path: str, option: str, shown: str) -> str:
    """The deepest existing directory at or above ``path``; PathError when a regular file stands in the way."""
    current = path
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    if not os.path.isdir(current):
        raise PathError(f"{option} {shown}: {current} is a regular file, not a directory")
    return current


def _check_can_create_in(directory: str, option: str, shown: str) -> None:
    """PathError unless a file can be created in ``directory`` (probed: a temporary file, removed at once)."""
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            raise PathError(f"{option} {shown}: cannot write in {directory}: read-only file system")
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        why = "read-only file system" if exc.errno == errno.EROFS else (exc.strerror or str(exc)).lower()
        raise PathError(f"{option} {shown}: cannot write in {directory}: {why}") from None


def check_writable_dir(path: str, option: str) -> str:
    """``path`` as an absolute path, if it is (or can be made) a directory this process can write in."""
    full = _absolute(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise PathError(f"{option} {path}: a regular file, not a directory")
    _check_can_create_in(_deepest_existing(full, option, path), option, path)
    return full


def check_writable_file(path: str, option: str) -> str:
    """``path`` as an absolute path, if it is a file this process can append to or create (with its folders)."""
    full = _absolute(path)
    if os.path.isdir(full):
        raise PathError(f"{option} {path}: a directory, not a file")
    if os.path.exists(full):
        if os.statvfs(full).f_flag & os.ST_RDONLY:
            raise PathError(f"{option} {path}: cannot be written: read-only file system")
        if not os.access(full, os.W_OK):
            raise PathError(f"{option} {path}: cannot be written: permission denied")
        return full
    _check_can_create_in(_deepest_existing(os.path.dirname(full), option, path), option, path)
    return full


def check_readable_file(path: str, option: str) -> str:
    """``path`` as given, if it is a regular file this process can read."""
    if not os.path.exists(path):
        raise PathError(f"{option} {path}: no such file")
    if os.path.isdir(path):
        raise PathError(f"{option} {path}: a directory, not a file")
    if not os.access(path, os.R_OK):
        raise PathError(f"{option} {path}: cannot be read: permission denied")
    return path


def check_readable_dir(path: str, option: str) -> str:
    """``path`` as given, if it is a directory this process can list."""
    if not os.path.exists(path):
        raise PathError(f"{option} {path}: no such directory")
    if not os.path.isdir(path):
        raise PathError(f"{option} {path}: a regular file, not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise PathError(f"{option} {path}: cannot be read: permission denied")
    return path


def check_readable_path(path: str, option: str) -> str:
    """``path`` as given, if it is a file this process can read or a directory it can list."""
    if not os.path.exists(path):
        raise PathError(f"{option} {path}: no such file or directory")
    return (check_readable_dir if os.path.isdir(path) else check_readable_file)(path, option)


class _PathAction(argparse.Action):
    """Stores the option's path once ``check`` accepts it; else ends the command with the check's one line."""

    check = staticmethod(check_readable_file)

    def __call__(self, parser, namespace, values, option_string=None):
        if values is not None:
            try:
                values = self.check(values, option_string or self.metavar or self.dest)
            except PathError as exc:
                parser.exit(2, f"{parser.prog}: {exc}\n")
        setattr(namespace, self.dest, values)


class WritableDir(_PathAction):
    """An option naming a directory to write in (``--kv-disk``): stored absolute."""

    check = staticmethod(check_writable_dir)


def _writable_file_with_folders(path: str, option: str) -> str:
    """``check_writable_file``, then its missing folders made, so every writer of the option can just open it."""
    full = check_writable_file(path, option)
    try:
        os.makedirs(os.path.dirname(full), exist_ok=True)
    except OSError as exc:
        raise PathError(f"{option} {path}: cannot create its folder: {(exc.strerror or str(exc)).lower()}") from None
    return full


class WritableFile(_PathAction):
    """An option naming a file to write (``--request-log``, ``--json``): stored absolute, its folders made."""

    check = staticmethod(_writable_file_with_folders)


class ReadableFile(_PathAction):
    """An option naming a file to read (a trace, ``--api-keys-file``)."""

    check = staticmethod(check_readable_file)


class ReadableDir(_PathAction):
    """An option naming a directory to read (``cache DIR``)."""

    check = staticmethod(check_readable_dir)


class ReadablePath(_PathAction):
    """An option naming a file or a directory to read (``--tokenizer``: a checkpoint directory or a GGUF file)."""

    check = staticmethod(check_readable_path)
