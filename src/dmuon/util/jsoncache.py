"""The on-disk JSON caches' conventions (the autotuner's and the owner-update profile's).

A cache file is ``{"header": {...}, "entries": {...}}`` under a cache
directory (argument, else ``$DMUON_CACHE_DIR``, else ``~/.cache/dmuon``). A
file that does not parse, or whose header differs from the reader's, is read
as empty, never trusted, and replaced on the next write. Writes go to a
temporary file in the same directory and are moved into place with
``os.replace``, so a reader never sees a half-written file; a directory that
cannot be written is not an error (the caller keeps its results in memory).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

try:  # POSIX: measuring is serialised per host through a lock file next to the cache.
    import fcntl
except ImportError:  # pragma: no cover - Windows: each process measures on its own
    fcntl = None


def default_cache_dir() -> Path:
    """``$DMUON_CACHE_DIR`` if set, else ``~/.cache/dmuon``."""
    env = os.environ.get("DMUON_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dmuon"


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    """``cache_dir`` (``~`` expanded), else :func:`default_cache_dir`."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def cache_file(root: Path, prefix: str, key: str, digits: int) -> Path:
    """``root / "{prefix}-{tag}.json"``, ``tag`` the first ``digits`` hex digits of ``key``'s SHA-1."""
    return root / f"{prefix}-{hashlib.sha1(key.encode()).hexdigest()[:digits]}.json"


def read_entries(path: Path, header: Mapping) -> dict:
    """The ``entries`` object of ``path``; empty when missing, unreadable, malformed or written for another header."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("header") != header or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def write_entries(path: Path, header: Mapping, entries: Mapping) -> bool:
    """Atomically replaces ``path`` with ``header`` and ``entries``; ``False`` if the directory is not writable."""
    payload = {"header": header, "entries": entries}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        # A read-only or full cache directory must not break training: the
        # results stay valid in memory, and are measured again next time.
        return False
    return True


UNLOCKED: list[str] = []
"""The first lock that could not be taken (``flock`` raised), for the setup log to say once."""


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path`` (created if missing) for the block.

    Serialises the processes of one host that share a cache directory. Where
    locking is unavailable (no ``fcntl``, a directory that cannot be written)
    the block runs unlocked.
    """
    if fcntl is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as e:
            # A file system without locks (NFS or Lustre mounted without them: ENOLCK, EOPNOTSUPP) must
            # not fail the optimizer's construction: the block runs unlocked, noted once for the setup log.
            if not UNLOCKED:
                UNLOCKED.append(f"{path}: {e}")
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
