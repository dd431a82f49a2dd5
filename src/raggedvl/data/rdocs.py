"""Build and cache the embedded "rdocs" retrieval dataset from the vendored R manuals.

Output directory (``rdocs-<version>-<subset>``)::

    manifest.jsonl   one JSON object per pair, in manual/page order:
                     id, query, image (relative path), split ("train"|"dev"), pdf, page
                     (0-based), pages (pages shown), view ("full"|"crop"|"spread"), dpi,
                     width, height (pixels), source ("outline"|"help_title")
    images/<id>.png  8-bit greyscale PNG, written with fixed settings and no metadata
    build_info.json  version, counts per split and view, SHA-256 of the manifest

The output is byte-identical run to run (PNG encoder settings are fixed, nothing depends on
time or the machine). The build renders into a temporary sibling directory and renames it
into place, so a reader never sees a half-built dataset; concurrent builders race harmlessly
(the loser discards its copy). The vendored PDFs' SHA-256 sums are verified first.
Measured speed on one core: see benchmarks/results/rdocs_build.md.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections import Counter
from importlib import resources
from pathlib import Path

import pypdfium2 as pdfium
from PIL import Image

from raggedvl.data.cache import cache_root
from raggedvl.data.rdocs_pairs import DEV_FRACTION, MANUALS, RDOCS_VERSION, PairPlan, plan_pairs, select_subset

DEFAULT_JOB_TRAIN_PAIRS = 256  # = TrainConfig.max_train_samples
DEFAULT_JOB_DEV_PAIRS = 128  # = TrainConfig.max_eval_samples
_PNG_COMPRESS_LEVEL = 6


def manuals_dir() -> Path:
    """Directory of the vendored R manual PDFs, SHA256SUMS and debian-copyright.txt."""
    return Path(str(resources.files("raggedvl.data") / "r_manuals"))


def verify_manuals(directory: Path | None = None) -> None:
    """Check every PDF against SHA256SUMS; raises ValueError naming the file on a mismatch."""
    directory = directory or manuals_dir()
    sums_file = directory / "SHA256SUMS"
    if not sums_file.is_file():
        raise ValueError(f"{sums_file} is missing; reinstall raggedvl (the R manuals are package data)")
    expected = dict(reversed(line.split(maxsplit=1)) for line in sums_file.read_text().splitlines() if line.strip())
    for name in MANUALS:
        path = directory / name
        if not path.is_file():
            raise ValueError(f"vendored manual {path} is missing; reinstall raggedvl")
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != expected.get(name):
            raise ValueError(
                f"vendored manual {path} has SHA-256 {actual}, expected {expected.get(name)}; "
                "the file was modified or truncated, reinstall raggedvl"
            )


def open_manuals(directory: Path | None = None) -> dict[str, pdfium.PdfDocument]:
    """Verify the sums and open every manual (name -> document)."""
    directory = directory or manuals_dir()
    verify_manuals(directory)
    return {name: pdfium.PdfDocument(str(directory / name)) for name in MANUALS}


@functools.lru_cache(maxsize=1)
def all_pairs() -> tuple[PairPlan, ...]:
    """Every pair of the full dataset (``plan_pairs`` over the verified manuals), computed once
    per process (about 2 s: reading ~1,400 help-page titles)."""
    return tuple(plan_pairs(open_manuals()))


def _render_page(doc: pdfium.PdfDocument, index: int, dpi: int, crop_pt: tuple[float, float] | None = None) -> Image.Image:
    page = doc[index]
    crop = (0, 0, 0, 0)
    if crop_pt is not None:
        top, bottom = crop_pt
        crop = (0, bottom, 0, page.get_size()[1] - top)  # (left, bottom, right, top) margins in pt
    bitmap = page.render(scale=dpi / 72.0, grayscale=True, crop=crop)
    image = bitmap.to_pil().convert("L")  # convert copies the pixels out of pdfium's buffer
    bitmap.close()
    page.close()  # pdfium pages are freed explicitly; the document would keep them alive
    return image


def render_pair(doc: pdfium.PdfDocument, plan: PairPlan) -> Image.Image:
    """The document image of one pair: full page, section crop or two-page spread (mode "L")."""
    if plan.view == "spread":
        left, right = (_render_page(doc, p, plan.dpi) for p in plan.pages)
        spread = Image.new("L", (left.width + right.width, max(left.height, right.height)), 255)
        spread.paste(left, (0, 0))
        spread.paste(right, (left.width, 0))
        return spread
    return _render_page(doc, plan.page, plan.dpi, plan.crop_pt)


def png_bytes(image: Image.Image) -> bytes:
    """Deterministic PNG encoding (fixed compression level, no metadata chunks)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=_PNG_COMPRESS_LEVEL, optimize=False)
    return buffer.getvalue()


def _resolve_limits(limit: int | None, train_limit: int | None, dev_limit: int | None) -> tuple[int | None, int | None]:
    if limit is None:
        return train_limit, dev_limit
    if train_limit is not None or dev_limit is not None:
        raise ValueError("pass either limit or train_limit/dev_limit, not both")
    if not isinstance(limit, int) or limit < 2:
        raise ValueError(f"limit must be an integer >= 2 (one train and one dev pair), got {limit!r}")
    dev = max(1, round(limit * DEV_FRACTION))
    return limit - dev, dev


def _subset_tag(train_limit: int | None, dev_limit: int | None) -> str:
    if train_limit is None and dev_limit is None:
        return "full"
    return f"train{train_limit if train_limit is not None else 'all'}-dev{dev_limit if dev_limit is not None else 'all'}"


def _write_dataset(target: Path, plans: list[PairPlan], manuals: dict[str, pdfium.PdfDocument], progress) -> None:
    (target / "images").mkdir(parents=True)
    lines = []
    for plan in plans:
        image = render_pair(manuals[plan.pdf], plan)
        rel = f"images/{plan.id}.png"
        (target / rel).write_bytes(png_bytes(image))
        record = {
            "id": plan.id, "query": plan.query, "image": rel, "split": plan.split, "pdf": plan.pdf,
            "page": plan.page, "pages": plan.pages, "view": plan.view, "dpi": plan.dpi,
            "width": image.width, "height": image.height, "source": plan.source,
        }
        lines.append(json.dumps(record, ensure_ascii=False, sort_keys=True))
        if progress is not None:
            progress(1)
    manifest = ("\n".join(lines) + "\n").encode()
    (target / "manifest.jsonl").write_bytes(manifest)
    info = {
        "version": RDOCS_VERSION,
        "pairs": len(plans),
        "splits": dict(sorted(Counter(p.split for p in plans).items())),
        "views": dict(sorted(Counter(p.view for p in plans).items())),
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        "source": "GNU R 4.2.2 manuals (Debian r-doc-pdf 4.2.2.20221110-2), see debian-copyright.txt",
    }
    (target / "build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(manuals_dir() / "debian-copyright.txt", target / "debian-copyright.txt")


def build_rdocs(
    cache_dir: str | os.PathLike | None = None,
    *,
    limit: int | None = None,
    train_limit: int | None = None,
    dev_limit: int | None = None,
    force: bool = False,
    progress=None,
) -> Path:
    """Build (or reuse) the rdocs dataset and return its directory.

    Args:
        cache_dir: root directory of the cache (default :func:`raggedvl.data.cache.cache_root`); the dataset
            lives in ``<cache_dir>/rdocs-<version>-<subset>``.
        limit: at most this many pairs in all, split like the full set (``dev = round(limit *
            0.2)``, at least 1); cannot be combined with ``train_limit`` / ``dev_limit``.
        train_limit, dev_limit: keep at most this many train / dev pairs (chosen by a stable
            hash rank, so smaller subsets are contained in larger ones and each pair's image is
            identical to the full build's). None keeps all (1,296 train + 357 dev).
            The default job uses ``DEFAULT_JOB_TRAIN_PAIRS`` / ``DEFAULT_JOB_DEV_PAIRS``.
        force: rebuild even when the directory exists.
        progress: optional callable ``progress(n)`` called after each rendered pair.

    Raises:
        ValueError: a vendored PDF fails its SHA-256 check, or a limit is not a positive int.
    """
    train_limit, dev_limit = _resolve_limits(limit, train_limit, dev_limit)
    root = cache_root(cache_dir)
    final = root / f"rdocs-{RDOCS_VERSION}-{_subset_tag(train_limit, dev_limit)}"
    if (final / "manifest.jsonl").is_file() and not force:
        return final
    manuals = open_manuals()
    plans = select_subset(list(all_pairs()), train_limit, dev_limit)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        _write_dataset(tmp, plans, manuals, progress)
        if force and final.exists():
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "manifest.jsonl").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def count_pairs(limit: int | None = None, train_limit: int | None = None, dev_limit: int | None = None) -> dict[str, int]:
    """Pairs per split that ``build_rdocs`` would write with these limits (no rendering)."""
    train_limit, dev_limit = _resolve_limits(limit, train_limit, dev_limit)
    plans = select_subset(list(all_pairs()), train_limit, dev_limit)
    return dict(sorted(Counter(p.split for p in plans).items()))
