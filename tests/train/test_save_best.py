"""``raggedvl train --save-best METRIC`` keeps the checkpoint with the best dev value."""

import json

import pytest

from raggedvl.app.cli import main
from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import train

from ..evaluation.test_benchmark import write_pairs
from ..evaluation.test_eval_cli import noise_png

pytestmark = pytest.mark.slow  # trains 3 steps of the tiny model


def test_save_best_keeps_the_best_dev_checkpoint_and_eval_loads_it(tmp_path, small_data_cache):
    data = tmp_path / "data"
    data.mkdir()
    write_pairs(data / "train.parquet", [(f"train query {i}", noise_png(i, (56 + 28 * (i % 2), 56))) for i in range(8)])
    write_pairs(data / "dev.parquet", [(f"dev query {i}", noise_png(100 + i, (56, 56 + 28 * (i % 2)))) for i in range(6)])
    run = tmp_path / "run"
    cfg = TrainConfig(dataset=str(data), max_steps=3, global_batch_size=4, checkpoint_every=1, save_best="mrr@10",
                      eval_before=False, eval_after=False, lr=1e-3, output_dir=str(run), data_cache=str(small_data_cache))
    train(cfg)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    values = [(r["step"], r["dev/mrr@10"]) for r in logged if r.get("event") == "eval_best"]
    assert [s for s, _ in values] == [1, 2, 3]
    best_step, best_value = max(values, key=lambda sv: (sv[1], -sv[0]))  # ties keep the earlier step
    best = json.loads((run / "best" / "best.json").read_text())
    assert (best["step"], best["value"]) == (best_step, best_value)
    assert [p.name for p in (run / "best").glob("step-*")] == [f"step-{best_step:06d}"]
    out = tmp_path / "best-eval.json"
    assert main(["eval", str(run / "best"), "--dataset", str(data), "--split", "dev", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["metrics"]["mrr@10"] == pytest.approx(best_value)
