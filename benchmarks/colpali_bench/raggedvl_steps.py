"""The first K steps of a ``raggedvl train`` run, for the loss-curve comparison (BENCHMARKS.md).

    python -m torch.distributed.run --standalone --nproc-per-node W raggedvl_steps.py \\
        --out OUT.json --stop-after K [--adamw default|foreach|fused] [--l2-eps E] -- TRAIN FLAGS...

``TRAIN FLAGS`` are ``raggedvl train``'s own (parsed and validated by its CLI parser); the run is
``raggedvl.app.loop.Trainer`` exactly as ``raggedvl train`` builds it, stepped K times with
``Trainer.train_step`` while the learning-rate schedule spans ``--max-steps`` (so K steps of a
200-step run see the 200-step schedule). Two knobs exist only here, to test differences from
colpali-engine that raggedvl does not expose: ``--adamw`` rebuilds the optimizer as
``torch.optim.AdamW`` with ``foreach=True`` or ``fused=True`` (the HF Trainer's default on CPU is
fused) and re-attaches the schedule; ``--l2-eps`` sets the head's L2-normalisation epsilon
(colpali-engine divides by the norm with no epsilon; 1e-12 stands for that).

Rank 0 writes ``OUT.json``: per step the global loss, this rank's documents' mean pairwise cosine
(mean-pooled embeddings) and the learning rate the step ran at.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from colpali_bench.raggedvl_side import validate_argv  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stop-after", type=int, required=True)
    p.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--l2-eps", type=float, default=None)
    p.add_argument("train", nargs=argparse.REMAINDER)
    args = p.parse_args()
    train_argv = args.train[1:] if args.train[:1] == ["--"] else args.train
    cfg = validate_argv(["train", *train_argv])

    from raggedvl.parallel import init_distributed, shutdown, unwrap_model
    from raggedvl.app.loop import Trainer
    from raggedvl.app.lr_schedule import make_scheduler

    torch.set_num_threads(1)
    info = init_distributed(timeout_s=cfg.collective_timeout_s)
    trainer = Trainer(cfg, info)
    model = unwrap_model(trainer.model)
    if args.l2_eps is not None:
        model.head.eps = args.l2_eps
    if args.adamw != "default":
        groups = model.parameter_groups(cfg.lr, cfg.head_lr, cfg.weight_decay)
        trainer.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, **{args.adamw: True})
        trainer.scheduler = make_scheduler(trainer.optimizer, cfg, trainer.total_steps)
    steps = []
    batches = trainer.batch_stream()
    for _ in range(min(args.stop_after, trainer.total_steps)):
        lr = trainer.optimizer.param_groups[0]["lr"]
        r = trainer.train_step(next(batches))
        trainer.step += 1
        steps.append({"step": trainer.step, "loss": r.loss, "doc_cosine": r.doc_cosine, "lr": lr})
        if info.is_main:
            print(f"step {trainer.step} loss {r.loss:.4f} doc cosine {r.doc_cosine:.5f}", flush=True)
    if info.is_main:
        Path(args.out).write_text(json.dumps({"config": cfg.to_dict(), "world_size": info.world_size,
                                              "adamw": args.adamw, "l2_eps": model.head.eps,
                                              "optimizer": repr(trainer.optimizer.defaults), "steps": steps}) + "\n")
    shutdown()


if __name__ == "__main__":
    main()
