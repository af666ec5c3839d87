"""Python children forked from a server that has imported the training stack once, not started afresh.

`python -m mmrl.cli train ...` spends about 6 s of CPU on these VMs importing torch, transformers and
mmrl before it trains; the suite starts a few dozen training children. Here one server per test process
imports the stack once, and forks each child from itself: the child starts where a fresh interpreter
stands after those imports (they only define things; no kernel has been chosen, no thread pool made),
then runs its command, and exits as a process of its own would: atexit hooks run (a Ray cluster it
started stops), and its exit code, or the signal that killed it, is its own.

One child at a time. A child still running when the next is asked for (a test that failed or timed out
midway) is killed with the server, so no later child reads its answer.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What a training child imports, but `mmrl.cli` itself: `-m mmrl.cli` runs it as `__main__` (runpy warns
# of a module that is run after it was imported), and its own import is a few milliseconds.
STACK = ("mmrl.trainer", "mmrl.sources.startup", "mmrl.data.loaders", "datasets", "matplotlib.pyplot", "ray")


class Child:
    """A forked child, driven as a `subprocess.Popen`: `pid`, `poll`, `wait`, `send_signal`, `kill`."""

    def __init__(self, server: _Server, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._answer(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._answer(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _answer(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self.server.line(timeout)
            self.returncode = None if line is None else int(line)
        return self.returncode


class _Server:
    """The server process and the lines it answers with: a child's pid when it starts, its exit code
    when it ends."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own process group, which its children join: one kill for all
        )
        self.buffer = b""

    def line(self, timeout: float | None) -> str | None:
        """The next line, or None if none came within `timeout` seconds (None: wait for it)."""
        assert self.process.stdout is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.process.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the fork server (tests/forked.py) exited with {self.process.wait()}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


_server: _Server | None = None
_last: Child | None = None


def run_python(
    argv: list[str], log: Path, env: dict[str, str] | None = None, fresh: bool = False
) -> Child | subprocess.Popen[bytes]:
    """`python *argv` (`-m module ...` or `-c code ...`) as a forked child in the repository, its
    environment `env` (this process's by default), its output appended to `log`. A fresh interpreter
    where asked (`fresh`) and off Linux: macOS's system libraries are not all safe in a forked child."""
    global _server, _last
    if fresh or sys.platform != "linux":
        with log.open("ab") as out:
            return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=out, stderr=out)
    if _server is not None and (_server.process.poll() is not None or (_last and _last.poll() is None)):
        _server.stop()
        _server = None
    if _server is None:
        _server = _Server()
    assert _server.process.stdin is not None
    request = [argv, dict(os.environ if env is None else env), str(log)]
    _server.process.stdin.write(json.dumps(request).encode() + b"\n")
    _server.process.stdin.flush()
    pid = _server.line(None)
    assert pid is not None
    _last = Child(_server, int(pid))
    return _last


@atexit.register
def _stop_a_running_child() -> None:
    if _server is not None and _last is not None and _last.poll() is None:
        _server.stop()


def die_with_parent(parent: int) -> None:
    """On Linux, have the kernel SIGKILL this process when its parent (pid `parent`) dies. The server and
    each child ask for it, so a pytest worker killed without its atexit hooks (`kill`, a CI timeout) takes
    its training child with it instead of leaving it to run on, at full CPU, beside the next run."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it died before the request was made
            os._exit(1)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _serve() -> None:
    """Import the stack, then fork a child per request line; answer with its pid, then its exit code."""
    die_with_parent(os.getppid())
    for module in STACK:
        importlib.import_module(module)
    for line in sys.stdin:
        argv, env, log = json.loads(line)
        server, pid = os.getpid(), os.fork()
        if pid == 0:
            die_with_parent(server)
            _child(argv, env, Path(log))
        print(pid, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)


def _child(argv: list[str], env: dict[str, str], log: Path) -> None:
    """Run `python *argv` in this forked process, then exit as that interpreter would."""
    os.environ.clear()
    os.environ.update(env)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    with log.open("ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    flag, target, *args = argv
    if flag == "-m":  # sys.path[0] as the interpreter sets it: the working folder, not this file's
        sys.path[0], sys.argv = os.getcwd(), [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif flag == "-c":
        sys.path[0], sys.argv = "", ["-c", *args]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    else:
        raise ValueError(f"run_python takes -m MODULE or -c CODE, got {argv[:2]}")
    sys.exit(0)


if __name__ == "__main__":
    _serve()
