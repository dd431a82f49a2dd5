"""The collapse check of `raggedvl train`: chance values, the streak rule, and
a real run on identical documents (every score equal, so the loss is ln(global batch) from
the first step; with hard negatives ln(pairs + negatives) of each step): it warns in one line, logs the event and, with --stop-on-collapse, stops."""

import json
import math

import pytest
from PIL import Image

from raggedvl.app.collapse import CollapseCheck, chance_loss
from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import train


def test_chance_loss_is_the_loss_at_equal_scores():
    import torch

    from raggedvl.losses import LateInteractionLoss, PairwiseLoss

    q, qm = torch.randn(6, 3, 8), torch.ones(6, 3, dtype=torch.bool)
    same = torch.nn.functional.normalize(torch.randn(1, 4, 8), dim=-1).expand(6, 4, 8)  # six identical documents
    dm = torch.ones(6, 4, dtype=torch.bool)
    assert float(LateInteractionLoss(temperature=0.02)(q, qm, same, dm)) == pytest.approx(chance_loss("late_interaction", 6))
    assert float(PairwiseLoss()(q, qm, same, dm)) == pytest.approx(chance_loss("pairwise", 6))
    assert chance_loss("infonce", 16) == pytest.approx(math.log(16))
    with pytest.raises(ValueError, match="unknown loss"):
        chance_loss("mse", 4)


def test_with_hard_negatives_chance_counts_every_candidate_of_a_query():
    """6 pairs with 2 hard negatives each: every query competes with 6 positives + 12 negatives,
    so equal scores give ln 18, not ln(global batch) = ln 6; pairwise stays ln 2."""
    import torch

    from raggedvl.losses import InfoNCELoss, LateInteractionLoss, PairwiseLoss

    q, qm = torch.randn(6, 3, 8), torch.ones(6, 3, dtype=torch.bool)
    same = torch.nn.functional.normalize(torch.randn(1, 4, 8), dim=-1)
    docs, dm = same.expand(6, 4, 8), torch.ones(6, 4, dtype=torch.bool)
    negs, nm = same.expand(12, 4, 8), torch.ones(12, 4, dtype=torch.bool)
    late = float(LateInteractionLoss(temperature=0.02)(q, qm, docs, dm, negs, nm))
    assert late == pytest.approx(chance_loss("late_interaction", 6, hard_negatives=12)) == pytest.approx(math.log(18))
    assert abs(late - chance_loss("late_interaction", 6)) > 1.0
    vec = torch.nn.functional.normalize(torch.randn(1, 8), dim=-1)
    single = float(InfoNCELoss(temperature=0.02)(torch.randn(6, 8), vec.expand(6, 8), vec.expand(12, 8)))
    assert single == pytest.approx(chance_loss("infonce", 6, 12))
    assert float(PairwiseLoss()(q, qm, docs, dm, negs, nm)) == pytest.approx(chance_loss("pairwise", 6, 12))
    with pytest.raises(ValueError, match="hard_negatives must be >= 0"):
        chance_loss("infonce", 6, -1)


def test_the_check_compares_each_step_with_its_own_chance_value():
    check = CollapseCheck(chance=math.log(4), patience=2)
    assert check.update(1, math.log(12), chance=math.log(12)) is None
    message = check.update(2, math.log(12), chance=math.log(12))
    assert message is not None and f"{math.log(12):.4f}" in message and check.chance == pytest.approx(math.log(12))
    check.update(3, math.log(6), chance=math.log(6))  # a smaller step after it fired: the fired value stays
    assert check.chance == pytest.approx(math.log(12))
    at_batch = CollapseCheck(chance=math.log(4), patience=2)  # ln(global batch) is not chance with negatives
    assert [at_batch.update(s, math.log(4), chance=math.log(12)) for s in (1, 2, 3)] == [None] * 3


def test_the_check_fires_once_after_patience_steps_in_a_row():
    check = CollapseCheck(chance=math.log(16), patience=3)
    at_chance = math.log(16) + 5e-5
    assert check.update(1, at_chance) is None
    assert check.update(2, at_chance) is None
    assert check.update(3, 2.70) is None  # the loss moved: the streak restarts
    assert [check.update(s, at_chance) for s in (4, 5)] == [None, None]
    message = check.update(6, at_chance, doc_cosine=1.0)
    assert message is not None and "\n" not in message
    assert "step 6" in message and "2.7726" in message and "cosine 1.0000" in message and "--lr" in message
    assert check.fired and check.update(7, at_chance) is None  # one warning per run
    assert CollapseCheck(chance=1.0, patience=0).update(1, 1.0) is None  # patience 0: off


def _identical_pages(root, n_train=12, n_dev=4):
    """An rdocs-style manifest whose training pages are all the same image (dev pages differ)."""
    (root / "images").mkdir(parents=True)
    rows = []
    for i in range(n_train + n_dev):
        name = f"images/p{i}.png"
        colour = "white" if i < n_train else (40 * i % 256, 90, 200)
        Image.new("RGB", (112, 112), colour).save(root / name)
        rows.append({"id": f"p{i}", "image": name, "query": f"question number {i}", "split": "train" if i < n_train else "dev",
                     "width": 112, "height": 112})
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.slow
def test_a_collapsed_run_warns_and_stops_when_asked(tmp_path, capsys):
    data = _identical_pages(tmp_path / "data")
    common = dict(dataset=str(data), max_train_samples=None, max_eval_samples=None, global_batch_size=4, max_steps=8,
                  warmup_steps=1, eval_before=False, eval_after=False, checkpoint_every=100, collapse_patience=3,
                  false_negatives="keep")  # identical pages are one document: masked, no negative would be left
    summary = train(TrainConfig(**common, output_dir=str(tmp_path / "warn")))
    out = capsys.readouterr()
    assert summary["collapsed"] and not summary["stopped_by_collapse"]
    assert "training collapsed at step 3" in out.out + out.err
    records = [json.loads(line) for line in (tmp_path / "warn" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "train"] == list(range(1, 9))  # it ran on
    (event,) = [r for r in records if r.get("event") == "collapse"]
    assert event["step"] == 3 and event["chance"] == pytest.approx(math.log(4))
    assert event["doc_cosine_rank0"] == pytest.approx(1.0, abs=1e-6)

    summary = train(TrainConfig(**common, stop_on_collapse=True, output_dir=str(tmp_path / "stop")))
    assert summary["stopped_by_collapse"]
    records = [json.loads(line) for line in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "train"] == [1, 2, 3]
    assert (tmp_path / "stop" / "checkpoints" / "step-000003").is_dir()  # the final checkpoint of the stopped run
    assert "STOPPED at step 3 of 8" in (tmp_path / "stop" / "summary.md").read_text()


def test_one_document_cosine_criterion_for_the_run_summary_and_raggedvl_eval(tmp_path):
    """0.9996 (a new user's `raggedvl eval` of a run whose training check had fired) is flagged;
    the healthy tiny range (<= 0.999) and a single document (NaN) are not."""
    from raggedvl.app.collapse import COLLAPSED_DOC_COSINE, doc_cosine_warning
    from raggedvl.app.report import write_summary

    warning = doc_cosine_warning(0.9996)
    assert warning is not None and "0.9996" in warning and str(COLLAPSED_DOC_COSINE) in warning and "\n" not in warning
    assert [doc_cosine_warning(c) for c in (COLLAPSED_DOC_COSINE, 0.97, float("nan"), None)] == [None] * 4
    evaluation = {"ndcg@5": 0.1, "queries": 4, "documents": 8, "n": 8, "doc_mean_cosine": 0.9996}
    for cosine, flagged in ((0.9996, True), (0.998, False)):
        write_summary(tmp_path, [], None, {"dev": {**evaluation, "doc_mean_cosine": cosine}}, {"dev": {}}, steps=1,
                      global_batch_size=4, world_size=1, on_bad_image="error", skipped_examples=0, rejected_pairs=0,
                      estimated_pairs=8)
        line = next(x for x in (tmp_path / "summary.md").read_text().splitlines() if x.startswith("dev documents:"))
        assert (doc_cosine_warning(cosine) or "WARNING") in line if flagged else "WARNING" not in line
