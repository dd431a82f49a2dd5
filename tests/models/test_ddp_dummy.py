"""DDP without find_unused_parameters when one rank's batch has no image (case C04).

Two gloo processes; rank 0's documents carry images, rank 1's documents are text-only, and both
ranks' queries are text-only. Each step is ONE forward (``ddp(queries=..., docs=...)``) and one
backward. Checks, for a plain and a gradient-checkpointed model: two steps run without DDP's
"Expected to have finished reduction" error, and the first step's averaged gradient of every
parameter equals the single-process reference (mean of the two ranks' gradients, float64).
"""

import pytest
import torch

from raggedvl.models import TinySizes, build_retriever
from tests.dist.harness import run_distributed
from tests.models.helpers import make_batch, tiny_tokenizer

SMALL = TinySizes(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128,
                  vision_depth=1, vision_embed_dim=32, vision_heads=2)


def _rank_batches(rank):
    queries = make_batch(["sample quantiles", "biplot"] if rank == 0 else ["writing R extensions"], [[], []][: 2 - rank])
    if rank == 0:
        docs = make_batch(["page one", "page two"], [[(1, 4, 4)], [(1, 2, 6)]], dtype=torch.float64, seed=1)
    else:
        docs = make_batch(["a text-only document"], [[]])
    return queries, docs


def _loss(q, d):
    """Any scalar that uses both outputs: mean of each sample's max query-document similarity."""
    return torch.einsum("qld,nmd->qnlm", q.embeddings, d.embeddings).amax(dim=(-1, -2)).mean()


def _model(checkpointing):
    return build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, seed=0,
                           gradient_checkpointing=checkpointing).double()


def _ddp_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    queries, docs = _rank_batches(rank)
    results = {}
    for checkpointing in (False, True):
        reference = _model(checkpointing)  # this rank's share of the single-process reference
        q, d = reference(queries=queries, docs=docs)
        _loss(q, d).backward()
        ref_grads = {n: p.grad.numpy() for n, p in reference.named_parameters()}  # numpy: picklable
        model = _model(checkpointing)
        ddp = DDP(model)  # find_unused_parameters=False
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
        for step in range(2):  # a missed reduction would raise in the second forward
            opt.zero_grad(set_to_none=True)
            q, d = ddp(queries=queries, docs=docs)
            _loss(q, d).backward()
            if step == 0:
                ddp_grads = {n: p.grad.numpy().copy() if p.grad is not None else None for n, p in model.named_parameters()}
            opt.step()
        checksum = sum(float(p.double().sum()) for p in model.parameters())
        results[checkpointing] = (ref_grads, ddp_grads, checksum)
    return results


@pytest.mark.dist
def test_ddp_with_a_text_only_rank_matches_the_single_process_reference():
    results = run_distributed(_ddp_worker, 2, timeout=120)
    for checkpointing in (False, True):
        (ref0, ddp0, sum0), (ref1, ddp1, sum1) = results[0][checkpointing], results[1][checkpointing]
        assert sum0 == sum1  # replicas stay identical after two steps
        for name, g in ddp0.items():
            assert g is not None and ddp1[name] is not None, (checkpointing, name)
            want = (torch.from_numpy(ref0[name]) + torch.from_numpy(ref1[name])) / 2  # DDP averages over W = 2
            assert torch.allclose(torch.from_numpy(g), want, rtol=0, atol=1e-10), (checkpointing, name)
            assert (g == ddp1[name]).all()
