"""init_distributed / rank helpers on one process: environment parsing and backend choice.

The multi-process path (a real gloo group) is exercised in tests/dist/test_gather_dist.py.
"""

import pytest
import torch

from raggedvl.parallel import get_rank, get_world_size, init_distributed, is_distributed, shutdown


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_without_process_group_rank_zero_of_one():
    assert not is_distributed()
    assert (get_rank(), get_world_size()) == (0, 1)
    shutdown()  # no group: a no-op


def test_plain_python_launch_gives_single_process_info(clean_env):
    info = init_distributed()
    assert (info.rank, info.world_size, info.local_rank, info.backend) == (0, 1, 0, "none")
    assert info.is_main and not is_distributed()
    assert info.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_world_size_one_from_torchrun_env(clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    clean_env.setenv("LOCAL_RANK", "0")
    assert init_distributed(timeout_s=5).world_size == 1
    assert not is_distributed()


@pytest.mark.parametrize(
    "env, kwargs, match",
    [
        ({}, {"timeout_s": 0}, "timeout_s must be > 0"),
        ({"WORLD_SIZE": "two"}, {}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, {}, r"RANK=2 is outside \[0, WORLD_SIZE=2\)"),
    ],
)
def test_bad_environment_is_reported(clean_env, env, kwargs, match):
    for key, value in env.items():
        clean_env.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        init_distributed(**kwargs)


def test_cuda_present_selects_nccl_and_checks_local_rank(clean_env):
    # pretend CUDA is available but the local rank has no device: the NCCL branch is taken
    # (never hard-coded) and reports the mismatch instead of crashing in set_device
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 1)
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "1")
    clean_env.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="LOCAL_RANK=1 but only 1 CUDA devices"):
        init_distributed()
