"""Score a retriever on a :class:`~raggedvl.evaluation.benchmark.RetrievalBenchmark`, on one
process or sharded over the ranks of a process group.

Per rank: encode its contiguous shard of the queries and of the documents (size-bucketed,
the same number of forward calls on every rank), gather every query's embeddings (small), score
them against its own document shard in chunks and keep the exact top-k
(:mod:`raggedvl.evaluation.search`); then gather the ranks' top-k lists, merge them in
trec_eval's order and compute the metrics (identical on every rank). Memory per rank: its
shard's document embeddings plus one scoring chunk; no rank holds the whole corpus.

The rank of each query's first relevant document in the whole corpus is also computed (a
second pass counts the documents ranked ahead of it): its mean, beside a random ranker's
(n + 1) / (R + 1), tells a model at chance from one that ranks systematically wrong, which
the top-10 metrics of a small set cannot (their spread under chance is wide).

Collectives: five ``all_gather_object`` calls (query embeddings; each rank's best relevant
document; counts ahead; top-k lists with pooled document vectors for the collapse statistic),
plus the model's own under FSDP2. No gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from raggedvl.evaluation.benchmark import RetrievalBenchmark
from raggedvl.evaluation.encode import document_collate, document_sizes, encode_shard
from raggedvl.evaluation.metrics import MAX_CUTOFF, mean_pairwise_cosine, random_ranker_metrics, ranking_metrics
from raggedvl.evaluation.ranking import TopK, merge_top_k, tie_keys, top_k
from raggedvl.evaluation.search import chunks_of, count_ahead, pad_rows, score_chunk
from raggedvl.parallel import all_gather_objects

@torch.no_grad()
def evaluate_benchmark(
    model: torch.nn.Module,
    collator: Any,
    benchmark: RetrievalBenchmark,
    *,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
    autocast: Any = None,
    chunk_size: int = 1024,
    progress: bool = False,
) -> dict[str, Any]:
    """Metrics (``raggedvl.evaluation.METRICS``) of ``model`` on ``benchmark``, plus
    ``queries``, ``documents``, ``skipped_documents`` (unreadable images under
    ``on_bad_image="skip"``: never retrieved, as a document missing from a run) and
    ``doc_mean_cosine`` (mean pairwise cosine of mean-pooled document embeddings; near 1 means
    collapse). ``collator``: a :class:`raggedvl.data.RetrievalCollator`. Returns the same dict
    on every rank."""
    texts, docs = benchmark.queries, benchmark.documents
    q_emb, q_mask, d_rows = encode_benchmark(model, collator, benchmark, batch_size=batch_size, device=device,
                                             autocast=autocast, progress=progress)
    keys = tie_keys(benchmark.doc_ids)
    positions = sorted(d_rows)
    chunks = lambda: chunks_of([d_rows[p] for p in positions], chunk_size, positions) if positions else iter(())  # noqa: E731
    local, best, best_key = _scan(q_emb, q_mask, chunks(), keys, benchmark.qrels)
    for other_best, other_key in all_gather_objects((best, best_key)):  # the best relevant document over all ranks
        better = (other_best > best) | ((other_best == best) & (other_key < best_key))
        best, best_key = torch.where(better, other_best, best), torch.where(better, other_key, best_key)
    ahead = sum(all_gather_objects(count_ahead(q_emb, q_mask, chunks(), best, best_key, keys)))
    first_rank = torch.where(torch.isinf(best), torch.full_like(ahead, len(docs)), ahead) + 1
    pooled = torch.stack([r if r.ndim == 1 else r.mean(dim=0) for r in (d_rows[p] for p in positions)]) if positions else None
    gathered = all_gather_objects((local, pooled, len(positions)))
    ranked = merge_top_k([g[0] for g in gathered if g[0] is not None], MAX_CUTOFF, keys)
    encoded = sum(g[2] for g in gathered)
    vectors = torch.cat([g[1] for g in gathered if g[1] is not None])
    metrics: dict[str, Any] = ranking_metrics(ranked.indices, benchmark.qrels)
    metrics.update({
        "mean_rank": float(first_rank.double().mean()),
        **random_rank_moments(len(docs), benchmark.qrels),
        "queries": len(texts), "documents": len(docs), "skipped_documents": len(docs) - encoded,
        "doc_mean_cosine": mean_pairwise_cosine(vectors),
    })
    return metrics


def encode_benchmark(model: torch.nn.Module, collator: Any, benchmark: RetrievalBenchmark, *, batch_size: int,
                     device: torch.device | str, autocast: Any = None, progress: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]]:
    """Every query's embeddings on every rank (``[Q, Lq, D]`` padded with its mask ``[Q, Lq]``,
    or ``[Q, D]`` and None for a bi-encoder) and this rank's contiguous shard of the document
    embeddings (corpus position -> ``[L_i, D]`` or ``[D]``). One ``all_gather_object``."""
    texts, docs = benchmark.queries, benchmark.documents
    q_collate = lambda pos: (collator.collate_queries([texts[p] for p in pos]), pos)  # noqa: E731
    _, q_rows = encode_shard(model, len(texts), q_collate, [float(len(t)) for t in texts], batch_size=batch_size,
                             device=device, autocast=autocast, desc="queries", progress=progress)
    _, d_rows = encode_shard(model, len(docs), document_collate(collator, docs), document_sizes(docs),
                             batch_size=batch_size, device=device, autocast=autocast, desc="documents", progress=progress)
    queries: dict[int, torch.Tensor] = {}
    for part in all_gather_objects(q_rows):
        queries.update(part)
    q_list = [queries[i] for i in range(len(texts))]
    if q_list[0].ndim == 1:
        return torch.stack(q_list), None, d_rows
    q_emb, q_mask = pad_rows(q_list)
    return q_emb, q_mask, d_rows


def _scan(q_emb, q_mask, chunks, keys, qrels) -> tuple[TopK | None, torch.Tensor, torch.Tensor]:
    """One pass over this rank's chunks: the exact top-k, and each query's best-ranked relevant
    document (score ``[Q]`` float64, -inf when none is here; tie key ``[Q]``)."""
    n_q = q_emb.shape[0]
    best = torch.full((n_q,), float("-inf"), dtype=torch.float64)
    best_key = torch.full((n_q,), len(keys), dtype=torch.long)
    running = None
    for where, docs, mask in chunks:
        scores = score_chunk(q_emb, q_mask, docs, mask)
        cols = where if isinstance(where, torch.Tensor) else torch.arange(where, where + scores.shape[1])
        column = {int(p): j for j, p in enumerate(cols)}
        for q, rels in enumerate(qrels):
            for d, g in rels.items():
                j = column.get(d)
                if g >= 1 and j is not None:
                    score, key = float(scores[q, j]), int(keys[d])
                    if score > best[q] or (score == best[q] and key < best_key[q]):
                        best[q], best_key[q] = score, key
        part = top_k(scores, MAX_CUTOFF, keys[cols], cols)
        running = part if running is None else merge_top_k([running, part], MAX_CUTOFF, keys)
    return running, best, best_key


def random_rank_moments(n_docs: int, qrels) -> dict[str, float]:
    """A random ranker's mean rank of the first relevant document, averaged over queries, and the
    standard error of that average: with R relevant among n, the first relevant rank (the
    minimum of R draws without replacement from 1..n) has mean (n+1)/(R+1) and variance
    R(n+1)(n-R) / ((R+1)^2 (R+2))."""
    means, variances = [], []
    for rels in qrels:
        r = max(1, sum(1 for g in rels.values() if g >= 1))
        means.append((n_docs + 1) / (r + 1))
        variances.append(r * (n_docs + 1) * (n_docs - r) / ((r + 1) ** 2 * (r + 2)))
    return {"random_mean_rank": sum(means) / len(means), "random_mean_rank_se": sum(variances) ** 0.5 / len(means)}


def chance_verdict(metrics: dict[str, float]) -> str:
    """One line on whether a mean rank differs from a random ranker's by more than 3 standard
    errors (``evaluate_benchmark``'s ``mean_rank``, ``random_mean_rank``, ``random_mean_rank_se``)."""
    mean, ref, se = metrics["mean_rank"], metrics["random_mean_rank"], metrics["random_mean_rank_se"]
    z = (mean - ref) / se if se > 0 else 0.0
    head = f"first relevant document's mean rank {mean:.1f}, random ranker {ref:.1f} +- {se:.1f} (z = {z:+.1f}): "
    if z < -3:
        return head + "better than chance"
    if z > 3:
        return head + "systematically WORSE than chance: look for an evaluation error or a bias against relevant documents"
    return head + ("not distinguishable from chance (|z| <= 3): the mean rank is within 3 standard errors of a random "
                   "ranker's; metrics below a random ranker's expectation are the spread of a small set (top-k metrics "
                   "count few hits), not a systematic error")


def random_baseline(benchmark: RetrievalBenchmark) -> dict[str, float]:
    """Expected metrics of a uniformly random ranking of this benchmark's corpus."""
    return random_ranker_metrics(len(benchmark.documents), benchmark.qrels)
