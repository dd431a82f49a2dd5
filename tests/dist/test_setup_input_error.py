"""A bad input the ranks find while setting up (here an evaluation set whose pages and queries
are the training pairs', in another file, which only the ranks' content check sees) ends a
2-process ``raggedvl train`` with the launcher's own one-line form: ``raggedvl: error: ...``,
exit code 2, no "rank N failed during setup"."""

import os
import sys

import pytest

from tests.jobs import run_job
from tests.train.test_preflight import _parquet

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_an_overlap_found_by_the_ranks_is_one_input_error_line(tmp_path, small_data_cache):
    pairs, copy = _parquet(tmp_path / "pairs.parquet"), _parquet(tmp_path / "copy.parquet")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAGGEDVL_FAULT", None)
    cmd = [sys.executable, "-m", "raggedvl.app.cli", "train", "--nproc-per-node", "2", "--dataset", pairs,
           "--eval-dataset", copy, "--max-steps", "1", "--global-batch-size", "4", "--output-dir", tmp_path / "run",
           "--data-cache", small_data_cache]
    result = run_job(cmd, env=env, ready=None, timeout=300)  # fails in setup: no start-up marker
    assert result.returncode == 2, result.describe()
    assert result.stderr == ("raggedvl: error: evaluation set 'copy.parquet' (split 'train') overlaps the training "
                             "pairs: 8 of 8 evaluation documents have the same image bytes as a training page (a "
                             "positive or hard negative), and 8 of 8 evaluation queries are also training queries "
                             "(e.g. ['train-0', 'train-1', 'train-2']); dev metrics would measure memorisation. "
                             "Evaluate on held-out data (--eval-dataset, --eval-split, --eval-fraction) or pass "
                             "--allow-eval-overlap\n").replace("'copy.parquet'", repr(copy)), result.describe()
