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
the timed steps. One thread
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
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps - args.warmup):
            s = time.perf_counter()
            trainer.train_step(next(batches))  # the wait for the batch counts
            walls.append(time.perf_counter() - s)
    n = len(walls)
    print(f"\n{n} timed steps, global batch {cfg.global_batch_size}: {sum(walls) / n:.3f} s/step "
          f"(min {min(walls):.3f}), {cfg.global_batch_size * n / sum(walls):.2f} samples/s")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
