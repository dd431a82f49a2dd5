"""Memory and time of exact top-k search over synthetic multi-vector documents: chunked scoring
from an on-disk index (``raggedvl search``) against the dense formula.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/search.py [--docs 100000] [--dense-docs 10000]

Corpus: ``--docs`` documents with 16..112 vectors each (uniform, mean 64), D = 128, unit
vectors, stored as float16 safetensors shards of 10,000 documents (the layout ``raggedvl
encode`` writes); queries of 20 vectors. Each measurement runs in a fresh process and reports
the peak resident memory above the process's resident memory at the start of the search
(Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``; glibc's mmap threshold
fixed at 64 KiB so freed tensors leave the process at once, as in grad_cache.py) and the
wall time. The dense formula materialises the padded corpus ``[N, L_max, D]`` and the
similarities ``[Q, Lq, N, L_max]`` (float32), so it runs on ``--dense-docs`` documents only; its
memory at the full size is given by the formula. The chunked result is checked against the dense
top-k on the same documents (identical indices).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

DIM, QUERY_TOKENS, MIN_LEN, MAX_LEN, SHARD = 128, 20, 16, 112, 10_000


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> float:
    """Reset the peak resident set size (Linux: clear_refs 5) and return the current one, MB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def peak_mb() -> float:
    return _status_mb("VmHWM")


def build_index(directory: Path, n_docs: int) -> None:
    from raggedvl.evaluation.index import write_index, write_shard

    if (directory / "index.json").exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for number, start in enumerate(range(0, n_docs, SHARD)):
        g = torch.Generator().manual_seed(number)
        count = min(SHARD, n_docs - start)
        lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (count,), generator=g)
        flat = torch.nn.functional.normalize(torch.randn(int(lengths.sum()), DIM, generator=g), dim=-1)
        rows = list(flat.split(lengths.tolist()))
        shards.append(write_shard(directory, number, rows, [f"doc-{start + i:07d}" for i in range(count)]))
    write_index(directory, shards, kind="multi_vector", dim=DIM, dtype=torch.float16)


def queries(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(12345)
    q = torch.nn.functional.normalize(torch.randn(n, QUERY_TOKENS, DIM, generator=g), dim=-1)
    return q, torch.ones(n, QUERY_TOKENS, dtype=torch.bool)


def run_one(mode: str, index_dir: Path, n_queries: int, n_docs: int, chunk: int, k: int) -> dict:
    from raggedvl.evaluation import tie_keys, top_k
    from raggedvl.evaluation.index import EmbeddingIndex
    from raggedvl.evaluation.search import pad_rows, search

    index = EmbeddingIndex(index_dir)
    q, qm = queries(n_queries)
    keys = tie_keys(index.ids[:n_docs])

    def limited_chunks(limit=n_docs):
        for where, emb, mask in index.chunks(chunk):
            if where >= limit:
                return
            keep = min(emb.shape[0], limit - where)
            yield where, emb[:keep], mask[:keep]
            del emb, mask  # (the views above keep the chunk alive otherwise)

    search(q, qm, limited_chunks(64), k, keys)  # warm-up: one-time allocations stay out of the figures

    if mode == "dense":
        rows = []
        for _, emb, mask in limited_chunks():
            rows += [e[m] for e, m in zip(emb, mask)]
    base = reset_peak()
    t0 = time.perf_counter()
    if mode == "chunked":
        top = search(q, qm, limited_chunks(), k, keys)
    else:
        d, dm = pad_rows(rows)  # [N, L_max, D]
        sim = torch.einsum("qld,nmd->qlnm", q, d)  # [Q, Lq, N, L_max]
        sim.masked_fill_(~dm[None, None], float("-inf"))
        scores = sim.amax(dim=-1).sum(dim=1)  # MaxSim: best document vector per query vector, summed
        del sim
        top = top_k(scores, k, keys)
    seconds = time.perf_counter() - t0
    return {"mode": mode, "docs": n_docs, "queries": n_queries, "seconds": seconds, "peak_mb": peak_mb() - base,
            "indices": top.indices.tolist()}


def measure(args, mode: str, n_queries: int, n_docs: int) -> dict:
    cmd = [sys.executable, __file__, "--one", mode, "--index", str(args.index), "--queries", str(n_queries),
           "--n", str(n_docs), "--chunk", str(args.chunk), "-k", str(args.k)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def dense_formula_mb(n_queries: int, n_docs: int) -> float:
    return 4 * (n_docs * MAX_LEN * DIM + n_queries * QUERY_TOKENS * n_docs * MAX_LEN) / 2**20


def chunk_formula_mb(n_queries: int, chunk: int) -> float:
    """Reading a chunk: its float16 rows and their float32 copy (mean length), then the padded
    float32 chunk [c, L_max, D]; scoring: one MaxSim block (search's default block_elements) and
    the [Q, c] scores. The peak is the larger of reading (copy + padded) and scoring (padded +
    block)."""
    mean_len = (MIN_LEN + MAX_LEN) / 2
    padded = chunk * MAX_LEN * DIM * 4
    reading = chunk * mean_len * DIM * (2 + 4) + padded
    scoring = padded + 4 * (min(1 << 22, n_queries * QUERY_TOKENS * chunk * MAX_LEN) + n_queries * chunk)
    return max(reading, scoring) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--dense-docs", type=int, default=10_000)
    ap.add_argument("--index", type=Path, default=Path("/tmp/raggedvl-search-bench"))
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--one", default=None)
    ap.add_argument("--queries", type=int, default=1)
    ap.add_argument("--n", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(run_one(args.one, args.index, args.queries, args.n, args.chunk, args.k)))
        return
    t0 = time.perf_counter()
    build_index(args.index, args.docs)
    print(f"index: {args.docs} documents, {MIN_LEN}..{MAX_LEN} vectors (mean {(MIN_LEN + MAX_LEN) / 2:.0f}), D={DIM}, float16, "
          f"{sum(p.stat().st_size for p in args.index.glob('*.safetensors')) / 2**30:.2f} GiB, built in {time.perf_counter() - t0:.0f} s")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, "
          f"1 thread; queries of {QUERY_TOKENS} vectors; top-{args.k}; chunk {args.chunk} documents")
    print()
    print("| scoring | documents | queries | time s | s / (query * 1k docs) | peak memory MB (measured) | memory MB (formula) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n_q in (1, 16):
        dense = measure(args, "dense", n_q, args.dense_docs)
        small = measure(args, "chunked", n_q, args.dense_docs)
        if small["indices"] != dense["indices"]:
            raise SystemExit("chunked top-k differs from the dense formula's")
        full = measure(args, "chunked", n_q, args.docs)
        for r, formula in ((dense, dense_formula_mb(n_q, args.dense_docs)), (small, chunk_formula_mb(n_q, args.chunk)),
                           (full, chunk_formula_mb(n_q, args.chunk))):
            print(f"| {r['mode']} | {r['docs']:,} | {n_q} | {r['seconds']:.2f} | {r['seconds'] / n_q / (r['docs'] / 1000):.4f} | "
                  f"{r['peak_mb']:.0f} | {formula:.0f} |")
        print(f"| dense (formula only) | {args.docs:,} | {n_q} | - | - | - | {dense_formula_mb(n_q, args.docs):,.0f} |")
    print()
    print("chunked top-k indices equal the dense formula's on the dense-size corpus, for every query")


if __name__ == "__main__":
    main()
