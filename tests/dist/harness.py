"""Run a function on W real gloo processes (STYLE.md item 10, tier c).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, each of which
joins a gloo process group through a file store (no fixed ports), sets
``OMP_NUM_THREADS=1``, calls ``fn(rank, world_size, *args)`` and sends back its return value.
The parent returns the list of per-rank results, or raises with every failing rank's
traceback.

Two bounds, so that a loaded machine (slow interpreter start-up and imports) is not mistaken
for a hang while a real hang still fails the test:

- start-up: every rank must arrive (interpreter started, ``fn``'s module and torch imported)
  within ``startup_timeout`` seconds (300 by default). A rank that exits first is reported at
  once with its exit code; one that never arrives is named when the bound expires.
- run: ``timeout`` seconds (60 by default) counted from the moment the last rank arrived,
  stretched by the slowdown measured during start-up (each rank's start-up wall time over its
  CPU time: about 1 on an idle machine, about N / cores with N busy processes; clipped to
  [1, 10], see tests/slowdown.py). The ranks wait for each other there and only then create the
  process group (whose collectives get the same bound), so the run bound covers rendezvous,
  ``fn`` and nothing else. A rank still running at the bound (stuck in a collective, or
  looping) is named, its Python stack is printed to stderr (``faulthandler``), and it is killed.

``fn`` must be a module-level function (it is pickled by reference for the spawn start method).
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

from tests import slowdown

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_STARTUP_TIMEOUT_S = 300.0
_ARRIVED, _DONE, _FAILED = "arrived", "done", "failed"
SLOWDOWN_ENV = "RAGGEDVL_TEST_SLOWDOWN"


def rank_slowdown() -> float:
    """Inside ``fn``: the slowdown factor the run bound was stretched by (1 on an idle machine);
    a test that bounds a duration of CPU work inside ``fn`` scales its bound by it."""
    return float(os.environ.get(SLOWDOWN_ENV, "1"))


def _worker(fn, rank, world_size, init_file, queue, go, bound, timeout, args, kwargs, startup_timeout_s):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    import faulthandler

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    queue.put((rank, _ARRIVED, time.process_time()))  # CPU seconds this process used to start
    if not go.wait(startup_timeout_s):  # the parent gave up on start-up: leave quietly
        return
    timeout_s = bound.value  # the run bound, set by the parent before ``go``
    os.environ[SLOWDOWN_ENV] = repr(timeout_s / timeout)  # for fn's own timing claims (rank_slowdown)
    faulthandler.dump_traceback_later(timeout_s, exit=False)  # a hung rank shows where it hangs
    try:
        dist.init_process_group(
            backend="gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, _DONE, result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, _FAILED, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_codes(procs, ranks) -> str:
    return ", ".join(f"rank {r}: " + ("running" if procs[r].exitcode is None else f"exit code {procs[r].exitcode}") for r in ranks)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo processes.

    ``timeout`` (seconds) bounds the run from the moment every rank has arrived (start-up
    excluded), stretched by the slowdown measured at start-up (module docstring);
    ``startup_timeout`` bounds the start-up. Returns the per-rank return values
    (which must be picklable; move tensors to CPU). Raises ``RuntimeError`` naming each failed
    rank with its traceback, the ranks that did not arrive within ``startup_timeout`` or exited
    before arriving, or the ranks that did not finish within ``timeout`` after the rendezvous
    (those processes are killed).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    go = ctx.Event()
    bound = ctx.Value("d", float(timeout))
    results: dict[int, tuple[bool, Any]] = {}
    arrived: set[int] = set()
    problems: list[str] = []
    launched = time.monotonic()
    slow = 1.0  # the largest start-up wall / CPU time ratio of the ranks
    with tempfile.TemporaryDirectory(prefix="raggedvl-dist-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, init_file, queue, go, bound, timeout, args, kwargs, startup_timeout),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = launched + startup_timeout
        rendezvous_at = None
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, kind, value = queue.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                gone = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if gone and queue.empty():
                    time.sleep(0.5)  # a result put just before exiting may still be in flight
                    if queue.empty():
                        phase = "before the rendezvous" if rendezvous_at is None else "without reporting a result"
                        problems.append(f"ranks {gone} exited {phase} ({_exit_codes(procs, gone)})")
                        break
                continue
            if kind == _ARRIVED:
                arrived.add(rank)
                slow = max(slow, (time.monotonic() - launched) / max(value, 1e-3))
                if len(arrived) == world_size:
                    rendezvous_at = time.monotonic()
                    bound.value = timeout * slowdown.clip(slow)
                    deadline = rendezvous_at + bound.value
                    go.set()
            else:
                results[rank] = (kind == _DONE, value)
        missing = sorted(set(range(world_size)) - set(results))
        if missing and not problems:
            if rendezvous_at is None:
                late = sorted(set(range(world_size)) - arrived)
                problems.append(
                    f"ranks {late} did not start (interpreter, imports) within startup_timeout={startup_timeout:.0f} s "
                    f"({_exit_codes(procs, late)}); ranks {sorted(arrived)} had arrived"
                )
            else:
                problems.append(
                    f"ranks {missing} returned nothing within {bound.value:.0f} s after the rendezvous (timeout "
                    f"{timeout:.0f} s x slowdown {slowdown.clip(slow):.1f}; all ranks had started "
                    f"{rendezvous_at - launched:.1f} s after launch): a hang, e.g. a rank stuck in a collective; "
                    f"stacks of the ranks still running at the bound are on stderr ({_exit_codes(procs, missing)})"
                )
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    if failed or problems:
        msg = [f"distributed run of {fn.__name__} on {world_size} ranks failed"]
        for r, tb in sorted(failed.items()):
            msg.append(f"--- rank {r} raised:\n{tb}")
        msg.extend(f"--- {line}" for line in problems)
        raise RuntimeError("\n".join(msg))
    return [results[r][1] for r in range(world_size)]
