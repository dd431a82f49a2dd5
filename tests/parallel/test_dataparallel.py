"""DataParallel transport (case C01): boundary-aware scatter, order-restoring gather, and
exactness against an unsplit forward of tiny random Qwen2-VL / Qwen2.5-VL models.

CI has no GPU: the scatter/gather logic runs on CPU with the device move as a parameter
(``devices=["cpu", ...]``); the real ``RaggedDataParallel`` on CUDA is the ``gpu`` test.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from raggedvl.batch import RaggedBatch
from raggedvl.parallel import RaggedDataParallel, ScatteredBatch, gather_outputs, scatter_batch
from tests.batch.synth import SMALL_IDS, make_features
from tests.batch.tiny_models import tiny_model

G448, G224 = (1, 32, 32), (1, 16, 16)
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module")
def models():
    return {f: tiny_model(f) for f in FAMILIES}


def forward(model, batch: RaggedBatch):
    with torch.no_grad():
        return model(**batch, use_cache=False)


def assert_outputs_match(got, want, batch: RaggedBatch, atol=1e-5):
    valid = batch["attention_mask"].bool()
    assert got.last_hidden_state.shape == want.last_hidden_state.shape
    torch.testing.assert_close(got.last_hidden_state[valid], want.last_hidden_state[valid], atol=atol, rtol=0)
    if batch.num_images:
        assert len(got.image_outputs.pooler_output) == batch.num_images
        for g, w in zip(got.image_outputs.pooler_output, want.image_outputs.pooler_output):
            torch.testing.assert_close(g, w, atol=atol, rtol=0)
        torch.testing.assert_close(got.image_outputs.last_hidden_state, want.image_outputs.last_hidden_state, atol=atol, rtol=0)
    if batch.num_videos:
        assert len(got.video_outputs.pooler_output) == batch.num_videos
        for g, w in zip(got.video_outputs.pooler_output, want.video_outputs.pooler_output):
            torch.testing.assert_close(g, w, atol=atol, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_c01_two_replicas_get_whole_samples_and_match_unsplit_forward(models, family):
    batch = RaggedBatch.from_features(make_features([{"images": [G448]}, {"images": [G224]}], family), family,
                                      token_ids=SMALL_IDS)
    # what nn.DataParallel's even chunking does: 640 + 640 patch rows but 1 + 1 grid rows
    halves = batch["pixel_values"].chunk(2)
    assert [h.shape[0] for h in halves] == [640, 640]
    assert [int(g.prod()) for g in batch["image_grid_thw"].chunk(2)[0]] == [1024]
    with pytest.raises(ValueError, match="pixel_values has 640 patch rows but the image_grid_thw products sum to 1024"):
        RaggedBatch.from_features({**{k: v[:1] for k, v in batch.items() if k != "pixel_values" and k != "image_grid_thw"},
                                   "pixel_values": halves[0], "image_grid_thw": batch["image_grid_thw"][:1]},
                                  family, token_ids=SMALL_IDS)
    scattered = scatter_batch(batch, 2, devices=["cpu", "cpu"])
    assert sorted(scattered.indices) == [[0], [1]]
    for shard, idx in zip(scattered.shards, scattered.indices):
        shard.validate()  # patch rows, grid rows, placeholder tokens and text rows agree
        assert shard["pixel_values"].shape[0] == int(shard["image_grid_thw"].prod(dim=1).sum())
        assert torch.equal(shard["input_ids"], batch["input_ids"][idx])
    model = models[family]
    outputs = [forward(model, s) for s in scattered.shards]
    assert_outputs_match(gather_outputs(outputs, scattered, "cpu"), forward(model, batch), batch)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_three_replicas_restores_sample_image_and_video_order(models, family):
    samples = [{"images": [(1, 8, 8), (1, 4, 6)]}, {"text": 7}, {"images": [(1, 12, 8)], "videos": [(2, 4, 4)]},
               {"text": 3}, {"images": [(1, 2, 2), (1, 4, 4), (1, 6, 2)]}]
    batch = RaggedBatch.from_features(make_features(samples, family), family, token_ids=SMALL_IDS)
    costs = torch.tensor([5.0, 1.0, 4.0, 1.0, 3.0], dtype=torch.float64)
    scattered = scatter_batch(batch, 3, costs, devices=["cpu"] * 3)
    assert sorted(i for p in scattered.indices for i in p) == list(range(5))
    assert max(float(costs[p].sum()) for p in scattered.indices) == 5.0  # the optimum for these costs
    counts = [s.num_images for s in scattered.shards]
    assert len(set(counts)) > 1  # replicas return different numbers of per-image outputs
    for shard in scattered.shards:
        if shard.num_images == 0:
            assert "pixel_values" not in shard.keys() and shard.get("pixel_values") is None
    model = models[family]
    outputs = [forward(model, s) for s in scattered.shards]
    assert_outputs_match(gather_outputs(outputs, scattered, "cpu"), forward(model, batch), batch)


def test_fewer_samples_than_replicas_runs_fewer_replicas():
    batch = RaggedBatch.from_features(make_features([{"images": [G224]}, {"text": 2}]), token_ids=SMALL_IDS)
    scattered = scatter_batch(batch, 4)
    assert len(scattered.shards) == 2 and sorted(scattered.indices) == [[0], [1]]
    with pytest.raises(ValueError, match="got 3 costs for a batch of 2 samples"):
        scatter_batch(batch, 2, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        scatter_batch(batch, 0)


@dataclass
class Out:
    emb: torch.Tensor
    loss: torch.Tensor
    per_image: tuple
    note: str = "x"


def test_gather_kinds_and_errors():
    batch = RaggedBatch.from_features(
        make_features([{"images": [(1, 2, 2)]}, {"text": 1}, {"images": [(1, 4, 2), (1, 2, 2)]}]), token_ids=SMALL_IDS)
    sc = scatter_batch(batch, 2, [3.0, 1.0, 2.0])
    assert sc.indices == [[0], [1, 2]]
    outs = [Out(torch.tensor(idx, dtype=torch.float32)[:, None] * torch.ones(1, 4, requires_grad=True),
                torch.tensor(float(r)), tuple(torch.full((int(p) // 4,), float(i)) for i, p in
                                              zip(sc.item_index("image")[r].tolist(), s.patch_counts("image"))))
            for r, (s, idx) in enumerate(zip(sc.shards, sc.indices))]
    g = gather_outputs(outs, sc)
    assert g.emb[:, 0].tolist() == [0.0, 1.0, 2.0] and g.emb.requires_grad
    assert g.loss.tolist() == [0.0, 1.0] and g.note == "x"
    assert [t[0].item() for t in g.per_image] == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match=r"cannot gather output 'output.emb': its dim-0 sizes per replica \[2, 2\]"):
        gather_outputs([Out(torch.zeros(2, 1), torch.tensor(0.0), ()) for _ in range(2)], sc)
    with pytest.raises(TypeError, match="KV cache"):
        gather_outputs([object(), object()], sc)


def test_wrapper_without_cuda_runs_whole_batch(models):
    if torch.cuda.is_available():
        pytest.skip("covers the CPU-only fallback")
    batch = RaggedBatch.from_features(make_features([{"images": [G224]}, {"text": 2}], "qwen2_vl"), token_ids=SMALL_IDS)
    dp = RaggedDataParallel(models["qwen2_vl"], token_ids=SMALL_IDS)
    with torch.no_grad():
        got_kw = dp(**batch, use_cache=False)
        got_pos = dp(batch, use_cache=False)
    want = forward(models["qwen2_vl"], batch)
    assert_outputs_match(got_kw, want, batch, atol=0)
    assert_outputs_match(got_pos, want, batch, atol=0)
    with pytest.raises(ValueError, match="tensor argument 'foo' is not part of layout"):
        dp(batch, foo=torch.ones(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ragged_data_parallel_on_gpus(models):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    samples = [{"images": [G448]}, {"images": [G224]}, {"text": 4}, {"images": [(1, 4, 4), (1, 2, 2)]}]
    batch = RaggedBatch.from_features(make_features(samples, "qwen2_vl"), token_ids=SMALL_IDS)
    want = forward(models["qwen2_vl"], batch)
    model = tiny_model("qwen2_vl").cuda()
    dp = RaggedDataParallel(model, token_ids=SMALL_IDS)
    with torch.no_grad():
        got = dp(**batch, use_cache=False)
    assert got.last_hidden_state.device.type == "cuda"
    got = type(got)(last_hidden_state=got.last_hidden_state.cpu(),
                    image_outputs=type(got.image_outputs)(last_hidden_state=got.image_outputs.last_hidden_state.cpu(),
                                                          pooler_output=tuple(p.cpu() for p in got.image_outputs.pooler_output)))
    assert_outputs_match(got, want, batch, atol=1e-4)


def test_gather_when_sample_and_patch_counts_coincide():
    # 8 samples; samples 0 and 5 own one [1,2,2] image (4 patch rows): every shard has 4 samples and 4 rows
    samples = [{"images": [(1, 2, 2)]} if i in (0, 5) else {"text": 2} for i in range(8)]
    batch = RaggedBatch.from_features(make_features(samples), token_ids=SMALL_IDS)
    parts = [[0, 3, 4, 7], [1, 2, 5, 6]]
    sc = ScatteredBatch([batch.select(p) for p in parts], parts, batch)
    outs = [{"emb": s["input_ids"][:, :3], "vision_hidden": s["pixel_values"]} for s in sc.shards]
    assert all(s.num_samples == int(s.patch_counts().sum()) == 4 for s in sc.shards)
    got = gather_outputs(outs, sc)
    assert torch.equal(got["emb"], batch["input_ids"][:, :3])
    assert torch.equal(got["vision_hidden"], batch["pixel_values"])


def test_gradients_through_scatter_and_gather_equal_unsplit(models):
    model = models["qwen2_vl"]
    samples = [{"images": [(1, 8, 8)]}, {"text": 5}, {"images": [(1, 4, 6), (1, 2, 2)], "text": 2}]
    batch = RaggedBatch.from_features(make_features(samples, "qwen2_vl"), token_ids=SMALL_IDS)
    valid = batch["attention_mask"].bool()
    weights = torch.linspace(-1.0, 1.0, 64)

    def grads(fn):
        model.zero_grad()
        hidden = fn()
        (hidden[valid] * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = grads(lambda: model(**batch, use_cache=False).last_hidden_state)
    sc = scatter_batch(batch, 2, [1.0, 1.0, 1.0], devices=["cpu", "cpu"])
    got = grads(lambda: gather_outputs([model(**s, use_cache=False) for s in sc.shards], sc).last_hidden_state)
    assert want.keys() == got.keys() and any("visual" in n for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    model.zero_grad()


class _CpuReplicas(RaggedDataParallel):
    """RaggedDataParallel whose replicas are the same CPU module, run in turn: exercises the real
    forward (argument split, scatter, per-replica kwargs, gather) on a machine without GPUs."""

    def __init__(self, module, replicas: int, **kwargs):
        super().__init__(module, **kwargs)
        self.device_ids, self.output_device = list(range(replicas)), 0
        self.src_device_obj = torch.device("cpu")
        self.seen: list[dict] = []

    def replicate(self, module, device_ids):
        return [module] * len(device_ids)

    def parallel_apply(self, replicas, inputs, kwargs):
        self.seen = kwargs
        return [m(*i, **k) for m, i, k in zip(replicas, inputs, kwargs)]


def test_wrapper_forward_orchestration_on_cpu_replicas(models):
    model = models["qwen2_vl"]
    samples = [{"images": [G224]}, {"text": 6}, {"images": [(1, 4, 4), (1, 2, 2)]}, {"text": 2}]
    batch = RaggedBatch.from_features(make_features(samples, "qwen2_vl"), token_ids=SMALL_IDS)
    dp = _CpuReplicas(model, 3, token_ids=SMALL_IDS)
    with torch.no_grad():
        got = dp(**batch, use_cache=False)
    assert len(dp.seen) == 3 and all(k["use_cache"] is False for k in dp.seen)
    assert any("pixel_values" not in k for k in dp.seen)  # a text-only replica gets no pixel_values
    assert_outputs_match(got, forward(model, batch), batch)
