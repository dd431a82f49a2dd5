"""Padding-free sequences: a padded batch's samples packed into one row for the backbone.

Shape legend: B samples, L tokens per sample (padded), T = sum of the samples' lengths (packed
tokens, no padding), H backbone hidden size, S = B + 1 sequence boundaries.

A padded batch ``input_ids`` [B, L] with ``attention_mask`` [B, L] computes on B * L tokens,
of which B * L - T are padding. :func:`pack_batch` keeps the T real tokens, in sample order, in
one row [1, T] and gives the backbone ``position_ids`` [4, 1, T]:

- rows 1..3: the M-RoPE (temporal, height, width) positions of each token exactly as the model
  computes them for the padded batch, which is per sample as for that sample alone: the
  model's own ``get_rope_index`` (images and videos, Qwen2.5-VL's ``second_per_grid_ts``,
  Qwen3-VL's per-frame runs) when the batch has visual inputs, else 0..l_i - 1 per sample (what
  the text model uses for right-padded text); positions given in the batch are used as given;
- row 0: the text positions 0..l_i - 1 of each sample. transformers' Qwen-VL text models read a
  4-row ``position_ids`` as (text, t, h, w) and use the text row to find packed sequences (a
  new sequence wherever the position does not grow by 1): flash-attention's varlen path derives
  ``cu_seqlens`` from it (only for one row, batch size 1), the sdpa / eager mask becomes
  block-diagonal causal, and ``raggedvl.models.packed_attention`` runs SDPA per sequence. A
  3-row ``position_ids`` carries no text row: transformers then builds the mask from
  ``attention_mask`` alone and a packed row would attend across its samples.

``attention_mask`` is dropped (the row has no padding). Visual inputs are passed unchanged (the
vision tower already runs per image on ``cu_seqlens``; the placeholders stay in sample order,
so features land on the same tokens). :func:`unpack_hidden` scatters the packed hidden states
[1, T, H] back to the padded [B, L, H] the heads expect (zeros at padding, which the heads mask
out), so embeddings, losses and gradients equal the padded path's up to float rounding (tested
in float32 for the three families). The scatter is differentiable: gradients flow back to the
packed row only.

No collective; one host sync for the lengths (and the model's ``get_rope_index`` loop, which
the padded forward runs too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raggedvl.families import family_of

PER_TOKEN = ("input_ids", "mm_token_type_ids")


@dataclass(frozen=True)
class PackedBatch:
    """The backbone inputs of one packed row and how to undo the packing.

    ``inputs``: ``input_ids`` [1, T], ``mm_token_type_ids`` [1, T] (when given),
    ``position_ids`` [4, 1, T], visual inputs unchanged, no ``attention_mask``.
    ``token_index``: [T] int64, each packed token's index in the flattened padded [B * L].
    ``cu_seqlens``: [S] int32, sequence boundaries in the row (0, l_0, l_0 + l_1, ..., T).
    ``batch_shape``: (B, L) of the padded batch.
    """

    inputs: dict[str, torch.Tensor]
    token_index: torch.Tensor
    cu_seqlens: torch.Tensor
    batch_shape: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        """T, the tokens of the packed row."""
        return int(self.token_index.numel())

    @property
    def padding_fraction(self) -> float:
        """Share of the padded batch's B * L token slots that were padding (what packing saves)."""
        slots = self.batch_shape[0] * self.batch_shape[1]
        return 1.0 - self.num_tokens / slots if slots else 0.0


def mrope_position_ids(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """M-RoPE positions [3, B, L] of a padded batch as ``model`` (a Qwen-VL base model) computes
    them in its forward: ``inputs["position_ids"]`` when given (its last 3 rows), the model's
    ``get_rope_index`` when the batch has image or video grids, else 0..l_i - 1 over each
    sample's real tokens. Padding slots hold 0. Raises ``ValueError`` when grids come without
    ``mm_token_type_ids`` (the model needs them to place the visual positions)."""
    given = inputs.get("position_ids")
    if given is not None:
        if given.dim() != 3 or given.shape[0] not in (3, 4):
            raise ValueError(f"position_ids must be [3 or 4, B, L] M-RoPE positions, got shape {list(given.shape)}")
        return given[-3:]
    mask = inputs["attention_mask"]
    streams = family_of(model.config).streams
    if any(inputs.get(s.grid_key) is not None for s in streams):
        if inputs.get("mm_token_type_ids") is None:
            raise ValueError(
                "packing a batch with images or videos needs mm_token_type_ids [B, L] (the processor returns it) "
                "to compute the M-RoPE positions; pass it, or train with --packing false"
            )
        extras = {k: inputs[k] for s in streams for k in s.item_keys if inputs.get(k) is not None}
        positions, _ = model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"), attention_mask=mask, **extras,
        )
        return positions
    return text_positions(mask).unsqueeze(0).expand(3, -1, -1)


def text_positions(mask_BL: torch.Tensor) -> torch.Tensor:
    """0..l_i - 1 over each sample's real tokens, [B, L] int64 (0 at padding)."""
    mask = mask_BL.to(torch.int64)
    return (mask.cumsum(dim=1) - 1).clamp_min(0) * mask


def pack_batch(model: nn.Module, inputs: dict[str, torch.Tensor]) -> PackedBatch:
    """Pack the padded batch ``inputs`` (``input_ids`` / ``attention_mask`` [B, L], optional
    ``mm_token_type_ids``, ``position_ids``, visual inputs) into one row for ``model``, a
    Qwen-VL base model (module docstring). Raises ``ValueError`` as :func:`mrope_position_ids`."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
    B, L = ids.shape
    positions_3BL = mrope_position_ids(model, inputs)
    token_index = mask.reshape(-1).nonzero().flatten()
    lengths = mask.sum(dim=1).to(torch.int32)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    positions_4BL = torch.cat([text_positions(mask).unsqueeze(0), positions_3BL.to(torch.int64)])
    packed = {k: v for k, v in inputs.items() if k not in ("attention_mask", "position_ids", *PER_TOKEN)}
    for key in PER_TOKEN:
        if inputs.get(key) is not None:
            packed[key] = inputs[key].reshape(-1)[token_index].unsqueeze(0)
    packed["position_ids"] = positions_4BL.reshape(4, B * L)[:, token_index].unsqueeze(1)
    return PackedBatch(packed, token_index, cu_seqlens, (B, L))


def unpack_hidden(hidden_1TH: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Packed hidden states [1, T, H] -> padded [B, L, H], zeros at padding. Raises
    ``ValueError`` when the row does not hold the packed batch's T tokens."""
    B, L = packed.batch_shape
    if hidden_1TH.dim() != 3 or hidden_1TH.shape[:2] != (1, packed.num_tokens):
        raise ValueError(f"expected packed hidden states [1, {packed.num_tokens}, H], got {list(hidden_1TH.shape)}")
    flat = hidden_1TH.new_zeros(B * L, hidden_1TH.shape[-1])
    return flat.index_copy(0, packed.token_index, hidden_1TH[0]).view(B, L, -1)
