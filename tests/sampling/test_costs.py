"""Size-based cost estimates against the real image processor; cost model; NNLS calibration."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch
from PIL import Image

from raggedvl.batch.costs import FEATURES, CostModel, cost_features
from raggedvl.images import BadImageError, ImagePolicy
from raggedvl.sampling import calibrate, estimate_costs, fit_cost_model


def _processor(min_pixels, max_pixels):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


def test_grids_match_the_processor_without_decoding():
    proc = _processor(min_pixels=56 * 56, max_pixels=128 * 28 * 28)
    rule = ImagePolicy.from_processor(proc)
    assert (rule.min_pixels, rule.max_pixels, rule.patch_size, rule.merge_size) == (3136, 100352, 14, 2)
    rng = random.Random(0)
    sizes = [(rng.randint(20, 900), rng.randint(20, 900)) for _ in range(12)] + [(30, 600), (700, 90)]
    images = [Image.new("RGB", size) for size in sizes]
    expected = proc(images=images, return_tensors="pt")["image_grid_thw"].tolist()
    assert [list(rule.geometry(w, h).grid) for w, h in sizes] == expected
    est = estimate_costs(sizes, 0, policy=rule)
    assert est.patches.tolist() == [t * h * w for t, h, w in expected]


def test_estimate_costs_multi_image_text_only_and_lengths():
    rule = ImagePolicy()
    est = estimate_costs([None, (448, 448), [(448, 448), (56, 56)]], [7, 3, 5], policy=rule)
    # 448x448 -> 32x32 patches = 1024 patches = 256 placeholder tokens (+2 markers)
    assert est.patches.tolist() == [0, 1024, 1024 + 16]
    assert est.seq_lens.tolist() == [7, 3 + 256 + 2, 5 + 256 + 2 + 4 + 2]
    m = CostModel()
    manual = [
        m.per_sample + m.per_token * 7,
        m.per_sample + m.per_patch * 1024 + m.per_patch_pair * 1024**2 + m.per_token * 261,
        m.per_sample + m.per_patch * 1040 + m.per_patch_pair * (1024**2 + 16**2) + m.per_token * 269,
    ]
    np.testing.assert_allclose(est.costs, manual, rtol=1e-12)
    with pytest.raises(BadImageError, match="sample 1: image has an empty size 0x5"):
        estimate_costs([(10, 10), (0, 5)], 1)
    with pytest.raises(ValueError, match="images has 2 samples but text_tokens has 3"):
        estimate_costs([(10, 10), (5, 5)], [1, 2, 3])


def test_cost_model_sample_costs_matches_per_image_sum_and_checks_counts():
    grid = torch.tensor([[1, 4, 6], [1, 8, 8], [1, 2, 2]])
    model = CostModel(per_sample=2.0, per_patch=0.5, per_patch_pair=0.01, per_token=0.25)
    costs = model.sample_costs(grid, [2, 0, 1], torch.tensor([10, 3, 4]))
    img = model.image_costs(grid)
    expected = torch.tensor([2 + img[0] + img[1] + 2.5, 2 + 0.75, 2 + img[2] + 1.0], dtype=torch.float64)
    torch.testing.assert_close(costs, expected)
    assert CostModel.from_coefficients(model.coefficients.tolist()) == model
    with pytest.raises(ValueError, match="image_counts sum to 2 but grid_thw has 3 rows"):
        cost_features(grid, [1, 1], torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="per_token"):
        CostModel(per_token=-1.0)


def test_nnls_recovers_coefficients_and_respects_signs():
    rng = np.random.default_rng(0)
    p = rng.integers(16, 5000, 60).astype(float)
    feats = np.stack([np.ones(60), p, p * p, rng.integers(10, 1500, 60).astype(float)], axis=1)
    truth = np.array([2e-3, 4e-6, 1e-10, 3e-6])
    times = feats @ truth * rng.uniform(0.98, 1.02, 60)
    fitted = fit_cost_model(feats, times).coefficients.numpy()
    np.testing.assert_allclose(fitted, truth, rtol=0.2)
    # a true negative coefficient is clamped at 0 and the fit stays KKT-optimal: no single
    # coefficient can be nudged (within w >= 0) to lower the relative squared error
    times_neg = feats @ np.array([2e-3, 4e-6, -1e-11, 3e-6]) + 1e-3
    w = fit_cost_model(feats, times_neg).coefficients.numpy()
    assert np.all(w >= 0)

    def loss(v):
        return np.sum(((feats @ v - times_neg) / times_neg) ** 2)

    for j, scale in enumerate([1e-3, 1e-6, 1e-11, 1e-6]):
        for delta in (1e-3 * scale, -1e-3 * scale):
            trial = w.copy()
            trial[j] = max(0.0, w[j] + delta)
            assert loss(trial) >= loss(w) * (1 - 1e-9)
    only = fit_cost_model(feats, times, fit=("per_sample", "per_patch"))
    assert only.per_patch_pair == 0.0 and only.per_token == 0.0
    with pytest.raises(ValueError, match="unknown features"):
        fit_cost_model(feats, times, fit=("per_pixel",))


def test_calibrate_times_a_callable_and_reports_heldout_error():
    # work whose duration is linear in the features: sleep 1 ms + 3 ms per 1000 "patches"
    patches = [0, 500, 1000, 1500, 2000, 2500, 3000, 3500, 250, 1750]
    feats = np.array([[1.0, p, p * p, 0.0] for p in patches])
    result = calibrate(lambda p: time.sleep(1e-3 + 3e-6 * p), patches, feats, fit=FEATURES[:2], repeats=1, warmup=0)
    assert result.measured.shape == (10,)
    assert result.cost_model.per_patch == pytest.approx(3e-6, rel=0.35)
    assert result.heldout_error < 0.3
    with pytest.raises(ValueError, match="needs >= 8 items"):
        calibrate(lambda p: None, patches[:3], feats[:3])


def test_measure_times_round_robin_min_and_median():
    from raggedvl.sampling import measure_times

    calls = []
    items = [1, 2, 3]
    lo = measure_times(lambda x: (calls.append(x), time.sleep(1e-3 * x)), items, repeats=3, warmup=1, reduce="min")
    assert calls == [1] + items * 3  # one warm-up, then three round-robin passes
    assert np.all(np.diff(lo) > 0) and lo[0] >= 1e-3
    med = measure_times(lambda x: time.sleep(1e-3 * x), items, repeats=3, warmup=0)
    assert np.all(med >= 0.9e-3 * np.array(items))
    with pytest.raises(ValueError, match="reduce must be"):
        measure_times(lambda x: None, items, reduce="mean")
