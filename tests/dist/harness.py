"""Run a function on W real gloo processes (STYLE.md item 10, tier c).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, each of which
joins a gloo process group through a file store (no fixed ports), sets
``OMP_NUM_THREADS=1``, calls ``fn(rank, world_size, *args)`` and sends back its return value.
The parent returns the list of per-rank results, or raises with every failing rank's
traceback. The whole launch is bounded by ``timeout`` seconds (60 by default): a hang becomes
a test failure, never a stuck CI run.

``fn`` must be a module-level function (it is pickled by reference for the spawn start method).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60.0


def _worker(fn, rank, world_size, init_file, queue, args, kwargs, timeout_s):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend="gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo processes.

    Returns the per-rank return values (which must be picklable; move tensors to CPU).
    Raises ``RuntimeError`` naming each failed rank with its traceback, or naming the ranks
    that did not finish within ``timeout`` seconds (those processes are killed).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="raggedvl-dist-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, init_file, queue, args, kwargs, timeout),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, tuple[bool, Any]] = {}
        import queue as queue_mod
        import time

        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            results[rank] = (ok, value)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    missing = sorted(set(range(world_size)) - set(results))
    if failed or missing:
        msg = [f"distributed run of {fn.__name__} on {world_size} ranks failed"]
        for r, tb in sorted(failed.items()):
            msg.append(f"--- rank {r} raised:\n{tb}")
        if missing:
            msg.append(f"--- ranks {missing} returned nothing within {timeout:.0f} s (hang or crash)")
        raise RuntimeError("\n".join(msg))
    return [results[r][1] for r in range(world_size)]
