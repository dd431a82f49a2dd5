"""Failure notes between ranks, and tearing a process group down without waiting for peers.

When a rank fails, its peers usually learn it only as a transport error that names no rank
(gloo: ``Connection closed by peer [127.0.0.1]:52125``; NCCL: a watchdog timeout). To let
every rank say *which* rank failed, a failing (or stalled) rank leaves a one-line note in the
process group's key-value store: the torchrun agent's store under torchrun, the ``env://``
TCPStore hosted by rank 0 otherwise, or a file store. A rank whose collective then fails
reads its peers' notes and prints them beside its own error.

A rank that can leave no note (killed, frozen by SIGSTOP or a hung driver, or on a node that
was lost) is found by its silence instead: while a :class:`Heartbeat` runs, each rank adds 1
to its own counter in the store every :data:`HEARTBEAT_S` seconds, and
:func:`silent_peers` names the peers whose counter stops moving for :data:`SILENCE_S` seconds.
Counters are compared by their values, never by time stamps, so clocks of different nodes
need not agree.

Notes are best effort: when the store's host has died the notes cannot be read; every
function here then returns quietly instead of raising, so failure reporting never masks the
original error. The store is reached through ``torch.distributed.distributed_c10d.
_get_default_store`` (private, stable since PyTorch 1.x; used because no public accessor
exists).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from raggedvl.parallel.runtime import is_distributed

_KEY = "raggedvl/failure-note/{rank}"
_BEAT_KEY = "raggedvl/heartbeat/{rank}"
_WHO_KEY = "raggedvl/identity/{rank}"
HEARTBEAT_S = 1.0  # seconds between two beats of a rank's Heartbeat
SILENCE_S = 5.0  # a peer whose counter has not moved for this long is silent (killed, frozen, node lost)


@dataclass(frozen=True)
class FailureNote:
    """A note left by ``rank`` at ``time`` (Unix seconds)."""

    rank: int
    time: float
    text: str


def group_store():
    """The default process group's key-value store, or None (no group, or none reachable)."""
    if not is_distributed():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store, no notes
        return None


def post_note(rank: int, text: str) -> bool:
    """Leave ``text`` as ``rank``'s note (replacing an earlier one); False when impossible.
    A rank may leave one for a silent peer (:func:`silent_peers`), which cannot leave its own.

    One store write (no collective; peers need not participate)."""
    store = group_store()
    if store is None:
        return False
    try:
        store.set(_KEY.format(rank=rank), json.dumps({"time": time.time(), "text": text}))
        return True
    except Exception:  # noqa: BLE001 - store host gone: the caller still reports locally
        return False


def clear_note(rank: int) -> None:
    """Remove ``rank``'s note (a stall that ended). No collective; silent when impossible."""
    store = group_store()
    if store is None:
        return
    try:
        store.delete_key(_KEY.format(rank=rank))
    except Exception:  # noqa: BLE001
        pass


def peer_notes(rank: int) -> list[FailureNote]:
    """Notes left by every rank other than ``rank``, oldest first (empty when unreadable).

    Store reads only (no collective); never blocks on a missing key."""
    store = group_store()
    if store is None:
        return []
    notes = []
    try:
        for peer in range(dist.get_world_size()):
            key = _KEY.format(rank=peer)
            if peer == rank or not store.check([key]):
                continue
            raw = json.loads(store.get(key))
            notes.append(FailureNote(peer, float(raw["time"]), str(raw["text"])))
    except Exception:  # noqa: BLE001 - store host gone: report what was read
        pass
    return sorted(notes, key=lambda n: n.time)


def abort() -> None:
    """Tear the default process group down on a failure path, without waiting for peers.

    NCCL: the communicators are aborted (``ncclCommAbort``), so this returns even while a
    peer is gone or a kernel is stuck. gloo: the group is shut down, which closes its
    connections, so a peer blocked in a collective with this rank fails at once ("Connection
    closed by peer") instead of at its timeout. No-op without a process group; never raises.
    """
    if not is_distributed():
        return
    try:
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process is failing anyway; keep the first error
        pass


class Heartbeat:
    """A daemon thread that adds 1 to this rank's counter in the process group's store every
    :data:`HEARTBEAT_S` seconds, after leaving this process's identity (node, host, pid) for
    :func:`silent_peers` to name it by. A no-op without a process group. Store operations only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        store = group_store()
        if store is None:
            return
        who = {"node": os.environ.get("GROUP_RANK"), "host": socket.gethostname(), "pid": os.getpid()}
        try:
            store.set(_WHO_KEY.format(rank=rank), json.dumps(who))
            store.add(_BEAT_KEY.format(rank=rank), 1)
        except Exception:  # noqa: BLE001 - no store: nobody can be told
            return
        self._thread = threading.Thread(target=self._run, args=(store,), name="raggedvl-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, store) -> None:
        key = _BEAT_KEY.format(rank=self.rank)
        while not self._stop.wait(HEARTBEAT_S):
            try:
                store.add(key, 1)
            except Exception:  # noqa: BLE001 - store host gone: nothing left to tell
                return

    def stop(self) -> None:
        """Stop beating (safe to call more than once); peers then see this rank fall silent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def describe_rank(rank: int, store=None) -> str:
    """``rank R (node N, host H, pid P)`` from the identity its :class:`Heartbeat` left (the
    node only under torchrun), or ``rank R`` when it left none."""
    store = store if store is not None else group_store()
    key = _WHO_KEY.format(rank=rank)
    try:
        who = json.loads(store.get(key)) if store.check([key]) else None
    except Exception:  # noqa: BLE001 - store gone: the rank alone
        who = None
    if not who:
        return f"rank {rank}"
    node = f"node {who['node']}, " if who.get("node") is not None else ""
    return f"rank {rank} ({node}host {who['host']}, pid {who['pid']})"


def silent_peers(rank: int, *, store=None, world_size: int | None = None, silence_s: float = SILENCE_S,
                 other_nodes: bool = False) -> list[int]:
    """Peers of ``rank`` whose :class:`Heartbeat` counter did not move for ``silence_s`` seconds
    and that left no note (a peer that reported its own failure is not silent): killed, frozen or
    on a lost node. Peers that never started a heartbeat are not judged. Returns as soon as every
    peer's counter moved (about :data:`HEARTBEAT_S` when all are alive), else after
    ``silence_s``. ``store`` and ``world_size`` default to the current process group's (pass
    them to ask after the group was torn down). ``other_nodes``: only peers on other nodes than
    this one (torchrun's ``GROUP_RANK``; all peers outside torchrun) are judged: this node's agent
    sees its own ranks end at once, and stops the others meanwhile. Store reads only; [] when
    unreadable."""
    store = store if store is not None else group_store()
    if store is None:
        return []
    try:
        world_size = world_size if world_size is not None else dist.get_world_size()
        keys = {p: _BEAT_KEY.format(rank=p) for p in range(world_size) if p != rank}
        keys = {p: k for p, k in keys.items() if store.check([k])}
        node = os.environ.get("GROUP_RANK")
        if other_nodes and node is not None:
            keys = {p: k for p, k in keys.items() if json.loads(store.get(_WHO_KEY.format(rank=p))).get("node") != node}
        first = {p: store.get(k) for p, k in keys.items()}
        deadline = time.monotonic() + silence_s
        waiting = set(keys)
        while waiting and time.monotonic() < deadline:
            time.sleep(min(0.25, HEARTBEAT_S / 4))
            waiting = {p for p in waiting if store.get(keys[p]) == first[p]}
        return sorted(p for p in waiting if not store.check([_KEY.format(rank=p)]))
    except Exception:  # noqa: BLE001 - store host gone: nobody can be judged
        return []
