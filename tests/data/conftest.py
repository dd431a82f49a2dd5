"""Shared, session-scoped fixtures for the data tests (each is built once: a few seconds)."""

from __future__ import annotations

import pytest

from raggedvl.data import build_processor, build_rdocs
from raggedvl.data.rdocs import all_pairs, open_manuals


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("raggedvl-cache")


@pytest.fixture(scope="session")
def manuals():
    return open_manuals()


@pytest.fixture(scope="session")
def all_plans():
    return list(all_pairs())


@pytest.fixture(scope="session")
def tiny_processor(data_cache):
    return build_processor("tiny", cache_dir=data_cache)


@pytest.fixture(scope="session")
def small_rdocs(data_cache):
    return build_rdocs(data_cache, train_limit=6, dev_limit=3)
