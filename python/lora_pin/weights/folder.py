"""An adapter's folder opened once, and its files opened relative to it, contained by construction.

Checking a path and then opening it by name leaves a window: a symlink renamed over the file in between is
followed out of the allowed roots. Here nothing is opened by a checked name. With ``allowed_roots``, the
folder is reached from the root's descriptor one component at a time with ``O_NOFOLLOW``, so a component
turned into a symlink after the containment check fails to open instead of being followed; each file is
then opened relative to the folder's descriptor with ``O_NOFOLLOW``, so a symlink there is never followed
by the open itself. A file that *is* a symlink (as in a download cache, where ``snapshots/<rev>/<file>``
links to ``blobs/<hash>``) is accepted when its target lies inside a root, and opened by walking from that
root's descriptor in the same way. Every file is opened non-blocking (a FIFO cannot stall the loading
thread) and its type, size and identity come from ``fstat`` on the descriptor the bytes are read from.
"""

from __future__ import annotations

import errno
import os
import stat
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lora_pin.errors import AdapterLoadError, PathNotAllowedError

__all__ = ["AdapterFolder", "FolderFile", "Stamp", "path_within", "real_roots", "resolve_folder"]

Stamp = tuple[int, int, int, int]
"""A file's inode, size, modification and change time (ns): a writer can put the mtime back, not the ctime."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What open(2) reports for a final component that is a symlink under O_NOFOLLOW (EMLINK on FreeBSD).
_SYMLINK_ERRNOS = (errno.ELOOP, errno.EMLINK)


def path_within(real: str, roots: list[str]) -> bool:
    """Whether real path ``real`` is one of ``roots`` (real paths) or lies inside one."""
    return _root_of(real, roots) is not None


def _root_of(real: str, roots: list[str]) -> str | None:
    # The innermost root holding ``real``: the walk from it is the shortest.
    holding = [r for r in roots if real == r or real.startswith(r.rstrip(os.sep) + os.sep)]
    return max(holding, key=len, default=None)


def real_roots(allowed_roots: Iterable[str | os.PathLike[str]] | None) -> list[str] | None:
    """``allowed_roots`` as real paths (None stays None: no containment)."""
    if allowed_roots is None:
        return None
    return [os.path.realpath(os.fspath(r)) for r in allowed_roots]


def resolve_folder(name: str, path: str | os.PathLike[str], roots: list[str] | None) -> Path:
    """The real path of adapter directory ``path``, checked against real paths ``roots`` when given.

    Raises:
        PathNotAllowedError: ``path`` has a ``..`` component, or its real path is outside every root.
        AdapterLoadError: ``path`` is not a directory, or holds a NUL or a lone surrogate.
    """
    raw = os.fspath(path)
    try:
        real = os.path.realpath(raw)
    except ValueError as exc:  # a NUL, or a lone surrogate the file system encoding cannot take
        raise AdapterLoadError(f"adapter {name!r}: path {raw!r} cannot name a file: {exc}") from None
    if roots is not None:
        if ".." in Path(raw).parts:
            raise PathNotAllowedError(
                f"adapter {name!r}: path {raw!r} contains '..'; refused under allowed_roots"
            )
        if not path_within(real, roots):
            raise PathNotAllowedError(
                f"adapter {name!r}: path {raw!r} resolves to {real!r}, outside every allowed root {roots}"
            )
    if not os.path.isdir(real):
        raise AdapterLoadError(
            f"adapter {name!r}: {raw!r} is not a directory (expected a PEFT adapter directory)"
        )
    return Path(real)


def _open_beneath(name: str, root: str, real: str, flags: int) -> int:
    """Open ``real`` (a real path inside ``root``) by walking from ``root`` without following a symlink;
    the last component is opened with ``flags``."""
    parts = [p for p in real[len(root) :].split(os.sep) if p]
    fd = os.open(root, _DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                child = os.open(part, flags if last else _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (*_SYMLINK_ERRNOS, errno.ENOTDIR):
                    raise PathNotAllowedError(
                        f"adapter {name!r}: {real!r} changed while it was opened (a component became a "
                        "symlink or a file); refused under allowed_roots"
                    ) from None
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


@dataclass(frozen=True)
class FolderFile:
    """One file of an adapter folder, open for reading: ``fd`` is a regular file, ``stamp`` its
    :data:`Stamp` when opened, ``path`` where it was found (its target's real path for a symlink)."""

    fd: int
    path: Path
    stamp: Stamp
    name: str
    via_link: bool


def _fstamp(fd: int) -> tuple[os.stat_result, Stamp]:
    info = os.fstat(fd)
    return info, (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class AdapterFolder:
    """An adapter's folder, open (see the module docstring); close it (or use ``with``) when done.

    Files opened with :meth:`open_file` are closed with the folder.

    Raises (when built with :meth:`open`):
        PathNotAllowedError: the folder has a ``..`` component, resolves outside ``roots``, or changed into
            a symlink while it was opened.
        AdapterLoadError: the folder is not a directory or cannot be opened.
    """

    def __init__(self, name: str, path: Path, fd: int, roots: list[str] | None) -> None:
        self.name = name
        self.path = path
        self.roots = roots
        self._fd = fd
        self._fds = [fd]
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    @classmethod
    def open(cls, name: str, path: str | os.PathLike[str], roots: list[str] | None) -> AdapterFolder:
        """Open the adapter folder at ``path``, confined to real paths ``roots`` when given."""
        real = str(resolve_folder(name, path, roots))
        try:
            root = None if roots is None else _root_of(real, roots)
            fd = os.open(real, _DIR_FLAGS) if root is None else _open_beneath(name, root, real, _DIR_FLAGS)
        except PathNotAllowedError:
            raise
        except OSError as exc:
            raise AdapterLoadError(f"adapter {name!r}: cannot open the folder {real!r}: {exc}") from None
        return cls(name, Path(real), fd, roots)

    def open_file(self, file_name: str, *, limit: int, what: str) -> FolderFile | None:
        """Open the folder's file ``file_name`` (one path component), or None when there is none.

        Raises:
            PathNotAllowedError: the file is a symlink whose target lies outside every root.
            AdapterLoadError: the file is not a regular file (a FIFO, device, socket or folder), is larger
                than ``limit`` bytes (the message names the limit ``what``), or cannot be opened.
        """
        shown = self.path / file_name
        via_link = False
        try:
            try:
                fd = os.open(file_name, _FILE_FLAGS, dir_fd=self._fd)
            except OSError as exc:
                if exc.errno not in _SYMLINK_ERRNOS:
                    raise
                via_link = True
                fd, shown = self._open_link(file_name)
        except FileNotFoundError:
            return None
        except PathNotAllowedError:
            raise
        except OSError as exc:
            why = "not a regular file (a socket)" if exc.errno == errno.ENXIO else f"cannot open: {exc}"
            raise AdapterLoadError(f"adapter {self.name!r} ({shown}): {why}") from None
        self._fds.append(fd)
        info, stamp = _fstamp(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AdapterLoadError(
                f"adapter {self.name!r} ({shown}): not a regular file (a FIFO, device or folder)"
            )
        if info.st_size > limit:
            raise AdapterLoadError(
                f"adapter {self.name!r} ({shown}): file is {info.st_size} bytes, above the limit "
                f"{what}={limit}"
            )
        return FolderFile(fd, shown, stamp, file_name, via_link)

    def _open_link(self, file_name: str) -> tuple[int, Path]:
        link = self.path / file_name
        if self.roots is None:
            return os.open(file_name, _FILE_FLAGS & ~os.O_NOFOLLOW, dir_fd=self._fd), link
        real = os.path.realpath(link)
        root = _root_of(real, self.roots)
        if root is None:
            raise PathNotAllowedError(
                f"adapter {self.name!r}: {link} resolves to {real!r}, outside every allowed root {self.roots}"
            )
        return _open_beneath(self.name, root, real, _FILE_FLAGS), Path(real)

    def check_unchanged(self, file: FolderFile) -> None:
        """Refuse the adapter if ``file`` was rewritten since it was opened, or its name now leads to
        another file (one renamed into place). Call it after every byte was read.

        Raises:
            AdapterLoadError: the inode, size, modification or change time differ, or the name is gone.
        """
        try:
            now = _fstamp(file.fd)[1]
            named = os.stat(file.name, dir_fd=self._fd, follow_symlinks=file.via_link)
        except OSError as exc:
            raise AdapterLoadError(
                f"adapter {self.name!r} ({file.path}): the file vanished while it was read: {exc}"
            ) from None
        by_name = (named.st_ino, named.st_size, named.st_mtime_ns, named.st_ctime_ns)
        for seen in (now, by_name):
            if seen != file.stamp:
                raise AdapterLoadError(
                    f"adapter {self.name!r} ({file.path}): the file changed while it was read "
                    f"(inode, size, mtime_ns, ctime_ns {file.stamp} -> {seen}); write adapters elsewhere "
                    "and rename them into place"
                )

    def close(self) -> None:
        """Close the folder and every file opened from it (idempotent)."""
        self._finalizer()

    def __enter__(self) -> AdapterFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())
