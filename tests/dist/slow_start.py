"""A module whose import takes ``RAGGEDVL_TEST_SLOW_IMPORT_S`` seconds (0 when unset): spawned
ranks import it to unpickle ``allreduce_rank``, which makes their start-up as slow as a loaded
machine's (tests/dist/test_harness.py)."""

import os
import time

import torch

time.sleep(float(os.environ.get("RAGGEDVL_TEST_SLOW_IMPORT_S", "0")))


def allreduce_rank(rank, world_size):
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()
