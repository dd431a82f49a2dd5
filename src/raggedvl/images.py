"""Image loading and hardening for the data path (issue 7 item 2).

Every document image goes through ``load_image`` (decode, orientation, colour) and then
``fit_image`` (geometry) before the Qwen2-VL image processor sees it. Policy, per input kind:

| input | result |
|---|---|
| grayscale ("L", "1"), palette ("P"), CMYK, YCbCr, LAB, HSV | converted to RGB |
| RGBA / LA / palette with transparency | composited on white, then RGB |
| 16-bit ("I;16*", "I") / float ("F") | scaled to 8 bits (value / 257 for 16-bit, clipped to 0..255 for float) |
| EXIF orientation tag | applied (pixels rotated/flipped), tag consumed |
| a side under ``factor`` px (28 for Qwen2/2.5-VL; e.g. 1x1) | upscaled (bicubic, aspect kept) so the short side is ``factor`` |
| aspect ratio above ``max_aspect`` (e.g. a 1:1000 strip) | padded with white on the short side up to ``max_aspect`` |
| more than ``max_source_pixels`` in the file header (decompression bomb) | rejected before decoding |
| truncated, corrupt or unidentifiable file | rejected |

Rejected images raise ``BadImageError`` (a ``ValueError``) naming the source; callers offer
``on_bad_image="error"|"skip"``, where skip drops the example and counts it (never silently).

After ``fit_image``, transformers' ``smart_resize`` (Qwen2-VL's resize rule) gives a size with
both sides multiples of ``factor = patch_size * merge_size`` (>= factor px) and total pixels within
``[min_pixels, max_pixels]``; ``resized_size`` exposes that rule and ``check_resize`` verifies it.
Sizes are (width, height) in pixels, as PIL reports them, unless a name says otherwise.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

ImageSource = Union[str, os.PathLike, bytes, Image.Image, dict]
BadImagePolicy = Literal["error", "skip"]
_SMART_RESIZE_MAX_ASPECT = 200.0  # transformers' smart_resize raises above this


class BadImageError(ValueError):
    """An image that cannot be decoded or is outside the documented limits."""


@dataclass(frozen=True)
class ImageLimits:
    """Resize limits of a Qwen2-VL-family image processor, in pixels.

    min_pixels/max_pixels bound the resized image's area; ``factor`` (patch_size *
    merge_size, 28 for Qwen2/2.5-VL, 32 for Qwen3-VL) is the granularity of both sides;
    ``max_source_pixels`` bounds the decoded file (decompression-bomb guard).
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
        """Largest long/short side ratio that still resizes to a short side >= factor within
        max_pixels (with a 2x margin for rounding), capped below smart_resize's 200."""
        return min(_SMART_RESIZE_MAX_ASPECT - 1.0, self.max_pixels / (2.0 * self.factor**2))

    @classmethod
    def from_processor(cls, processor, max_source_pixels: int = 64_000_000) -> "ImageLimits":
        """Limits of a transformers Qwen2-VL processor or image processor (PIL or torchvision)."""
        image_processor = getattr(processor, "image_processor", processor)
        size = dict(getattr(image_processor, "size", None) or {})
        min_pixels = size.get("shortest_edge", getattr(image_processor, "min_pixels", None))
        max_pixels = size.get("longest_edge", getattr(image_processor, "max_pixels", None))
        if min_pixels is None or max_pixels is None:
            raise TypeError(f"{type(image_processor).__name__} has no min/max pixel limits; is it a Qwen2-VL image processor?")
        return cls(
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            max_source_pixels=max_source_pixels,
        )


def _describe(source: ImageSource, name: str | None) -> str:
    if name is not None:
        return name
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return f"<{type(source).__name__} image>"


def _open(source: ImageSource) -> Image.Image:
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, dict):  # datasets' Image feature without decoding: {"bytes", "path"}
        if source.get("bytes") is not None:
            return Image.open(io.BytesIO(source["bytes"]))
        if source.get("path"):
            return Image.open(source["path"])
        raise BadImageError("image dict has neither 'bytes' nor 'path'")
    if isinstance(source, (bytes, bytearray)):
        return Image.open(io.BytesIO(bytes(source)))
    if isinstance(source, (str, os.PathLike)):
        return Image.open(Path(source))
    raise TypeError(f"unsupported image source {type(source).__name__}; pass a path, bytes, a PIL image or a datasets image dict")


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
    """Decode an image, apply its EXIF orientation and convert it to 8-bit RGB.

    Args:
        source: path, encoded bytes, PIL image, or a datasets Image dict ({"bytes", "path"}).
        max_source_pixels: images whose header announces more pixels are rejected before
            their pixels are decoded.
        name: how errors refer to the image (e.g. "row 12 (id doc-3)").

    Raises:
        BadImageError: unidentifiable, truncated or corrupt data, or too many pixels.
        TypeError: an unsupported source type.
    """
    label = _describe(source, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = _open(source)
            width, height = image.size
            if width * height > max_source_pixels:
                raise BadImageError(
                    f"image {label} is {width}x{height} = {width * height} pixels, above the limit "
                    f"max_source_pixels={max_source_pixels}; downscale it or raise the limit"
                )
            if width < 1 or height < 1:
                raise BadImageError(f"image {label} has an empty size {width}x{height}")
            image.load()
            image = ImageOps.exif_transpose(image)
            return _to_rgb(image)
    except BadImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise BadImageError(
            f"image {label} is above PIL's decompression-bomb limit and above max_source_pixels="
            f"{max_source_pixels} ({exc}); downscale it"
        ) from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise BadImageError(f"image {label} cannot be decoded ({type(exc).__name__}: {exc}); fix or remove the file") from exc


def fit_image(image: Image.Image, limits: ImageLimits) -> Image.Image:
    """Make an RGB image safe for Qwen2-VL's resize rule (see the module table).

    Short side < factor: upscale (bicubic, aspect kept) so the short side is ``factor``.
    Long/short > ``limits.max_aspect``: pad the short side with white (centred).
    Otherwise the image is returned unchanged (the processor resizes it).
    """
    width, height = image.size
    short, long = min(width, height), max(width, height)
    if long / short > limits.max_aspect:
        new_short = math.ceil(long / limits.max_aspect)
        size = (new_short, height) if width < height else (width, new_short)
        canvas = Image.new("RGB", size, (255, 255, 255))
        canvas.paste(image, ((size[0] - width) // 2, (size[1] - height) // 2))
        image, (width, height) = canvas, size
        short = min(width, height)
    if short < limits.factor:
        scale = limits.factor / short
        size = (max(limits.factor, round(width * scale)), max(limits.factor, round(height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
    return image


def resized_size(width: int, height: int, limits: ImageLimits) -> tuple[int, int]:
    """(width, height) in pixels that the Qwen2-VL processor resizes this image to.

    Qwen2-VL's rule (transformers ``smart_resize``): round both sides to multiples of
    ``factor``, then rescale keeping the aspect ratio into [min_pixels, max_pixels].
    Raises ValueError when the aspect ratio is above 200 (call ``fit_image`` first).
    """
    new_h, new_w = smart_resize(height, width, factor=limits.factor, min_pixels=limits.min_pixels, max_pixels=limits.max_pixels)
    return new_w, new_h


def check_resize(width: int, height: int, limits: ImageLimits, name: str = "image") -> tuple[int, int]:
    """``resized_size`` plus a check that both sides are >= factor and the area is in range.

    Raises:
        BadImageError: the processor would produce an invalid grid for this size.
    """
    try:
        new_w, new_h = resized_size(width, height, limits)
    except ValueError as exc:
        raise BadImageError(f"{name} of size {width}x{height} cannot be resized: {exc}") from exc
    if min(new_w, new_h) < limits.factor or not limits.min_pixels <= new_w * new_h <= limits.max_pixels:
        raise BadImageError(
            f"{name} of size {width}x{height} resizes to {new_w}x{new_h} = {new_w * new_h} pixels, outside "
            f"[{limits.min_pixels}, {limits.max_pixels}] or with a side under {limits.factor}; "
            "widen min_pixels/max_pixels"
        )
    return new_w, new_h


def prepare_image(source: ImageSource, limits: ImageLimits, *, name: str | None = None) -> Image.Image:
    """``load_image`` + ``fit_image`` + ``check_resize``: an RGB image the processor accepts."""
    image = fit_image(load_image(source, max_source_pixels=limits.max_source_pixels, name=name), limits)
    check_resize(image.width, image.height, limits, name=_describe(source, name))
    return image
