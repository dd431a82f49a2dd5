"""The pair sets of the vs-colpali benchmark, rendered deterministically from the vendored R manuals.

Both libraries read the same files: ``train.parquet`` and ``dev.parquet`` with columns ``id``,
``query``, ``image`` (a ``datasets.Image`` feature holding PNG bytes), ``view``, ``width``,
``height`` (pixels of the stored image, before any processor resize).

(a) ``uniform``: rdocs pairs exactly as raggedvl's embedded dataset renders them (the same
    ``plan_pairs`` plans, ``select_subset`` hash order and ``render_pair``): 240 train + 64 dev
    pairs of full pages (60-150 dpi), section crops and two-page spreads. At max_pixels 200,704
    almost every image is resized to the cap, so per-sample cost is nearly uniform.
(b) ``heavy``: the same manuals' pairs (same queries and pages, 256 train + 64 dev by the same
    hash order), each re-viewed by a SHA-256 hash of its id into a heavy-tailed document mix
    for max_pixels 1,003,520 (VIEWS below: thumbnails, narrow strips, section crops, slides,
    full pages, two-page spreads), so per-sample cost spans about two orders of magnitude.

Everything is a pure function of the PDF bytes and the constants here: the same PNG bytes on
every machine. ``describe`` gives the size distribution after the processor's resize rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

WORKLOAD_VERSION = "v1"
UNIFORM_MAX_PIXELS = 200_704
HEAVY_MAX_PIXELS = 1_003_520
MIN_PIXELS = 12_544  # colqwen2_full's processor (shortest_edge); used only to describe sizes

# view -> (share of pairs, dpi range): the heavy mix. Shares sum to 1; the order is the hash cut order.
VIEWS = {
    "thumbnail": (0.25, (10, 20)),  # full page at 10-20 dpi: ~85x110 .. 170x220 px
    "strip": (0.15, (100, 150)),  # full-width band 30-40 pt tall: aspect 15-20 : 1
    "crop": (0.20, (60, 150)),  # full-width band 100-400 pt tall (a section)
    "slide": (0.15, (100, 150)),  # 16:9 band of the page's upper half
    "full": (0.15, (60, 150)),  # the whole page
    "spread": (0.10, (100, 150)),  # two facing pages, up to ~4.2 Mpx before resize
}


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    name: str
    train_pairs: int
    dev_pairs: int
    max_pixels: int


WORKLOADS = {
    "uniform": WorkloadSpec("uniform", 240, 64, UNIFORM_MAX_PIXELS),
    "heavy": WorkloadSpec("heavy", 256, 64, HEAVY_MAX_PIXELS),
}


def _unit(key: str, salt: str) -> float:
    digest = hashlib.sha256(f"vs-colpali-{WORKLOAD_VERSION}|{salt}|{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def heavy_view(plan, page_size: tuple[float, float], pages_in_pdf: int):
    """The heavy-mix ``PairPlan`` for one rdocs pair: its view, dpi and crop from hashes of its id."""
    u, cut = _unit(plan.id, "view"), 0.0
    for view, (share, (lo, hi)) in VIEWS.items():
        cut += share
        if u < cut:
            break
    dpi = lo + int(_unit(plan.id, "dpi") * (hi - lo + 1))
    _, height = page_size
    v = _unit(plan.id, "band")
    if view in ("thumbnail", "full"):
        return dataclasses.replace(plan, view="full", dpi=dpi, crop_pt=None), view
    if view == "spread":
        if plan.page + 1 >= pages_in_pdf:
            return dataclasses.replace(plan, view="full", dpi=dpi, crop_pt=None), "full"
        return dataclasses.replace(plan, view="spread", dpi=dpi, crop_pt=None), view
    band = {"strip": 30 + 10 * v, "crop": 100 + 300 * v, "slide": page_size[0] * 9 / 16}[view]
    top = height - 36 - (height / 2 - 36) * _unit(plan.id, "top")  # a band starting in the upper half
    top = max(band, top)
    return dataclasses.replace(plan, view="crop", dpi=dpi, crop_pt=(top, top - band)), view


def _plans(train_pairs: int, dev_pairs: int):
    from raggedvl.data.rdocs import all_pairs
    from raggedvl.data.rdocs_pairs import select_subset

    return select_subset(list(all_pairs()), train_pairs, dev_pairs)


def _render(spec: WorkloadSpec, plans, manuals) -> list[dict]:
    from raggedvl.data.rdocs import png_bytes, render_pair

    rows = []
    for plan in plans:
        kind = plan.view
        if spec.name == "heavy":
            doc = manuals[plan.pdf]
            page = doc[plan.page]
            size = page.get_size()
            page.close()
            plan, kind = heavy_view(plan, size, len(doc))
        image = render_pair(manuals[plan.pdf], plan)
        rows.append({
            "id": plan.id, "query": plan.query, "split": plan.split,
            "image": {"bytes": png_bytes(image), "path": None},
            "view": kind, "width": image.width, "height": image.height,
        })
    return rows


def _write_parquet(rows: list[dict], path: Path) -> None:
    import datasets

    datasets.disable_progress_bars()
    features = datasets.Features({
        "id": datasets.Value("string"), "query": datasets.Value("string"), "image": datasets.Image(),
        "view": datasets.Value("string"), "width": datasets.Value("int32"), "height": datasets.Value("int32"),
    })
    columns = {k: [r[k] for r in rows] for k in features}
    datasets.Dataset.from_dict(columns, features=features).to_parquet(str(path))


def build_workload(name: str, root: Path, *, train_pairs: int | None = None, dev_pairs: int | None = None) -> Path:
    """Render workload ``name`` into ``root/<name>-<version>-<train>-<dev>/`` (reused when present)
    and return that directory: ``train.parquet``, ``dev.parquet``, ``workload.json``."""
    spec = WORKLOADS[name]
    n_train = spec.train_pairs if train_pairs is None else train_pairs
    n_dev = spec.dev_pairs if dev_pairs is None else dev_pairs
    final = Path(root) / f"{name}-{WORKLOAD_VERSION}-{n_train}-{n_dev}"
    if (final / "workload.json").is_file():
        return final
    from raggedvl.data.rdocs import open_manuals

    manuals = open_manuals()
    rows = _render(spec, _plans(n_train, n_dev), manuals)
    Path(root).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        for split in ("train", "dev"):
            _write_parquet([r for r in rows if r["split"] == split], tmp / f"{split}.parquet")
        meta = {
            "name": name, "version": WORKLOAD_VERSION, "max_pixels": spec.max_pixels,
            "pairs": dict(Counter(r["split"] for r in rows)),
            "sizes": {split: [[r["width"], r["height"], r["view"]] for r in rows if r["split"] == split]
                      for split in ("train", "dev")},
        }
        (tmp / "workload.json").write_text(json.dumps(meta) + "\n")
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "workload.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def load_sizes(directory: Path, split: str = "train") -> list[tuple[int, int, str]]:
    meta = json.loads((Path(directory) / "workload.json").read_text())
    return [(int(w), int(h), v) for w, h, v in meta["sizes"][split]]


def describe(directory: Path, split: str = "train", min_pixels: int = MIN_PIXELS) -> str:
    """Markdown table: per view, count and the range / median of patches (pixel_values rows)
    after raggedvl's image policy (the Qwen2-VL resize rule) at the workload's max_pixels, plus
    the whole-set spread."""
    from raggedvl.images import ImagePolicy
    from raggedvl.sampling import estimate_costs

    meta = json.loads((Path(directory) / "workload.json").read_text())
    policy = ImagePolicy(min_pixels=min_pixels, max_pixels=int(meta["max_pixels"]))
    sizes = load_sizes(directory, split)
    patches = estimate_costs([(w, h) for w, h, _ in sizes], 0, policy=policy).patches
    by_view: dict[str, list[tuple[int, int, int]]] = {}
    for (w, h, view), p in zip(sizes, patches.tolist()):
        by_view.setdefault(view, []).append((w, h, p))
    lines = [
        f"{meta['name']} ({split}, {len(sizes)} pairs, max_pixels {meta['max_pixels']:,}): patches = pixel_values rows "
        f"after resize (visual tokens = patches / 4)",
        "",
        "| view | pairs | source px (median w x h) | patches min | median | max |",
        "|---|---:|---|---:|---:|---:|",
    ]
    order = [v for v in VIEWS if v in by_view] + sorted(v for v in by_view if v not in VIEWS)
    for view in order:
        items = by_view[view]
        p = np.array([x[2] for x in items])
        w_med, h_med = int(np.median([x[0] for x in items])), int(np.median([x[1] for x in items]))
        lines.append(f"| {view} | {len(items)} | {w_med} x {h_med} | {p.min():,} | {int(np.median(p)):,} | {p.max():,} |")
    allp = np.array([x[2] for items in by_view.values() for x in items])
    lines.append(
        f"| all | {len(allp)} | | {allp.min():,} | {int(np.median(allp)):,} | {allp.max():,} |"
    )
    lines.append("")
    lines.append(f"max/median patches {allp.max() / np.median(allp):.1f}, max/min {allp.max() / allp.min():.1f}, "
                 f"mean {allp.mean():,.0f}")
    return "\n".join(lines)
