"""Several positives per query and a ragged number of hard negatives, through the tiny retriever
under DDP, on 2 real gloo processes, with and without GradCache, against the single-process
float64 reference (the loss alone is proven on 2 and 3 ranks in test_losses_dist.py).

The global batch: queries 0..4 split 4 / 1 over the ranks (unequal n_r). Each rank encodes its
positives and its own hard negatives in one document batch, as the training step does;
``neg_counts`` per query are rank 0: [2, 0, 1, 3], rank 1: [0] (no hard negative at all: no
negatives batch). Keys: a document's key is its row of the shared pools, so the hard negative
of row 1 held by query 2 is query 1's positive (a false negative of query 1 only), and the
further positives (``relevant_keys``) are query 0 -> row 4 (the positive on rank 1), query 4 ->
row 7 (hard negatives of queries 0 and 3), query 3 -> rows 1 and 6. Reference: one
process, the six queries, the six positives then the negatives in rank order, the same keys
and counts, gather off: its loss and every parameter's gradient must equal the distributed
step's (error model: float64 sums in a different order, ~1e-16 relative; bound 1e-10).
"""

from __future__ import annotations

import copy

import pytest
import torch

from raggedvl.losses import loss_with_negatives
from tests.dist.harness import run_distributed
from tests.gradcache.test_grad_cache import cached_step, make_loss_fn, max_diff, pair_batches, plain_step, tiny_model

QUERIES = {0: [0, 1, 2, 3], 1: [4]}
NEGATIVES = {0: [[6, 7], [], [1], [7, 2, 6]], 1: [[]]}
RELEVANT = {0: [4], 1: [], 2: [], 3: [1, 6], 4: [7]}
BUDGET = 25


def _inputs(ranks: list[int]):
    """Queries, documents (positives then hard negatives) and the loss keywords of ``ranks``' rows
    together (one rank: its local batch; all ranks: the reference's global batch)."""
    rows = [r for rank in ranks for r in QUERIES[rank]]
    negs = [[n for n in cell] for rank in ranks for cell in NEGATIVES[rank]]
    flat = [n for cell in negs for n in cell]
    queries, _ = pair_batches(rows)
    _, docs = pair_batches(rows + flat)
    keys = dict(neg_counts=torch.tensor([len(c) for c in negs], dtype=torch.int64),
                doc_keys=torch.tensor(rows, dtype=torch.int64), neg_keys=torch.tensor(flat, dtype=torch.int64),
                query_keys=torch.tensor([100 + r for r in rows], dtype=torch.int64),
                relevant_keys=torch.tensor([k for r in rows for k in RELEVANT[r]], dtype=torch.int64),
                relevant_counts=torch.tensor([len(RELEVANT[r]) for r in rows], dtype=torch.int64))
    if not flat:
        keys.pop("neg_keys")
    return queries, docs, len(rows), keys


def _objective(head: str, num_positives: int, keys: dict, **options):
    loss = make_loss_fn(head, **options)

    def loss_fn(q, d):
        return loss_with_negatives(loss, q, d, num_positives, **keys)

    return loss, loss_fn


def _global(value: torch.Tensor, *, mean: bool) -> float:
    import torch.distributed as dist

    t = value.detach().clone().double()
    dist.all_reduce(t)
    return float(t) / (dist.get_world_size() if mean else 1)


def _checks(rank: int, world_size: int) -> dict:
    from raggedvl.parallel.wrap import wrap_model

    out = {}
    for head in ("late_interaction", "bi_encoder"):
        model = tiny_model(head)
        queries, docs, n_all, keys = _inputs(list(range(world_size)))
        ref_loss_module, ref_fn = _objective(head, n_all, keys, gather_across_ranks=False)
        ref_loss, ref = plain_step(copy.deepcopy(model), queries, docs, ref_fn)
        ref_masked = int(ref_loss_module.loss.false_negatives)
        plain_keys = {k: v for k, v in keys.items() if k not in ("relevant_keys", "relevant_counts")}
        _, fewer_fn = _objective(head, n_all, plain_keys, gather_across_ranks=False)
        out[f"{head}/relevant_changes_loss"] = abs(plain_step(copy.deepcopy(model), queries, docs, fewer_fn)[0] - ref_loss)
        ddp = wrap_model(model, strategy="ddp")
        queries, docs, n_local, keys = _inputs([rank])
        loss_module, loss_fn = _objective(head, n_local, keys)
        expected = {f"module.{k}": v for k, v in ref.items()}
        for name, run in (("cached", lambda: cached_step(ddp, queries, docs, loss_fn, BUDGET)),
                          ("plain", lambda: plain_step(ddp, queries, docs, loss_fn))):
            step, got = run()
            loss = step.loss if name == "cached" else torch.tensor(step, dtype=torch.float64)
            out[f"{head}/{name}/grad"] = max_diff(expected, got)
            out[f"{head}/{name}/loss"] = abs(_global(loss, mean=True) - ref_loss)
            out[f"{head}/{name}/masked"] = (_global(loss_module.loss.false_negatives, mean=False), ref_masked)
    return out


@pytest.mark.dist
def test_several_positives_and_ragged_negatives_match_one_process_with_and_without_grad_cache():
    results = run_distributed(_checks, 2, timeout=180)
    for res in results:
        for key, value in res.items():
            if key.endswith(("/grad", "/loss")):
                assert value < 1e-10, (key, value)
            if key.endswith("/masked"):
                assert value[0] == value[1] > 0, (key, value)
            if key.endswith("relevant_changes_loss"):  # the further positives do mask something
                assert value > 1e-6, (key, value)
