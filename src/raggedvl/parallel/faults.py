"""Rank failures in ``raggedvl train`` and ``raggedvl.hf.RaggedTrainer``: say which rank failed
and where, end fast, never hang.

What each situation produces (2 or more ranks, ``collective_timeout_s`` = T):

- **a rank raises**: :func:`report_failure` prints ``raggedvl: rank R failed in step S: ...``
  to stderr, leaves the same line as a note in the process group's store, adds it to the
  exception (``exc.__notes__``) and aborts the process group; the caller re-raises. Its peers'
  pending collectives fail at once on gloo (connection closed) and within T on NCCL (the
  watchdog), and each peer prints its own line followed by the failing rank's note. Under
  torchrun the agent stops the remaining ranks as soon as one exits and lists each failed
  rank in its summary.
- **a rank is killed, frozen or its node lost** (SIGKILL, OOM killer, SIGSTOP, a hung driver,
  a dead machine): it leaves no note, but its :class:`~raggedvl.parallel.failures.Heartbeat`
  stops. A peer whose collective fails (at once on gloo when the process is gone, at T when it
  is frozen) finds it silent (:func:`~raggedvl.parallel.failures.silent_peers`) and its line
  names it: ``... (after rank R (node N, host H, pid P) stopped responding: ...)``. A peer still
  waiting at T/2 says it is waiting for that rank, and leaves the note for it, instead of
  warning that it stalls itself.
- **a rank stalls** (alive, its heartbeat going): :class:`StallWatchdog` prints ``raggedvl:
  rank R has spent X s in step S ...`` with the stalled thread's stack once a watched phase runs
  past T/2, and leaves that as its note. Peers waiting in a collective fail after T and print
  the note; torchrun then terminates the stalled rank. Without a launcher that tears the job
  down, a rank stalled outside any collective stays stalled (no self-kill: a legitimately slow
  step must survive).

``raggedvl.app.fault_injection.inject_fault`` produces each situation on purpose, for tests.
A launcher that collects the ranks' failures itself (``raggedvl.app.agent``) sets
:data:`QUIET_ENV` in its ranks: they then keep their line in ``exc.raggedvl_report``
(:data:`REPORT_ATTRIBUTE`) instead of printing it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import torch.distributed as dist

from raggedvl.parallel.failures import (
    SILENCE_S,
    Heartbeat,
    abort,
    clear_note,
    describe_rank,
    group_store,
    peer_notes,
    post_note,
    silent_peers,
)

QUIET_ENV = "RAGGEDVL_AGENT"  # set by a launcher that prints the job's first failure itself
REPORT_ATTRIBUTE = "raggedvl_report"  # set on an exception by report_failure


def quiet_ranks() -> bool:
    """True in a rank whose launcher prints failures (:data:`QUIET_ENV`): record, do not print."""
    return os.environ.get(QUIET_ENV) == "1"


def _one_line(exc: BaseException, limit: int = 4000) -> str:
    """``Type: message`` with the whole message on one line (its lines joined by spaces: the fix an
    error ends with stays in it); only a message past ``limit`` characters (a tensor's repr, a
    dumped config) is cut, and says so."""
    try:
        text = " ".join(str(exc).split())
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails is still reported by type
        text = "<str() failed>"
    if len(text) > limit:
        text = text[:limit] + f" ... ({len(text) - limit} more characters in the traceback)"
    return f"{type(exc).__name__}: {text}"


def _silence(peers: list[int], store=None, *, which: bool = False) -> str:
    """``rank P (node N, host H, pid Q) stopped responding: ...`` for silent ``peers`` (the first
    named, the others counted); ``which``: as a relative clause (``..., which stopped ...``)."""
    more = f" and {len(peers) - 1} other ranks" if len(peers) > 1 else ""
    verb = ", which stopped" if which else " stopped"
    return (f"{describe_rank(peers[0], store)}{more}{verb} responding: no heartbeat for {SILENCE_S:g} s "
            "(killed, frozen, or its node lost)")


def report_failure(rank: int, where: str, exc: BaseException) -> str:
    """Report that this rank failed ``where`` (e.g. ``"in step 3"``) with ``exc``; returns the text.

    Posts this rank's note, aborts the process group (see
    :func:`raggedvl.parallel.failures.abort`), and when no peer left a note, looks for peers on
    other nodes that fell silent (up to ``SILENCE_S`` seconds; about one heartbeat when all are
    alive; a frozen peer on this node was named at half the timeout by :class:`StallWatchdog`,
    a killed one is named by this node's agent). Then prints
    to stderr (not in ranks of ``raggedvl.app.agent``, which prints the first failure of the job;
    the one-line report is kept in ``exc.raggedvl_report`` with the peer it followed as
    ``cause``) and appends the text to ``exc``'s notes (so it shows in the traceback and in
    ``exc.__notes__``); the caller re-raises. Peers' notes, oldest first, or the silent peer
    follow this rank's line. Store operations only, no collective; never raises.
    """
    own = f"rank {rank} failed {where}: {_one_line(exc)}"
    post_note(rank, own)
    now = time.time()
    notes = peer_notes(rank)
    store = group_store()  # held: still readable after the group is torn down
    world = dist.get_world_size() if store is not None else None
    abort()
    silent = [] if notes or store is None else silent_peers(rank, store=store, world_size=world, other_nodes=True)
    lines = [f"raggedvl: {own}"]
    lines += [f"raggedvl:   rank {n.rank} reported {now - n.time:.1f} s earlier: {n.text}" for n in notes]
    cause = notes[0].text if notes else _silence(silent, store) if silent else None
    if silent:
        lines.append(f"raggedvl:   {cause}")
    text = "\n".join(lines)
    line = own
    if notes:
        line += f" (after rank {notes[0].rank}: {cause})"
    elif silent:
        line += f" (after {cause})"
    try:  # what raggedvl.app.agent.record_failure writes to torchrun's error file
        setattr(exc, REPORT_ATTRIBUTE, {"line": line, "own": own, "cause": cause, "time": now,
                                        "after_peer": cause is not None})
    except AttributeError:
        pass
    try:
        if not quiet_ranks():  # under raggedvl's agent, the agent prints the first failure once
            print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed: the note and exc.__notes__ still carry the text
        pass
    exc.add_note(text)  # BaseException.add_note: Python 3.11+, the project's requires-python
    return text


class StallWatchdog:
    """Warns, with the stack, when a watched phase of a rank runs longer than ``timeout_s / 2``;
    keeps this rank's :class:`~raggedvl.parallel.failures.Heartbeat` going meanwhile.

    ``enter(phase, watch=True)`` marks the start of a phase (``"step 3"``, ``"checkpoint after
    step 4"``); a daemon thread started on the first ``enter`` polls the clock and, once per
    phase past ``timeout_s / 2``, first looks for peers that fell silent
    (:func:`~raggedvl.parallel.failures.silent_peers`, up to ``SILENCE_S`` seconds). With one
    (killed, frozen, node lost), this rank is only waiting for it: it prints ``raggedvl: rank R
    has waited X s <phase> for rank P (node N, host H, pid Q), which stopped responding ...`` and
    leaves that as the silent peer's note. Otherwise this rank is the one that stalls: it prints
    ``raggedvl: rank R has spent X s in <phase> ...`` with the main thread's stack to stderr and
    posts it as this rank's failure note. Peers blocked on this rank fail at ``timeout_s`` (the
    collective timeout), so the warning precedes their errors and their reports name the right
    rank. Phases with ``watch=False`` (evaluation, which issues no collective) are never warned
    about. A note from a phase that then finished is removed (also one left for a silent peer).
    ``timeout_s`` is in seconds, > 0 (``ValueError`` otherwise). With ``enabled=False`` (one
    process, no peers to wait on it) ``enter`` only records the phase and no heartbeat runs.
    """

    def __init__(self, rank: int, timeout_s: float, *, enabled: bool = True) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.rank = rank
        self.warn_after_s = timeout_s / 2
        self.timeout_s = timeout_s
        self.enabled = enabled
        self.phase = "during setup"
        self._watch = False
        self._since = time.monotonic()
        self._entered = 0  # phases entered so far: a warning is for the phase it was found in
        self._warned = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main_ident = threading.get_ident()
        self._heartbeat = Heartbeat(rank) if enabled else None
        self._noted_for: list[int] = []  # silent peers this rank left a note for

    def enter(self, phase: str, *, watch: bool = True) -> None:
        """Start ``phase`` now (the thread that calls this is the one whose stack is shown)."""
        with self._lock:
            if self._warned:
                clear_note(self.rank)
            for peer in self._noted_for:  # it answered after all: the phase it held up finished
                clear_note(peer)
            self._noted_for = []
            self.phase, self._watch, self._warned = phase, watch, False
            self._since = time.monotonic()
            self._entered += 1
            self._main_ident = threading.get_ident()
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="raggedvl-stall-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and the heartbeat (safe to call more than once, or before any ``enter``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def _run(self) -> None:
        poll = min(1.0, self.warn_after_s / 10)
        while not self._stop.wait(poll):
            with self._lock:
                elapsed = time.monotonic() - self._since
                if not self._watch or self._warned or elapsed < self.warn_after_s:
                    continue
                self._warned = True
                phase, entered = self.phase, self._entered
            silent = silent_peers(self.rank)
            with self._lock:
                if entered != self._entered:  # the phase finished meanwhile: nobody stalled
                    continue
                elapsed, ident = time.monotonic() - self._since, self._main_ident
                for peer in silent:  # their note, which they cannot leave; removed if the phase still finishes
                    post_note(peer, _silence([peer]))
                self._noted_for = silent
            if silent:
                self._waiting_for(silent, phase, elapsed)
            else:
                self._stalled(phase, elapsed, ident)

    def _waiting_for(self, silent: list[int], phase: str, elapsed: float) -> None:
        print(f"raggedvl: rank {self.rank} has waited {elapsed:.0f} s {phase} for {_silence(silent, which=True)}; "
              f"the job fails at collective_timeout_s={self.timeout_s:g}", file=sys.stderr, flush=True)

    def _stalled(self, phase: str, elapsed: float, ident: int) -> None:
        note = (f"rank {self.rank} has spent {elapsed:.0f} s {phase} without finishing "
                f"(collective_timeout_s={self.timeout_s:g}; warning at half of it)")
        post_note(self.rank, note)
        frame = sys._current_frames().get(ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (stack unavailable)\n"
        print(f"raggedvl: {note}; peers waiting on it fail at the timeout. Where rank {self.rank} is now:\n{stack}",
              file=sys.stderr, flush=True)
