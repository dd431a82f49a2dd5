"""Peak memory and time of the late-interaction loss: blocked MaxSim vs the dense formula.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/loss_memory.py [--batch 64] [--full-batch 256]

Workload: global batch B queries x B documents, Lq 32, Ld 768, D 128, float32 on CPU,
one forward + backward of the late-interaction InfoNCE loss (temperature 0.02, normalised by
query length) with gradients for queries and documents. Documents keep 60-100% of their 768
vectors, queries 8-32 of their 32 tokens (masks as the model would return them).

- dense: the textbook formula, einsum into a ``[B, B, Lq, Ld]`` tensor, pads filled with -inf,
  amax, masked sum, cross-entropy (what most projects write).
- blocked: ``raggedvl.losses.LateInteractionLoss`` (blocked MaxSim, argmax-routed backward).

Each variant runs in a fresh subprocess; peak memory = the process's peak resident set size
(``ru_maxrss``) minus its resident size just before the loss (inputs already built), so it
counts every allocation of the loss's forward and backward, torch's included. Time = wall time of
the same single forward+backward (the first and only run, so the peak is not inflated by
repetitions), 1 thread. Both variants get identical inputs (same seed); the parent checks that
their losses and gradients agree. The dense variant at B = 256 needs about 6.4 GB per 4-D tensor
(>= 13 GB in all), which does not fit beside the other jobs of a shared 24 GB machine, so the
comparison runs at ``--batch`` (64 by default: dense memory grows with B^2, so the ratio at
256 is at least as large) and the blocked variant alone also runs at ``--full-batch``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import torch

from raggedvl.losses import LateInteractionLoss

LQ, LD, DIM, TEMPERATURE = 32, 768, 128, 0.02


def _inputs(batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(batch, LQ, DIM, generator=g), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(batch, LD, DIM, generator=g), dim=-1)
    q_valid = torch.randint(8, LQ + 1, (batch,), generator=g)
    d_valid = torch.randint(int(0.6 * LD), LD + 1, (batch,), generator=g)
    qm = torch.arange(LQ)[None] < q_valid[:, None]
    dm = torch.arange(LD)[None] < d_valid[:, None]
    return q * qm[..., None], qm, d * dm[..., None], dm


def _dense_loss(q, qm, d, dm):
    sim = torch.einsum("ild,jmd->ijlm", q, d)
    sim = sim.masked_fill(~dm[None, :, None, :], float("-inf"))
    best = sim.amax(dim=-1).masked_fill(~qm[:, None, :], 0.0)
    scores = best.sum(dim=-1) / qm.sum(dim=1, keepdim=True)
    return torch.nn.functional.cross_entropy(scores / TEMPERATURE, torch.arange(q.shape[0]))


def _blocked_loss(q, qm, d, dm):
    return LateInteractionLoss(TEMPERATURE, normalize_by_query_length=True)(q, qm, d, dm)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(variant: str, batch: int, grads_path: str) -> None:
    torch.set_num_threads(1)
    q, qm, d, dm = _inputs(batch)
    q.requires_grad_(True)
    d.requires_grad_(True)
    fn = _dense_loss if variant == "dense" else _blocked_loss
    base = _rss_bytes()
    start = time.perf_counter()
    loss = fn(q, qm, d, dm)
    loss.backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if grads_path:
        torch.save({"q": q.grad, "d": d.grad}, grads_path)
    print(json.dumps({"loss": loss.item(), "seconds": elapsed, "peak_bytes": peak - base}))


def _run(variant: str, batch: int, grads_path: str = "") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, "--batch", str(batch), "--grads", grads_path],
        check=True, capture_output=True, text=True, env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores (1 thread used), torch {torch.__version__}, {platform.python_version()}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="global batch for the dense comparison")
    parser.add_argument("--full-batch", type=int, default=256, help="global batch for blocked alone (0: skip)")
    parser.add_argument("--child", choices=["dense", "blocked"], help=argparse.SUPPRESS)
    parser.add_argument("--grads", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.batch, args.grads)
        return
    with tempfile.TemporaryDirectory() as tmp:
        paths = {v: os.path.join(tmp, f"{v}.pt") for v in ("dense", "blocked")}
        rows = {v: _run(v, args.batch, paths[v]) for v in ("dense", "blocked")}
        dense_g, blocked_g = (torch.load(paths[v], weights_only=True) for v in ("dense", "blocked"))
    grad_err = max((dense_g[k] - blocked_g[k]).abs().max().item() for k in ("q", "d"))
    grad_scale = max(dense_g[k].abs().max().item() for k in ("q", "d"))
    full = _run("blocked", args.full_batch) if args.full_batch else None
    mib = 1 << 20
    print(f"machine: {_machine()}")
    print(f"workload: Lq {LQ}, Ld {LD}, D {DIM}, float32, forward+backward, peak = ru_maxrss - RSS before loss")
    print()
    print("| variant | batch | peak memory (MiB) | time (s) | loss |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {args.batch} | {row['peak_bytes'] / mib:,.1f} | {row['seconds']:.2f} | {row['loss']:.6f} |")
    if full:
        print(f"| blocked | {args.full_batch} | {full['peak_bytes'] / mib:,.1f} | {full['seconds']:.2f} | {full['loss']:.6f} |")
    print()
    d, b = rows["dense"], rows["blocked"]
    print(f"at batch {args.batch}: dense/blocked peak memory = {d['peak_bytes'] / max(b['peak_bytes'], 1):.1f}x, "
          f"dense/blocked time = {d['seconds'] / b['seconds']:.2f}x")
    print(f"same values: |loss diff| = {abs(d['loss'] - b['loss']):.2e}, "
          f"max |grad diff| = {grad_err:.2e} (max |grad| {grad_scale:.2e})")


if __name__ == "__main__":
    main()
