"""Score a retriever on a :class:`~raggedvl.evaluation.benchmark.RetrievalBenchmark`, on one
process or sharded over the ranks of a process group.

Per rank: encode its contiguous shard of the queries and of the documents (size-bucketed,
the same number of forward calls on every rank), gather every query's embeddings (small), score
them against its own document shard in chunks and keep the exact top-k
(:mod:`raggedvl.evaluation.search`); then gather the ranks' top-k lists, merge them in
trec_eval's order and compute the metrics (identical on every rank). Memory per rank: its
shard's document embeddings plus one scoring chunk; no rank holds the whole corpus.

Collectives: three ``all_gather_object`` calls (query embeddings; top-k lists with skipped
counts; pooled document vectors for the collapse statistic), plus the model's own under FSDP2.
No gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from raggedvl.evaluation.benchmark import RetrievalBenchmark
from raggedvl.evaluation.encode import document_collate, document_sizes, encode_shard
from raggedvl.evaluation.metrics import MAX_CUTOFF, mean_pairwise_cosine, random_ranker_metrics, ranking_metrics
from raggedvl.evaluation.ranking import merge_top_k, tie_keys
from raggedvl.evaluation.search import chunks_of, pad_rows, search
from raggedvl.parallel.wrap import all_gather_objects

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
        q_emb, q_mask = torch.stack(q_list), None
    else:
        q_emb, q_mask = pad_rows(q_list)
    keys = tie_keys(benchmark.doc_ids)
    positions = sorted(d_rows)
    local = None
    if positions:
        local = search(q_emb, q_mask, chunks_of([d_rows[p] for p in positions], chunk_size, positions), MAX_CUTOFF, keys)
    pooled = torch.stack([r if r.ndim == 1 else r.mean(dim=0) for r in (d_rows[p] for p in positions)]) if positions else None
    gathered = all_gather_objects((local, pooled, len(positions)))
    ranked = merge_top_k([g[0] for g in gathered if g[0] is not None], MAX_CUTOFF, keys)
    encoded = sum(g[2] for g in gathered)
    vectors = torch.cat([g[1] for g in gathered if g[1] is not None])
    metrics: dict[str, Any] = ranking_metrics(ranked.indices, benchmark.qrels)
    metrics.update({
        "queries": len(texts), "documents": len(docs), "skipped_documents": len(docs) - encoded,
        "doc_mean_cosine": mean_pairwise_cosine(vectors),
    })
    return metrics


def random_baseline(benchmark: RetrievalBenchmark) -> dict[str, float]:
    """Expected metrics of a uniformly random ranking of this benchmark's corpus."""
    return random_ranker_metrics(len(benchmark.documents), benchmark.qrels)
