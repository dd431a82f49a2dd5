"""Which sample owns which image or video, derived from the placeholder tokens in ``input_ids``.

Shape legend: B samples, L tokens, N items (images or videos) of one stream, in batch order.

In the Qwen2-VL family every image appears in the text as one ``<|vision_start|>`` token followed
by a run of ``t*h*w / merge_size**2`` placeholder tokens (``<|image_pad|>``); items are numbered
in reading order, sample by sample. Qwen3-VL writes each temporal step of a video as its own run
(with a ``<t seconds>`` text stamp between runs), so one video is ``t`` runs there.
"""

from __future__ import annotations

import torch

from raggedvl.families import VisualStream


def placeholder_runs(input_ids: torch.Tensor, token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Find the runs of ``token_id`` in ``input_ids`` [B, L].

    Returns ``(tokens_B, runs_B, starts_BL)``: placeholder tokens per sample, runs per sample
    (int64), and a bool mask of the first token of every run.
    """
    is_tok = input_ids == token_id
    prev = torch.zeros_like(is_tok)
    prev[:, 1:] = is_tok[:, :-1]
    starts = is_tok & ~prev
    return is_tok.sum(dim=1), starts.sum(dim=1), starts


def runs_without_vision_start(input_ids: torch.Tensor, starts_BL: torch.Tensor, vision_start_id: int) -> list[tuple[int, int]]:
    """(sample, position) of every placeholder run not directly preceded by ``vision_start_id``."""
    prev_ids = torch.full_like(input_ids, -1)
    prev_ids[:, 1:] = input_ids[:, :-1]
    bad = starts_BL & (prev_ids != vision_start_id)
    return [tuple(x) for x in bad.nonzero().tolist()]


def item_counts_from_runs(stream: VisualStream, runs_B: torch.Tensor, grid_N3: torch.Tensor) -> list[int]:
    """Items per sample from placeholder runs per sample.

    One run per item, except ``stream.run_per_frame`` streams, where item i takes ``t_i`` runs.
    Raises ``ValueError`` naming the first sample whose runs do not end on an item boundary.
    """
    runs = runs_B.tolist()
    if not stream.run_per_frame:
        return [int(r) for r in runs]
    frames = grid_N3[:, 0].to(torch.int64) if grid_N3.numel() else torch.zeros(0, dtype=torch.int64)
    item_ends = torch.cumsum(frames, 0)  # cumulative runs after each item
    sample_ends = torch.cumsum(torch.tensor(runs, dtype=torch.int64), 0)
    pos = torch.searchsorted(item_ends, sample_ends, right=True)  # items fully inside the prefix
    ends_with_zero = torch.cat([torch.zeros(1, dtype=torch.int64), item_ends])
    for b, (end, p) in enumerate(zip(sample_ends.tolist(), pos.tolist())):
        if ends_with_zero[p].item() != end:
            raise ValueError(
                f"sample {b}: its {stream.name} placeholder runs end after run {end} of the batch, "
                f"inside a {stream.name} (one run per temporal step; steps per {stream.name}: "
                f"{frames.tolist()}); pass {stream.name}_counts explicitly or check the text for truncation"
            )
    counts = torch.diff(pos, prepend=torch.zeros(1, dtype=torch.int64))
    return [int(c) for c in counts.tolist()]
