"""Image hardening (raggedvl.images): every hostile kind of file is processed into a valid grid or rejected."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from raggedvl.images import BadImageError, ImagePolicy, load_image, read_size

LIMITS = ImagePolicy(min_pixels=56 * 56, max_pixels=200_704)


def _processor_grid(image: Image.Image, limits: ImagePolicy) -> tuple[int, int, int]:
    proc = Qwen2VLImageProcessorPil(min_pixels=limits.min_pixels, max_pixels=limits.max_pixels)
    out = proc(images=[image], return_tensors="pt")
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    assert out["pixel_values"].shape[0] == t * h * w
    return t, h, w


def _assert_valid_grid(image: Image.Image, limits: ImagePolicy = LIMITS) -> None:
    assert image.mode == "RGB"
    _, gh, gw = _processor_grid(image, limits)
    h_px, w_px = gh * limits.patch_size, gw * limits.patch_size
    assert min(h_px, w_px) >= limits.factor
    assert limits.min_pixels <= h_px * w_px <= limits.max_pixels
    assert gh % limits.merge_size == 0 and gw % limits.merge_size == 0
    assert (w_px, h_px) == image.size == limits.geometry(*image.size).target  # the processor keeps the size


def _save(image: Image.Image, path, **kwargs):
    image.save(path, **kwargs)
    return path


@pytest.mark.parametrize(
    "size",
    [(1, 1), (5, 3), (27, 27), (31, 639), (639, 31), (15, 690), (100, 2000), (20, 3900), (10, 5000), (3, 9000), (2000, 2), (2000, 1500)],
)
def test_geometry_always_gives_a_valid_grid(tmp_path, size):
    rng = np.random.default_rng(sum(size))
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    path = _save(Image.fromarray(pixels), tmp_path / "x.png")
    _assert_valid_grid(LIMITS.prepare(path))


def test_extreme_aspect_is_padded_not_distorted():
    strip = Image.new("RGB", (2000, 2), (0, 0, 0))
    geometry = LIMITS.geometry(2000, 2)
    assert geometry.canvas == (2000, 16) and max(geometry.canvas) / min(geometry.canvas) <= LIMITS.max_aspect
    fitted = LIMITS.prepare(strip)
    assert fitted.size == geometry.target
    array = np.asarray(fitted)
    row_means = array.mean(axis=(1, 2))
    assert row_means[0] == 255 and row_means[-1] == 255  # white padding above and below
    assert row_means[len(row_means) // 2] < 10  # the black strip survives in the middle


def test_small_max_pixels_still_valid():
    limits = ImagePolicy(min_pixels=28 * 28, max_pixels=2 * 28 * 28 * 8)
    for size in [(1, 1), (20, 3900), (3900, 20), (700, 700)]:
        _assert_valid_grid(limits.prepare(Image.new("RGB", size, (9, 9, 9))), limits)


def test_modes_convert_to_rgb(tmp_path):
    gray = _save(Image.new("L", (60, 40), 100), tmp_path / "g.png")
    assert load_image(gray).getpixel((0, 0)) == (100, 100, 100)

    palette = Image.new("P", (60, 40), 0)
    palette.putpalette([10, 20, 30] + [0] * 765)
    assert load_image(_save(palette, tmp_path / "p.png")).getpixel((5, 5)) == (10, 20, 30)

    rgba = Image.new("RGBA", (60, 40), (0, 0, 0, 0))
    rgba.putpixel((1, 1), (200, 0, 0, 255))
    out = load_image(_save(rgba, tmp_path / "a.png"))
    assert out.getpixel((0, 0)) == (255, 255, 255)  # transparent -> white, not black
    assert out.getpixel((1, 1)) == (200, 0, 0)

    transparent_palette = palette.copy()
    transparent_palette.info["transparency"] = 0
    assert load_image(_save(transparent_palette, tmp_path / "pt.png", transparency=0)).getpixel((0, 0)) == (255, 255, 255)

    cmyk = _save(Image.new("CMYK", (60, 40), (0, 255, 255, 0)), tmp_path / "c.jpg", quality=95)
    r, g, b = load_image(cmyk).getpixel((30, 20))
    assert r > 200 and g < 60 and b < 60

    sixteen = Image.fromarray(np.full((40, 60), 65535 // 2, dtype=np.uint16))
    path16 = _save(sixteen, tmp_path / "s.png")
    assert Image.open(path16).mode.startswith("I")
    assert load_image(path16).getpixel((0, 0)) == (127, 127, 127)

    for path in (gray, cmyk, path16):
        _assert_valid_grid(LIMITS.prepare(path))


def test_exif_orientation_is_applied(tmp_path):
    image = Image.new("RGB", (80, 40), (255, 255, 255))
    image.paste((0, 0, 0), (0, 0, 10, 10))  # black square top-left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    path = _save(image, tmp_path / "r.jpg", exif=exif, quality=95)
    out = load_image(path)
    assert out.size == (40, 80)
    assert sum(out.getpixel((35, 3))) < 100  # the square moved to the top-right


def _png_with_header_size(width: int, height: int) -> bytes:
    """A valid small PNG whose IHDR announces ``width`` x ``height``."""
    buffer = io.BytesIO()
    Image.new("L", (4, 4), 0).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


def test_decompression_bomb_rejected_before_decoding():
    bomb = _png_with_header_size(100_000, 100_000)
    with pytest.raises(BadImageError, match="max_source_pixels"):
        load_image(bomb, name="row 7")
    limits = ImagePolicy(max_pixels=200_704, max_source_pixels=10_000)
    with pytest.raises(BadImageError, match="row 3"):
        limits.prepare(Image.new("RGB", (200, 100)), name="row 3")


def test_truncated_and_corrupt_files_are_rejected(tmp_path):
    full = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)).save(full, format="PNG")
    truncated = tmp_path / "t.png"
    truncated.write_bytes(full.getvalue()[: len(full.getvalue()) // 2])
    with pytest.raises(BadImageError, match="t.png"):
        load_image(truncated)
    corrupt = tmp_path / "c.png"
    corrupt.write_bytes(b"not an image at all")
    with pytest.raises(BadImageError, match="cannot be decoded"):
        load_image(corrupt)
    with pytest.raises(BadImageError):
        load_image(tmp_path / "missing.png")
    with pytest.raises(TypeError):
        load_image(12345)


def test_a_png_cut_short_is_rejected_by_the_header_read(tmp_path):
    """A PNG whose header is intact but whose data stops early (no IEND chunk within its last
    4 KiB) is rejected by ``read_size`` (the size estimate, the launcher's scan) from every input
    form, with ``reason`` the short cause; a complete PNG, one with bytes appended after IEND, and a
    PIL image pass; the error keeps ``reason`` through pickling (a scan worker's error)."""
    import pickle

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (120, 90, 3), dtype=np.uint8)).save(buffer, format="PNG")
    whole = buffer.getvalue()
    assert len(whole) > 4096 * 2  # the data is longer than the tail that is read
    (tmp_path / "whole.png").write_bytes(whole)
    (tmp_path / "cut.png").write_bytes(whole[:-1])  # even one byte missing (the IEND CRC)
    for good in (whole, whole + b"\0" * 100, {"bytes": whole, "path": None}, tmp_path / "whole.png", Image.open(io.BytesIO(whole))):
        assert read_size(good) == (90, 120)
    for cut in (whole[: len(whole) // 2], whole[:200], {"bytes": whole[:-12], "path": None}, tmp_path / "cut.png",
                {"bytes": None, "path": str(tmp_path / "cut.png")}):
        with pytest.raises(BadImageError, match=r"row 4(, file .*cut\.png)?: truncated PNG \(no IEND chunk\)") as error:
            read_size(cut, name="row 4")
        assert error.value.reason == "truncated PNG (no IEND chunk)"
        assert "on_bad_image='skip'" in str(error.value) and "skip" not in error.value.reason
    assert pickle.loads(pickle.dumps(error.value)).reason == "truncated PNG (no IEND chunk)"


def test_bad_image_reasons_are_the_cause_without_the_name_or_the_fix(tmp_path):
    (tmp_path / "c.png").write_bytes(b"not an image at all")
    for call, cause in ((lambda: read_size(tmp_path / "c.png", name="row 2"), "cannot read the image header ("),
                        (lambda: load_image(tmp_path / "c.png", name="row 2"), "cannot be decoded ("),
                        (lambda: LIMITS.geometry(0, 5, name="row 2"), "empty size 0x5"),
                        (lambda: ImagePolicy(max_source_pixels=100).geometry(20, 20, name="row 2"),
                         "20x20 = 400 pixels, above max_source_pixels=100")):
        with pytest.raises(BadImageError) as error:
            call()
        assert "row 2" in str(error.value) and error.value.reason.startswith(cause), error.value.reason
        assert "row 2" not in error.value.reason and "skip" not in error.value.reason
    assert BadImageError("plain").reason == "plain"


def test_a_bad_image_names_its_file_once(tmp_path):
    """``inspect`` and ``prepare`` pass their label (name + file) on to ``read_size`` /
    ``load_image``: the message names the file once, not "file c.png, file c.png"."""
    (tmp_path / "c.png").write_bytes(b"not an image at all")
    for source in (tmp_path / "c.png", {"bytes": b"not an image at all", "path": "c.png"}):
        for call in (LIMITS.inspect, LIMITS.prepare):
            with pytest.raises(BadImageError) as error:
                call(source, name="row 5 (id 'a'): image")
            assert str(error.value).count(", file ") == 1, str(error.value)
            assert str(error.value).startswith("row 5 (id 'a'): image, file "), str(error.value)


def test_limits_from_processor_and_validation():
    proc = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=250_000)
    limits = ImagePolicy.from_processor(proc)
    assert (limits.min_pixels, limits.max_pixels, limits.factor) == (3136, 250_000, 28)
    with pytest.raises(ValueError, match="min_pixels"):
        ImagePolicy(min_pixels=10_000, max_pixels=5_000)


def test_resize_image_equals_torchvision_where_installed():
    """``resize_image`` is torchvision's uint8 bicubic antialiased resize, computed with torch
    alone; compared directly where torchvision is importable (a GPU setup), skipped here (the
    colpali fixture tests compare the resulting embeddings with colpali-engine's instead)."""
    tv = pytest.importorskip("torchvision.transforms.v2.functional")
    import numpy as np
    import torch

    from raggedvl.images import resize_image

    noise = Image.fromarray(np.random.default_rng(1).integers(0, 256, (611, 903, 3), dtype=np.uint8))
    for size in [(448, 308), (196, 140), (1204, 812)]:
        ours = torch.from_numpy(np.array(resize_image(noise, size))).permute(2, 0, 1)
        theirs = tv.resize(torch.from_numpy(np.array(noise)).permute(2, 0, 1), [size[1], size[0]],
                           interpolation=tv.InterpolationMode.BICUBIC, antialias=True)
        assert torch.equal(ours, theirs)
