"""Shared fixtures. The small rdocs subset and the tiny tokenizer are built once per session
(rendering and tokenizer training cost tens of seconds on a loaded 2-core machine)."""

import pytest

SMALL_TRAIN_PAIRS = 16
SMALL_DEV_PAIRS = 8


@pytest.fixture(scope="session")
def small_data_cache(tmp_path_factory):
    """A data cache holding the tiny processor and the rdocs subset of 16 train + 8 dev pairs
    (pass it as ``data_cache`` / ``--data-cache`` with those sample limits)."""
    from raggedvl.app.config import TrainConfig
    from raggedvl.app.setup import prepare_data

    cache = tmp_path_factory.mktemp("small-data")
    prepare_data(TrainConfig(max_train_samples=SMALL_TRAIN_PAIRS, max_eval_samples=SMALL_DEV_PAIRS, data_cache=str(cache)))
    return cache
