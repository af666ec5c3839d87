"""A SIGALRM deadline for work that a model's text can make slow, where signals can be used."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType


class Timeout(BaseException):
    """Raised by the SIGALRM handler. A BaseException, so no `except Exception` (ours or sympy's) can
    swallow it and let the work run on past the deadline."""


def _raise_timeout(signum: int, frame: FrameType | None) -> None:
    raise Timeout


def _install_alarm() -> signal.Handlers | Callable[..., object] | int | None:
    """Install the SIGALRM handler and return the one it replaced, or None where we must not: off the main
    thread (signals are delivered there only), in a subinterpreter (signal.signal refuses), or when the
    current handler was installed outside Python and could not be put back."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGALRM)
    if previous is None:
        return None
    try:
        signal.signal(signal.SIGALRM, _raise_timeout)
    except ValueError:
        return None
    return previous


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise `Timeout` in the body after `seconds`, where SIGALRM can be used; elsewhere (a trainer scoring
    from a worker thread) do nothing and rely on the parser's bounds, which keep a call to milliseconds.
    A timer already running (pytest-timeout, the caller's own alarm) is kept: our deadline is cut short to
    its expiry if that comes first, and it is re-armed afterwards with the time it had left."""
    previous = _install_alarm()
    if previous is None:
        yield
        return
    started = time.monotonic()
    pending, interval = signal.getitimer(signal.ITIMER_REAL)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, pending) if pending else seconds)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, previous)
            if pending:
                left = max(pending - (time.monotonic() - started), 1e-6)
                signal.setitimer(signal.ITIMER_REAL, left, interval)
