"""Per-sample step costs of a workload: forward + backward of each (query, document) pair alone.

    python sample_costs.py --spec SPEC.json        (one thread; run by vs_colpali.py)

The model is built as ``raggedvl train`` builds it from the checkpoint (``build_retriever``,
full fine-tuning) and the pair is collated by raggedvl's ``RetrievalCollator`` at the workload's
max_pixels (collation is not timed). Each pair's time is the minimum over ``repeats`` timed
calls of ``raggedvl.sampling.measure_times`` (the best estimate of uncontended time on a shared
machine) after one untimed call on the first pair. Also written: the cost raggedvl's sampler
estimates for each pair from its image header (``raggedvl.app.setup.estimate_train_costs``, as
``raggedvl train`` computes it), which is what its plan balances.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from colpali_bench.raggedvl_side import train_argv, validate_argv
    from colpali_bench.settings import RunSettings
    from raggedvl.data import RetrievalCollator, build_processor, load_retrieval_dataset
    from raggedvl.images import ImagePolicy
    from raggedvl.models import build_retriever
    from raggedvl.sampling import measure_times
    from raggedvl.app.setup import estimate_train_costs

    s = RunSettings(**spec["settings"])
    cfg = validate_argv(train_argv(s, dataset=spec["train_parquet"], output_dir="/nonexistent", extra=[]))
    processor = build_processor(cfg.model, min_pixels=cfg.min_pixels, max_pixels=cfg.resolved_max_pixels)
    train = load_retrieval_dataset(spec["train_parquet"], split=cfg.train_split)
    estimated = estimate_train_costs(cfg, train, ImagePolicy.from_processor(processor)).costs.tolist()
    model = build_retriever(cfg.model, processor=processor, seed=cfg.seed)
    model.train()
    collate = RetrievalCollator(processor, prompts=model.config.prompts)
    limit = min(len(train), spec.get("limit") or len(train))

    def step(batch) -> None:
        q, d = model(queries=batch["queries"], docs=batch["docs"])
        (q.embeddings.sum() + d.embeddings.sum()).backward()
        model.zero_grad(set_to_none=True)

    measured = []
    t0 = time.perf_counter()
    for i in range(limit):
        batch = collate([train[i]])
        measured.append(float(measure_times(step, [batch], repeats=spec["repeats"], warmup=1 if i == 0 else 0, reduce="min")[0]))
    result = {
        "measured_s": measured, "estimated_cost": estimated[:limit],         "repeats": spec["repeats"], "wall_s": time.perf_counter() - t0,
    }
    Path(spec["out"]).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
