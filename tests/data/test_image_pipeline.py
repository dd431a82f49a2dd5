"""One image pipeline (raggedvl.images.ImagePolicy) for the size estimate and both collators:
the estimate's patch count equals the collators' pixel_values rows for every size and every
input form, and the SFT collator hardens images exactly like retrieval."""

from __future__ import annotations

import copy
import io

import datasets
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from raggedvl.data import BadImageError, RetrievalCollator
from raggedvl.hf import SFTCollator
from raggedvl.images import ImagePolicy
from raggedvl.sampling import estimate_costs

# Image-processor settings of each family's released checkpoints (preprocessor_config.json):
# Qwen2-VL and Qwen2.5-VL: patch 14 (factor 28), 3,136 .. 12,845,056 pixels; Qwen3-VL: patch 16
# (factor 32), 65,536 .. 16,777,216 pixels. Plus the tiny default job (factor 28, <= 200,704).
FAMILIES = {
    "qwen2_vl": dict(patch_size=14, min_pixels=3136, max_pixels=12_845_056),
    "qwen2_5_vl": dict(patch_size=14, min_pixels=3136, max_pixels=12_845_056),
    "qwen3_vl": dict(patch_size=16, min_pixels=65_536, max_pixels=16_777_216),
    "tiny": dict(patch_size=14, min_pixels=56 * 56, max_pixels=448 * 448),
}


@pytest.fixture(scope="module")
def family_processors(tiny_processor):
    out = {}
    for name, kwargs in FAMILIES.items():
        proc = copy.copy(tiny_processor)
        proc.image_processor = Qwen2VLImageProcessorPil(merge_size=2, **kwargs)
        if name != "tiny":
            proc.model_type = name  # as a checkpoint's config.json states it (raggedvl.families.family_of)
        out[name] = proc
    return out


def _png(size, value=(0, 0, 0)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, value).save(buffer, format="PNG")
    return buffer.getvalue()


def _retrieval_rows(proc, image) -> int:
    docs = RetrievalCollator(proc)([{"query": "a page", "image": image, "id": "x"}])["docs"]
    grid = docs["image_grid_thw"]
    assert docs["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())
    return int(docs["pixel_values"].shape[0])


def _sft_rows(proc, images) -> int:
    wire = SFTCollator(proc)([{"images": images, "prompt": "read it ", "answer": "ok"}])
    return int(wire["pixel_values"].shape[0])


SIZES = st.one_of(
    st.tuples(st.integers(1, 40), st.integers(1, 40)),  # tiny: scaled up to the factor
    st.tuples(st.integers(1, 30), st.integers(31, 20_000)),  # strips up to 20000x30: padded
    st.tuples(st.integers(31, 900), st.integers(31, 900)),  # ordinary pages and crops
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(sorted(FAMILIES)), size=SIZES, transpose=st.booleans())
@example(family="qwen2_5_vl", size=(1, 5615), transpose=False)  # padded to 29x5615, rounded to 28x5628 (> 200:1)
def test_estimate_equals_collator_rows_for_odd_sizes(family_processors, family, size, transpose):
    """Property: for any size (1x1 .. 20000x30, both orientations) and each family's factor and
    limits, the header-only estimate gives exactly the collators' patch rows (and the processor
    accepts the prepared image: hypothesis found 1x5615, whose first padding rounded to 201:1)."""
    width, height = (size[1], size[0]) if transpose else size
    proc = family_processors[family]
    policy = ImagePolicy.from_processor(proc)
    encoded = _png((width, height))
    est = estimate_costs([(width, height), encoded], 0, policy=policy).patches.tolist()
    rows = _retrieval_rows(proc, encoded)
    assert est == [rows, rows]
    assert rows == policy.inspect(encoded).patches
    assert _sft_rows(proc, [Image.new("RGB", (width, height))]) == rows


@pytest.mark.parametrize("size, rows", [((2000, 2), 500), ((1, 313), 416), ((3000, 20), 500), ((20000, 30), 720)])
def test_strips_estimate_equals_collators(tiny_processor, size, rows):
    """The issue's reproductions with the tiny defaults (3,136 .. 200,704 pixels, factor 28):
    the estimate used to raise for 2000x2 and 1x313 and to give 428 for 3000x20; the SFT
    collator raised transformers' bare aspect-ratio error for the first two."""
    policy = ImagePolicy.from_processor(tiny_processor)
    assert estimate_costs([size], 0, policy=policy).patches.tolist() == [rows]
    image = Image.new("RGB", size, (0, 0, 0))
    assert _retrieval_rows(tiny_processor, image) == rows
    assert _sft_rows(tiny_processor, [image]) == rows


def _rotated_jpeg(path) -> bytes:
    """A 90x30 JPEG (black square top-left) with EXIF orientation 6: displayed as 30x90."""
    image = Image.new("RGB", (90, 30), (255, 255, 255))
    image.paste((0, 0, 0), (0, 0, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6
    image.save(path, exif=exif, quality=95)
    return path.read_bytes()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_collator_pixels_equal_the_processors_own_resize(family_processors, family):
    # The collator skips the processor's resize (ImagePolicy.prepare already gave the target size).
    # Exact equality with the processor's full path (its resize on) on noise images, where any
    # real resampling would change the pixels; sizes: under, inside and above the pixel limits.
    proc = family_processors[family]
    policy = ImagePolicy.from_processor(proc)
    rng = np.random.default_rng(0)
    sizes = [(policy.factor + 3, 3 * policy.factor + 5), (617, 443), (4000, 3100)]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    docs = RetrievalCollator(proc)([{"query": "a page", "image": im, "id": str(i)} for i, im in enumerate(images)])["docs"]
    prepared = [policy.prepare(im) for im in images]
    assert all(im.size != size for im, size in zip(prepared, sizes))  # prepare resized every image
    full = proc(text=["<|vision_start|><|image_pad|><|vision_end|>"] * len(images), images=prepared, return_tensors="pt",
                padding="longest")
    assert torch.equal(docs["image_grid_thw"], full["image_grid_thw"])
    assert docs["pixel_values"].dtype == full["pixel_values"].dtype == torch.float32
    assert torch.equal(docs["pixel_values"], full["pixel_values"])


def test_every_input_form_gives_the_same_image(tiny_processor, tmp_path):
    """path, str path, bytes, both datasets dict forms, an opened PIL image and a row decoded by
    datasets' Image() feature: same estimate, same collator pixels, orientation applied."""
    path = tmp_path / "rotated.jpg"
    data = _rotated_jpeg(path)
    decoded_row = datasets.Dataset.from_dict(
        {"image": [str(path)]}, features=datasets.Features({"image": datasets.Image()})
    )[0]["image"]
    forms = {
        "path": path, "str": str(path), "bytes": data, "dict bytes": {"bytes": data, "path": None},
        "dict path": {"bytes": None, "path": str(path)}, "PIL opened": Image.open(path), "datasets row": decoded_row,
    }
    policy = ImagePolicy.from_processor(tiny_processor)
    upright = policy.geometry(30, 90)
    assert upright.grid != policy.geometry(90, 30).grid  # the orientation matters for the grid
    estimate = estimate_costs(list(forms.values()), 0, policy=policy)
    assert estimate.patches.tolist() == [upright.patches] * len(forms)
    reference = None
    for name, form in forms.items():
        docs = RetrievalCollator(tiny_processor)([{"query": "q", "image": form, "id": name}])["docs"]
        assert docs["image_grid_thw"].tolist() == [list(upright.grid)], name
        sft = SFTCollator(tiny_processor)([{"images": [form], "prompt": "p ", "answer": "a"}])
        assert torch.equal(sft["pixel_values"], docs["pixel_values"]), name
        if reference is None:
            reference = docs["pixel_values"]
        assert torch.equal(docs["pixel_values"], reference), name
    prepared = policy.prepare(data)
    assert prepared.size == upright.target
    assert sum(prepared.getpixel((prepared.width - 4, 4))) < 200  # the square moved to the top-right


def test_size_estimate_reads_headers_only(tiny_processor, tmp_path, monkeypatch):
    """No pixel is decoded for the estimate: with decoding disabled it still sees the size and
    the EXIF orientation; a JPEG whose pixel data is truncated passes the estimate (header
    intact) and is rejected by the collator, naming the example; a truncated PNG is rejected
    by the estimate already (no IEND chunk at its end), still without decoding."""
    path = tmp_path / "rotated.jpg"
    data = _rotated_jpeg(path)
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 200, 3), dtype=np.uint8))
    cut = {}
    for fmt in ("PNG", "JPEG"):
        buffer = io.BytesIO()
        noise.save(buffer, format=fmt)
        cut[fmt] = buffer.getvalue()[: len(buffer.getvalue()) // 2]
    policy = ImagePolicy.from_processor(tiny_processor)

    def no_decoding(self):
        raise AssertionError("the size estimate decoded pixels")

    with monkeypatch.context() as patch:
        patch.setattr(ImageFile.ImageFile, "load", no_decoding)
        est = estimate_costs([path, data, {"bytes": cut["JPEG"], "path": None}], 0, policy=policy)
        with pytest.raises(BadImageError, match=r"sample 1: image: truncated PNG \(no IEND chunk\)") as error:
            estimate_costs([data, cut["PNG"]], 0, policy=policy)
    assert error.value.reason == "truncated PNG (no IEND chunk)"
    assert est.patches.tolist() == [policy.geometry(30, 90).patches] * 2 + [policy.geometry(200, 300).patches]
    for image in cut.values():
        with pytest.raises(BadImageError, match=r"image of example 'cut'.*cannot be decoded"):
            RetrievalCollator(tiny_processor)([{"query": "q", "image": image, "id": "cut"}])


def test_estimate_rejects_like_the_collator_and_skip_counts(tiny_processor):
    """Header-level rejections (unreadable, empty, above max_source_pixels) raise naming the
    sample under "error"; under "skip" the sample is costed as text and listed."""
    policy = ImagePolicy(min_pixels=56 * 56, max_pixels=448 * 448, max_source_pixels=1_000_000)
    images = [(100, 80), b"not an image", (2000, 1000), None]
    with pytest.raises(BadImageError, match=r"row 1 \(id 'b'\): image.*cannot read the image header"):
        estimate_costs(images, 5, policy=policy, names=["row 0 (id 'a')", "row 1 (id 'b')", "row 2", "row 3"])
    est = estimate_costs(images, 5, policy=policy, on_bad_image="skip")
    assert [s["sample"] for s in est.skipped] == [1, 2]
    assert "max_source_pixels=1000000" in est.skipped[1]["reason"]
    assert est.patches.tolist() == [policy.geometry(100, 80).patches, 0, 0, 0]
    assert est.seq_lens.tolist()[1:] == [5, 5, 5]
    with pytest.raises(ValueError, match="on_bad_image"):
        estimate_costs(images, 5, on_bad_image="ignore")


def test_sft_errors_name_the_example(tiny_processor):
    examples = [
        {"images": [Image.new("RGB", (56, 56))], "prompt": "p ", "answer": "a"},
        {"images": [Image.new("RGB", (56, 56)), b"\x89PNG\r\n\x1a\n broken"], "prompt": "p ", "answer": "a", "id": "s7"},
    ]
    with pytest.raises(BadImageError, match=r"image 1 of SFT example 1 \(id 's7'\)"):
        SFTCollator(tiny_processor)(examples)
