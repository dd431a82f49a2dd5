"""Start-up of ``raggedvl train`` on a 100,000-row parquet dataset of page images, or on 100,000
queries referring to a corpus of pages (``--layout beir``):
the launcher's data check (columns, queries, every image header: ``raggedvl.data.scan``), the
dataset open (``datasets.load_dataset`` of the parquet file), the size estimate and the
sampler's plan of the first epoch, cold (no size cache, no ``datasets`` cache) and warm.

    python benchmarks/startup_scale.py                       # build (once) and measure, 100,000 rows
    python benchmarks/startup_scale.py --rows 25000 --dir /tmp/x
    python benchmarks/startup_scale.py --layout beir         # 100,000 queries over a 20,000-page corpus

``--layout beir`` writes the same kind of pages as a BEIR folder (``corpus.parquet``: ``--pages``
distinct renderings, rdocs pairs at as many reduced resolutions as needed; ``queries.parquet``
and ``qrels.parquet``: query i's relevant page is page i mod pages) and runs the same phases on
``--dataset FOLDER``: every page is stored, scanned and decoded once however many queries refer
to it.

The dataset is built from the vendored R manuals: every rdocs pair (``raggedvl.data.rdocs``:
full pages, section crops, two-page spreads) is rendered at 4 reduced resolutions (30-45 % of
its rdocs dpi, greyscale PNG), and row i holds variant i mod V, so identical images are V rows
apart; each row has a query, the image (``datasets``' Image feature: PNG bytes) and an id.
Row groups of 1,000 rows. It goes under ``--dir`` (default ``$TMPDIR/raggedvl-startup-<rows>``),
with ``datasets``' cache beside it (``HF_DATASETS_CACHE``), never in the repository.

Each phase runs in a fresh process (``--phase``): ``cold`` first removes the size cache and
the ``datasets`` cache, ``warm`` runs right after with both in place. The job is the CLI's
``raggedvl train --dataset FILE --max-train-samples none --eval-before false --eval-after
false`` on 2 ranks, up to the sampler's plan (rank 0's view; the model is not built). Peak RSS:
the measuring process (``ru_maxrss``; its anonymous and file-backed parts sampled, see
``MemorySampler``) and, separately, the largest header-reading worker (``RUSAGE_CHILDREN``).
CPU seconds (all processes) beside the wall times: under load, wall time is CPU time stretched
by contention. The load average is printed with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROW_GROUP = 1000
SCALES = (0.30, 0.35, 0.40, 0.45)  # of each rdocs pair's dpi


def render(count: int) -> list[tuple[str, bytes]]:
    """``count`` distinct (query, PNG bytes) page renderings: every rdocs pair at 0.30, 0.35,
    0.40, 0.45 of its dpi, then 0.32, 0.37, ... as more are needed."""
    from dataclasses import replace

    from raggedvl.data.rdocs import all_pairs, open_manuals, png_bytes, render_pair

    manuals = open_manuals()
    plans = list(all_pairs())
    scales = list(SCALES) + [x + 0.02 for x in SCALES] + [x + 0.04 for x in SCALES] + [x - 0.02 for x in SCALES]
    variants = []
    t0 = time.perf_counter()
    for scale in scales:
        for plan in plans:
            if len(variants) == count:
                break
            low = replace(plan, dpi=max(18, round(plan.dpi * scale)))
            variants.append((plan.query, png_bytes(render_pair(manuals[plan.pdf], low))))
    print(f"rendered {len(variants)} page variants in {time.perf_counter() - t0:.1f} s, "
          f"{sum(len(b) for _, b in variants) / len(variants) / 1024:.1f} KiB each on average", flush=True)
    return variants


def build_beir(root: Path, rows: int, pages: int) -> None:
    """Write the BEIR folder of ``--layout beir`` (module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    variants = render(pages)
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    tmp = root.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(str(tmp / "corpus.parquet"), pa.schema([("corpus-id", pa.string()), ("image", image)])) as w:
        for start in range(0, len(variants), ROW_GROUP):
            part = range(start, min(len(variants), start + ROW_GROUP))
            w.write_table(pa.table({"corpus-id": [f"page-{p}" for p in part],
                                    "image": pa.array([{"bytes": variants[p][1], "path": None} for p in part],
                                                      type=image)}))
    pages = len(variants)
    pq.write_table(pa.table({"query-id": [f"q-{i}" for i in range(rows)],
                             "query": [f"{variants[i % pages][0]} (copy {i // pages})" for i in range(rows)]}),
                   tmp / "queries.parquet")
    pq.write_table(pa.table({"query-id": [f"q-{i}" for i in range(rows)],
                             "corpus-id": [f"page-{i % pages}" for i in range(rows)], "score": [1] * rows}),
                   tmp / "qrels.parquet")
    tmp.replace(root)


def build(path: Path, rows: int) -> None:
    """Write the ``rows``-row parquet file (module docstring)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raggedvl.data.rdocs import all_pairs

    variants = render(len(SCALES) * len(list(all_pairs())))
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image(),
                                  "id": datasets.Value("string")})
    schema = features.arrow_schema
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(str(tmp), schema) as writer:
        for start in range(0, rows, ROW_GROUP):
            chosen = [variants[i % len(variants)] for i in range(start, min(rows, start + ROW_GROUP))]
            batch = {"query": [f"{q} (copy {(start + j) // len(variants)})" for j, (q, _) in enumerate(chosen)],
                     "image": [{"bytes": b, "path": None} for _, b in chosen],
                     "id": [f"row-{start + j}" for j in range(len(chosen))]}
            writer.write_table(pa.Table.from_pydict(batch, schema=schema))
    tmp.replace(path)


class MemorySampler(threading.Thread):
    """Peak anonymous and file-backed resident memory of this process (``/proc/self/status``
    RssAnon, RssFile), sampled every ``interval_s``: pages of memory-mapped Arrow files count
    in RSS (and in ``ru_maxrss``) while they are touched, but the kernel reclaims them at will;
    RssAnon is the memory the process itself holds."""

    def __init__(self, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.interval_s, self.peak = interval_s, {"RssAnon": 0, "RssFile": 0}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            with open("/proc/self/status", encoding="ascii") as f:
                for line in f:
                    key = line.split(":", 1)[0]
                    if key in self.peak:
                        self.peak[key] = max(self.peak[key], int(line.split()[1]) // 1024)
            self.stop.wait(self.interval_s)


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def measure(data: Path, workers: int | None) -> dict:
    """One start-up in this process: the launcher's check, then what a rank does before its
    first step, minus the model."""
    memory = MemorySampler()
    memory.start()
    t0 = time.perf_counter()
    from raggedvl.app.config import TrainConfig
    from raggedvl.app.launch import check_data, check_names

    cfg = TrainConfig(dataset=str(data), max_train_samples=None, eval_before=False, eval_after=False,
                      global_batch_size=32)
    if workers is not None:
        from raggedvl.data import scan

        scan.PARALLEL_ROWS = 0 if workers > 1 else 10**12  # the benchmark forces serial or parallel reads
    t1, c1 = time.perf_counter(), _cpu_s()
    check_names(cfg)
    check_data(cfg)
    t2, c2 = time.perf_counter(), _cpu_s()
    from raggedvl.parallel import DistInfo
    from raggedvl.app.setup import make_sampler, prepare_run_data

    t3, c3 = time.perf_counter(), _cpu_s()
    run = prepare_run_data(cfg)
    t4, c4 = time.perf_counter(), _cpu_s()
    import torch

    sampler = make_sampler(cfg, run.costs, DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"),
                                                    backend="none"))
    steps = len(sampler)  # plans the whole epoch
    t5, c5 = time.perf_counter(), _cpu_s()
    memory.stop.set()
    memory.join()
    return {
        "rows": len(run.train_set), "steps": steps,
        "launcher_imports_s": t1 - t0, "launcher_check_s": t2 - t1, "rank_imports_s": t3 - t2,
        "open_data_s": run.phases_s["data"], "cost_scan_s": run.phases_s["cost_scan"], "sampler_plan_s": t5 - t4,
        "total_s": t5 - t0, "check_cpu_s": c2 - c1, "data_cpu_s": c4 - c3, "plan_cpu_s": c5 - c4, "total_cpu_s": c5,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_anon_mib": memory.peak["RssAnon"], "peak_file_mib": memory.peak["RssFile"],
        "worker_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--layout", choices=("parquet", "beir"), default="parquet")
    parser.add_argument("--pages", type=int, default=20_000, help="--layout beir: distinct corpus pages")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--workers", type=int, default=None, help="header-reading processes (default: one per CPU)")
    parser.add_argument("--phase", choices=("cold", "warm"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    name = f"raggedvl-startup-{args.rows}" + (f"-beir-{args.pages}" if args.layout == "beir" else "")
    root = args.dir or Path(tempfile.gettempdir()) / name
    data = root / "data" / ("pages.parquet" if args.layout == "parquet" else "beir")
    os.environ["HF_DATASETS_CACHE"] = str(root / "hf-datasets")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ["RAGGEDVL_CACHE"] = str(root / "raggedvl-cache")  # the Arrow cache of the corpus
    if args.phase is not None:
        print(json.dumps(measure(data, args.workers)))
        return
    if not data.exists():
        data.parent.mkdir(parents=True, exist_ok=True)
        build(data, args.rows) if args.layout == "parquet" else build_beir(data, args.rows, args.pages)
    size_mib = sum(f.stat().st_size for f in ([data] if data.is_file() else data.iterdir())) / 2**20
    print(f"{data}: {args.rows} rows, {size_mib:.0f} MiB", flush=True)
    results = {}
    for phase in ("cold", "warm"):
        if phase == "cold":
            shutil.rmtree(data.parent / ".raggedvl", ignore_errors=True)
            shutil.rmtree(data / ".raggedvl", ignore_errors=True)
            shutil.rmtree(root / "hf-datasets", ignore_errors=True)
            shutil.rmtree(root / "raggedvl-cache", ignore_errors=True)
        load = os.getloadavg()
        cmd = [sys.executable, __file__, "--rows", str(args.rows), "--dir", str(root), "--phase", phase,
               "--layout", args.layout, "--pages", str(args.pages)]
        if args.workers is not None:
            cmd += ["--workers", str(args.workers)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                             env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
        if out.returncode != 0:
            raise SystemExit(f"{phase} run failed:\n{out.stderr[-3000:]}")
        results[phase] = json.loads(out.stdout.strip().splitlines()[-1])
        results[phase]["load"] = f"{load[0]:.1f}"
    du = subprocess.run(["du", "-sm", str(root)], capture_output=True, text=True).stdout.split()[0]
    keys = ["launcher_imports_s", "launcher_check_s", "rank_imports_s", "open_data_s", "cost_scan_s",
            "sampler_plan_s", "total_s", "check_cpu_s", "data_cpu_s", "plan_cpu_s", "total_cpu_s",
            "peak_rss_mib", "peak_anon_mib", "peak_file_mib", "worker_peak_rss_mib", "load"]
    print(f"\nrows {results['cold']['rows']}, {results['cold']['steps']} steps of 32 on 2 ranks; parquet {size_mib:.0f} MiB, "
          f"on disk with the datasets cache {du} MiB; workers {args.workers or 'one per CPU'} of {os.cpu_count()} CPUs")
    print("| phase | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for phase, r in results.items():
        print(f"| {phase} | " + " | ".join(f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
