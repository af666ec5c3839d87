"""Media files read with a deadline: a path that blocks (a FIFO, a hung network mount) costs its row,
never the run.

`open` on a FIFO waits for a writer and a read from a hung NFS or FUSE mount waits for the server, both
without end and beyond the reach of signals: the data thread stops, the step waits for its batch, and a
SIGTERM's "finishing this step" never finishes. Each read here runs on a thread of its own and is given
up after `READ_TIMEOUT_S`; the caller gets an `OSError` naming the path (the thread stays blocked, as
nothing can interrupt it, but the run goes on). A path that is not a regular file is refused at once.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

# Seconds a media file's stat and read may take; the environment variable sets it (a slow mount).
READ_TIMEOUT_S = float(os.environ.get("MMRL_MEDIA_READ_TIMEOUT_S", "30"))

T = TypeVar("T")


def local_path(source: str | Path, base_dir: str | Path | None = None) -> Path:
    """The file a row's media string names: a path (relative ones under `base_dir`) or a `file://` URL.
    Other URLs are refused with a `ValueError` saying so: media is never fetched over a network, where a
    slow or hostile server would hold the data thread."""
    if isinstance(source, str) and (url := urlparse(source)).scheme and source.startswith(f"{url.scheme}://"):
        if url.scheme.lower() != "file":
            raise ValueError(
                f"{url.scheme}:// URLs are not fetched: mmrl reads local files, bytes and PIL images; "
                "download the media and give its path (relative paths are read under data.base_dir)"
            )
        source = url2pathname(unquote(url.path))
    path = Path(source)
    return Path(base_dir) / path if base_dir is not None and not path.is_absolute() else path


def read_media(path: Path) -> bytes:
    """The bytes of the regular file `path`, or an `OSError` after `READ_TIMEOUT_S`."""
    return _with_deadline(path, lambda: (_regular_size(path), path.read_bytes())[1])


def media_size(path: Path) -> int:
    """The size of the regular file `path` (for decoders that read the file themselves)."""
    return _with_deadline(path, lambda: _regular_size(path))


def _regular_size(path: Path) -> int:
    mode = os.stat(path)
    if not stat.S_ISREG(mode.st_mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(mode.st_mode)
            else "a folder"
            if stat.S_ISDIR(mode.st_mode)
            else "not a file"
        )
        raise OSError(f"{path} is {kind}, not a regular file")
    return mode.st_size


def _with_deadline(path: Path, read: Callable[[], T]) -> T:
    """`read()` on a daemon thread, waited for at most `READ_TIMEOUT_S`."""
    outcome: list[T | BaseException] = []
    thread = threading.Thread(
        target=lambda: outcome.append(_attempt(read)), name="mmrl-media-read", daemon=True
    )
    thread.start()
    thread.join(READ_TIMEOUT_S)
    if not outcome:
        raise TimeoutError(
            f"reading {path} took over {READ_TIMEOUT_S:g} s (a hung network mount?); "
            "MMRL_MEDIA_READ_TIMEOUT_S sets the limit"
        )
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _attempt(read: Callable[[], T]) -> T | BaseException:
    try:
        return read()
    except Exception as err:  # handed to the waiting thread, which raises it
        return err
