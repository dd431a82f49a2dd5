"""Per-sequence SDPA for packed rows: the language model's attention when packing is on.

Shape legend: R rows, T tokens per row, h heads, d head dim, S sequences in a row.

A packed row (``raggedvl.models.packing``) holds several sequences one after another, marked by
the text row of the 4-row M-RoPE ``position_ids`` (0, 1, ..., l_i - 1 per sequence; a sequence
starts wherever the position does not grow by exactly 1, transformers' own rule in
``masking_utils.find_packed_sequence_indices``). Each sequence must attend causally to itself
only. transformers has two ways to do that: flash-attention's varlen kernel, which reads
``cu_seqlens`` from those positions (used as is on GPU with ``attn_implementation=
"flash_attention_2"``), and, for ``sdpa`` / ``eager``, a block-diagonal causal mask over the
whole row, [1, 1, T, T], whose cost grows with T**2 = (sum of lengths)**2 although only
sum(l_i**2) of it is used.

``raggedvl_packed_sdpa`` (registered in transformers' ``AttentionInterface`` under
:data:`PACKED_SDPA`) is ``sdpa`` that, for a row without a padding mask, splits q/k/v at the
sequence starts and runs one causal SDPA call per sequence, so the attention work is
sum(l_i**2) as in a padded batch without padding. With a padding mask (an ordinary padded
batch) or one sequence per row it is plain transformers ``sdpa``. Its mask function skips
building the [T, T] mask when there is no padding mask (the attention handles causality and
sequence boundaries), else it is transformers' ``sdpa_mask``. The vision tower keeps its own
implementation (it already attends per image on ``cu_seqlens``).

Per-sequence SDPA is faster than a block-diagonal mask, which costs more than the padded batch
it replaces (benchmarks/packing.py, BENCHMARKS.md "Padding-free sequences").
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "raggedvl_packed_sdpa"


def sequence_lengths(text_positions_RT: torch.Tensor) -> list[list[int]]:
    """Lengths of the sequences of each row, from the text positions [R, T] (a sequence starts
    where the position does not grow by exactly 1). One host sync."""
    starts = torch.ones_like(text_positions_RT, dtype=torch.bool)
    starts[:, 1:] = text_positions_RT[:, 1:] - text_positions_RT[:, :-1] != 1
    rows = []
    total = text_positions_RT.shape[1]
    for row in starts.cpu():
        idx = row.nonzero().flatten().tolist() + [total]
        rows.append([b - a for a, b in zip(idx[:-1], idx[1:])])
    return rows


def packed_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface`` signature): q [R, h, T, d],
    k / v [R, h_kv, T, d] -> ([R, T, h, d], None). Per-sequence causal SDPA when the row has no
    padding mask and ``position_ids`` (the text row, [R, T]) mark several sequences; otherwise
    transformers' ``sdpa_attention_forward`` unchanged. Differentiable; no collective."""
    if attention_mask is not None or position_ids is None or position_ids.dim() != 2 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    lengths = sequence_lengths(position_ids)
    if all(len(row) == 1 for row in lengths):
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    rows = []
    for r, row_lengths in enumerate(lengths):
        parts = zip(query[r:r + 1].split(row_lengths, dim=2), key[r:r + 1].split(row_lengths, dim=2),
                    value[r:r + 1].split(row_lengths, dim=2))
        rows.append(torch.cat([sdpa_attention_forward(module, q, k, v, None, **kwargs)[0] for q, k, v in parts], dim=1))
    return torch.cat(rows, dim=0), None


def packed_sdpa_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Mask function of :data:`PACKED_SDPA`: no mask without a padding mask, else ``sdpa_mask``."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)


def text_attention(base_model: nn.Module) -> str:
    """The attention implementation of the language model of a Qwen-VL base model."""
    return base_model.config.text_config._attn_implementation


def set_packed_attention(base_model: nn.Module, enabled: bool) -> str:
    """Switch the language model between ``sdpa`` and :data:`PACKED_SDPA` (other
    implementations, e.g. ``flash_attention_2`` or ``eager``, handle packed rows themselves and
    are left alone). Returns the language model's implementation afterwards."""
    current = text_attention(base_model)
    target = {"sdpa": PACKED_SDPA} if enabled else {PACKED_SDPA: "sdpa"}
    if current in target:
        base_model.set_attn_implementation({"text_config": target[current]})
    return text_attention(base_model)
