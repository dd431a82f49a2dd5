"""Failure notes between ranks, and tearing a process group down without waiting for peers.

When a rank fails, its peers usually learn it only as a transport error that names no rank
(gloo: ``Connection closed by peer [127.0.0.1]:52125``; NCCL: a watchdog timeout). To let
every rank say *which* rank failed, a failing (or stalled) rank leaves a one-line note in the
process group's key-value store: the torchrun agent's store under torchrun, the ``env://``
TCPStore hosted by rank 0 otherwise, or a file store. A rank whose collective then fails
reads its peers' notes and prints them beside its own error.

Notes are best effort: a rank killed by a signal leaves none (torchrun's failure summary names
it, with the signal), and when the store's host has died the notes cannot be read; every
function here then returns quietly instead of raising, so failure reporting never masks the
original error. The store is reached through ``torch.distributed.distributed_c10d.
_get_default_store`` (private, stable since PyTorch 1.x; used because no public accessor
exists).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch.distributed as dist

from raggedvl.parallel.runtime import is_distributed

_KEY = "raggedvl/failure-note/{rank}"


@dataclass(frozen=True)
class FailureNote:
    """A note left by ``rank`` at ``time`` (Unix seconds)."""

    rank: int
    time: float
    text: str


def _store():
    if not is_distributed():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store, no notes
        return None


def post_note(rank: int, text: str) -> bool:
    """Leave ``text`` as this rank's note (replacing an earlier one); False when impossible.

    One store write (no collective; peers need not participate)."""
    store = _store()
    if store is None:
        return False
    try:
        store.set(_KEY.format(rank=rank), json.dumps({"time": time.time(), "text": text}))
        return True
    except Exception:  # noqa: BLE001 - store host gone: the caller still reports locally
        return False


def clear_note(rank: int) -> None:
    """Remove this rank's note (a stall that ended). No collective; silent when impossible."""
    store = _store()
    if store is None:
        return
    try:
        store.delete_key(_KEY.format(rank=rank))
    except Exception:  # noqa: BLE001
        pass


def peer_notes(rank: int) -> list[FailureNote]:
    """Notes left by every rank other than ``rank``, oldest first (empty when unreadable).

    Store reads only (no collective); never blocks on a missing key."""
    store = _store()
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
