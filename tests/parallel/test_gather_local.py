"""Single-process behaviour of the ragged gathers: fast path without a process group, input checks."""

import pytest
import torch

from raggedvl.parallel import all_gather_padded, all_gather_variable
from raggedvl.parallel.agreement import debug_enabled


def test_variable_gather_without_group_returns_input_untouched():
    x = torch.randn(3, 2, requires_grad=True)
    out = all_gather_variable(x)
    assert out.values is x and out.counts == [3] and out.offsets == [0]
    values, counts, offsets = out  # unpacks like a tuple
    assert counts == [3]


def test_padded_gather_without_group_returns_inputs_untouched():
    x, mask = torch.randn(2, 5, 4), torch.rand(2, 5) > 0.5
    out = all_gather_padded(x, mask)
    assert out.values is x and out.mask is mask and out.counts == [2] and out.offsets == [0]


@pytest.mark.parametrize(
    "x, mask, error, match",
    [
        (torch.zeros(2, 5), torch.ones(2, 5, dtype=torch.bool), ValueError, r"x \[n, L, \.\.\.\]"),
        (torch.zeros(2, 5, 3), torch.ones(2, 4, dtype=torch.bool), ValueError, r"mask \[2, 4\]"),
        (torch.zeros(2, 5, 3), torch.ones(2, 5), TypeError, "mask must be bool"),
    ],
)
def test_padded_gather_checks_inputs_before_any_collective(x, mask, error, match):
    with pytest.raises(error, match=match):
        all_gather_padded(x, mask)


def test_debug_flag_follows_argument_then_environment(monkeypatch):
    monkeypatch.delenv("RAGGEDVL_DEBUG_COLLECTIVES", raising=False)
    assert not debug_enabled(None)
    assert debug_enabled(True)
    monkeypatch.setenv("RAGGEDVL_DEBUG_COLLECTIVES", "1")
    assert debug_enabled(None)
    assert not debug_enabled(False)
