"""The fork server's children (tests/forked.py) never outlive the test process that asked for them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

ORPHAN = f"""
import os, sys, time
sys.path.insert(0, {str(TESTS)!r})
from forked import die_with_parent
parent, pid = os.getpid(), os.fork()
if pid == 0:
    die_with_parent(parent)
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
os._exit(0)  # the parent dies at once, without any atexit hook, as a killed pytest worker does
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its new parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_that_asked_dies_with_its_parent() -> None:
    out = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True, timeout=30)
    child = int(out.stdout)
    try:
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the child outlived its parent"
    finally:
        with suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
