"""The family registry: everything raggedvl knows about one model family, in one table entry.

A family (``Qwen2-VL``, ``Qwen2.5-VL``, ``Qwen3-VL``) is one :class:`Family` in :data:`FAMILIES`,
keyed by its transformers ``model_type``. The entry holds:

- its **batch layout** (:class:`BatchLayout`, DESIGN.md section 2): which model-input key is per
  sample, per item (image / video) or per patch row; ``patch_dim`` computed once from the
  vision geometry;
- its **token ids** (:class:`TokenIds`): the default placeholder ids (a processor, tokenizer or
  config that states its own wins, ``TokenIds.from_any``);
- its **resize rule** geometry: ``patch_size`` and ``merge_size`` give transformers'
  ``smart_resize`` factor ``patch_size * merge_size``; the one resize class,
  ``raggedvl.images.ImagePolicy``, reads factor and pixel limits from the processor, and
  :func:`family_of` refuses a processor whose geometry differs from its family's;
- its **model classes** (config, base model, processor), named by import path and loaded on
  first use, so importing this module imports no transformers model code;
- its **dummy-vision needs**: the modalities its tower takes (the layout's streams) and
  ``deepstack`` (the tower also returns deepstack features, which the dummy pass must reach).

:func:`family_of` finds the entry of a config, a model or a processor by ``model_type`` (a
processor by its transformers class, as transformers' ``PROCESSOR_MAPPING_NAMES`` pairs them, or
the ``model_type`` the checkpoint's config stated). Adding a family is adding one entry here.

Shape legend: B samples, L tokens per sample, N images (or videos) in the batch,
P patch rows (sum over items of t*h*w), D_p patch_dim (3 * temporal_patch * patch**2).

| kind              | dim counting                | keys (Qwen2-VL)                          |
|-------------------|-----------------------------|------------------------------------------|
| per sample        | B (at ``sample_dims[key]``) | input_ids, attention_mask, labels, ...   |
| per item          | N                           | image_grid_thw [N, 3], second_per_grid_ts|
| per item patch    | P                           | pixel_values [P, D_p]                    |

Token ids default to the public Qwen2-VL / Qwen2.5-VL / Qwen3-VL vocabulary (``image_token_id``
151655, ``video_token_id`` 151656, ``vision_start_token_id`` 151652, as in transformers'
``Qwen2VLConfig``); tiny test models and custom tokenizers pass their own.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from functools import cached_property
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
    def from_any(cls, source: Any, defaults: "TokenIds | None" = None) -> "TokenIds":
        """Read the ids from a ``TokenIds``, a processor, a tokenizer or a model config.

        Looks for ``vision_start_token_id``, ``image_token_id`` and ``video_token_id`` on
        ``source`` and on ``source.tokenizer`` / ``source.config``, then asks the tokenizer for
        ``<|vision_start|>``, ``<|image_pad|>``, ``<|video_pad|>`` (transformers 5.x's
        ``Qwen2VLProcessor`` has no ``vision_start_token_id``); a missing id keeps the one of
        ``defaults`` (a family's ``token_ids``; default: the public Qwen ids). ``None`` gives
        the defaults.
        """
        defaults = defaults or cls()
        if source is None:
            return defaults
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
            vision_start=lookup("vision_start_token_id", "<|vision_start|>", defaults.vision_start),
            image=lookup("image_token_id", "<|image_pad|>", defaults.image),
            video=lookup("video_token_id", "<|video_pad|>", defaults.video),
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

    def __reduce__(self):
        """Pickled and deep-copied as plain dicts (``MappingProxyType`` pickles in neither):
        models holding a layout survive ``copy.deepcopy``, ``torch.save`` and spawn."""
        return (_layout_from_dicts, (self.name, self.streams, self.patch_dim, self.merge_size,
                                     dict(self.sample_dims), dict(self.pad_values)))

    @property
    def known_keys(self) -> frozenset[str]:
        """Every key this layout can place."""
        keys = set(self.sample_dims)
        for s in self.streams:
            keys.update((s.patches_key, s.grid_key, *s.item_keys))
        return frozenset(keys)

    @property
    def model_inputs(self) -> frozenset[str]:
        """The keys a base model's ``forward`` takes: every known key but ``labels`` (the loss's)
        and ``token_type_ids`` (a tokenizer output the Qwen-VL models do not take)."""
        return self.known_keys - {"labels", "token_type_ids"}

    def stream(self, name: str) -> VisualStream:
        """The stream called ``name`` ("image" or "video"); ``KeyError`` if absent."""
        for s in self.streams:
            if s.name == name:
                return s
        raise KeyError(f"layout {self.name!r} has no {name!r} stream")


IMAGE = VisualStream("image", "pixel_values", "image_grid_thw", token="image", type_id=1)
VIDEO = VisualStream("video", "pixel_values_videos", "video_grid_thw", token="video", type_id=2)


def _load(path: str) -> Any:
    """The object at ``"module:attribute"``."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _layout_from_dicts(name, streams, patch_dim, merge_size, sample_dims, pad_values) -> BatchLayout:
    return BatchLayout(name, streams, patch_dim, merge_size, MappingProxyType(sample_dims), MappingProxyType(pad_values))


@dataclass(frozen=True)
class Family:
    """One model family (module docstring): a registry entry of :data:`FAMILIES`.

    ``name``: the transformers ``model_type`` of its configs (and the layout's name).
    ``config_path`` / ``model_path``: ``"module:Class"`` of its config and base model
    (``Qwen2VLModel``, not ``...ForConditionalGeneration``), imported on first use through
    :attr:`config_class` / :attr:`model_class`. ``processor_class``: the class name of its
    transformers processor (as in ``PROCESSOR_MAPPING_NAMES``). ``patch_size`` (px),
    ``merge_size`` (patches per merged token side), ``temporal_patch_size`` (frames per patch):
    the vision geometry. ``streams``: its visual inputs (image, video). ``token_ids``: default
    placeholder ids. ``deepstack``: the vision tower returns deepstack features too.
    """

    name: str
    config_path: str
    model_path: str
    processor_class: str
    patch_size: int
    merge_size: int = 2
    temporal_patch_size: int = 2
    streams: tuple[VisualStream, ...] = (IMAGE, VIDEO)
    token_ids: TokenIds = TokenIds()
    deepstack: bool = False

    @property
    def patch_dim(self) -> int:
        """Width D_p of one ``pixel_values`` row: 3 channels * temporal_patch * patch * patch."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @cached_property
    def layout(self) -> BatchLayout:
        """Its batch layout (named like the family)."""
        return BatchLayout(self.name, self.streams, patch_dim=self.patch_dim, merge_size=self.merge_size)

    @property
    def config_class(self) -> type:
        """The transformers config class (imported on first use)."""
        return _load(self.config_path)

    @property
    def model_class(self) -> type:
        """The transformers base model class (imported on first use)."""
        return _load(self.model_path)


FAMILIES: dict[str, Family] = {
    # Qwen2-VL: patch 14, temporal patch 2, 3 channels -> patch_dim 1176.
    "qwen2_vl": Family("qwen2_vl", "transformers:Qwen2VLConfig", "transformers:Qwen2VLModel",
                       "Qwen2VLProcessor", patch_size=14),
    # Qwen2.5-VL adds per-video second_per_grid_ts (seconds per temporal grid step).
    "qwen2_5_vl": Family("qwen2_5_vl", "transformers:Qwen2_5_VLConfig", "transformers:Qwen2_5_VLModel",
                         "Qwen2_5_VLProcessor", patch_size=14,
                         streams=(IMAGE, replace(VIDEO, item_keys=("second_per_grid_ts",)))),
    # Qwen3-VL: patch 16 -> 1536; a video is one placeholder run per temporal step; deepstack.
    "qwen3_vl": Family("qwen3_vl", "transformers:Qwen3VLConfig", "transformers:Qwen3VLModel",
                       "Qwen3VLProcessor", patch_size=16, streams=(IMAGE, replace(VIDEO, run_per_frame=True)),
                       deepstack=True),
}
"""The registry, by ``model_type``. A new family is one more entry (tests add one)."""


def _unknown(what: str) -> ValueError:
    return ValueError(
        f"{what} is not a supported backbone family; raggedvl knows {sorted(FAMILIES)} "
        "(e.g. Qwen/Qwen2-VL-2B-Instruct); a new family is one entry of raggedvl.families.FAMILIES"
    )


def _family_of_processor(processor: Any) -> Family:
    model_type = getattr(processor, "model_type", None)
    if isinstance(model_type, str):
        if model_type not in FAMILIES:
            raise _unknown(f"processor {type(processor).__name__} (model_type {model_type!r})")
        family = FAMILIES[model_type]
    else:
        by_class = {f.processor_class: f for f in FAMILIES.values()}
        family = next((by_class[c.__name__] for c in type(processor).__mro__ if c.__name__ in by_class), None)
        if family is None:
            raise _unknown(f"processor {type(processor).__name__}")
    image_processor = getattr(processor, "image_processor", None)
    for attr in ("patch_size", "merge_size", "temporal_patch_size"):
        value = getattr(image_processor, attr, None)
        if isinstance(value, int) and value != getattr(family, attr):
            raise ValueError(
                f"processor {type(processor).__name__} is a {family.name} processor but its image processor has "
                f"{attr} {value}, where {family.name} has {getattr(family, attr)}: its pixel_values rows would not "
                f"fit the model; use the checkpoint's own processor (raggedvl.data.build_processor(checkpoint))"
            )
    return family


def family_of(source: Any) -> Family:
    """The :class:`Family` of ``source``, found by transformers ``model_type``.

    ``source``: a ``Family``, a family name, a transformers config (a ColQwen2 config resolves
    through its ``vlm_config``), a transformers or peft model (its ``config``), a raggedvl
    ``Retriever`` (its ``family``), or a processor
    (its ``model_type`` attribute when the checkpoint stated one, else its class or a parent
    class matching an entry's ``processor_class``).

    Raises:
        ValueError: an unknown name or model type, or a processor whose image processor's
            patch geometry (``patch_size``, ``merge_size``, ``temporal_patch_size``) differs
            from its family's.
    """
    if isinstance(source, Family):
        return source
    if isinstance(source, str):
        if source not in FAMILIES:
            raise _unknown(f"family {source!r}")
        return FAMILIES[source]
    if isinstance(getattr(source, "family", None), Family):  # a raggedvl Retriever
        return source.family
    if hasattr(source, "image_processor"):
        return _family_of_processor(source)
    config = source if hasattr(source, "model_type") and not hasattr(source, "config") else getattr(source, "config", None)
    model_type = getattr(config, "model_type", None)
    vlm_config = getattr(config, "vlm_config", None)
    if model_type not in FAMILIES and vlm_config is not None:
        model_type = getattr(vlm_config, "model_type", None)
    if model_type not in FAMILIES:
        raise _unknown(f"{type(source).__name__} with model_type {model_type!r}")
    return FAMILIES[model_type]


def get_layout(layout: str | BatchLayout) -> BatchLayout:
    """A family's layout by name (:data:`FAMILIES`), or a ``BatchLayout`` passed through.

    Raises ``ValueError`` for an unknown name, listing the known ones; ``TypeError`` for
    anything else.
    """
    if isinstance(layout, BatchLayout):
        return layout
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a family name or a BatchLayout, got {type(layout).__name__}")
    if layout not in FAMILIES:
        raise ValueError(
            f"unknown layout {layout!r}; known layouts: {sorted(FAMILIES)} "
            "(or pass a BatchLayout, or add a Family to raggedvl.families.FAMILIES)"
        )
    return FAMILIES[layout].layout


def processor_batch_format(processor: Any, layout: str | BatchLayout | None = None) -> tuple[str | BatchLayout, TokenIds]:
    """The layout and placeholder token ids of the batches ``processor`` builds: ``layout`` or
    the processor's family's (:func:`family_of`), and the ids its tokenizer assigns
    (``TokenIds.from_any``, the family's ids for any it lacks). Raises ``ValueError`` as
    :func:`family_of` does when ``layout`` is None."""
    if layout is None:
        family = family_of(processor)
        return family.name, TokenIds.from_any(processor, family.token_ids)
    name = layout if isinstance(layout, str) else layout.name
    return layout, TokenIds.from_any(processor, FAMILIES[name].token_ids if name in FAMILIES else None)
