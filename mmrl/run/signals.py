"""Pre-emption: SIGTERM (what job schedulers send before they kill) or a first Ctrl-C ends a run at the
end of the step under way, with a checkpoint, instead of losing up to `trainer.save_every` steps.

The step is finished rather than abandoned: a step cut off mid-update would leave weights and optimizer
state that belong to no step, and a checkpoint of them could not be resumed exactly. A second Ctrl-C
stops at once, for a step that takes too long to wait for."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType

from mmrl.errors import RunStopped

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + the signal, as shells report it


class RunInterrupted(RunStopped):
    """The run stopped on a signal after saving a checkpoint; `exit_code` is the signal's shell code."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = EXIT_CODES[signal.Signals(signum)]


class SecondInterrupt(KeyboardInterrupt):
    """A second Ctrl-C while `StopSignals` holds SIGINT: never a bare KeyboardInterrupt, so user code that
    raises one itself (a reward function) is told apart from the user's keyboard."""


class StopSignals:
    """While entered, SIGTERM and SIGINT set `received` instead of killing the process; a second
    SIGINT raises KeyboardInterrupt where the program is. Outside the main thread (where Python
    cannot install handlers) it does nothing, and signals act as they would without it."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in EXIT_CODES:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise SecondInterrupt
        self.received = signal.Signals(signum)
        again = " (Ctrl-C again stops at once, without saving)" if signum == signal.SIGINT else ""
        # os.write, not print: a handler may run in the middle of another write to stderr.
        os.write(
            2, f"\n{self.received.name}: finishing this step, then saving a checkpoint{again}\n".encode()
        )
