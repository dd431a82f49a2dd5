"""Ragged scatter vs the pad-every-image workaround, per batch, on two image-size mixes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/transport.py [--batches 8] [--batch-size 8] [--replicas 2] [--rdocs]

Both paths start from per-image patch tensors [P_i, 1176] (what the image processor yields;
image decoding and resizing are not timed) and end with each replica holding model-ready inputs:

- ragged (raggedvl): collate = one ``torch.cat`` into ``pixel_values`` [P, 1176] plus grids and
  tokens; ``RaggedBatch.from_features`` (validates every invariant); ``scatter_batch`` (cost-
  balanced whole samples per replica); no unpadding.
- padded (colpali-engine / transformers ColQwen2 style): collate pads every image to the batch's
  largest, [N, P_max, 1176]; ``nn.DataParallel``-style even chunk of every tensor along dim 0;
  inside each replica a per-image loop cuts the padding off again.

Bytes moved: the bytes of all tensors the replicas receive. Padding fraction: padding patch rows
over all patch rows shipped. Grids come from ``raggedvl.images.ImagePolicy`` (transformers' ``smart_resize``, factor 28,
max_pixels 1,003,520, the ColQwen2 default). Image sizes are synthesised (seeded):
document pages = US letter / A4 at 60-150 dpi as full pages (60 %), section crops from heading
to heading (aspect 0.7-7.5, 25 %) and two-page spreads (15 %); natural images = icons, phone
photos, multi-megapixel photos, screenshots and extreme panoramas / tall strips. ``--rdocs`` adds
a third mix drawn from the embedded rdocs dataset's page views (``raggedvl.data.build_rdocs``
with the default job's subset, built once and cached; sizes read from its manifest).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

import torch

from raggedvl.batch import RaggedBatch, TokenIds
from raggedvl.images import ImagePolicy
from raggedvl.parallel import scatter_batch

MAX_PIXELS = 1_003_520
PATCH_DIM = 1176
IDS = TokenIds()  # public Qwen2-VL ids


def doc_size(rng: random.Random) -> tuple[int, int]:
    """(height, width) in pixels of one document-page view."""
    w_in, h_in = rng.choice([(8.5, 11.0), (8.27, 11.69)])
    dpi = rng.uniform(60, 150)
    w, h = w_in * dpi, h_in * dpi
    view = rng.random()
    if view < 0.60:
        return int(h), int(w)
    if view < 0.85:
        return max(28, int(w / rng.uniform(0.7, 7.5))), int(w)  # section crop, full width
    return int(h), int(2 * w)  # two-page spread


def natural_size(rng: random.Random) -> tuple[int, int]:
    """(height, width) in pixels of one natural image."""
    kind = rng.random()
    if kind < 0.2:
        s = rng.choice([32, 48, 64, 128])
        return s, s  # icons (smart_resize upsamples to min_pixels)
    if kind < 0.5:
        return rng.choice([(480, 640), (768, 1024), (1080, 1440)])  # phone / web photos
    if kind < 0.7:
        return rng.choice([(3000, 4000), (4000, 6000), (2448, 3264)])  # multi-megapixel photos
    if kind < 0.85:
        return rng.choice([(1080, 1920), (900, 1440), (1600, 2560)])  # screenshots
    return rng.choice([(300, 3000), (2000, 200), (256, 4096)])  # panoramas, tall strips


def rdocs_size_fn():
    """Size sampler over the embedded dataset's document views (width, height from the manifest)."""
    from raggedvl.data import RetrievalDataset, build_rdocs
    from raggedvl.data.rdocs import DEFAULT_JOB_DEV_PAIRS, DEFAULT_JOB_TRAIN_PAIRS

    root = build_rdocs(train_limit=DEFAULT_JOB_TRAIN_PAIRS, dev_limit=DEFAULT_JOB_DEV_PAIRS)
    sizes = [s for s in RetrievalDataset.from_manifest(root, split=None).image_sizes() if s is not None]
    return lambda rng: tuple(reversed(rng.choice(sizes))), len(sizes)


def grid_of(h: int, w: int) -> tuple[int, int, int]:
    return ImagePolicy(min_pixels=56 * 56, max_pixels=MAX_PIXELS).geometry(w, h).grid


def tokens(grids: list[tuple[int, int, int]], text: int = 24) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, mm_token_type_ids for one image per sample (right padded)."""
    rows = []
    for t, h, w in grids:
        n = t * h * w // 4
        rows.append([1, IDS.vision_start] + [IDS.image] * n + [151653] + [2] * text)
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    mask = (torch.arange(length)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
    return ids, mask, (ids == IDS.image).long()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def ragged_path(per_image, grids, replicas):
    ids, mask, types = tokens(grids)
    feats = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types,
             "pixel_values": torch.cat(per_image), "image_grid_thw": torch.tensor(grids)}
    batch = RaggedBatch.from_features(feats, "qwen2_vl", token_ids=IDS)
    shards = [s.to_dict() for s in scatter_batch(batch, replicas).shards]
    shipped = sum(nbytes(s.values()) for s in shards)
    return shipped, 0, sum(s["pixel_values"].shape[0] for s in shards if "pixel_values" in s)


def padded_path(per_image, grids, replicas):
    ids, mask, types = tokens(grids)
    feats = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types,
             "pixel_values": torch.nn.utils.rnn.pad_sequence(per_image, batch_first=True),
             "image_grid_thw": torch.tensor(grids)}
    chunks = [dict(zip(feats, parts)) for parts in zip(*(v.chunk(replicas) for v in feats.values()))]
    shipped = sum(nbytes(c.values()) for c in chunks)
    rows = 0
    for c in chunks:  # inside each replica: cut every image's padding off again
        sizes = c["image_grid_thw"].prod(dim=1).tolist()
        flat = torch.cat([c["pixel_values"][i, :n] for i, n in enumerate(sizes)])
        rows += flat.shape[0]
    pv = feats["pixel_values"]
    return shipped, pv.shape[0] * pv.shape[1] - rows, pv.shape[0] * pv.shape[1]


def run_mix(name, size_fn, args):
    rng = random.Random(f"transport-{name}")
    stats = {"ragged": [0, 0, 0, 0.0], "padded": [0, 0, 0, 0.0]}  # bytes, pad rows, rows, seconds
    for _ in range(args.batches):
        grids = [grid_of(*size_fn(rng)) for _ in range(args.batch_size)]
        per_image = [torch.empty(t * h * w, PATCH_DIM) for t, h, w in grids]
        for method, fn in (("padded", padded_path), ("ragged", ragged_path)):
            start = time.perf_counter()
            shipped, pad_rows, rows = fn(per_image, grids, args.replicas)
            elapsed = time.perf_counter() - start
            s = stats[method]
            for i, value in enumerate((shipped, pad_rows, rows, elapsed)):
                s[i] += value
    return stats


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rdocs", action="store_true", help="add the embedded rdocs dataset's pages as a third mix")
    args = p.parse_args(argv)
    mixes = [("document pages", doc_size), ("natural images", natural_size)]
    if args.rdocs:
        fn, n = rdocs_size_fn()
        mixes.append((f"rdocs ({n} pages)", fn))
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()} {platform.processor() or ''} | {os.cpu_count()} CPUs | "
          f"torch {torch.__version__} | threads 1 | {args.batches} batches x {args.batch_size} samples -> "
          f"{args.replicas} replicas, float32 pixel_values")
    header = "| mix | method | MB moved / batch | padding rows | ms / batch (collate+split+unpad) | bytes ratio padded/ragged | time ratio padded/ragged |"
    print(header)
    print("|" + "---|" * 7)
    for name, fn in mixes:
        st = run_mix(name, fn, args)
        r, d = st["ragged"], st["padded"]
        for method, s in (("ragged (raggedvl)", r), ("pad every image", d)):
            ratio_b = d[0] / r[0] if method.startswith("pad") else 1.0
            ratio_t = d[3] / r[3] if method.startswith("pad") else 1.0
            print(f"| {name} | {method} | {s[0] / args.batches / 2**20:.1f} | {100 * s[1] / max(s[2], 1):.1f} % | "
                  f"{1000 * s[3] / args.batches:.1f} | {ratio_b:.2f} | {ratio_t:.2f} |")


if __name__ == "__main__":
    main()
