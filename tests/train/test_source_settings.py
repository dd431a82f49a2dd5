"""The sources of ``raggedvl train`` (several --dataset, or --source-column values) and their
weights, as ``make_sampler`` builds them: one-source steps hold rows of one source, default
weights follow the rows, --dataset-weights weigh a source column's values in sorted order, bad
combinations are one-line errors, and the default (mixed) sampler's plans are pinned by hashes.
No data or processor: the size estimate and the per-row source values are given."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from raggedvl.app.cli import main
from raggedvl.parallel import DistInfo
from raggedvl.sampling import SampleCosts
from raggedvl.app import launch
from raggedvl.app.config import TrainConfig
from raggedvl.app.setup import make_sampler, sources_text, training_pairs_text


def _costs(n, rejected=()):
    costs = np.random.default_rng(2).lognormal(0.0, 1.0, n)
    return SampleCosts(costs=costs, patches=np.arange(n, dtype=np.int64) * 10 + 50, seq_lens=np.full(n, 40),
                       features=np.zeros((n, 4)),
                       skipped=[{"sample": i, "name": f"row {i}", "reason": "bad"} for i in rejected])


def _info(rank=0, world=1):
    return DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")


def _steps(sampler, epoch):
    sampler.set_epoch(epoch)
    return [(sampler.step_source(k), list(ix)) for k, ix in enumerate(sampler)]


# a source column over 30 rows: 'x' and 'y' interleaved, 'z' a small block
VALUES = ["x", "y"] * 10 + ["z"] * 6 + ["y", "x", "y", "y"]


@pytest.mark.parametrize("w", [1, 2])
def test_one_source_steps_over_a_source_column_hold_rows_of_one_value(w):
    cfg = TrainConfig(source_column="kind", batch_sampling="one-source", global_batch_size=4, seed=1)
    costs = _costs(30, rejected=[3])
    samplers = [make_sampler(cfg, costs, _info(r, w), row_sources=VALUES) for r in range(w)]
    mixture = samplers[0].mixture
    assert mixture.names == ("x", "y", "z") and mixture.sizes == (11, 12, 6)  # row 3 ('y') rejected: never drawn
    assert mixture.weights == pytest.approx((11 / 29, 12 / 29, 6 / 29))  # default: proportional to the kept rows
    seen = set()
    for epoch in range(4):
        per_rank = [_steps(s, epoch) for s in samplers]
        for steps in zip(*per_rank):
            (name,) = {name for name, _ in steps}  # every rank names the same source
            rows = [i for _, part in steps for i in part]
            assert len(rows) == 4 and {VALUES[i] for i in rows} == {name} and 3 not in rows
            seen.add(name)
    assert seen == {"x", "y", "z"}
    assert "one-source global batches from: x (11 pairs, p=0.379), y (12 pairs, p=0.414), z (6 pairs, p=0.207)" == \
        sources_text(cfg, mixture)


def test_dataset_weights_weigh_the_values_in_sorted_order_and_zero_is_never_drawn():
    cfg = TrainConfig(source_column="kind", batch_sampling="one-source", global_batch_size=4,
                      dataset_weights=[1, 0, 3])  # x, y, z
    sampler = make_sampler(cfg, _costs(30), _info(), row_sources=VALUES)
    assert sampler.mixture.names == ("x", "y", "z") and sampler.mixture.weights == pytest.approx((0.25, 0.0, 0.75))
    assert {name for e in range(5) for name, _ in _steps(sampler, e)} == {"x", "z"}
    assert training_pairs_text(cfg, _costs(30), row_sources=VALUES) == "30 training pairs (y: 13 of them at weight 0, never drawn)"
    mixed = TrainConfig(source_column="kind", global_batch_size=4, dataset_weights=[1, 0, 3])
    sampler = make_sampler(mixed, _costs(30), _info(), row_sources=VALUES)  # mixed: each sample's source by weight
    drawn = [VALUES[i] for e in range(5) for _, ix in _steps(sampler, e) for i in ix]
    assert set(drawn) == {"x", "z"} and sampler.step_source(0) is None
    assert sources_text(mixed, sampler.mixture) == (
        "mixed global batches from: x (11 pairs, p=0.25), y (13 pairs, p=0), z (6 pairs, p=0.75)")


@pytest.mark.parametrize("weights", [[1, 1], [1, 1, 1, 2]])
def test_dataset_weights_must_give_one_weight_per_value(weights):
    cfg = TrainConfig(source_column="kind", batch_sampling="one-source", global_batch_size=4, dataset_weights=weights)
    match = (rf"dataset_weights has {len(weights)} values .* for the 3 values of source column 'kind': 'x' \(11 rows\), "
             r"'y' \(13 rows\), 'z' \(6 rows\); give one weight per value, in this order")
    with pytest.raises(ValueError, match=match):
        make_sampler(cfg, _costs(30), _info(), row_sources=VALUES)


def test_two_datasets_one_source_steps_and_default_weights():
    cfg = TrainConfig(dataset=["a.parquet", "b.parquet"], batch_sampling="one-source", global_batch_size=4, seed=3)
    costs = _costs(23, rejected=[4])
    samplers = [make_sampler(cfg, costs, _info(r, 2), dataset_sizes=[10, 13]) for r in range(2)]
    assert samplers[0].mixture.sizes == (9, 13) and samplers[0].mixture.weights == pytest.approx((9 / 22, 13 / 22))
    for epoch in range(3):
        for steps in zip(*[_steps(s, epoch) for s in samplers]):
            (name,) = {name for name, _ in steps}
            rows = [i for _, part in steps for i in part]
            assert all((i < 10) == (name == "a.parquet") for i in rows) and 4 not in rows and len(rows) == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_sampling": "one-source"}, "batch_sampling 'one-source' draws each global batch from one of several sources"),
    ({"dataset": ["a", "b"], "source_column": "kind"}, "source_column 'kind' splits one dataset into sources, but 2 datasets"),
    ({"source_column": "kind", "dataset": ["a", "b"], "dataset_weights": [1, 1]}, "splits one dataset"),
    ({"source_column": "kind", "dataset_weights": [0, 0]}, r"dataset_weights \[0, 0\] are all 0"),
    ({"source_column": "kind", "dataset_weights": [1, -1]}, "dataset_weights must be >= 0"),
    ({"dataset": ["a", "b"], "dataset_weights": [1, 1, 1]}, "dataset_weights has 3 values .* for 2 datasets"),
])
def test_source_settings_that_do_not_go_together_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_the_flags_reach_the_config_and_errors_are_one_line_before_any_process(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "exec_agent", lambda cmd, env_updates=None: pytest.fail(f"started {cmd}"))
    monkeypatch.setattr(launch, "check_names", lambda cfg: pytest.fail("checked names after a config error"))
    code = main(["train", "--output-dir", str(tmp_path / "run"), "--dataset", "a.parquet", "--batch-sampling", "one-source"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "give several --dataset, or --source-column" in err, err
    cfg = TrainConfig.from_dict({"source_column": "kind", "dataset_weights": [1, 2], "batch_sampling": "one-source"})
    assert (cfg.source_column, cfg.dataset_weights, cfg.batch_sampling) == ("kind", [1, 2], "one-source")


def _digest(samplers, epochs=2):
    out = []
    for s in samplers:
        for e in range(epochs):
            s.set_epoch(e)
            out.append([list(x) for x in s])
        out.append(s.state_dict(step=1))
    return hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()[:16]


# sha256 of make_sampler's plans and states for the default batch_sampling (mixed), pinned: a
# change of them changes every mixed run's order and the plans of its checkpoints (23 pairs,
# row 4 rejected, G = 4, seed 3)
MIXED_DIGESTS = {
    ("one", 1): "f104e0d214d28580", ("one", 2): "0c43c526ac1a0058",
    ("two", 1): "6ab7ac6b81bcf1ae", ("two", 2): "714d97160b47fd37",
    ("two_noweights", 1): "f104e0d214d28580", ("two_noweights", 2): "0c43c526ac1a0058",
}


@pytest.mark.parametrize("case, w", sorted(MIXED_DIGESTS))
def test_the_default_mixed_sampler_is_unchanged(case, w):
    configs = {
        "one": (TrainConfig(global_batch_size=4, seed=3), None),
        "two": (TrainConfig(dataset=["a.parquet", "b.parquet"], dataset_weights=[0.7, 0.3], global_batch_size=4, seed=3),
                [10, 13]),
        "two_noweights": (TrainConfig(dataset=["a.parquet", "b.parquet"], global_batch_size=4, seed=3), [10, 13]),
    }
    cfg, sizes = configs[case]
    assert cfg.batch_sampling == "mixed"
    samplers = [make_sampler(cfg, _costs(23, rejected=[4]), _info(r, w), sizes) for r in range(w)]
    assert _digest(samplers) == MIXED_DIGESTS[(case, w)]
