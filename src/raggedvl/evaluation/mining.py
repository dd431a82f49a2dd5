"""Hard-negative mining with positive-aware filtering (NV-Retriever's TopK-PercPos).

For each query of a :class:`~raggedvl.evaluation.benchmark.RetrievalBenchmark` (a training set
read as one: its queries, its distinct pages, each query's relevant pages), the retriever
ranks the whole corpus exactly (:mod:`raggedvl.evaluation.search`, trec_eval's tie order), and
the candidates are filtered in order:

1. its relevant pages (``positives``) and pages whose stored bytes equal one of them
   (``duplicates``: the same page under another id) are dropped;
2. the ``skip_top`` best remaining candidates are dropped (``skip_top``);
3. a candidate scoring at least ``max_positive_ratio`` x the query's lowest positive score is
   dropped (``above_ratio``): it is likely an unlabelled positive (Moreira et al., 2024,
   "NV-Retriever: Improving text embedding models with effective hard-negative mining",
   TopK-PercPos, 0.95 there);
4. the first ``k`` left are the query's hard negatives, best first.

Ranking depth: ``k + skip_top + positives + extra`` candidates per query, ``extra`` growing
(doubling) until every query has ``k`` negatives or the corpus is exhausted, so the result is
the same as filtering the full ranking. One process or sharded over ranks (documents encoded in
contiguous shards; the top candidates gathered and merged), the same result on every rank.

Collectives (under torchrun): ``all_gather_object`` of the query embeddings, the positives'
scores and each pass's top candidates; no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from raggedvl.evaluation.benchmark import RetrievalBenchmark
from raggedvl.evaluation.evaluator import encode_benchmark
from raggedvl.evaluation.ranking import merge_top_k, tie_keys, top_k
from raggedvl.evaluation.search import chunks_of, score_chunk
from raggedvl.parallel import all_gather_objects

FILTERS = ("positives", "duplicates", "skip_top", "above_ratio")


@dataclass
class MinedNegatives:
    """``negatives``: per query (benchmark order), positions into ``benchmark.documents``, best
    first, at most ``k``; ``scores``: their scores; ``removed``: candidates each filter dropped
    (module docstring, counted over the ranking depth that was needed); ``short``: queries
    left with fewer than ``k``."""

    negatives: list[list[int]]
    scores: list[list[float]]
    removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FILTERS, 0))
    short: int = 0


@torch.no_grad()
def mine_negatives(model: torch.nn.Module, collator: Any, benchmark: RetrievalBenchmark, *, k: int,
                   max_positive_ratio: float = 0.95, skip_top: int = 0, batch_size: int = 16,
                   device: torch.device | str = "cpu", autocast: Any = None, chunk_size: int = 1024,
                   progress: bool = False) -> MinedNegatives:
    """Mine ``k`` hard negatives per query (module docstring). ``collator``: a
    :class:`raggedvl.data.RetrievalCollator` with the retriever's prompts. Raises
    ``ValueError`` for ``k < 1``, ``skip_top < 0`` or a ratio outside (0, 1]; returns the same
    result on every rank."""
    if k < 1 or skip_top < 0 or not 0 < max_positive_ratio <= 1:
        raise ValueError(f"k must be >= 1, skip_top >= 0 and max_positive_ratio in (0, 1]; got k={k}, "
                         f"skip_top={skip_top}, max_positive_ratio={max_positive_ratio}")
    texts, docs = benchmark.queries, benchmark.documents
    q_emb, q_mask, d_rows = encode_benchmark(model, collator, benchmark, batch_size=batch_size, device=device,
                                             autocast=autocast, progress=progress)
    positions = sorted(d_rows)
    keys = tie_keys(benchmark.doc_ids)
    positives = [{d for d, g in rels.items() if g >= 1} for rels in benchmark.qrels]
    digests = docs.image_digests()
    pages_of: dict[str, set[int]] = {}  # stored bytes -> the corpus positions holding them
    for d, digest in enumerate(digests):
        pages_of.setdefault(digest, set()).add(d)
    same_page = [set().union(*(pages_of[digests[p]] for p in pos)) - pos for pos in positives]

    # each query's lowest positive score (over every rank's shard)
    lowest = torch.full((len(texts),), float("inf"), dtype=torch.float64)
    ranked = None
    depth = min(len(docs), k + skip_top + max(len(p) + len(s) for p, s in zip(positives, same_page)) + k)
    while True:
        part = None
        for where, chunk, mask in (chunks_of([d_rows[p] for p in positions], chunk_size, positions)
                                   if positions else ()):
            scores = score_chunk(q_emb, q_mask, chunk, mask)
            cols = where if isinstance(where, torch.Tensor) else torch.arange(where, where + scores.shape[1])
            if ranked is None:  # first pass: the positives' scores too
                column = {int(p): j for j, p in enumerate(cols)}
                for q, pos in enumerate(positives):
                    for d in pos:
                        if d in column:
                            lowest[q] = min(float(lowest[q]), float(scores[q, column[d]]))
            found = top_k(scores, depth, keys[cols], cols)
            part = found if part is None else merge_top_k([part, found], depth, keys)
        gathered = all_gather_objects((part, lowest if ranked is None else None))
        if ranked is None:
            for _, other in gathered:
                lowest = torch.minimum(lowest, other)
        ranked = merge_top_k([g[0] for g in gathered if g[0] is not None], depth, keys)
        result = _filter(ranked, positives, same_page, lowest, k=k, skip_top=skip_top, ratio=max_positive_ratio)
        if result.short == 0 or depth >= len(docs):
            return result
        depth = min(len(docs), 2 * depth)


def _filter(ranked, positives, same_page, lowest, *, k: int, skip_top: int, ratio: float) -> MinedNegatives:
    out = MinedNegatives([], [])
    for q in range(len(positives)):
        kept, kept_scores, skipped = [], [], 0
        threshold = ratio * float(lowest[q])
        for d, score in zip(ranked.indices[q].tolist(), ranked.scores[q].tolist()):
            if len(kept) == k:
                break
            if d in positives[q]:
                out.removed["positives"] += 1
            elif d in same_page[q]:
                out.removed["duplicates"] += 1
            elif skipped < skip_top:
                skipped += 1
                out.removed["skip_top"] += 1
            elif score >= threshold:
                out.removed["above_ratio"] += 1
            else:
                kept.append(d)
                kept_scores.append(score)
        out.negatives.append(kept)
        out.scores.append(kept_scores)
        out.short += len(kept) < k
    return out
