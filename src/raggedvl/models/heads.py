"""Retrieval heads over a backbone's last hidden states.

Shape legend: B samples, L tokens per sample (padded), H backbone hidden size, D embedding dim.

- late interaction (ColBERT / ColPali, Khattab & Zaharia 2020; Faysse et al. 2024):
  ``hidden_BLH -> Linear(H, D) -> L2 normalise per token -> zero the padded tokens``;
  returns ``[B, L, D]`` and the bool mask ``[B, L]`` (from ``attention_mask``).
- bi-encoder (DSE, Ma et al. 2024): pool ``hidden_BLH`` to ``[B, H]`` (the last non-pad token,
  or the mask-weighted mean), ``Linear(H, D)``, L2 normalise; returns ``[B, D]`` and mask None.

L2 normalisation is ``x / max(||x||_2, eps)`` (``torch.nn.functional.normalize``); the eps keeps
the gradient finite for a vector of norm ~0 (a collapsed or zero-initialised head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .head_options import HEADS, POOLINGS


@dataclass
class EmbeddingOutput:
    """Retriever output.

    ``embeddings``: late interaction ``[B, L, D]`` (unit-norm rows, padded rows exactly zero) or
    bi-encoder ``[B, D]`` (unit-norm rows). ``mask``: ``[B, L]`` bool (True = real token) for
    late interaction, ``None`` for the bi-encoder.
    """

    embeddings: torch.Tensor
    mask: torch.Tensor | None = None


def pool_hidden(hidden_BLH: torch.Tensor, mask_BL: torch.Tensor, pooling: str) -> torch.Tensor:
    """Pool ``[B, L, H]`` to ``[B, H]``: the last True position of each row, or the masked mean.

    Works for left and right padding. Raises ``ValueError`` naming the sample if a row's mask
    is all False (checked when the mask is on the CPU; on an accelerator the read would wait
    for the device on every call, and ``RaggedBatch`` has rejected such a sample on the host).
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    counts = mask_BL.sum(dim=1)
    if mask_BL.device.type == "cpu" and bool((counts == 0).any()):
        empty = (counts == 0).nonzero().flatten().tolist()
        raise ValueError(f"samples {empty} have an all-zero attention_mask; every sample needs >= 1 token")
    if pooling == "mean":
        weights = mask_BL.to(hidden_BLH.dtype).unsqueeze(-1)
        return (hidden_BLH * weights).sum(dim=1) / counts.to(hidden_BLH.dtype).unsqueeze(-1)
    positions = torch.arange(mask_BL.shape[1], device=mask_BL.device).expand_as(mask_BL)
    last = torch.where(mask_BL, positions, -1).max(dim=1).values
    return hidden_BLH[torch.arange(hidden_BLH.shape[0], device=hidden_BLH.device), last]


class RetrievalHead(nn.Module):
    """Linear projection ``H -> D`` plus normalisation and masking (module docstring).

    The head is kept in float32 (or float64) whatever the backbone dtype and outputs at least
    float32: bf16 cosine scores lose ~3 significant digits, enough to tie MaxSim candidates.
    """

    def __init__(self, hidden_size: int, dim: int, head: str, pooling: str, eps: float) -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if dim <= 0 or eps <= 0:
            raise ValueError(f"dim and eps must be positive, got dim={dim}, eps={eps}")
        self.head, self.pooling, self.eps = head, pooling, eps
        self.proj = nn.Linear(hidden_size, dim)

    def forward(self, hidden_BLH: torch.Tensor, mask_BL: torch.Tensor) -> EmbeddingOutput:
        mask_BL = mask_BL.bool()
        weight_dtype = self.proj.weight.dtype
        out_dtype = torch.promote_types(weight_dtype, torch.float32)
        if self.head == "bi_encoder":
            pooled_BH = pool_hidden(hidden_BLH, mask_BL, self.pooling)
            emb_BD = self.proj(pooled_BH.to(weight_dtype)).to(out_dtype)
            return EmbeddingOutput(F.normalize(emb_BD, dim=-1, eps=self.eps), None)
        emb_BLD = self.proj(hidden_BLH.to(weight_dtype)).to(out_dtype)
        emb_BLD = F.normalize(emb_BLD, dim=-1, eps=self.eps) * mask_BL.unsqueeze(-1)
        return EmbeddingOutput(emb_BLD, mask_BL)
