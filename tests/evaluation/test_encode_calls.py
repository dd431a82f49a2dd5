"""``encode_in_batches``'s forward calls when items are unreadable: a sharded job (``n_calls``)
makes the same number of calls on every rank whatever its shard holds, or fails before the call
it cannot make; results keep only readable items."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raggedvl.evaluation.encode import encode_in_batches


class Batch(dict):
    def to(self, device):
        return self


class CountingModel(torch.nn.Module):
    """Embeds each item as one vector [position]; counts its forward calls."""

    def __init__(self):
        super().__init__()
        self.calls: list[list[int]] = []

    def forward(self, positions):
        self.calls.append(positions.tolist())
        return SimpleNamespace(embeddings=positions.float()[:, None, None], mask=torch.ones(len(positions), 1, dtype=torch.bool))


def collate_skipping(unreadable: set[int]):
    def collate(positions):
        kept = [p for p in positions if p not in unreadable]
        return (Batch(positions=torch.tensor(kept)), kept) if kept else (None, [])
    return collate


def test_a_shard_whose_first_batch_is_unreadable_still_makes_every_call_with_the_stand_in():
    model = CountingModel()
    out = encode_in_batches(model, [4, 5, 6], collate_skipping({4, 5}), batch_size=2, n_calls=3, filler=0)
    # call 1: both items unreadable, nothing earlier to repeat -> the stand-in (position 0);
    # call 2: the readable item 6; call 3: beyond this shard's batches -> the filler again
    assert model.calls == [[0], [6], [0]]
    assert {k: v.tolist() for k, v in out.items()} == {6: [[6.0]]}


def test_without_n_calls_an_unreadable_first_batch_is_left_out():
    model = CountingModel()
    out = encode_in_batches(model, [4, 5, 6], collate_skipping({4, 5}), batch_size=2)
    assert model.calls == [[6]] and list(out) == [6]


def test_an_unreadable_stand_in_fails_before_the_call_it_cannot_make():
    model = CountingModel()
    with pytest.raises(ValueError, match=r"batch 1 of 2 \(positions \[4, 5\]\) has no readable item, nor has the "
                                         r"stand-in position 0"):
        encode_in_batches(model, [4, 5, 6], collate_skipping({0, 4, 5}), batch_size=2, n_calls=2, filler=0)
    assert model.calls == []
