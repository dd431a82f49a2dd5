"""Declarative batch layouts for the Qwen2-VL model family: which tensor belongs to which kind of
row (DESIGN.md section 2). A new family is a new ``LAYOUTS`` entry, not new code.

Shape legend: B samples, L tokens per sample, N images (or videos) in the batch,
P patch rows (sum over items of t*h*w), D_p patch_dim (3 * temporal_patch * patch**2).

| kind              | dim counting                | keys (Qwen2-VL)                          |
|-------------------|-----------------------------|------------------------------------------|
| per sample        | B (at ``sample_dims[key]``) | input_ids, attention_mask, labels, ...   |
| per item          | N                           | image_grid_thw [N, 3], second_per_grid_ts|
| per item patch    | P                           | pixel_values [P, D_p]                    |

Token ids (``TokenIds``) default to the public Qwen2-VL / Qwen2.5-VL / Qwen3-VL vocabulary
(``image_token_id`` 151655, ``video_token_id`` 151656, ``vision_start_token_id`` 151652, as in
transformers' ``Qwen2VLConfig``); tiny test models and custom tokenizers pass their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

QWEN_VISION_START_ID = 151652
QWEN_IMAGE_PAD_ID = 151655
QWEN_VIDEO_PAD_ID = 151656


@dataclass(frozen=True)
class TokenIds:
    """Ids of the tokens that mark visual content in ``input_ids``.

    ``vision_start``: ``<|vision_start|>``, which opens every placeholder run;
    ``image``: ``<|image_pad|>`` (one per visual token of an image);
    ``video``: ``<|video_pad|>``.
    """

    vision_start: int = QWEN_VISION_START_ID
    image: int = QWEN_IMAGE_PAD_ID
    video: int = QWEN_VIDEO_PAD_ID

    @classmethod
    def from_any(cls, source: Any) -> "TokenIds":
        """Read the ids from a ``TokenIds``, a processor, a tokenizer or a model config.

        Looks for ``vision_start_token_id``, ``image_token_id`` and ``video_token_id`` on
        ``source`` and on ``source.tokenizer`` / ``source.config``, then asks the tokenizer for
        ``<|vision_start|>``, ``<|image_pad|>``, ``<|video_pad|>`` (transformers 5.x's
        ``Qwen2VLProcessor`` has no ``vision_start_token_id``); a missing id keeps the public
        Qwen default. ``None`` gives the defaults.
        """
        if source is None:
            return cls()
        if isinstance(source, TokenIds):
            return source
        candidates = [source, getattr(source, "tokenizer", None), getattr(source, "config", None)]
        tokenizer = next((c for c in candidates if hasattr(c, "convert_tokens_to_ids")), None)

        def lookup(attr: str, token: str, default: int) -> int:
            for obj in candidates:
                value = getattr(obj, attr, None) if obj is not None else None
                if isinstance(value, int):
                    return value
            if tokenizer is not None:
                value = tokenizer.convert_tokens_to_ids(token)
                if isinstance(value, int) and tokenizer.convert_ids_to_tokens(value) == token:
                    return value
            return default

        return cls(
            vision_start=lookup("vision_start_token_id", "<|vision_start|>", QWEN_VISION_START_ID),
            image=lookup("image_token_id", "<|image_pad|>", QWEN_IMAGE_PAD_ID),
            video=lookup("video_token_id", "<|video_pad|>", QWEN_VIDEO_PAD_ID),
        )


@dataclass(frozen=True)
class VisualStream:
    """One kind of visual input (images or videos) of a layout.

    ``patches_key``: flat per-patch tensor [P, D_p]; ``grid_key``: [N, 3] (t, h, w in patches);
    ``item_keys``: further per-item tensors (dim 0 counts items); ``token``: the ``TokenIds``
    field of its placeholder token; ``type_id``: its value in ``mm_token_type_ids``;
    ``run_per_frame``: each temporal grid step has its own placeholder run (Qwen3-VL videos
    interleave ``<t seconds>`` text between frames), otherwise one run per item.
    """

    name: str
    patches_key: str
    grid_key: str
    token: str
    type_id: int
    item_keys: tuple[str, ...] = ()
    run_per_frame: bool = False


@dataclass(frozen=True)
class BatchLayout:
    """Which key of a model-input dict is per sample, per item or per patch for one family.

    ``sample_dims`` maps each per-sample key to its sample dimension (mRoPE ``position_ids`` is
    [3 or 4, B, L]: dim 1). ``pad_values`` are used when batches of different sequence lengths
    are concatenated (``input_ids`` is padded with the ``pad_token_id`` argument instead).
    """

    name: str
    streams: tuple[VisualStream, ...]
    patch_dim: int
    merge_size: int = 2
    sample_dims: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType(
            {
                "input_ids": 0,
                "attention_mask": 0,
                "mm_token_type_ids": 0,
                "token_type_ids": 0,
                "labels": 0,
                "position_ids": 1,
            }
        )
    )
    pad_values: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType(
            {"attention_mask": 0, "mm_token_type_ids": 0, "token_type_ids": 0, "labels": -100, "position_ids": 0}
        )
    )

    @property
    def known_keys(self) -> frozenset[str]:
        """Every key this layout can place."""
        keys = set(self.sample_dims)
        for s in self.streams:
            keys.update((s.patches_key, s.grid_key, *s.item_keys))
        return frozenset(keys)

    def stream(self, name: str) -> VisualStream:
        """The stream called ``name`` ("image" or "video"); ``KeyError`` if absent."""
        for s in self.streams:
            if s.name == name:
                return s
        raise KeyError(f"layout {self.name!r} has no {name!r} stream")


_IMAGE = VisualStream("image", "pixel_values", "image_grid_thw", token="image", type_id=1)
_VIDEO = VisualStream("video", "pixel_values_videos", "video_grid_thw", token="video", type_id=2)

LAYOUTS: Mapping[str, BatchLayout] = MappingProxyType(
    {
        # Qwen2-VL: patch 14, temporal patch 2, 3 channels -> 1176.
        "qwen2_vl": BatchLayout("qwen2_vl", (_IMAGE, _VIDEO), patch_dim=1176),
        # Qwen2.5-VL adds per-video second_per_grid_ts (seconds per temporal grid step).
        "qwen2_5_vl": BatchLayout(
            "qwen2_5_vl",
            (_IMAGE, replace(_VIDEO, item_keys=("second_per_grid_ts",))),
            patch_dim=1176,
        ),
        # Qwen3-VL: patch 16 -> 1536; a video is one placeholder run per temporal step.
        "qwen3_vl": BatchLayout(
            "qwen3_vl",
            (_IMAGE, replace(_VIDEO, run_per_frame=True)),
            patch_dim=1536,
        ),
    }
)


def get_layout(layout: str | BatchLayout) -> BatchLayout:
    """Resolve a layout name or pass a ``BatchLayout`` through.

    Raises ``ValueError`` for an unknown name, listing the known ones.
    """
    if isinstance(layout, BatchLayout):
        return layout
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a name or a BatchLayout, got {type(layout).__name__}")
    try:
        return LAYOUTS[layout]
    except KeyError:
        raise ValueError(
            f"unknown layout {layout!r}; known layouts: {sorted(LAYOUTS)} "
            "(or pass a BatchLayout for another family)"
        ) from None
