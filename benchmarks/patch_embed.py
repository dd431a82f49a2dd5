"""Patch embedding: transformers' Conv3d against raggedvl's matrix product (raggedvl.models.patch_embed).

    OMP_NUM_THREADS=1 python benchmarks/patch_embed.py [--repeats 5] [--device cpu|cuda] [--dtype float32|bfloat16]

Forward + backward (weight gradient; pixel rows take none, as in training) of one patch
embedding, [P, 1176] pixel rows -> [P, D], the two variants interleaved, `--repeats` timed calls
each after one warm-up, median. Rows: the tower of colpali-engine's tiny fixture (D 32, the
checkpoint of BENCHMARKS.md section 9) at a step's worth of patches of its workloads (a) and
(b), raggedvl's tiny preset (D 64, `raggedvl train`'s default job) and Qwen2-VL-2B's tower
(D 1,280).
Prints milliseconds, the ratio and the largest differences of outputs and weight gradients
(relative to the convolution's largest value). ``compare`` is also the GPU check's
(``benchmarks/gpu/checks.py``).
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
    ("colpali fixture's tower (D 32), one step of workload (a): 8 pages", 7_200, 32),
    ("colpali fixture's tower (D 32), one rank's step of workload (b)", 16_600, 32),
    ("tiny preset's tower (D 64), one step of the default job: 8 pages", 4_000, 64),
    ("Qwen2-VL-2B tower (D 1,280), 4 pages", 4_000, 1_280),
]


def compare(rows: int, dim: int, device, dtype, repeats: int = 5) -> dict[str, float]:
    """transformers' patch Conv3d and ``WholePatchConv3d`` (same weight) on ``rows`` random
    pixel rows at embed dim ``dim``: median milliseconds of forward + backward over ``repeats``
    interleaved calls after one warm-up, and the largest differences of outputs and weight
    gradients, relative to the convolution's largest value."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    conv = nn.Conv3d(3, dim, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False).to(device, dtype)
    fast = copy.deepcopy(conv)
    fast.__class__ = WholePatchConv3d
    x = torch.randn(rows, 3, 2, 14, 14, device=device, dtype=dtype)
    grad_out = torch.randn(rows, dim, 1, 1, 1, device=device, dtype=dtype)
    times: dict[str, list[float]] = {"conv": [], "matmul": []}
    results = {}
    for i in range(repeats + 1):  # the first round warms up
        for name, module in (("conv", conv), ("matmul", fast)):
            module.weight.grad = None
            sync()
            start = time.perf_counter()
            out = module(x)
            out.backward(grad_out)
            sync()
            if i:
                times[name].append((time.perf_counter() - start) * 1000)
            results[name] = (out.detach().float(), module.weight.grad.float())
    (out_c, grad_c), (out_m, grad_m) = results["conv"], results["matmul"]
    return {"conv_ms": statistics.median(times["conv"]), "matmul_ms": statistics.median(times["matmul"]),
            "out_rel_diff": float((out_c - out_m).abs().max() / out_c.abs().max()),
            "grad_rel_diff": float((grad_c - grad_m).abs().max() / grad_c.abs().max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {device}, {args.dtype}, {torch.get_num_threads()} thread(s), "
          f"median of {args.repeats}\n")
    print("| shape | rows P | D | Conv3d ms | matrix product ms | conv / matmul | max rel diff out | max rel diff grad |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows, dim in SHAPES:
        r = compare(rows, dim, device, dtype, args.repeats)
        print(f"| {label} | {rows:,} | {dim:,} | {r['conv_ms']:.1f} | {r['matmul_ms']:.1f} | "
              f"{r['conv_ms'] / r['matmul_ms']:.2f} | {r['out_rel_diff']:.1e} | {r['grad_rel_diff']:.1e} |")


if __name__ == "__main__":
    main()
