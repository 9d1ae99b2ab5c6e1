"""Session files on disk: opening one safely, locking it for a process, and guarding what /save replaces.

- `open_regular`: a session path may name anything — a FIFO (a plain open blocks forever), a
  symlink to /dev/zero (reads forever), a directory. It is opened non-blocking and fstat-ed;
  only a regular file is read, and the caller bounds every length by the size fstat gave.
- `SessionLock`: two processes on one `--session` file would each save their own turn over the
  other's. An advisory flock on a lock file next to the session (`.NAME.lock`, holding the
  owner's pid) is taken for the life of the process; a second process is refused with one line
  naming the holder. The lock file is beside the file and not the file itself because saving
  renames a new inode over the session; a lock on the old inode would protect nothing.
- `check_save_target`: /save must not replace a text file or a model with a session unless
  asked to (`/save! FILE`, `--force`), and never replaces something that is not a regular file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from kvchat.runtime.errors import SessionError

MAGIC = b"KVCHATSS"


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def open_regular(path, what: str = "session file"):
    """(fd, size) of a regular file opened for reading without blocking; SessionError otherwise."""
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise SessionError(f"{what} {p} does not exist") from None
    except IsADirectoryError:
        raise SessionError(f"{what} {p} is a directory") from None
    except OSError as e:
        raise SessionError(f"cannot read {what} {p}: {_reason(e)}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "a device"
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a socket"
            if stat.S_ISSOCK(st.st_mode)
            else "not a regular file"
        )
        raise SessionError(f"{what} {p} is {kind}, not a regular file")
    # reads of a regular file never block; clear O_NONBLOCK so they are ordinary reads
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd, st.st_size


def read_exact(fd, n: int) -> bytes:
    """n bytes from fd (fewer only at end of file)."""
    parts, left = [], n
    while left > 0:
        b = os.read(fd, min(left, 16 << 20))
        if not b:
            break
        parts.append(b)
        left -= len(b)
    return b"".join(parts)


def is_session_file(path) -> bool:
    try:
        fd, size = open_regular(path)
    except SessionError:
        return False
    try:
        return read_exact(fd, len(MAGIC)) == MAGIC
    finally:
        os.close(fd)


def check_save_target(path, force: bool = False) -> None:
    """Refuse to replace a non-regular file ever, or a regular non-session file unless forced."""
    p = Path(path)
    try:
        st = p.stat()  # follows a symlink: what counts is what the link points at
    except FileNotFoundError:
        return
    except OSError as e:
        raise SessionError(f"cannot save to {p}: {_reason(e)}") from None
    if stat.S_ISDIR(st.st_mode):
        raise SessionError(f"cannot save to {p}: it is a directory (give a file name)")
    if not stat.S_ISREG(st.st_mode):
        raise SessionError(f"cannot save to {p}: it is not a regular file")
    if force or st.st_size == 0 or is_session_file(p):
        return
    raise SessionError(
        f"{p} exists and is not a kvchat session file: not overwriting it (/save! FILE or --force replaces it)"
    )


def resolve_target(path) -> Path:
    """The file a save really writes: a symlink's final target (relative links resolved)."""
    return Path(os.path.realpath(os.fspath(path)))


class SessionLock:
    """An exclusive advisory lock on a session file, held until release() (or the process ends)."""

    def __init__(self, path):
        self.path = Path(path)
        target = resolve_target(path)
        self.lock_path = target.parent / f".{target.name}.lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "SessionLock":
        """Take the lock; SessionError naming the holder if another process has it.

        A directory where no lock file can be made (read-only) is not an error here: nothing can
        be saved there either, and the save reports that itself."""
        if self._fd is not None:
            return self
        for _ in range(5):  # the holder may unlink the lock file between our open and flock
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as e:
                if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR):
                    return self
                raise SessionError(f"cannot lock session file {self.path}: {_reason(e)}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_pid(fd)
                if holder is None:  # it locked but has not written its pid yet
                    time.sleep(0.05)
                    holder = _read_pid(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    who = f"process {holder}" if holder else "another process"
                    raise SessionError(
                        f"session file {self.path} is in use by {who}; wait for it to finish or use another file"
                    ) from None
                raise SessionError(f"cannot lock session file {self.path}: {_reason(e)}") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # we locked a lock file its holder had just removed: try again
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._fd = fd
            from kvchat.runtime.memory.state import remove_stale_temps

            remove_stale_temps(self.path)  # temp files of a save that was killed
            return self
        raise SessionError(f"cannot lock session file {self.path}: the lock file keeps changing")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.lock_path)  # while still holding it: a waiter re-checks the inode
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _read_pid(fd) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


class AutosaveTarget:
    """Where a chat saves after every turn (--session), with that file's lock held.

    /load of another file moves the target there: `claim(path)` takes the new file's lock first
    (a file another process holds is refused before anything changes), `adopt` switches after
    the load succeeded and releases the old lock. The --session file is never overwritten by a
    conversation it did not hold."""

    def __init__(self, path=None):
        self.path = Path(path) if path is not None else None
        self._lock = SessionLock(path).acquire() if path is not None else None

    def is_target(self, path) -> bool:
        return self.path is not None and resolve_target(path) == resolve_target(self.path)

    def claim(self, path) -> "SessionLock | None":
        """The lock on `path` if it would become the new target (None: no switch needed)."""
        if self.path is None or self.is_target(path):
            return None
        return SessionLock(path).acquire()

    def adopt(self, path, lock: "SessionLock") -> Path:
        """Make `path` the target; returns the previous one."""
        old = self.path
        if self._lock is not None:
            self._lock.release()
        self.path, self._lock = Path(path), lock
        return old

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
