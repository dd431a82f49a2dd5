"""What a document image becomes before a Qwen2-VL-family processor sees it: one policy for
every entry point (size estimate, retrieval and SFT collators, evaluation).

``ImagePolicy`` holds the processor's resize limits and decides, in one place:

| input | result |
|---|---|
| grayscale ("L", "1"), palette ("P"), CMYK, YCbCr, LAB, HSV | converted to RGB |
| RGBA / LA / palette with transparency | composited on white, then RGB |
| 16-bit ("I;16*", "I") / float ("F") | scaled to 8 bits (value / 257 for 16-bit, clipped to 0..255 for float) |
| EXIF orientation tag (or XMP ``tiff:Orientation``) stored before the pixel data | applied (pixels rotated/flipped), tag consumed |
| aspect ratio above ``max_aspect`` (e.g. a 1:1000 strip), or one that rounding to multiples of ``factor`` would push over smart_resize's 200 | padded with white on the short side (centred), just enough |
| a side under ``factor`` px (28 for Qwen2/2.5-VL, 32 for Qwen3-VL; e.g. 1x1) | scaled up (aspect kept) so the short side is ``factor`` |
| then | resized to transformers' ``smart_resize`` size (both sides multiples of ``factor``, area in ``[min_pixels, max_pixels]``) with the kernel of transformers' default (torchvision) image processor: antialiased bicubic on the uint8 pixels (``resize_image``) |
| more than ``max_source_pixels`` (decompression bomb), or an empty side | rejected before decoding |
| truncated, corrupt or unidentifiable file | rejected (a PNG without its IEND chunk already by the header read) |

Every step is a function of the (oriented) size alone, so ``ImagePolicy.inspect`` predicts the
grid from a file's header (no pixel is decoded) and ``ImagePolicy.prepare`` produces an image of
exactly that size; the processor then leaves the size unchanged. The pixels are those
colpali-engine and transformers' ``ColQwen2Processor`` feed their models where torchvision is
installed (the usual GPU setup): document embeddings equal colpali-engine 0.3.18's recorded ones
(within 3.2e-7, where PIL's bicubic gives 1.4e-4). An orientation stored after the pixel data (a PNG
``eXIf`` chunk after ``IDAT``) is not read by either path.

Input forms (``ImageSource``): a path (str or ``os.PathLike``), encoded bytes, a ``{"bytes",
"path"}`` dict (``datasets``' ``Image(decode=False)``), or a PIL image (also what ``datasets``'
``Image()`` feature decodes a row to). A ``(width, height)`` pair of ints stands for an image of
that size wherever only the size matters (``inspect``).

Rejected images raise ``BadImageError`` (a ``ValueError``) naming the source and the numbers;
callers offer ``on_bad_image="error"|"skip"``, where skip drops the example and counts it
(never silently). Sizes are (width, height) in pixels, as PIL reports them, unless a name says
otherwise; grids are (t, h, w) in patches.
"""

from __future__ import annotations

import io
import math
import os
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Union

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

ImageSource = Union[str, os.PathLike, bytes, Image.Image, dict]
BadImagePolicy = Literal["error", "skip"]
_SMART_RESIZE_MAX_ASPECT = 200.0  # transformers' smart_resize raises above this
_SWAPS_SIDES = {5, 6, 7, 8}  # EXIF orientations that rotate by 90 degrees
_DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError)


_BAD_IMAGE_FIX = "fix or remove it, or skip such images: on_bad_image='skip' (raggedvl: --on-bad-image skip)"
_IN_MEMORY_FILE = re.compile(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


def _reason(exc: BaseException) -> str:
    """``exc`` as ``Type: message``, without PIL's ``<_io.BytesIO object at 0x...>`` for images held in memory."""
    return f"{type(exc).__name__}: {_IN_MEMORY_FILE.sub('', str(exc))}"


def unreadable_image(source: Any, name: str, exc: BaseException) -> "BadImageError":
    """The error for an image whose stored bytes cannot be read (a missing file, a file it may
    not open, a source of no known form): ``name`` and the file (:func:`describe_source`), the
    cause, and the fix (``--on-bad-image skip`` among them)."""
    cause = f"cannot read the image ({_reason(exc)})"
    return BadImageError(f"{describe_source(source, name)}: {cause}; {_BAD_IMAGE_FIX}", reason=cause)


class BadImageError(ValueError):
    """An image that cannot be decoded or is outside the documented limits.

    The message names the image and says how to fix it (or skip it); ``reason`` is the short
    cause alone (``"truncated PNG (no IEND chunk)"``, ``"cannot be decoded (OSError: ...)"``),
    what an ``on_bad_image="skip"`` warning prints beside the row it already names. Without a
    ``reason`` argument it is the message. Survives pickling (a worker process's error)."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason


def check_bad_image_policy(on_bad_image: str) -> None:
    """Raises ValueError unless ``on_bad_image`` is "error" or "skip"."""
    if on_bad_image not in ("error", "skip"):
        raise ValueError(f"on_bad_image must be 'error' or 'skip', got {on_bad_image!r}")


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL resize rule (the one import of it in this package); (h, w) px."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


@dataclass(frozen=True)
class ImageGeometry:
    """The sizes one image goes through, (width, height) in pixels.

    ``source``: as oriented for display (EXIF applied); ``canvas``: after white padding of an
    extreme aspect ratio; ``target``: what the processor receives (multiples of ``factor``);
    ``grid``: (t, h, w) in patches, ``patches = t*h*w`` rows of ``pixel_values``."""

    source: tuple[int, int]
    canvas: tuple[int, int]
    target: tuple[int, int]
    grid: tuple[int, int, int]

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


@dataclass(frozen=True)
class ImagePolicy:
    """Resize limits of a Qwen2-VL-family image processor and what they make of an image.

    ``min_pixels``/``max_pixels`` bound the resized image's area; ``factor = patch_size *
    merge_size`` (28 for Qwen2/2.5-VL, 32 for Qwen3-VL) is the granularity of both sides;
    ``max_source_pixels`` bounds the source image (decompression-bomb guard). Defaults are
    transformers 5's ``Qwen2VLImageProcessor`` (patch 14, merge 2, 56*56 .. 28*28*1280 pixels).
    Raises ValueError for limits under which no image fits (``min_pixels > max_pixels`` or
    ``max_pixels < 2 * factor**2``).
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    max_source_pixels: int = 64_000_000

    def __post_init__(self) -> None:
        factor = self.patch_size * self.merge_size
        if self.min_pixels < 1 or self.max_pixels < 2 * factor * factor or self.min_pixels > self.max_pixels:
            raise ValueError(
                f"need 1 <= min_pixels <= max_pixels and max_pixels >= 2*{factor}**2 = {2 * factor * factor}, "
                f"got min_pixels={self.min_pixels}, max_pixels={self.max_pixels}"
            )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def max_aspect(self) -> float:
        """Largest long/short side ratio kept unpadded: one that still resizes to a short side
        >= factor within max_pixels (with a 2x margin for rounding), capped below smart_resize's 200."""
        return min(_SMART_RESIZE_MAX_ASPECT - 1.0, self.max_pixels / (2.0 * self.factor**2))

    @classmethod
    def from_processor(cls, processor: Any, max_source_pixels: int = 64_000_000) -> "ImagePolicy":
        """The policy of a transformers Qwen2-VL-family processor or image processor (PIL or
        torchvision backend; ``size`` holds ``shortest_edge`` = min_pixels and ``longest_edge`` =
        max_pixels in transformers 5). Raises TypeError when it has no pixel limits."""
        image_processor = getattr(processor, "image_processor", processor)
        size = getattr(image_processor, "size", None) or {}
        size = dict(size) if not isinstance(size, dict) else size
        min_pixels = size.get("shortest_edge") or getattr(image_processor, "min_pixels", None)
        max_pixels = size.get("longest_edge") or getattr(image_processor, "max_pixels", None)
        if min_pixels is None or max_pixels is None or not hasattr(image_processor, "patch_size"):
            raise TypeError(
                f"{type(image_processor).__name__} has no min/max pixel limits or patch size; is it a Qwen2-VL-family image processor?"
            )
        return cls(
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            max_source_pixels=max_source_pixels,
        )

    # ------------------------------------------------------------------ sizes only
    def geometry(self, width: int, height: int, *, name: str = "image") -> ImageGeometry:
        """What an image of ``width`` x ``height`` pixels (oriented) becomes; no pixels involved.

        Raises:
            BadImageError: an empty side, more than ``max_source_pixels`` pixels, or (never for
                valid limits) a size the processor's rule cannot resize.
        """
        width, height = int(width), int(height)
        if width < 1 or height < 1:
            raise BadImageError(f"{name} has an empty size {width}x{height}", reason=f"empty size {width}x{height}")
        if width * height > self.max_source_pixels:
            raise BadImageError(
                f"{name} is {width}x{height} = {width * height} pixels, above the limit "
                f"max_source_pixels={self.max_source_pixels}; downscale it or raise the limit",
                reason=f"{width}x{height} = {width * height} pixels, above max_source_pixels={self.max_source_pixels}",
            )
        canvas = (width, height)
        if max(canvas) / min(canvas) > self.max_aspect:  # pad the short side
            canvas = self._with_short_side(canvas, math.ceil(max(canvas) / self.max_aspect))
        new_w, new_h = self._resized(canvas, width, height, name)
        # Rounding both sides to multiples of factor can push a canvas just under the aspect
        # limit over smart_resize's 200 (29x5615 -> 28x5628); the processor would then raise on
        # the resized image. Pad a little more until the resized image is within the limit.
        while max(new_w, new_h) / min(new_w, new_h) > _SMART_RESIZE_MAX_ASPECT:
            short = min(canvas)
            ratio = max(new_w, new_h) / min(new_w, new_h) / _SMART_RESIZE_MAX_ASPECT
            canvas = self._with_short_side(canvas, max(short + 1, math.ceil(short * ratio)))
            new_w, new_h = self._resized(canvas, width, height, name)
        if min(new_w, new_h) < self.factor or not self.min_pixels <= new_w * new_h <= self.max_pixels:
            cause = (f"size {width}x{height} resizes to {new_w}x{new_h} = {new_w * new_h} pixels, outside "
                     f"[{self.min_pixels}, {self.max_pixels}] or with a side under {self.factor}")
            raise BadImageError(f"{name} of {cause}; widen min_pixels/max_pixels", reason=cause)
        grid = (1, new_h // self.patch_size, new_w // self.patch_size)
        return ImageGeometry(source=(width, height), canvas=canvas, target=(new_w, new_h), grid=grid)

    @staticmethod
    def _with_short_side(size: tuple[int, int], short: int) -> tuple[int, int]:
        width, height = size
        return (short, height) if width < height else (width, short)

    def _resized(self, canvas: tuple[int, int], width: int, height: int, name: str) -> tuple[int, int]:
        """(width, height) the processor's rule gives a canvas, after scaling a short side under
        ``factor`` up to ``factor`` (aspect kept)."""
        short = min(canvas)
        scaled = canvas
        if short < self.factor:
            scale = self.factor / short
            scaled = (max(self.factor, round(canvas[0] * scale)), max(self.factor, round(canvas[1] * scale)))
        try:
            new_h, new_w = _smart_resize(scaled[1], scaled[0], self.factor, self.min_pixels, self.max_pixels)
        except ValueError as exc:
            cause = f"size {width}x{height} cannot be resized: {exc}"
            raise BadImageError(f"{name} of {cause}", reason=cause) from exc
        return new_w, new_h

    def inspect(self, image: ImageSource | tuple[int, int], *, name: str | None = None) -> ImageGeometry:
        """``geometry`` of an image given as a (width, height) pair or any ``ImageSource``,
        reading only the file header (size and orientation), never the pixel data.

        Raises ``BadImageError`` (unreadable header, limits; see ``geometry``) and
        ``TypeError`` (unsupported source)."""
        if _is_size_pair(image):
            return self.geometry(*image, name=name or "image")
        label = describe_source(image, name)
        return self.geometry(*read_size(image, name=label), name=label)

    # ------------------------------------------------------------------ pixels
    def prepare(self, image: ImageSource, *, name: str | None = None) -> Image.Image:
        """Decode (if needed), orient, convert to RGB, pad, and resize to ``geometry(...).target``:
        an RGB image the processor keeps at its size, giving ``inspect(image).grid``.

        Raises ``BadImageError`` naming ``name`` (or the path) and ``TypeError`` as ``load_image``."""
        label = describe_source(image, name)
        rgb = load_image(image, max_source_pixels=self.max_source_pixels, name=label)
        geom = self.geometry(*rgb.size, name=label)
        if geom.canvas != rgb.size:
            canvas = Image.new("RGB", geom.canvas, (255, 255, 255))
            canvas.paste(rgb, ((geom.canvas[0] - rgb.width) // 2, (geom.canvas[1] - rgb.height) // 2))
            rgb = canvas
        return resize_image(rgb, geom.target)


def resize_image(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """An RGB image resized to ``size`` (width, height) as transformers' torchvision-backed
    ``Qwen2VLImageProcessor`` resizes it: bicubic with antialiasing on the uint8 pixels
    (``torchvision.transforms.v2.functional.resize`` runs ``torch.nn.functional.interpolate`` with
    ``antialias=True`` on uint8 CPU tensors), computed with torch alone. Returned unchanged when
    it already has that size."""
    if image.size == tuple(size):
        return image
    import torch  # here, so that header reads (read_size, ImagePolicy.inspect) never import torch
    import torch.nn.functional as F

    rgb = image if image.mode == "RGB" else image.convert("RGB")  # convert copies even an RGB image
    pixels = torch.from_numpy(np.array(rgb)).permute(2, 0, 1).unsqueeze(0)
    out = F.interpolate(pixels, size=(size[1], size[0]), mode="bicubic", align_corners=False, antialias=True)
    return Image.fromarray(out[0].permute(1, 2, 0).contiguous().numpy(), mode="RGB")


def _is_size_pair(value: Any) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
    )


def describe_source(source: Any, name: str | None = None) -> str:
    """How errors refer to an image: ``name`` when given, then its file when it has one
    (``"row 3 (id 'a'), file scans/a.png"``; not twice when ``name`` already ends with it, as a
    label passed on from ``inspect`` or ``prepare`` to ``read_size`` or ``load_image`` does);
    else its file or its type."""
    path = source if isinstance(source, (str, os.PathLike)) else source.get("path") if isinstance(source, dict) else None
    if name is not None:
        return f"{name}, file {path}" if path and not name.endswith(f"file {path}") else name
    return f"image {path}" if path else f"<{type(source).__name__} image>"


@contextmanager
def _opened(source: ImageSource) -> Iterator[Image.Image]:
    """A lazily opened PIL image (header read, pixels not decoded); closed on exit unless the
    caller passed the PIL image itself."""
    if isinstance(source, Image.Image):
        yield source
        return
    if isinstance(source, dict):  # datasets' Image feature without decoding: {"bytes", "path"}
        if source.get("bytes") is not None:
            target: Any = io.BytesIO(source["bytes"])
        elif source.get("path"):
            target = Path(source["path"])
        else:
            raise BadImageError("image dict has neither 'bytes' nor 'path'", reason="no image (neither 'bytes' nor 'path')")
    elif isinstance(source, (bytes, bytearray)):
        target = io.BytesIO(bytes(source))
    elif isinstance(source, (str, os.PathLike)):
        target = Path(source)
    else:
        raise TypeError(
            f"unsupported image source {type(source).__name__}; pass a path, bytes, a PIL image or a datasets image dict"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = Image.open(target)
    with image:
        yield image


def _orientation(image: Image.Image) -> int:
    """EXIF orientation (1..8) from the metadata read with the header, 1 when absent or invalid.

    Uses the base ``Image.getexif`` (PNG's own override decodes the pixels to look for a late
    ``eXIf`` chunk); the result is cached on the image, so ``ImageOps.exif_transpose`` later
    applies the same orientation."""
    try:
        value = Image.Image.getexif(image).get(ExifTags.Base.Orientation, 1)
    except Exception:  # noqa: BLE001 - malformed metadata: treat as unrotated, like viewers do
        return 1
    return int(value) if isinstance(value, int) and 1 <= value <= 8 else 1


_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # a PNG's last chunk: length 0, type, CRC (always the same)
PNG_TAIL_BYTES = 4096  # where a PNG's IEND chunk must lie: within this many bytes of the end (trailing bytes allowed)
TRUNCATED_PNG = "truncated PNG (no IEND chunk)"


def _png_is_complete(fp) -> bool:
    """True when the open file ``fp`` (a PNG) holds an IEND chunk within its last
    ``PNG_TAIL_BYTES`` bytes: its last 12 bytes, or (tools that append bytes) the last 4 KiB.
    One or two small reads at the end; the position of ``fp`` is not restored (the caller has
    read the header)."""
    size = fp.seek(0, os.SEEK_END)
    if size < len(_PNG_IEND):
        return False
    fp.seek(size - len(_PNG_IEND))
    if fp.read(len(_PNG_IEND)) == _PNG_IEND:
        return True
    fp.seek(max(0, size - PNG_TAIL_BYTES))
    return _PNG_IEND in fp.read(PNG_TAIL_BYTES)


def read_size(source: ImageSource, *, name: str | None = None) -> tuple[int, int]:
    """(width, height) in pixels as displayed (EXIF orientation applied), from the header only,
    plus, for a PNG file or bytes, a look at its last bytes: a PNG cut short (a download or a
    copy that stopped) has a valid header but no IEND chunk within its last 4 KiB, and is
    rejected here rather than when a rank decodes it (a PIL image passed in is not checked).

    Raises ``BadImageError`` (unreadable header, truncated PNG; ``reason`` the short cause) and
    ``TypeError`` (unsupported source)."""
    label = describe_source(source, name)
    try:
        with _opened(source) as image:
            width, height = image.size
            swap = _orientation(image) in _SWAPS_SIDES
            fp = getattr(image, "fp", None) if image is not source else None
            if image.format == "PNG" and fp is not None and not _png_is_complete(fp):
                raise BadImageError(f"{label}: {TRUNCATED_PNG}: the file ends before its last chunk; {_BAD_IMAGE_FIX}",
                                    reason=TRUNCATED_PNG)
    except BadImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise BadImageError(f"{label} is above PIL's decompression-bomb limit ({exc}); downscale it",
                            reason=f"above PIL's decompression-bomb limit ({exc})") from exc
    except _DECODE_ERRORS as exc:
        cause = f"cannot read the image header ({_reason(exc)})"
        raise BadImageError(f"{label}: {cause}; {_BAD_IMAGE_FIX}", reason=cause) from exc
    return (height, width) if swap else (width, height)


def _to_rgb(image: Image.Image) -> Image.Image:
    mode = image.mode
    if mode.startswith("I;16") or mode == "I":
        array = np.asarray(image, dtype=np.float64)
        image = Image.fromarray(np.clip(np.rint(array / 257.0), 0, 255).astype(np.uint8), mode="L")
    elif mode == "F":
        image = Image.fromarray(np.clip(np.rint(np.asarray(image)), 0, 255).astype(np.uint8), mode="L")
    elif mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    elif mode == "PA":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def load_image(source: ImageSource, *, max_source_pixels: int = 64_000_000, name: str | None = None) -> Image.Image:
    """Decode an image, apply its EXIF orientation and convert it to 8-bit RGB (no resizing).

    Args:
        source: any ``ImageSource``.
        max_source_pixels: images whose header announces more pixels are rejected before
            their pixels are decoded.
        name: how errors refer to the image (e.g. "row 12 (id doc-3)").

    Returns a PIL image passed in unchanged when it is already RGB and unrotated, else a new
    image without metadata (so its orientation is never applied twice).

    Raises:
        BadImageError: unidentifiable, truncated or corrupt data, an empty size or too many pixels.
        TypeError: an unsupported source type.
    """
    label = describe_source(source, name)
    try:
        with _opened(source) as image:
            width, height = image.size
            if width * height > max_source_pixels:
                raise BadImageError(
                    f"{label} is {width}x{height} = {width * height} pixels, above the limit "
                    f"max_source_pixels={max_source_pixels}; downscale it or raise the limit",
                    reason=f"{width}x{height} = {width * height} pixels, above max_source_pixels={max_source_pixels}",
                )
            if width < 1 or height < 1:
                raise BadImageError(f"{label} has an empty size {width}x{height}", reason=f"empty size {width}x{height}")
            orientation = _orientation(image)  # before load(): what read_size sees
            image.load()
            out = ImageOps.exif_transpose(image) if orientation != 1 else image
            out = _to_rgb(out)
            if out is image and image is not source:
                out = image.copy()  # the file is closed on leaving this block
            if out is not source:
                out.info = {}
            return out
    except BadImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise BadImageError(
            f"{label} is above PIL's decompression-bomb limit and above max_source_pixels="
            f"{max_source_pixels} ({exc}); downscale it",
            reason=f"above PIL's decompression-bomb limit and max_source_pixels={max_source_pixels}",
        ) from exc
    except _DECODE_ERRORS as exc:
        cause = f"cannot be decoded ({_reason(exc)})"
        raise BadImageError(f"{label} {cause}; {_BAD_IMAGE_FIX}", reason=cause) from exc
