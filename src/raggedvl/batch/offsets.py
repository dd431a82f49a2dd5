"""Where each group's rows start when groups are stored back to back.

``exclusive_cumsum([3, 1, 2]) == [0, 3, 4]``: the first item of each sample (from items per
sample), the first patch row of each item (from patch rows per item), the first column of each
rank's rows in a rank-ordered gather (from rows per rank). Every such offset in raggedvl comes
from this one function; :func:`boundaries` appends the end, for cutting groups ``i:j`` out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def exclusive_cumsum(counts: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``[0, c0, c0+c1, ..., c0+...+c_{n-2}]``: int64 ``[n]`` on the device of ``counts``
    (CPU for a sequence). Raises ``ValueError`` for a negative count (one host sync for a
    device tensor)."""
    counts_t = torch.as_tensor(counts, dtype=torch.int64)
    if counts_t.dim() != 1:
        raise ValueError(f"counts must be one-dimensional, got shape {list(counts_t.shape)}")
    if counts_t.numel() and bool((counts_t < 0).any()):
        raise ValueError(f"counts must be >= 0, got {counts_t.tolist()}")
    return torch.cumsum(counts_t, 0) - counts_t


def boundaries(counts: torch.Tensor | Sequence[int]) -> list[int]:
    """``[0, c0, c0+c1, ..., sum(c)]`` as ``n + 1`` Python ints (:func:`exclusive_cumsum` plus the
    end): groups ``i:j`` occupy rows ``b[i]:b[j]``. Same errors as :func:`exclusive_cumsum`."""
    starts = exclusive_cumsum(counts)
    end = int(starts[-1]) + int(torch.as_tensor(counts, dtype=torch.int64)[-1]) if starts.numel() else 0
    return [*starts.tolist(), end]
