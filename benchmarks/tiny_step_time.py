"""Forward + backward time of the tiny retriever on 8 queries + 8 rendered R-manual pages.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tiny_step_time.py

One process, one thread (the default job runs 2 such processes with 4 + 4 each). Prints a table
per image budget (max_pixels): mean patch rows and visual tokens per page, seconds per step
(median of the timed steps), the ratio to the smallest budget, and the machine with its load.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, str(Path(__file__).parent))
import tiny_recipe as tr  # noqa: E402  (shared helpers of the recipe benchmark)

from raggedvl.data.rdocs import DEFAULT_JOB_DEV_PAIRS, DEFAULT_JOB_TRAIN_PAIRS, build_rdocs  # noqa: E402
from raggedvl.models import TinySizes, build_retriever  # noqa: E402


def main(budgets=(100_352, 200_704, 301_056), steps=5) -> None:
    torch.set_num_threads(1)
    root = build_rdocs(train_limit=DEFAULT_JOB_TRAIN_PAIRS, dev_limit=DEFAULT_JOB_DEV_PAIRS)
    records = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines()]
    records = [r for r in records if r["split"] == "train"][: 8 * (steps + 1)]
    tok = tr.make_tokenizer(["Query: " + r["query"] for r in records] + [tr.DOC_PROMPT], 2048)
    image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
    model = build_retriever("tiny", processor=tok, tiny_sizes=TinySizes(), seed=0)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for budget in budgets:
        items = tr.encode_items(records, root, tok, Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=budget))
        times = []
        for step in range(steps + 1):
            idx = list(range(8 * step, 8 * step + 8))
            t0 = time.perf_counter()
            q, d = tr.encode(model, items, idx, tok, image_token_id)
            loss = F.cross_entropy(tr.maxsim(q, d) / 0.02, torch.arange(8))
            loss.backward()
            model.zero_grad(set_to_none=True)
            if step:  # the first step warms up allocator and kernels
                times.append(time.perf_counter() - t0)
        patches = statistics.mean(float(it[3].prod()) for it in items)
        rows.append((budget, patches, patches / 4, statistics.median(times)))
    print(f"tiny retriever ({params / 1e6:.2f} M parameters, TinySizes defaults), 8 queries + 8 pages, fwd+bwd, 1 thread")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    print("| max_pixels | patch rows / page | visual tokens / page | s / step | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for budget, patches, tokens, sec in rows:
        print(f"| {budget} | {patches:.0f} | {tokens:.0f} | {sec:.2f} | {sec / rows[0][3]:.2f} |")


if __name__ == "__main__":
    main()
