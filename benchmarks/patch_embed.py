"""Patch embedding: transformers' Conv3d against raggedvl's matrix product (raggedvl.models.patch_embed).

    OMP_NUM_THREADS=1 python benchmarks/patch_embed.py [--repeats 5] [--device cpu|cuda] [--dtype float32|bfloat16]

Forward + backward (weight gradient; pixel rows take none, as in training) of one patch
embedding, [P, 1176] pixel rows -> [P, D], the two variants interleaved, `--repeats` timed calls
each after one warm-up, median. Rows: the tiny preset's tower (D 32) at a step's worth of
patches of workload (a) and (b) of BENCHMARKS.md section 9, and Qwen2-VL-2B's tower (D 1,280).
Prints milliseconds, the ratio and the largest difference of outputs and weight gradients.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from raggedvl.models import WholePatchConv3d

SHAPES = [  # (label, patch rows P, embed dim D)
    ("tiny tower, one step of workload (a): 8 pages", 7_200, 32),
    ("tiny tower, one rank's step of workload (b)", 16_600, 32),
    ("Qwen2-VL-2B tower (D 1,280), 4 pages", 4_000, 1_280),
]


def _timed(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, sync) -> float:
    module.weight.grad = None
    sync()
    start = time.perf_counter()
    module(x).backward(grad_out)
    sync()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, {device}, {args.dtype}, {torch.get_num_threads()} thread(s), "
          f"median of {args.repeats}\n")
    print("| shape | rows P | D | Conv3d ms | matrix product ms | conv / matmul | max abs diff out | max rel diff grad |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows, dim in SHAPES:
        torch.manual_seed(0)
        conv = nn.Conv3d(3, dim, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False).to(device, dtype)
        fast = copy.deepcopy(conv)
        fast.__class__ = WholePatchConv3d
        x = torch.randn(rows, 3, 2, 14, 14, device=device, dtype=dtype)
        grad_out = torch.randn(rows, dim, 1, 1, 1, device=device, dtype=dtype)
        times = {"conv": [], "fast": []}
        for module in (conv, fast):  # warm-up
            _timed(module, x, grad_out, sync)
        for _ in range(args.repeats):
            times["conv"].append(_timed(conv, x, grad_out, sync))
            times["fast"].append(_timed(fast, x, grad_out, sync))
        c, f = (statistics.median(times[k]) * 1000 for k in ("conv", "fast"))
        with torch.no_grad():
            out_diff = (conv(x) - fast(x)).abs().max().item()
        grad_diff = ((conv.weight.grad - fast.weight.grad).abs().max() / conv.weight.grad.abs().max()).item()
        print(f"| {label} | {rows:,} | {dim:,} | {c:.1f} | {f:.1f} | {c / f:.2f} | {out_diff:.1e} | {grad_diff:.1e} |")


if __name__ == "__main__":
    main()
