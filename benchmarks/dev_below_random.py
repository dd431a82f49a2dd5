"""Why the default run's dev nDCG@5 fell below a random ranker's (issue 15): measure each
candidate cause on a trained checkpoint.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dev_below_random.py RUN_DIR_OR_CHECKPOINT [--split dev]

Prints, for the run's dev and training benchmarks: the metrics with trec_eval's tie order and
with the old pessimistic ties, the number of exact score ties with the relevant document, the
relevant document's mean rank against a random ranker's, hubness (how many distinct documents
fill all queries' top 5; the correlation of a document's mean score over all queries with its
number of visual tokens), the metrics after removing each document's mean score over the
queries (a hubness correction), and train/dev page overlap in the rdocs manifest.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from raggedvl.data import RetrievalCollator
from raggedvl.evaluation import random_ranker_metrics, score_metrics
from raggedvl.evaluation.encode import encode_documents, encode_queries
from raggedvl.evaluation.search import pad_rows
from raggedvl.losses import late_interaction_scores
from raggedvl.parallel.runtime import init_distributed, shutdown
from raggedvl.train.evaluate_checkpoint import load_model
from raggedvl.train.setup import load_splits


def pessimistic(scores: torch.Tensor, qrels) -> dict[str, float]:
    """The old evaluation: rank = number of documents scoring >= the relevant one."""
    rel = torch.tensor([next(iter(r)) for r in qrels])
    r = (scores >= scores.gather(1, rel[:, None])).sum(1).double()
    return {"ndcg@5": float(torch.where(r <= 5, 1 / torch.log2(r + 1), 0).mean()), "recall@1": float((r <= 1).double().mean()),
            "mrr@10": float(torch.where(r <= 10, 1 / r, 0).mean())}


def analyse(name, model, collate, bench, manifest_rows) -> list[str]:
    q = encode_queries(model, collate, bench.queries, batch_size=16, progress=False)
    d = encode_documents(model, collate, bench.documents, batch_size=8, progress=False)
    qe, qm = pad_rows(q)
    de, dm = pad_rows(d)
    scores = late_interaction_scores(qe.double(), qm, de.double(), dm)
    n_q, n_d = scores.shape
    rel = torch.tensor([next(iter(r)) for r in bench.qrels])
    pos = scores.gather(1, rel[:, None])
    ties = int(((scores == pos).sum(1) - 1).sum())
    rank = 1 + (scores > pos).sum(1).double()
    trec = score_metrics(scores, bench.qrels, bench.doc_ids)
    old = pessimistic(scores, bench.qrels)
    rnd = random_ranker_metrics(n_d, bench.qrels)
    top5 = scores.topk(5, dim=1).indices
    distinct_top5 = len(set(top5.flatten().tolist()))
    lengths = dm.sum(1).double()
    popularity = scores.mean(0)
    corr = float(torch.corrcoef(torch.stack([popularity, lengths]))[0, 1])
    rel_len_rank = float(torch.corrcoef(torch.stack([rank, lengths[rel]]))[0, 1])
    centred = scores - scores.mean(0, keepdim=True)  # remove each document's mean score over queries
    debiased = score_metrics(centred, bench.qrels, bench.doc_ids)
    # per-query normalised: MaxSim / number of query tokens does not change a query's ranking
    lines = [f"## {name}: {n_q} queries, {n_d} documents", "",
             "| scoring | " + " | ".join(["ndcg@5", "recall@1", "mrr@10"]) + " |", "|---|---:|---:|---:|"]
    for label, m in (("random ranker (expected)", rnd), ("MaxSim, old pessimistic ties", old),
                     ("MaxSim, trec_eval ties", trec), ("MaxSim minus each document's mean score", debiased)):
        lines.append(f"| {label} | " + " | ".join(f"{m[k]:.4f}" for k in ("ndcg@5", "recall@1", "mrr@10")) + " |")
    lines += ["",
              f"- exact score ties with the relevant document: {ties} (over {n_q} queries)",
              f"- relevant document's mean rank {float(rank.mean()):.1f} (random: {(n_d + 1) / 2:.1f}), median {float(rank.median()):.0f}",
              f"- distinct documents in all queries' top 5: {distinct_top5} of {n_d} (random: about {n_d * (1 - (1 - 5 / n_d) ** n_q):.0f})",
              f"- the 5 most frequent top-1 documents take {sum(sorted(torch.bincount(top5[:, 0], minlength=n_d).tolist())[-5:])} of {n_q} top-1 slots",
              f"- correlation of a document's mean score over queries with its visual-token count: {corr:+.3f}",
              f"- correlation of the relevant document's rank with its token count: {rel_len_rank:+.3f}",
              f"- document token counts: min {int(lengths.min())}, median {int(lengths.median())}, max {int(lengths.max())}"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--split", default=None)
    args = ap.parse_args()
    info = init_distributed()
    try:
        model, processor, cfg, described = load_model(Path(args.checkpoint), info)
        cfg = dataclasses.replace(cfg, eval_split=args.split or cfg.eval_split, allow_eval_overlap=True)
        train, dev = load_splits(cfg)
        from raggedvl.evaluation.benchmark import RetrievalBenchmark

        train_bench = RetrievalBenchmark.from_pairs(train.select(range(min(128, len(train)))), name="train")
        collate = RetrievalCollator(processor, max_length=cfg.max_length)
        out = [f"# dev below random: {described}", ""]
        out += analyse("dev", model, collate, dev, None) + [""]
        out += analyse("train (first 128 pairs)", model, collate, train_bench, None) + [""]
        pages = lambda ds: {(r["pdf"], p) for r in ds.records for p in r.get("pages", [r.get("page")])}  # noqa: E731
        if "pdf" in train.records[0]:
            shared = pages(train) & pages(dev.documents)
            dev_pages = pages(dev.documents)
            out.append(f"- rdocs pages shown on both sides (a spread shows two): {len(shared)} of {len(dev_pages)} dev pages")
        print("\n".join(out))
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
