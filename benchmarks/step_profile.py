"""Where the 1-process ``raggedvl train`` step and start-up spend their time (issue 17 item 2).

    python benchmarks/step_profile.py                       # rdocs, tiny model, global batch 8, 12 steps
    python benchmarks/step_profile.py --max-pixels 200704 --top 15

Start-up (outside the training loop), each phase timed once in this process: ``import raggedvl.cli``
and the heavy imports it pulls in, the data build (``load_splits``: rdocs from the cache), the cost
scan (``estimate_train_costs``: image headers through the resize rule), the model build, the
sampler and the optimizer (``Trainer.__init__`` as a whole). Then ``--steps`` training steps of
``Trainer.train_step`` in one process (no process group, as ``--nproc-per-node 1`` runs a rank),
the first ``--warmup`` untimed, batches drawn from ``Trainer.batch_stream`` as the loop draws them
(``--extra '--data-workers 0'`` collates on the training thread; the wait for a batch counts):
wall seconds per step and a ``torch.profiler`` table of the top operators by self CPU time over
the timed steps; then one more step counting the reads of tensor values into Python (``HostReads``:
each is a device sync on a GPU) by caller. One thread
(``OMP_NUM_THREADS=1``) unless ``--threads``. Figures on a shared machine vary with its load:
compare runs made back to back.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--max-train-samples", type=int, default=256)
    p.add_argument("--max-pixels", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--data-cache", default=None)
    p.add_argument("--extra", default="", help="more `raggedvl train` flags, e.g. '--packing true'")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    t0 = time.perf_counter()
    import raggedvl.cli  # noqa: F401 - what `raggedvl train` imports first

    t_import_cli = time.perf_counter() - t0
    import torch

    torch.set_num_threads(args.threads)
    t1 = time.perf_counter()
    from raggedvl.train.config import TrainConfig
    from raggedvl.train.loop import Trainer

    t_import_loop = time.perf_counter() - t1
    import shlex

    from raggedvl.options import values_from
    from raggedvl.train.config import add_config_arguments

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    extra = values_from(parser.parse_args(shlex.split(args.extra)), TrainConfig)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"raggedvl-step-profile-{os.getpid()}"
    cfg = TrainConfig(global_batch_size=args.global_batch_size, max_train_samples=args.max_train_samples,
                      max_pixels=args.max_pixels, eval_before=False, eval_after=False, checkpoint_every=10**6,
                      max_steps=args.steps, output_dir=str(out), data_cache=args.data_cache, **extra)
    from raggedvl.parallel.runtime import init_distributed
    from raggedvl.train import setup

    timings: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            s = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timings[name] = timings.get(name, 0.0) + time.perf_counter() - s
        return wrapper

    setup.load_splits = timed("data build (load_splits)", setup.load_splits)
    setup.estimate_train_costs = timed("cost scan (estimate_train_costs)", setup.estimate_train_costs)
    setup.build_model = timed("model build", setup.build_model)
    info = init_distributed()
    t2 = time.perf_counter()
    trainer = Trainer(cfg, info)
    t_init = time.perf_counter() - t2
    print(f"start-up, one process ({torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}):")
    print(f"  import raggedvl.cli            {t_import_cli:6.2f} s")
    print(f"  import the training loop       {t_import_loop:6.2f} s  (torch, transformers, raggedvl.train)")
    for name, s in timings.items():
        print(f"  {name:<30} {s:6.2f} s")
    print(f"  Trainer.__init__ in all        {t_init:6.2f} s")

    batches = trainer.batch_stream()  # collated as Trainer.run draws them (--data-workers processes ahead)
    for _ in range(args.warmup):
        trainer.train_step(next(batches))
    from torch.profiler import ProfilerActivity, profile

    walls = []
    cpu0 = time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps - args.warmup):
            s = time.perf_counter()
            trainer.train_step(next(batches))  # the wait for the batch counts
            walls.append(time.perf_counter() - s)
    cpu = time.process_time() - cpu0
    n = len(walls)
    print(f"\n{n} timed steps, global batch {cfg.global_batch_size}: {sum(walls) / n:.3f} s/step "
          f"(min {min(walls):.3f}), {cfg.global_batch_size * n / sum(walls):.2f} samples/s, "
          f"training process CPU {cpu / n:.3f} s/step (profiler included; worker processes not counted), "
          f"load average {os.getloadavg()[0]:.1f}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    print(table)
    batch = next(batches)
    with HostReads() as reads:
        trainer.train_step(batch)
    print(f"host reads of tensor values in one step (each a device sync on a GPU): {sum(reads.counts.values())}")
    for where, n in reads.counts.most_common(args.top):
        print(f"  {n:5d}  {where}")
    return 0


class HostReads:
    """Counts reads of tensor values into Python (``item``, ``tolist``, ``bool``/``float``/``int``
    of a tensor, ``numpy``) while active, by the first caller outside torch (and the torch function
    that read it, if any): on a GPU each read of a device tensor waits for the device's queue to
    drain. CPU tensors are counted alike, so the count is the same on CPU and GPU for the same code
    path; some are CPU-resident on a GPU too (AdamW's step counters, the batch's host copy, counts
    lists), and those cost no sync there."""

    METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")

    def __enter__(self):
        import collections
        import sys

        import torch

        self.counts = collections.Counter()
        self.saved = {m: getattr(torch.Tensor, m) for m in self.METHODS}

        def wrap(name, fn):
            def counted(t, *a, **k):
                f = inner = sys._getframe(1)
                while f is not None and "/torch/" in f.f_code.co_filename:
                    f = f.f_back
                where = "?" if f is None else f"{f.f_globals.get('__name__', '?')}.{f.f_code.co_name}"
                if inner is not f:  # read inside torch (e.g. the optimizer's step counters): name it
                    where += f" via {inner.f_globals.get('__name__', '?')}.{inner.f_code.co_name}"
                self.counts[f"{where} ({name})"] += 1
                return fn(t, *a, **k)
            return counted

        for m, fn in self.saved.items():
            setattr(torch.Tensor, m, wrap(m, fn))
        return self

    def __exit__(self, *exc):
        import torch

        for m, fn in self.saved.items():
            setattr(torch.Tensor, m, fn)
        return False


if __name__ == "__main__":
    raise SystemExit(main())
