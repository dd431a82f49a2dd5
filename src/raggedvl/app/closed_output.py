"""Output whose reader went away (``raggedvl train | head -3``, a pager quit early): the job runs on.

Python ignores SIGPIPE, so once the reading end of a pipe is closed every write to it raises
``BrokenPipeError``. :func:`drop_output_when_closed` gives ``sys.stdout`` and ``sys.stderr`` a
bottom layer that, on the first such error, points the stream's file descriptor at
``os.devnull`` (``os.dup2``) and reports the write as done: what the process prints from then
on is dropped, the command runs to its normal end (files, metrics, exit code as without the
pipe), and the processes it starts afterwards (torchrun's agent and ranks) inherit the
descriptor already pointing at ``os.devnull``. Signal handling is unchanged.
"""

from __future__ import annotations

import io
import os
import sys
from typing import TextIO


class _DropWhenClosed(io.FileIO):
    """A file descriptor's raw writer that, when the reader of its pipe has gone, points the
    descriptor at ``os.devnull`` and takes the bytes as written."""

    def write(self, data) -> int:
        try:
            return super().write(data)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.fileno())
            finally:
                os.close(devnull)
            return memoryview(data).nbytes


def guarded(stream: TextIO) -> TextIO:
    """A text stream over ``stream``'s file descriptor, with its encoding and buffering (none
    under ``python -u``: every write reaches the descriptor at once, in order with the other
    stream's), whose
    writes never raise ``BrokenPipeError`` (module docstring); ``stream`` is flushed first and
    its descriptor stays open when the new stream is closed."""
    stream.flush()
    raw = _DropWhenClosed(stream.fileno(), "w", closefd=False)
    unbuffered = isinstance(getattr(stream, "buffer", None), io.RawIOBase)  # python -u, PYTHONUNBUFFERED
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=stream.encoding, errors=stream.errors,
                            line_buffering=stream.line_buffering, write_through=stream.write_through)


def drop_output_when_closed() -> None:
    """Replace ``sys.stdout`` and ``sys.stderr`` with :func:`guarded` streams, for a process's
    entry point (the ``raggedvl`` command, its ranks and torchrun agent). A stream already
    replaced (a test's capture, an earlier call) or without a file descriptor is left as it is."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or stream is not getattr(sys, f"__{name}__"):
            continue
        try:
            setattr(sys, name, guarded(stream))
        except (AttributeError, OSError, ValueError):  # no file descriptor (an embedding host's stream)
            continue
