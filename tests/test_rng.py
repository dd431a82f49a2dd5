"""raggedvl.rng: one RNG state for exact resume and for GradCache's replayed forwards."""

import io
import random

import torch

from raggedvl.rng import capture_rng_state, replayed_rng_state, restore_rng_state


def _draws():
    return torch.rand(3).tolist(), random.random()


def test_replay_repeats_the_draws_and_leaves_the_stream_untouched():
    torch.manual_seed(1)
    random.seed(1)
    state = capture_rng_state([])
    first = _draws()
    after_first = capture_rng_state([])
    with replayed_rng_state(state):
        assert _draws() == first  # same dropout masks in the replay
    continued = _draws()
    restore_rng_state(after_first)
    assert _draws() == continued  # the replay did not advance the generators


def test_a_checkpointed_state_restores_after_a_weights_only_round_trip():
    state = capture_rng_state()
    expected = _draws()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restore_rng_state(torch.load(buffer, weights_only=True))
    assert _draws() == expected
