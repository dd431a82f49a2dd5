"""Build time of the embedded rdocs dataset and the tiny tokenizer, and collation throughput.

Usage: OMP_NUM_THREADS=1 python benchmarks/rdocs_build.py [--skip-full]

Builds into a fresh temporary cache (nothing is reused): the default job's subset
(DEFAULT_JOB_TRAIN_PAIRS + DEFAULT_JOB_DEV_PAIRS), then the full set, then the tiny tokenizer.
Then collates the subset's train pairs in batches of 8 with ``RetrievalCollator`` (which
pre-resizes each page to the processor's own target size with transformers' default torchvision kernel,
computed with torch: ``raggedvl.images.resize_image``) and with the
bare processor on the same decoded images, and prints the ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

from raggedvl.data import (
    DEFAULT_JOB_DEV_PAIRS,
    DEFAULT_JOB_TRAIN_PAIRS,
    DOC_TEMPLATE,
    RetrievalCollator,
    RetrievalDataset,
    build_processor,
    build_rdocs,
)
from raggedvl.data.rdocs import all_pairs


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def _timed(fn):
    """(value, wall seconds); CPU seconds of the call are appended to CPU_SECONDS."""
    start, cpu = time.perf_counter(), time.process_time()
    value = fn()
    CPU_SECONDS.append(time.process_time() - cpu)
    return value, time.perf_counter() - start


CPU_SECONDS: list[float] = []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-full", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        _, plan_s = _timed(all_pairs)
        plan_cpu = CPU_SECONDS[-1]
        rows.append(("plan all pairs (outlines + help titles)", plan_s, plan_cpu, len(all_pairs()), None))
        subset, sub_s = _timed(lambda: build_rdocs(cache, train_limit=DEFAULT_JOB_TRAIN_PAIRS, dev_limit=DEFAULT_JOB_DEV_PAIRS))
        rows.append((f"build default-job subset ({DEFAULT_JOB_TRAIN_PAIRS}+{DEFAULT_JOB_DEV_PAIRS})", plan_s + sub_s, plan_cpu + CPU_SECONDS[-1],
                     DEFAULT_JOB_TRAIN_PAIRS + DEFAULT_JOB_DEV_PAIRS, _size_mb(subset)))
        if not args.skip_full:
            full, full_s = _timed(lambda: build_rdocs(cache))
            rows.append(("build full set", plan_s + full_s, plan_cpu + CPU_SECONDS[-1], len(all_pairs()), _size_mb(full)))
        processor, tok_s = _timed(lambda: build_processor("tiny", cache_dir=cache))
        rows.append(("train tiny tokenizer (4,096 tokens)", tok_s, CPU_SECONDS[-1], None, None))

        train = RetrievalDataset.from_manifest(subset, "train", limit=64)
        examples = [train[i] for i in range(len(train))]
        collate = RetrievalCollator(processor)
        batches = [examples[i:i + 8] for i in range(0, len(examples), 8)]
        _, ours = _timed(lambda: [collate(b) for b in batches])
        _, bare = _timed(lambda: [processor(text=[DOC_TEMPLATE] * len(b), images=[e["image"] for e in b],
                                            padding="longest", return_tensors="pt") for b in batches])
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} logical cores, "
          f"python {platform.python_version()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; one process")
    print(f"{'step (plan time included in builds)':52s} {'wall s':>7s} {'CPU s':>7s} {'pairs':>6s} {'MB on disk':>10s}")
    for name, seconds, cpu, pairs, mb in rows:
        print(f"{name:52s} {seconds:7.1f} {cpu:7.1f} {'' if pairs is None else pairs:>6} {'' if mb is None else f'{mb:.0f}':>10}")
    print(f"peak RSS {peak_mb:.0f} MB")
    n = len(examples)
    print(f"collate {n} decoded train pairs, batch 8: RetrievalCollator {n / ours:.1f} pairs/s (queries + docs), "
          f"bare processor (docs only) {n / bare:.1f} pairs/s; speed ratio {bare / ours:.2f}x "
          f"(CPU s {CPU_SECONDS[-2]:.2f} vs {CPU_SECONDS[-1]:.2f})")


if __name__ == "__main__":
    main()
