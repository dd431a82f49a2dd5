"""What every ``raggedvl`` process does with Ctrl-C and a closed output pipe, before any heavy import.

Ctrl-C (SIGINT) ends a job at any moment with exit code 130 and one line on stderr:

- the launching process (``raggedvl.app.cli.run``) turns SIGINT into ``KeyboardInterrupt``
  (:func:`raise_on_sigint`) whatever disposition it inherited: a job started with SIGINT
  ignored (a background job of a non-interactive shell, some job runners) would otherwise ignore
  Ctrl-C until torchrun's agent installs its own handler, and train on;
- across the ``os.execve`` into torchrun's agent and while the agent starts its ranks, SIGINT is
  blocked (:func:`sigint_blocked`), not ignored: a Ctrl-C then stays pending (a blocked signal
  survives ``execve`` and ``fork``) and is delivered once the process can act on it;
- the agent, until torchrun installs its handler, and each rank it starts, until the training
  loop takes over (``raggedvl.app.loop.train``), end at once on SIGINT with 130
  (:func:`exit_on_sigint`): nothing is running that needs a clean stop, and a
  ``KeyboardInterrupt`` inside ``import torch`` leaves a half-imported torch whose next import
  fails with a traceback. Rank 0 (or the agent before any rank exists) prints
  ``raggedvl: interrupted``.

A closed stdout or stderr (``raggedvl train | head -3``) is not a failure: the first write that
meets EPIPE points the stream at ``os.devnull`` (:func:`tolerate_closed_output`, the Python
documentation's advice for ``BrokenPipeError``) and the process carries on, so the run's exit
code is the training's.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator, NoReturn

INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130, what a shell reports for a job stopped by Ctrl-C
INTERRUPTED_LINE = "raggedvl: interrupted"


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def raise_on_sigint() -> None:
    """SIGINT raises ``KeyboardInterrupt`` in this process (Python's own handler), replacing an
    inherited ``SIG_IGN`` or :func:`exit_on_sigint`; unblocks SIGINT. No-op outside the main thread."""
    if _main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def exit_on_sigint(line: str | None) -> None:
    """From now on SIGINT prints ``line`` (when given) on stderr and ends this process at once
    with exit code 130 (``os._exit``: no ``KeyboardInterrupt``, no traceback, no cleanup); then
    unblocks SIGINT, so a Ctrl-C that arrived while it was blocked is acted on now. Main thread only."""

    def stop(signum, frame) -> None:
        if line:
            try:
                os.write(2, (line + "\n").encode())
            except OSError:  # stderr closed
                pass
        os._exit(INTERRUPTED_EXIT_CODE)

    signal.signal(signal.SIGINT, stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread inside the block (and in any process started or exec'd
    there, until it unblocks it); a SIGINT that arrived meanwhile is delivered on leaving it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if signal.SIGINT not in previous:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class _PipeTolerant:
    """A text stream whose writes and flushes go to ``os.devnull`` once its pipe is closed."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()
            self._stream.flush()  # what was buffered goes to devnull

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def tolerate_closed_output() -> None:
    """``sys.stdout`` and ``sys.stderr`` survive a reader that closed the pipe (module
    docstring). Streams without a file descriptor (a test's capture) are left as they are."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, _PipeTolerant):
            continue
        try:
            stream.fileno()
        except (OSError, ValueError, AttributeError):
            continue
        setattr(sys, name, _PipeTolerant(stream))


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` without the interpreter's teardown: ``atexit`` handlers
    run (logging, trackers, multiprocessing's workers), stdout and stderr are flushed, then
    ``os._exit``: finalising the thousands of modules torch and transformers import takes seconds
    per process (BENCHMARKS.md "The launcher"). Only for a process whose files are all
    closed: the ``raggedvl`` command (``raggedvl.app.cli.run``) and torchrun's agent
    (``raggedvl.app.agent``). Imports nothing: safe after an interrupted ``import torch``."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to say
            pass
    os._exit(code)
