"""Case C03: accelerate ``dispatch_batches=True`` on 2 real gloo processes.

Without the fix accelerate slices every tensor by position: each process gets 2 patch rows and
2 grid rows, so patches are cut from their grids (shown below, the corruption is asserted).
With ``prepare_ragged_data_loader`` (``RaggedDispatchSlicer``) every process receives whole samples whose tokens, grids and patch
rows agree, and together the processes see exactly the samples a single process would. With 5
samples (not a multiple of 2 x 2) ``real_sample_mask`` marks the repeats accelerate adds to the
last batch, dispatched or loaded by each process.
"""

from __future__ import annotations

import pytest
import torch

from tests.batch.synth import SMALL_IDS, make_features

GRIDS = [(1, 4, 4), (1, 8, 6), (1, 2, 2), (1, 6, 6)]
SPECS = [{"images": [GRIDS[i % 4]]} for i in range(8)]
SPECS[3] = {"images": [(1, 6, 6), (1, 2, 2)]}  # a two-image sample
SPECS[6] = {"text": 3}  # a text-only sample
PAD_TO = 40  # one padded length, so accelerate can concatenate batches


def collate(indices: list[int]) -> dict:
    """Processor-like features of samples ``indices``; the first token and every patch value
    identify the sample, so a receiver can tell exactly what it got."""
    feats = make_features([SPECS[i] for i in indices], pad_to=PAD_TO)
    feats["input_ids"][:, 0] = 10 + torch.tensor(indices)
    rows = [int(torch.tensor(g).prod()) for i in indices for g in SPECS[i].get("images", [])]
    owners = [float(i) for i in indices for _ in SPECS[i].get("images", [])]
    if rows:
        feats["pixel_values"] = torch.repeat_interleave(torch.tensor(owners), torch.tensor(rows))[:, None].expand(-1, 1176).contiguous()
    return feats


def _c03(rank: int, world_size: int) -> dict:
    import os

    from accelerate import PartialState
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from raggedvl.batch import RaggedBatch
    from raggedvl.parallel import prepare_ragged_data_loader

    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # one machine: accelerate needs no MASTER_ADDR
    state = PartialState(cpu=True)  # joins the harness's gloo group as MULTI_CPU
    assert state.num_processes == world_size and state.process_index == rank

    broken = []
    plain_loader = prepare_data_loader(DataLoader(list(range(8)), batch_size=2, collate_fn=collate),
                                       device=torch.device("cpu"), dispatch_batches=True, put_on_device=True)
    for batch in plain_loader:  # accelerate's default slice_tensors
        entry = {"patch_rows": batch["pixel_values"].shape[0], "grid_products": int(batch["image_grid_thw"].prod(dim=1).sum())
                 if "image_grid_thw" in batch else 0}
        try:
            RaggedBatch.from_features(batch, token_ids=SMALL_IDS)
            entry["error"] = None
        except ValueError as e:
            entry["error"] = str(e)
        broken.append(entry)

    fixed = []
    fixed_loader = prepare_ragged_data_loader(DataLoader(list(range(8)), batch_size=2, collate_fn=collate),
                                              layout="qwen2_vl", token_ids=SMALL_IDS, device=torch.device("cpu"),
                                              dispatch_batches=True, put_on_device=True)
    for batch in fixed_loader:
        rb = RaggedBatch.from_features(batch, token_ids=SMALL_IDS)  # validates every invariant
        ids = (rb["input_ids"][:, 0] - 10).tolist()
        owners = rb["pixel_values"][:, 0].tolist() if rb.num_images else []
        fixed.append({"ids": ids, "grids": rb["image_grid_thw"].tolist() if rb.num_images else [],
                      "owners": owners, "image_counts": rb.image_counts, "type": type(batch).__name__})
    # 5 samples: accelerate completes the last global batch with repeats; real_sample_mask marks them
    from raggedvl.parallel import real_sample_mask

    tails = {}
    for dispatch in (True, False):
        loader = prepare_ragged_data_loader(DataLoader(list(range(5)), batch_size=2, collate_fn=collate),
                                            layout="qwen2_vl", token_ids=SMALL_IDS, device=torch.device("cpu"),
                                            dispatch_batches=dispatch, put_on_device=True)
        tails[dispatch] = [((b["input_ids"][:, 0] - 10).tolist(),
                            real_sample_mask(loader, b["input_ids"].shape[0], rank=rank, world_size=world_size).tolist())
                           for b in loader]
    return {"broken": broken, "fixed": fixed, "tails": tails}


@pytest.mark.dist
def test_c03_dispatch_batches_whole_samples():
    from tests.dist.harness import run_distributed

    results = run_distributed(_c03, 2)
    # without the fix: every process gets 2 patch rows against 2 grid rows of up to 48 patches each
    for res in results:
        assert len(res["broken"]) == 2
        for entry in res["broken"]:
            assert entry["patch_rows"] == 2 and entry["grid_products"] > entry["patch_rows"]
            assert entry["error"] is not None  # patches cut from grids, or grids cut from their samples' tokens
    # with the fix: step s gives rank r the samples [4s + 2r, 4s + 2r + 1], whole
    for rank, res in enumerate(results):
        assert [f["ids"] for f in res["fixed"]] == [[4 * s + 2 * rank, 4 * s + 2 * rank + 1] for s in range(2)]
        for f in res["fixed"]:
            assert f["type"] == "dict"
            assert f["grids"] == [list(g) for i in f["ids"] for g in SPECS[i].get("images", [])]
            assert f["image_counts"] == [len(SPECS[i].get("images", [])) for i in f["ids"]]
            want_owners = [float(i) for i in f["ids"] for g in SPECS[i].get("images", []) for _ in range(g[0] * g[1] * g[2])]
            assert f["owners"] == want_owners  # every patch row belongs to a sample of this process
    seen = sorted(i for res in results for f in res["fixed"] for i in f["ids"])
    assert seen == list(range(8))
    # repeats completing the last batch are marked on every process: the real samples are 0..4 once
    assert [res["tails"][True] for res in results] == [  # dispatcher: [4 | 0]
        [([0, 1], [True, True]), ([4], [True])], [([2, 3], [True, True]), ([0], [False])]]
    assert [res["tails"][False] for res in results] == [  # each process loads: [4, 0 | 1, 2]
        [([0, 1], [True, True]), ([4, 0], [True, False])], [([2, 3], [True, True]), ([1, 2], [False, False])]]
