"""boundaries: group i:j of counts stored back to back occupies rows b[i]:b[j]."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from raggedvl.batch.offsets import boundaries, exclusive_cumsum


@given(st.lists(st.integers(0, 9), max_size=12))
def test_boundaries_cut_every_group_range_out_of_the_flat_rows(counts):
    rows = [g for g, c in enumerate(counts) for _ in range(c)]  # row r belongs to group rows[r]
    b = boundaries(counts)
    assert len(b) == len(counts) + 1 and b[-1] == len(rows)
    assert b[:-1] == exclusive_cumsum(counts).tolist()
    for i in range(len(counts) + 1):
        for j in range(i, len(counts) + 1):
            assert rows[b[i]:b[j]] == [g for g in range(i, j) for _ in range(counts[g])]


def test_boundaries_of_a_tensor_and_of_nothing():
    assert boundaries(torch.tensor([2, 0, 3])) == [0, 2, 2, 5]
    assert boundaries([]) == [0]
    with pytest.raises(ValueError, match=">= 0"):
        boundaries([1, -2])
