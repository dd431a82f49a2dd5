"""Synthetic Qwen2-VL-family batches for tests: exact token layouts, random pixel values.

``make_features(samples, layout=..., token_ids=..., pad_to=None)`` builds processor-like features
from a list of samples, each a dict with ``images`` (list of (t, h, w) grids), ``videos`` (list of
grids) and ``text`` (number of plain text tokens). Placeholder runs follow the real format:
``<|vision_start|> pad * (t*h*w/4) <|vision_end|>`` per image; per video one such run, or, for a
run-per-frame layout (Qwen3-VL), one run per temporal step with a text timestamp token between.
"""

from __future__ import annotations

import torch

from raggedvl.batch import TokenIds, get_layout

SMALL_IDS = TokenIds(vision_start=5, image=7, video=8)
VISION_END = 6
PAD = 0


def sample_tokens(sample: dict, layout, ids: TokenIds, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """(input_ids, mm_token_type_ids) for one sample."""
    m2 = layout.merge_size ** 2
    video = layout.stream("video")
    toks: list[int] = []
    types: list[int] = []

    def text(n: int) -> None:
        toks.extend(torch.randint(10, 60, (n,), generator=gen).tolist())
        types.extend([0] * n)

    def run(n: int, token: int, type_id: int) -> None:
        toks.extend([ids.vision_start, *[token] * n, VISION_END])
        types.extend([0, *[type_id] * n, 0])

    text(1)
    for t, h, w in sample.get("images", []):
        run(t * h * w // m2, ids.image, 1)
        text(1)
    for t, h, w in sample.get("videos", []):
        if video.run_per_frame:
            for _ in range(t):
                text(1)
                run(h * w // m2, ids.video, 2)
        else:
            run(t * h * w // m2, ids.video, 2)
    text(sample.get("text", 3))
    return toks, types


def make_features(samples: list[dict], layout="qwen2_vl", ids: TokenIds = SMALL_IDS, seed: int = 0,
                  mrope: bool = False, labels: bool = False, pad_to: int | None = None) -> dict:
    lay = get_layout(layout)
    gen = torch.Generator().manual_seed(seed)
    rows = [sample_tokens(s, lay, ids, gen) for s in samples]
    length = max([len(r[0]) for r in rows] + [pad_to or 0])
    B = len(samples)
    input_ids = torch.full((B, length), PAD, dtype=torch.int64)
    types = torch.zeros(B, length, dtype=torch.int64)
    mask = torch.zeros(B, length, dtype=torch.int64)
    for b, (t, ty) in enumerate(rows):
        input_ids[b, : len(t)] = torch.tensor(t)
        types[b, : len(ty)] = torch.tensor(ty)
        mask[b, : len(t)] = 1
    feats = {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": types}
    if labels:
        feats["labels"] = input_ids.masked_fill(mask == 0, -100)
    if mrope:
        feats["position_ids"] = torch.randint(0, 100, (3, B, length), generator=gen)
    for stream, key in (("image", "images"), ("video", "videos")):
        grids = [g for s in samples for g in s.get(key, [])]
        if not grids:
            continue
        st = lay.stream(stream)
        grid = torch.tensor(grids, dtype=torch.int64)
        feats[st.grid_key] = grid
        feats[st.patches_key] = torch.randn(int(grid.prod(dim=1).sum()), lay.patch_dim, generator=gen)
        for k in st.item_keys:
            feats[k] = torch.rand(len(grids), generator=gen, dtype=torch.float64)
    return feats
