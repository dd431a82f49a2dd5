"""Ctrl-C (SIGINT) in ``raggedvl train``: one line from rank 0, a torn-down process group, exit 130.

A terminal's Ctrl-C reaches the launching process: with one process, the training loop itself;
with several, torchrun's agent (``raggedvl.app.agent``), which sends SIGINT on to every
rank (each rank runs in its own session, so it gets that one signal). On every rank,
:func:`raggedvl.app.loop.train` turns the ``KeyboardInterrupt`` into :func:`stop_interrupted`:

- further SIGINTs are ignored while the rank shuts down (:func:`ignore_sigint`; the caller
  restores the previous handler on its way out);
- the rank leaves the note ``rank R interrupted at step S`` in the process group's store
  (``raggedvl.parallel.failures``): a peer whose collective fails because this rank tore the
  group down reads it (:func:`peer_interrupted`) and stops the same way instead of reporting a
  failure;
- rank 0 prints ``raggedvl: interrupted at step S; last checkpoint: PATH; resume with --resume``
  (``last checkpoint: none`` and no advice when there is none; ``interrupted during setup``
  before the first step could start);
- the process group is torn down without waiting for peers (``failures.abort``: gloo's is
  destroyed, NCCL's aborted), and :class:`TrainingInterrupted`, a ``KeyboardInterrupt``,
  propagates: ``raggedvl.app.cli.main`` returns 130 (128 + SIGINT) without a traceback, and the agent
  exits 130 without a line of its own.

S counts the optimizer steps completed. Store operations only, no collective: a peer may be
anywhere when the signal arrives.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from raggedvl.parallel.failures import abort, peer_notes, post_note

INTERRUPTED = "interrupted at step"  # in every rank's note, and rank 0's line
EXIT_CODE = 128 + signal.SIGINT  # 130, what a shell reports for a job stopped by Ctrl-C
_UNCHANGED = object()
_NOTE = re.compile(rf"rank \d+ ({INTERRUPTED} \d+|interrupted during setup)")


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C after the rank shut down cleanly; rank 0 has printed ``line``.

    ``step``: optimizer steps completed (None: interrupted during setup); ``checkpoint``: the
    newest checkpoint folder of the run, or None."""

    def __init__(self, line: str, step: int | None, checkpoint: Path | None) -> None:
        super().__init__(line)
        self.line, self.step, self.checkpoint = line, step, checkpoint


def ignore_sigint() -> Any:
    """Ignore SIGINT from now on; returns the previous handler for :func:`restore_sigint` (a
    marker that restores nothing when called outside the main thread, where signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return _UNCHANGED
    return signal.signal(signal.SIGINT, signal.SIG_IGN)


def restore_sigint(previous: Any) -> None:
    """Put back what :func:`ignore_sigint` returned."""
    if previous is not _UNCHANGED and previous is not None:
        signal.signal(signal.SIGINT, previous)


def peer_interrupted(rank: int) -> bool:
    """True when another rank left an interruption note (its Ctrl-C, not a failure, ended the
    group). Store reads only; False without a process group or store."""
    return any(_NOTE.fullmatch(note.text) for note in peer_notes(rank))


def interrupted_line(step: int | None, checkpoint: Path | None) -> str:
    """Rank 0's line (module docstring), without the ``raggedvl: `` prefix."""
    where = f"{INTERRUPTED} {step}" if step is not None else "interrupted during setup"
    if checkpoint is None:
        return f"{where}; last checkpoint: none"
    return f"{where}; last checkpoint: {checkpoint}; resume with --resume"


def stop_interrupted(rank: int, step: int | None, checkpoint: Path | None) -> TrainingInterrupted:
    """This rank's share of an interruption (module docstring): note, rank 0's line, abort of the
    process group. Returns the exception to raise; never raises (SIGINT should be ignored first)."""
    line = interrupted_line(step, checkpoint)
    post_note(rank, f"rank {rank} {line.split(';')[0]}")  # what peer_interrupted recognises
    if rank == 0:
        try:
            newline = "\n" if sys.stderr.isatty() else ""  # after a progress bar's unfinished line
            print(f"{newline}raggedvl: {line}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed
            pass
    abort()
    return TrainingInterrupted(line, step, checkpoint)


@contextmanager
def sigint_after_block() -> Iterator[None]:
    """A Ctrl-C inside the block is acted on when the block ends: ``KeyboardInterrupt`` is
    raised then (replacing an exception the block raised), not in the middle of a collective
    checkpoint write whose ranks would then leave each other waiting. Main thread only, and
    only while Python's own handler is installed; elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if received:
            raise KeyboardInterrupt
