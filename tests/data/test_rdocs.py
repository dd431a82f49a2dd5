"""The embedded rdocs dataset: structure of the pairs, determinism, caching, integrity checks."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter

import pytest
from PIL import Image

from raggedvl.data import build_rdocs, verify_manuals
from raggedvl.data.rdocs import count_pairs, manuals_dir, png_bytes, render_pair
from raggedvl.data.rdocs_pairs import DPI_RANGE, clean_title, is_useful_query, select_subset


def _tree_digest(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_pairs_follow_the_recipe(all_plans):
    assert 1200 <= len(all_plans) <= 2000
    queries = [p.query.casefold() for p in all_plans]
    assert len(set(queries)) == len(queries)  # duplicates dropped, not just deduplicated
    keys = [(p.pdf, p.page) for p in all_plans]
    assert len(set(keys)) == len(keys)  # one query per page
    assert all(is_useful_query(p.query) for p in all_plans)
    assert all(DPI_RANGE[0] <= p.dpi <= DPI_RANGE[1] for p in all_plans)
    views = Counter(p.view for p in all_plans)
    assert views["full"] > views["crop"] > 0 and views["spread"] > 0
    splits = Counter(p.split for p in all_plans)
    assert 0.1 < splits["dev"] / len(all_plans) < 0.3
    positives = set(keys)
    for plan in all_plans:
        if plan.view == "spread":
            assert (plan.pdf, plan.page + 1) not in positives  # a spread never shows another answer
    assert {p.source for p in all_plans} == {"outline", "help_title"}
    titles = {p.query for p in all_plans if p.pdf == "refman.pdf"}
    assert "Sample Quantiles" in titles


def test_title_cleaning():
    assert clean_title("2.3 Generating regular sequences") == "Generating regular sequences"
    assert clean_title("A.1 Sample\u00adsession") == "Samplesession"
    assert clean_title("Appendix B  Invoking   R") == "Invoking R"
    assert clean_title("A A sample session", chapter=True) == "A sample session"
    assert clean_title("A specific example") == "A specific example"
    assert clean_title("R and statistics") == "R and statistics"
    assert clean_title("64-bit types") == "64-bit types"
    assert not is_useful_query("Introduction")
    assert not is_useful_query("Examples")
    assert not is_useful_query("Function and variable index")
    assert not is_useful_query("Vectors")  # one word
    assert is_useful_query("Sample Quantiles")


def test_subsets_are_nested_and_sized(all_plans):
    small = select_subset(all_plans, 5, 2)
    large = select_subset(all_plans, 20, 8)
    assert Counter(p.split for p in small) == {"train": 5, "dev": 2}
    assert {p.id for p in small} <= {p.id for p in large}
    with pytest.raises(ValueError, match="train_limit"):
        select_subset(all_plans, 0, 2)
    assert count_pairs(limit=10) == {"dev": 2, "train": 8}
    with pytest.raises(ValueError, match="not both"):
        count_pairs(limit=10, dev_limit=3)


def test_every_view_renders_deterministically(all_plans, manuals):
    for view in ("full", "crop", "spread"):
        plan = next(p for p in all_plans if p.view == view and p.dpi < 90)
        first = render_pair(manuals[plan.pdf], plan)
        second = render_pair(manuals[plan.pdf], plan)
        assert png_bytes(first) == png_bytes(second)
        page_w, page_h = manuals[plan.pdf][plan.page].get_size()
        scale = plan.dpi / 72.0
        assert first.mode == "L"
        if view == "spread":
            assert first.width == pytest.approx(2 * page_w * scale, abs=3)
        elif view == "crop":
            top, bottom = plan.crop_pt
            assert first.height == pytest.approx((top - bottom) * scale, abs=2)
            assert 0.7 <= first.width / first.height <= 7.6
        else:
            assert first.size == pytest.approx((page_w * scale, page_h * scale), abs=2)


def test_build_is_byte_identical_and_cached(small_rdocs, tmp_path):
    again = build_rdocs(tmp_path, train_limit=6, dev_limit=3)
    assert _tree_digest(small_rdocs) == _tree_digest(again)
    rows = [json.loads(line) for line in (small_rdocs / "manifest.jsonl").read_text().splitlines()]
    assert Counter(r["split"] for r in rows) == {"train": 6, "dev": 3}
    for row in rows:
        with Image.open(small_rdocs / row["image"]) as image:
            assert image.size == (row["width"], row["height"])
    info = json.loads((small_rdocs / "build_info.json").read_text())
    assert info["manifest_sha256"] == hashlib.sha256((small_rdocs / "manifest.jsonl").read_bytes()).hexdigest()
    mtime = (again / "manifest.jsonl").stat().st_mtime_ns
    assert build_rdocs(tmp_path, train_limit=6, dev_limit=3) == again  # cached: nothing rewritten
    assert (again / "manifest.jsonl").stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_vendored_manuals_are_verified(tmp_path):
    verify_manuals()
    copy = tmp_path / "manuals"
    shutil.copytree(manuals_dir(), copy)
    (copy / "R-FAQ.pdf").write_bytes((copy / "R-FAQ.pdf").read_bytes()[:-10])
    with pytest.raises(ValueError, match="R-FAQ.pdf has SHA-256"):
        verify_manuals(copy)
    assert (manuals_dir() / "debian-copyright.txt").read_text().strip()
