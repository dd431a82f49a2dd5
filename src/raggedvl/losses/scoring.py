"""Late-interaction (ColBERT MaxSim) scoring in blocks, without a dense 4-D similarity tensor.

Shape legend: Q queries with Lq token vectors, C candidate documents with Ld token vectors,
D embedding dim. ``q_QLD`` query vectors, ``qmask_QL`` / ``dmask_CL`` bool masks (True = real
token), ``argmax_QLC`` the winning document token of each (query token, document) pair.

Formula (Khattab & Zaharia, "ColBERT", SIGIR 2020, eq. 3; ColPali, Faysse et al. 2024):
    score(i, j) = sum over valid query tokens l of  max over valid doc tokens m of <q_il, d_jm>.

Padding: document pads are filled with -inf before the max, so a pad can never win (a zero pad
would score 0 and beat a document whose real similarities are all negative). Query pads
contribute nothing. A query with zero valid tokens scores exactly 0 against every document
(an empty sum; its gradient is 0). A document with zero valid tokens has no defined score and
is rejected with ``ValueError`` (on CPU masks; on an accelerator the check would cost a device
sync per call and is left to the batch, see :func:`check_late_interaction_inputs`).

Memory: the similarities are computed block by block (at most ``block_elements`` entries of
``[Q_blk, Lq, C_blk, Ld]`` at a time) and only the max value and its index are kept, so the
peak is O(block_elements + Q*Lq*C) instead of O(Q*C*Lq*Ld). The backward pass (a custom
autograd function) routes each score's gradient through the stored argmax: to the winning
document token and to the query token, again block by block; it never recomputes the
similarities. Double backward is not supported.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK_ELEMENTS = 1 << 23
"""Similarity entries per block (8M: 32 MiB in float32)."""


def _blocks(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(start + size, total)


def _block_sizes(n_q: int, n_d: int, per_pair: int, budget: int) -> tuple[int, int]:
    q_blk = max(1, min(n_q, budget // max(1, per_pair)))
    d_blk = max(1, min(n_d, budget // max(1, q_blk * per_pair)))
    return q_blk, d_blk


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """Scores of 16-bit embeddings are summed (and returned) in float32."""
    return torch.promote_types(dtype, torch.float32)


def _maxsim_forward(q_QLD, qmask_QL, d_CLD, dmask_CL, budget, keep_argmax):
    n_q, l_q, dim = q_QLD.shape
    n_d, l_d, _ = d_CLD.shape
    scores_QC = q_QLD.new_zeros((n_q, n_d), dtype=_accumulator(q_QLD.dtype))
    idx_dtype = torch.int16 if l_d <= torch.iinfo(torch.int16).max else torch.int32
    argmax_QLC = q_QLD.new_empty((n_q, l_q, n_d), dtype=idx_dtype) if keep_argmax else None
    q_blk, d_blk = _block_sizes(n_q, n_d, l_q * l_d, budget)
    pad_CL = ~dmask_CL
    for q0, q1 in _blocks(n_q, q_blk):
        q_flat = q_QLD[q0:q1].reshape(-1, dim)
        qpad = ~qmask_QL[q0:q1, :, None]
        for d0, d1 in _blocks(n_d, d_blk):
            sim = (q_flat @ d_CLD[d0:d1].reshape(-1, dim).T).view(q1 - q0, l_q, d1 - d0, l_d)
            sim.masked_fill_(pad_CL[None, None, d0:d1], float("-inf"))
            best, where = sim.max(dim=-1)
            del sim
            best.masked_fill_(qpad, 0.0)
            scores_QC[q0:q1, d0:d1] = best.sum(dim=1, dtype=scores_QC.dtype)
            if keep_argmax:
                argmax_QLC[q0:q1, :, d0:d1] = where
    return scores_QC, argmax_QLC


class _MaxSim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_QLD, qmask_QL, d_CLD, dmask_CL, budget):
        scores_QC, argmax_QLC = _maxsim_forward(q_QLD, qmask_QL, d_CLD, dmask_CL, budget, True)
        ctx.save_for_backward(q_QLD, qmask_QL, d_CLD, argmax_QLC)
        ctx.budget = budget
        return scores_QC

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_QC):
        q_QLD, qmask_QL, d_CLD, argmax_QLC = ctx.saved_tensors
        want_q, _, want_d = ctx.needs_input_grad[:3]
        n_q, l_q, dim = q_QLD.shape
        n_d, l_d, _ = d_CLD.shape
        acc = grad_QC.dtype  # float32 or wider: 16-bit inputs accumulate their gradients in it
        grad_q = torch.zeros_like(q_QLD, dtype=acc) if want_q else None
        grad_d = torch.zeros_like(d_CLD, dtype=acc) if want_d else None
        # weight of query token l of query i in score (i, j): grad(i, j) if the token is real
        weight_QLC = grad_QC[:, None, :] * qmask_QL[:, :, None].to(grad_QC.dtype)
        # gathered rows [Q_blk, Lq, C_blk, D] are memory-bound: smaller blocks cost no speed
        q_blk, d_blk = _block_sizes(n_q, n_d, l_q * dim, max(1, ctx.budget // 4))
        d_flat = d_CLD.reshape(-1, dim)
        grad_d_flat = grad_d.view(-1, dim) if want_d else None
        for d0, d1 in _blocks(n_d, d_blk):
            base = (torch.arange(d0, d1, device=d_CLD.device) * l_d)[None, None, :]
            for q0, q1 in _blocks(n_q, q_blk):
                rows = (argmax_QLC[q0:q1, :, d0:d1].long() + base).reshape(-1)
                w = weight_QLC[q0:q1, :, d0:d1]
                if want_q:
                    picked = d_flat.index_select(0, rows).view(q1 - q0, l_q, d1 - d0, dim).to(acc)
                    grad_q[q0:q1] += (w.unsqueeze(-2) @ picked).squeeze(-2)
                    del picked
                if want_d:
                    src = w[..., None] * q_QLD[q0:q1, :, None, :].to(acc)
                    grad_d_flat.index_add_(0, rows, src.reshape(-1, dim))
        if want_q:
            grad_q = grad_q.to(q_QLD.dtype)
        if want_d:
            grad_d = grad_d.to(d_CLD.dtype)
        return grad_q, None, grad_d, None, None


def check_late_interaction_inputs(query_emb, query_mask, doc_emb, doc_mask, *, doc_name="documents",
                                  check_empty: bool | None = None) -> None:
    """Raise ``ValueError``/``TypeError`` unless the inputs of :func:`late_interaction_scores` are
    valid (3-D embeddings with equal D and dtype, bool masks ``[n, L]``, no empty document);
    ``doc_name`` names the document rows in the messages (e.g. ``"hard negatives"``).

    ``check_empty``: look for a document without a valid token, which reads the mask into
    Python. Default (None): only when ``doc_mask`` is on the CPU, where that read is free; on an
    accelerator it would wait for the device on every call, so it is the batch's job there:
    ``RaggedBatch`` rejects a sample whose ``attention_mask`` has no real token when it is built
    (on the host), and a retriever's document masks are those attention masks."""
    if query_emb.dim() != 3 or doc_emb.dim() != 3:
        raise ValueError(
            f"late interaction needs query_emb [n_q, Lq, D] and doc_emb [n_d, Ld, D]; got "
            f"{list(query_emb.shape)} and {list(doc_emb.shape)}"
        )
    if query_emb.shape[-1] != doc_emb.shape[-1]:
        raise ValueError(
            f"query dim D={query_emb.shape[-1]} differs from document dim D={doc_emb.shape[-1]}"
        )
    if query_emb.dtype != doc_emb.dtype:
        raise TypeError(f"query dtype {query_emb.dtype} differs from document dtype {doc_emb.dtype}")
    for name, mask, emb in (("query_mask", query_mask, query_emb), ("doc_mask", doc_mask, doc_emb)):
        if mask.dtype != torch.bool:
            raise TypeError(f"{name} must be bool (True = real token), got {mask.dtype}")
        if tuple(mask.shape) != tuple(emb.shape[:2]):
            raise ValueError(f"{name} has shape {list(mask.shape)}, expected {list(emb.shape[:2])}")
    if check_empty is None:
        check_empty = doc_mask.device.type == "cpu"
    empty = (~doc_mask.any(dim=1)).nonzero().flatten().tolist() if check_empty else []
    if empty:
        raise ValueError(
            f"{doc_name} {empty[:8]} have no valid token in their mask; every document needs at "
            "least one real vector (drop empty documents before scoring)"
        )


def late_interaction_scores(
    query_emb: torch.Tensor,
    query_mask: torch.Tensor,
    doc_emb: torch.Tensor,
    doc_mask: torch.Tensor,
    *,
    block_elements: int = DEFAULT_BLOCK_ELEMENTS,
) -> torch.Tensor:
    """MaxSim scores ``[n_q, n_d]`` of queries ``[n_q, Lq, D]`` against documents ``[n_d, Ld, D]``.

    ``score(i, j) = sum_{l valid in i} max_{m valid in j} <query_emb[i, l], doc_emb[j, m]>``
    (ColBERT, Khattab & Zaharia 2020), unnormalised; divide by the valid query-token count to
    normalise. Masks are bool ``[n, L]`` with True for real tokens; pads never win a max and a
    query with no valid token scores 0. Pure function (no communication). Differentiable in
    ``query_emb`` and ``doc_emb`` through a custom autograd function whose memory stays
    O(block_elements + n_q*Lq*n_d) (see the module docstring); ties in a max send the gradient
    to one of the tied tokens. Scores are float32 for float16/bfloat16 embeddings (the sums over
    query tokens and the gradients accumulate in float32), else in the embeddings' dtype.

    Raises ``ValueError`` for mismatched shapes or a document with no valid token (checked on
    CPU masks, see :func:`check_late_interaction_inputs`), ``TypeError`` for non-bool masks or
    mismatched dtypes.
    """
    check_late_interaction_inputs(query_emb, query_mask, doc_emb, doc_mask)
    if block_elements < 1:
        raise ValueError(f"block_elements must be >= 1, got {block_elements}")
    if torch.is_grad_enabled() and (query_emb.requires_grad or doc_emb.requires_grad):
        return _MaxSim.apply(query_emb, query_mask, doc_emb, doc_mask, block_elements)
    scores, _ = _maxsim_forward(query_emb, query_mask, doc_emb, doc_mask, block_elements, False)
    return scores
