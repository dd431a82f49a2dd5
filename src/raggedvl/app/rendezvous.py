"""Waiting for the nodes of a multi-node job, as ``raggedvl.app.agent`` shows it.

torchrun's rendezvous blocks, silently, until every node joined or its join timeout passed. While
``raggedvl``'s agent waits there:

- every :data:`WAITING_INTERVAL_S` seconds (``RAGGEDVL_WAITING_INTERVAL_S`` in the environment
  sets it) it prints ``raggedvl: waiting for nodes: K of N joined (rdzv HOST:PORT, timeout T s)``.
  K counts the agents that reached the rendezvous store at HOST:PORT (each adds itself once under
  a key of the job's ``--rdzv-id``); before anything answers there, K is this node alone;
- torchrun's join timeout is ``--rdzv-conf join_timeout=SECONDS`` for every rendezvous backend
  (the static one, used with ``--node-rank``, reads ``timeout``: ``join_timeout`` is passed on as
  that when ``timeout`` is not given). Past it, the agent ends with one line (:class:`NodesMissing`);
- Ctrl-C ends the wait at once with one line and exit code 130: the rendezvous blocks in C++,
  where Python's own handler would not run until the timeout, so the signal is read from
  Python's wakeup file descriptor (``signal.set_wakeup_fd``) by the waiting thread.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time

WAITING_INTERVAL_ENV = "RAGGEDVL_WAITING_INTERVAL_S"
WAITING_INTERVAL_S = float(os.environ.get(WAITING_INTERVAL_ENV, "30"))  # between two "waiting for nodes" lines
STATIC_TIMEOUT_S = 900  # torchrun's default rendezvous timeout (LaunchConfig), read by the static backend
JOIN_TIMEOUT_S = 600  # torchrun's default join_timeout of the dynamic (c10d) backend
_JOINED_KEY = "raggedvl/joined/{run_id}"


class NodesMissing(RuntimeError):
    """The rendezvous did not complete: the one line the agent prints for it."""


def join_timeout(args) -> int:
    """The rendezvous timeout torchrun applies for parsed torchrun ``args``, in seconds; for the
    static backend, ``join_timeout`` in ``--rdzv-conf`` becomes its ``timeout`` (module docstring),
    so ``args.rdzv_conf`` may be extended."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    conf = _parse_rendezvous_config(args.rdzv_conf)
    if args.rdzv_backend != "static":
        return int(conf.get("join_timeout", JOIN_TIMEOUT_S))
    if "timeout" not in conf and "join_timeout" in conf:
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"timeout={conf['join_timeout']}"]))
        conf["timeout"] = conf["join_timeout"]
    return int(conf.get("timeout", STATIC_TIMEOUT_S))


class NodeWait:
    """Shows the wait of one rendezvous (module docstring); use as a context manager around it,
    in the main thread. ``endpoint``: ``HOST:PORT``; ``nodes``: the nodes the job needs;
    ``timeout_s``: the join timeout in seconds; ``run_id``: torchrun's ``--rdzv-id``."""

    def __init__(self, endpoint: str, nodes: int, timeout_s: int, run_id: str) -> None:
        self.endpoint, self.nodes, self.timeout_s, self.run_id = endpoint, nodes, timeout_s, run_id
        self.joined = 1  # this node, until the store says how many
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._wakeup: tuple[int, int] | None = None
        self._previous_fd = -1

    def line(self) -> str:
        return f"{self.joined} of {self.nodes} joined (rdzv {self.endpoint}, timeout {self.timeout_s} s)"

    def __enter__(self) -> NodeWait:
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._wakeup = (read, write)
        self._previous_fd = signal.set_wakeup_fd(write)
        self._thread = threading.Thread(target=self._run, name="raggedvl-node-wait", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        signal.set_wakeup_fd(self._previous_fd)
        os.write(self._wakeup[1], b"\0")  # wakes the thread up to see that it is done
        self._thread.join(timeout=10)
        for fd in self._wakeup:
            os.close(fd)

    def _run(self) -> None:
        client = None
        next_line = time.monotonic() + WAITING_INTERVAL_S
        while not self._done.is_set():
            if client is None:
                client = self._announce()
            elif (count := _read_count(client, self.run_id)) is not None:
                self.joined = max(count, 1)
            wait = max(0.0, min(1.0, next_line - time.monotonic()))
            readable, _, _ = select.select([self._wakeup[0]], [], [], wait)
            if self._done.is_set():
                return
            if readable and signal.SIGINT in os.read(self._wakeup[0], 64):
                print(f"raggedvl: stopped by Ctrl-C while waiting for nodes: {self.line()}", file=sys.stderr, flush=True)
                os._exit(128 + signal.SIGINT)
            if time.monotonic() >= next_line:
                print(f"raggedvl: waiting for nodes: {self.line()}", file=sys.stderr, flush=True)
                next_line += WAITING_INTERVAL_S

    def _announce(self):
        """A client of the rendezvous store that has counted this node, or None while nothing
        answers at the endpoint (probed with a plain socket first: a store client retrying a
        closed port would log each attempt)."""
        from torch.distributed.elastic.utils.distributed import create_c10d_store

        host, _, port = self.endpoint.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            client = create_c10d_store(False, host, int(port), timeout=10, wait_for_workers=False)
            self.joined = max(int(client.add(_JOINED_KEY.format(run_id=self.run_id), 1)), 1)
            return client
        except Exception:  # noqa: BLE001 - not up yet (or not a TCP store): count this node alone
            return None


def _read_count(client, run_id: str) -> int | None:
    try:
        return int(client.add(_JOINED_KEY.format(run_id=run_id), 0))
    except Exception:  # noqa: BLE001 - store gone (the rendezvous is ending): keep the last count
        return None


def show_waits(args) -> None:
    """Wrap torchrun's ``SimpleElasticAgent._rendezvous`` (private; a torch without it keeps its
    own behaviour) for the parsed torchrun ``args`` of a multi-node job: the wait is shown, and a
    rendezvous that fails raises :class:`NodesMissing` with the line to print."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.run import get_rdzv_endpoint, parse_min_max_nnodes

    rendezvous = getattr(api.SimpleElasticAgent, "_rendezvous", None)
    if rendezvous is None:
        return
    endpoint = get_rdzv_endpoint(args)
    nodes = parse_min_max_nnodes(args.nnodes)[0]
    timeout_s = join_timeout(args)
    same = (f"--nnodes {args.nnodes}, --node-rank 0 to {nodes - 1}, the same --rdzv-endpoint" if args.rdzv_backend == "static"
            else f"--nnodes {args.nnodes}, the same --rdzv-endpoint and --rdzv-id")

    def shown(self, worker_group):
        wait = NodeWait(endpoint, nodes, timeout_s, str(args.rdzv_id))
        try:
            with wait:
                return rendezvous(self, worker_group)
        except Exception as exc:  # noqa: BLE001 - one line for the job
            text = " ".join(str(exc).split())
            if "Timed out" in text or "timed out" in text or type(exc).__name__ == "RendezvousTimeoutError":
                raise NodesMissing(
                    f"the nodes did not join within the join timeout: {wait.line()}; start the same command on "
                    f"every node ({same}), or wait longer with --rdzv-conf join_timeout=SECONDS") from exc
            raise NodesMissing(f"rendezvous at {endpoint} failed: {type(exc).__name__}: {text}") from exc

    api.SimpleElasticAgent._rendezvous = shown
