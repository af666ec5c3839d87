"""One run per folder: a lock file naming the host and process that holds a run folder.

Two runs writing into one folder (a `--resume` while the first run still lives, two fresh runs started
together) log every step twice and overwrite each other's checkpoints. The lock is created atomically,
so of two runs started together one wins; a lock left by a process that died on this host is taken over,
since nothing else removes it after a `kill -9` or a lost node.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("mmrl.run.lock")
LOCK_NAME = "run.lock"


class FolderInUse(FileExistsError):
    """Another run holds the folder; the message names it and what to do."""


class RunLock:
    """Holds `run_dir` for this process from construction until `release` (or the process exits)."""

    def __init__(self, run_dir: Path) -> None:
        self.made = not run_dir.exists()  # a folder made here and left empty goes again on release
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_NAME
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
        }
        while not self._create():
            holder = _read(self.path)
            if holder is None:
                continue  # released between our attempt and the read: try again
            self._take_over_or_refuse(holder)
        atexit.register(self.release)

    def release(self) -> None:
        """Remove the lock if it is still ours; safe to call more than once."""
        atexit.unregister(self.release)
        holder = _read(self.path)
        if holder is not None and _same_process(holder, self.me):
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            if self.made:  # a run refused at start leaves no empty folder behind
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()

    def _create(self) -> bool:
        """Put the lock in place unless one exists. It is written whole under another name and then
        linked in (atomic, and refused if the name exists), so two runs cannot both win and no run
        ever reads a half-written lock."""
        draft = self.path.with_name(f".{LOCK_NAME}.{self.me['pid']}")
        draft.write_text(json.dumps(self.me))
        try:
            os.link(draft, self.path)
        except FileExistsError:
            return False
        finally:
            draft.unlink()
        return True

    def _take_over_or_refuse(self, holder: dict[str, Any]) -> None:
        """Remove a lock whose process is gone from this host; refuse any other."""
        where = f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
        if holder.get("host") != self.me["host"]:
            raise FolderInUse(
                f"{self.path.parent} is held by another run ({where}), which this machine cannot check. "
                f"If that run is over, delete {self.path} and run again; otherwise set "
                "trainer.output_dir to another folder."
            )
        if _alive(holder.get("pid")):
            this = " (this process)" if holder.get("pid") == self.me["pid"] else ""
            raise FolderInUse(
                f"{self.path.parent} is in use by another run: {where}{this}, `{holder.get('command')}`. "
                f"Wait for it to end or stop it (kill {holder.get('pid')}), or set trainer.output_dir to "
                "another folder."
            )
        log.warning("%s was left by a run that is no longer alive (%s); taking it over", self.path, where)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _read(path: Path) -> dict[str, Any] | None:
    """The holder a lock names; None when the lock is gone. An unreadable lock (a damaged disk) names
    nobody alive, so it reads as a dead holder on this host. A folder in its place is none of mmrl's, so
    it is not taken over: the run stops in one line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise FolderInUse(
            f"{path} is a folder where the run's lock file goes; mmrl never writes one: move it away (or delete "
            "it if nothing in it matters) and run again"
        ) from None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = None
    return holder if isinstance(holder, dict) else {"host": socket.gethostname(), "pid": None}


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("host") == b["host"] and a.get("pid") == b["pid"] and a.get("started") == b["started"]
