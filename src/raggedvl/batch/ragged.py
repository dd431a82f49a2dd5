"""``RaggedBatch``: a Qwen2-VL-family model input that splits, selects, concatenates and pads
exactly, sample by sample (DESIGN.md section 2).

Shape legend: B samples, L tokens per sample, N items (images or videos) of a stream,
P patch rows (sum of t*h*w over the stream's items), D_p patch_dim.

Storage: per-sample tensors (``input_ids`` [B, L], ``position_ids`` [3|4, B, L], ...), and per
visual stream the grid [N, 3], the flat patches [P, D_p] (``None`` when N == 0), per-item extras,
and ``counts`` (items per sample, in order). Item and patch offsets are cumulative sums computed
once, so ``select`` / ``split`` are a few index ops, never a per-row Python loop.

The mapping view (``keys()``, ``[]``, ``items()``, ``len``) lists exactly what a model expects:
a stream's keys are absent when the batch has none of its items, so ``model(**batch)`` receives
``pixel_values=None`` for a text-only batch, never a zero-row tensor. ``RaggedBatch`` is
deliberately not registered as a ``collections.abc.Mapping``: generic tree utilities (accelerate's
``recursively_apply``, the HF Trainer's ``_prepare_input``) rebuild Mappings key by key, which
would drop the ownership; as a leaf with ``.to()`` they move it whole.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from . import ownership, validation
from .costs import CostModel
from raggedvl.families import BatchLayout, TokenIds, get_layout
from .offsets import boundaries, exclusive_cumsum
from .padded import pad_patches, ranges, unpad_patches


@dataclass(frozen=True)
class _StreamRows:
    """Rows of one visual stream; offsets derived in ``__post_init__``."""

    grid: torch.Tensor  # [N, 3] int64
    patches: torch.Tensor | None  # [P, D_p], None iff N == 0
    extras: dict[str, torch.Tensor]  # per item, dim 0 = N
    counts: tuple[int, ...]  # items per sample, length B
    counts_t: torch.Tensor = field(init=False)
    item_start: torch.Tensor = field(init=False)  # [B]
    patch_counts: torch.Tensor = field(init=False)  # [N]
    patch_start: torch.Tensor = field(init=False)  # [N]

    def __post_init__(self) -> None:
        counts_t = torch.tensor(self.counts, dtype=torch.int64)
        patch_counts = self.grid.to("cpu", torch.int64).prod(dim=1) if self.grid.numel() else torch.zeros(0, dtype=torch.int64)
        object.__setattr__(self, "counts_t", counts_t)
        object.__setattr__(self, "item_start", exclusive_cumsum(counts_t))
        object.__setattr__(self, "patch_counts", patch_counts)
        object.__setattr__(self, "patch_start", exclusive_cumsum(patch_counts))

    def map(self, fn) -> "_StreamRows":
        """``fn`` applied to every tensor row set; the CPU offsets are reused (no device sync)."""
        out = copy.copy(self)
        object.__setattr__(out, "grid", fn(self.grid))
        object.__setattr__(out, "patches", None if self.patches is None else fn(self.patches))
        object.__setattr__(out, "extras", {k: fn(v) for k, v in self.extras.items()})
        return out


def _as_tensor(key: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, list, tuple, int, float)):
        return torch.as_tensor(np.asarray(value))
    raise TypeError(f"feature {key!r} must be a tensor, array or list, got {type(value).__name__}")


class RaggedBatch:
    """A batch of B samples with ragged images and videos. Build with ``from_features`` (the
    constructor takes already-checked parts and is used by the operations below).

    Properties: ``layout``, ``layout_name``, ``token_ids``, ``num_samples``, ``image_counts``,
    ``video_counts`` (lists of int), ``num_images``, ``num_videos``. Per stream ("image",
    "video"): ``counts``, ``item_offsets``, ``patch_counts``, ``patch_offsets``; per sample:
    ``sample_sizes``, ``sample_costs``. All operations return new batches; tensors are never
    modified in place.
    """

    def __init__(self, layout: BatchLayout, token_ids: TokenIds, sample: dict[str, torch.Tensor],
                 streams: dict[str, _StreamRows], order: tuple[str, ...]):
        self._layout = layout
        self._token_ids = token_ids
        self._sample = sample
        self._streams = streams
        self._order = order

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_features(
        cls,
        features: Mapping[str, Any],
        layout: str | BatchLayout = "qwen2_vl",
        image_counts: Sequence[int] | None = None,
        video_counts: Sequence[int] | None = None,
        *,
        token_ids: Any = None,
        validate: bool = True,
    ) -> "RaggedBatch":
        """Wrap a processor output (dict or transformers ``BatchFeature``).

        ``image_counts`` / ``video_counts``: items per sample; derived from the placeholder runs
        in ``input_ids`` when ``None``. ``token_ids``: a ``TokenIds``, processor, tokenizer or
        model config to read the placeholder ids from (default: public Qwen ids). ``None`` values
        are ignored. Raises ``ValueError`` for an unknown key or any broken invariant (see
        ``validate``), ``TypeError`` for a value that is not tensor-like.
        """
        lay = get_layout(layout)
        if isinstance(features, RaggedBatch):
            if features.layout != lay:
                raise ValueError(f"batch has layout {features.layout_name!r}, asked for {lay.name!r}")
            return features
        tids = TokenIds.from_any(token_ids)
        feats = {k: _as_tensor(k, v) for k, v in features.items() if v is not None}
        unknown = [k for k in feats if k not in lay.known_keys]
        if unknown:
            raise ValueError(
                f"keys {unknown} are not part of layout {lay.name!r} (known: {sorted(lay.known_keys)}); "
                "drop them before batching or declare them in a BatchLayout"
            )
        sample = {k: v for k, v in feats.items() if k in lay.sample_dims}
        num_samples = validation.check_sample_tensors(lay, sample)
        given = {"image": image_counts, "video": video_counts}
        streams: dict[str, _StreamRows] = {}
        for s in lay.streams:
            grid = feats.get(s.grid_key)
            patches = feats.get(s.patches_key)
            if (grid is None) != (patches is None):
                have, miss = (s.grid_key, s.patches_key) if patches is None else (s.patches_key, s.grid_key)
                raise ValueError(f"{have} is present but {miss} is missing; pass both or neither")
            grid = torch.zeros(0, 3, dtype=torch.int64) if grid is None else grid
            tokens, runs, _ = ownership.placeholder_runs(sample["input_ids"], getattr(tids, s.token))
            counts = given.get(s.name)
            if counts is None:
                validation.check_grid(lay, s, grid, [])
                counts = ownership.item_counts_from_runs(s, runs, grid)
            counts = tuple(int(c) for c in counts)
            ok_len = len(counts) == num_samples
            validation.check_grid(lay, s, grid, counts if ok_len else [])
            if ok_len and sum(counts) != grid.shape[0]:
                validation.check_ownership(lay, s, tokens.cpu(), grid.cpu(), counts)
            validation.check_counts(s, counts, num_samples, grid.shape[0])
            rows = _StreamRows(grid.to(torch.int64), None, {k: feats[k] for k in s.item_keys if k in feats}, counts)
            validation.check_patches(lay, s, patches, rows.patch_counts)
            streams[s.name] = _StreamRows(rows.grid, patches if grid.shape[0] else None, rows.extras, counts)
        batch = cls(lay, tids, sample, streams, tuple(feats))
        if validate:
            batch.validate()
        return batch

    @classmethod
    def from_padded(cls, features: Mapping[str, Any], layout: str | BatchLayout = "qwen2_vl", **kwargs: Any) -> "RaggedBatch":
        """Inverse of ``to_padded``: image ``pixel_values`` [N, P_max, D_p] are unpadded with the
        grid products (a 2-D ``pixel_values`` is taken as already flat). ``kwargs`` go to
        ``from_features``. Raises ``ValueError`` if the grids need more rows than P_max."""
        lay = get_layout(layout)
        feats = dict(features)
        for s in lay.streams:
            padded = feats.get(s.patches_key)
            if padded is not None and padded.dim() == 3:
                grid = _as_tensor(s.grid_key, feats[s.grid_key]).to(torch.int64)
                feats[s.patches_key] = unpad_patches(padded, grid.prod(dim=1))
        return cls.from_features(feats, lay, **kwargs)

    # ------------------------------------------------------------------ properties
    @property
    def layout(self) -> BatchLayout:
        return self._layout

    @property
    def layout_name(self) -> str:
        return self._layout.name

    @property
    def token_ids(self) -> TokenIds:
        return self._token_ids

    @property
    def num_samples(self) -> int:
        return self._sample["input_ids"].shape[0]

    @property
    def image_counts(self) -> list[int]:
        return self.counts("image")

    @property
    def video_counts(self) -> list[int]:
        return self.counts("video")

    @property
    def num_images(self) -> int:
        return self._streams["image"].grid.shape[0]

    @property
    def num_videos(self) -> int:
        return self._streams["video"].grid.shape[0] if "video" in self._streams else 0

    def _rows(self, stream: str) -> _StreamRows | None:
        """The stream's rows; ``None`` for "video" in a layout without videos."""
        if stream in self._streams:
            return self._streams[stream]
        if stream in ("image", "video"):
            return None
        raise ValueError(f"unknown stream {stream!r}; layout {self.layout_name!r} has {sorted(self._streams)}")

    def counts(self, stream: str = "image") -> list[int]:
        """Items of ``stream`` ("image" or "video") per sample, length B (zeros when the layout
        has no such stream). Raises ``ValueError`` for another stream name."""
        rows = self._rows(stream)
        return list(rows.counts) if rows is not None else [0] * self.num_samples

    def item_offsets(self, stream: str = "image") -> torch.Tensor:
        """Index of each sample's first item of ``stream`` (exclusive cumsum of ``counts``),
        int64 [B] on CPU."""
        rows = self._rows(stream)
        return rows.item_start if rows is not None else torch.zeros(self.num_samples, dtype=torch.int64)

    def patch_counts(self, stream: str = "image") -> torch.Tensor:
        """Patch rows per item of ``stream`` ("image" or "video"), int64 [N] on CPU."""
        rows = self._rows(stream)
        return rows.patch_counts if rows is not None else torch.zeros(0, dtype=torch.int64)

    def patch_offsets(self, stream: str = "image") -> torch.Tensor:
        """First patch row of each item of ``stream`` in the flat patches (exclusive cumsum of
        ``patch_counts``), int64 [N] on CPU."""
        rows = self._rows(stream)
        return rows.patch_start if rows is not None else torch.zeros(0, dtype=torch.int64)

    # ------------------------------------------------------------------ mapping view
    def keys(self) -> list[str]:
        """Keys a model receives: stream keys only when the stream has items."""
        present = set(self._sample)
        for name, rows in self._streams.items():
            if rows.patches is not None:
                s = self._layout.stream(name)
                present.update((s.patches_key, s.grid_key, *rows.extras))
        return [k for k in self._order if k in present]

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._sample:
            return self._sample[key]
        for name, rows in self._streams.items():
            s = self._layout.stream(name)
            if rows.patches is not None:
                if key == s.patches_key:
                    return rows.patches
                if key == s.grid_key:
                    return rows.grid
                if key in rows.extras:
                    return rows.extras[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(k, self[k]) for k in self.keys()]

    def values(self) -> list[torch.Tensor]:
        return [self[k] for k in self.keys()]

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def to_dict(self) -> dict[str, torch.Tensor]:
        """The mapping view as a plain dict."""
        return dict(self.items())

    def __repr__(self) -> str:
        return (f"RaggedBatch(layout={self.layout_name!r}, num_samples={self.num_samples}, "
                f"image_counts={self.image_counts}, video_counts={self.video_counts})")

    # ------------------------------------------------------------------ checks and costs
    def validate(self) -> "RaggedBatch":
        """Check every invariant of DESIGN.md section 2; returns ``self``.

        Raises ``ValueError`` naming the sample and numbers for: per-sample shape disagreement,
        counts vs grid rows, non-positive or non-mergeable grids, patch rows vs grid products,
        placeholder tokens vs t*h*w/merge_size**2 per sample (C09), ``mm_token_type_ids`` vs
        placeholders, and placeholder runs not opened by ``<|vision_start|>``.
        """
        lay, ids = self._layout, self._sample["input_ids"]
        validation.check_sample_tensors(lay, self._sample)
        for name, rows in self._streams.items():
            s = lay.stream(name)
            validation.check_counts(s, rows.counts, self.num_samples, rows.grid.shape[0])
            validation.check_grid(lay, s, rows.grid, rows.counts)
            validation.check_patches(lay, s, rows.patches, rows.patch_counts)
            validation.check_item_tensors(s, rows.extras, rows.grid.shape[0])
            token = getattr(self._token_ids, s.token)
            tokens, _, starts = ownership.placeholder_runs(ids, token)
            validation.check_placeholders(lay, s, tokens.cpu(), rows.grid.cpu(), rows.counts)
            validation.check_vision_starts(s, ownership.runs_without_vision_start(ids, starts, self._token_ids.vision_start),
                                           self._token_ids.vision_start)
            if "mm_token_type_ids" in self._sample:
                validation.check_token_types(s, ids == token, self._sample["mm_token_type_ids"])
        return self

    def tokens_per_sample(self) -> torch.Tensor:
        """Real tokens per sample: ``attention_mask.sum(1)`` (L without a mask), int64 [B] on CPU."""
        mask = self._sample.get("attention_mask")
        if mask is None:
            return torch.full((self.num_samples,), self._sample["input_ids"].shape[-1], dtype=torch.int64)
        return mask.detach().to("cpu", torch.int64).sum(dim=1)

    def _add_per_item(self, totals: torch.Tensor, rows: _StreamRows, per_item: torch.Tensor) -> torch.Tensor:
        """``totals`` [B] plus each item's ``per_item`` value added to its owning sample."""
        owner = torch.repeat_interleave(torch.arange(self.num_samples), rows.counts_t)
        return totals.index_add(0, owner, per_item.to(totals.dtype))

    def sample_sizes(self) -> torch.Tensor:
        """Patch rows (images and videos) + real tokens of every sample, int64 [B] on CPU: the
        size GradCache chunks are budgeted in (``raggedvl.gradcache.chunking``)."""
        sizes = self.tokens_per_sample()
        for rows in self._streams.values():
            if rows.grid.numel():
                sizes = self._add_per_item(sizes, rows, rows.patch_counts)
        return sizes

    def sample_costs(self, cost_model: CostModel | None = None) -> torch.Tensor:
        """Per-sample cost, float64 [B] on CPU (units of ``cost_model``, default ``CostModel()``).

        Images and videos both count through ``CostModel.image_costs`` of their grids; the token
        count is :meth:`tokens_per_sample`.
        """
        cm = cost_model or CostModel()
        img = self._streams["image"]
        costs = cm.sample_costs(img.grid.cpu(), list(img.counts), self.tokens_per_sample())
        for name, rows in self._streams.items():
            if name != "image" and rows.grid.numel():
                costs = self._add_per_item(costs, rows, cm.image_costs(rows.grid.cpu()))
        return costs

    # ------------------------------------------------------------------ transforms
    def _with(self, sample: dict[str, torch.Tensor], streams: dict[str, _StreamRows]) -> "RaggedBatch":
        return RaggedBatch(self._layout, self._token_ids, sample, streams, self._order)

    def to(self, *args: Any, **kwargs: Any) -> "RaggedBatch":
        """A new batch with its tensors moved and cast as transformers' ``BatchFeature.to`` does:
        floating-point tensors (``pixel_values``, ...) get ``tensor.to(*args, **kwargs)``, so a
        dtype casts them; integer and bool tensors (ids, masks, grids) only move to the device
        given (first argument or ``device=``), never change type. ``non_blocking`` is passed on.
        The ownership offsets stay on the CPU. Raises ``ValueError`` for a first argument that
        is neither a device nor a dtype (as ``BatchFeature.to`` does).
        """
        device = kwargs.get("device")
        if device is None and args:
            if isinstance(args[0], (str, int, torch.device)):
                device = args[0]
            elif not isinstance(args[0], torch.dtype):
                raise ValueError(f"RaggedBatch.to({args[0]!r}): expected a device or a dtype")
        non_blocking = kwargs.get("non_blocking", False)

        def move(t: torch.Tensor) -> torch.Tensor:
            if torch.is_floating_point(t):
                return t.to(*args, **kwargs)
            return t if device is None else t.to(device=device, non_blocking=non_blocking)

        return self._with({k: move(v) for k, v in self._sample.items()},
                          {n: r.map(move) for n, r in self._streams.items()})

    def pin_memory(self) -> "RaggedBatch":
        """A new batch with every tensor in page-locked memory (what a ``DataLoader`` with
        ``pin_memory=True`` calls), so ``to(cuda, non_blocking=True)`` copies asynchronously."""
        pin = torch.Tensor.pin_memory
        return self._with({k: pin(v) for k, v in self._sample.items()}, {n: r.map(pin) for n, r in self._streams.items()})

    def select(self, indices: Sequence[int] | torch.Tensor) -> "RaggedBatch":
        """The samples ``indices`` (any order, repeats allowed) with exactly their tokens, grids,
        patches and per-item extras, in that order. Raises ``ValueError`` for an out-of-range index."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_samples):
            raise ValueError(f"sample indices {idx.tolist()} out of range for a batch of {self.num_samples} samples")
        sample = {}
        for k, v in self._sample.items():
            sample[k] = v.index_select(self._layout.sample_dims[k], idx.to(v.device))
        streams = {}
        for name, rows in self._streams.items():
            items = ranges(rows.item_start[idx], rows.counts_t[idx])
            patch_rows = ranges(rows.patch_start[items], rows.patch_counts[items])
            take = lambda t, i: t.index_select(0, i.to(t.device))  # noqa: E731
            streams[name] = _StreamRows(
                take(rows.grid, items),
                take(rows.patches, patch_rows) if rows.patches is not None and items.numel() else None,
                {k: take(v, items) for k, v in rows.extras.items()},
                tuple(rows.counts_t[idx].tolist()),
            )
        return self._with(sample, streams)

    def split(self, sizes: Sequence[int]) -> list["RaggedBatch"]:
        """Consecutive chunks of ``sizes`` samples (views, no copy). Raises ``ValueError`` unless
        the sizes are non-negative and sum to B."""
        sizes = [int(s) for s in sizes]
        if any(s < 0 for s in sizes) or sum(sizes) != self.num_samples:
            raise ValueError(f"split sizes {sizes} must be >= 0 and sum to the {self.num_samples} samples")
        bounds = boundaries(sizes)
        item_cum = {n: boundaries(r.counts_t) for n, r in self._streams.items()}
        patch_cum = {n: boundaries(r.patch_counts) for n, r in self._streams.items()}
        out = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            sample = {k: v.narrow(self._layout.sample_dims[k], lo, hi - lo) for k, v in self._sample.items()}
            streams = {}
            for name, rows in self._streams.items():
                i0, i1 = item_cum[name][lo], item_cum[name][hi]
                p0, p1 = patch_cum[name][i0], patch_cum[name][i1]
                streams[name] = _StreamRows(
                    rows.grid[i0:i1],
                    rows.patches[p0:p1] if rows.patches is not None and i1 > i0 else None,
                    {k: v[i0:i1] for k, v in rows.extras.items()},
                    rows.counts[lo:hi],
                )
            out.append(self._with(sample, streams))
        return out

    @staticmethod
    def concat(batches: Sequence["RaggedBatch"], *, pad_token_id: int = 0) -> "RaggedBatch":
        """Samples of ``batches`` in order. Batches of different L are right-padded to the longest
        (``input_ids`` with ``pad_token_id``, others with ``layout.pad_values``). Raises
        ``ValueError`` for an empty list, mixed layouts or token ids, or different per-sample keys."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches):
            if b.layout != first.layout or b.token_ids != first.token_ids:
                raise ValueError(f"batch {i} has layout {b.layout_name!r} / {b.token_ids}, batch 0 has "
                                 f"{first.layout_name!r} / {first.token_ids}; concat batches of one family")
            if set(b._sample) != set(first._sample):
                raise ValueError(f"batch {i} has per-sample keys {sorted(b._sample)}, batch 0 has {sorted(first._sample)}")
        lay = first.layout
        length = max(b._sample["input_ids"].shape[-1] for b in batches)
        sample = {}
        for k in first._sample:
            value = pad_token_id if k == "input_ids" else lay.pad_values.get(k, 0)
            parts = [torch.nn.functional.pad(b._sample[k], (0, length - b._sample[k].shape[-1]), value=value) for b in batches]
            sample[k] = torch.cat(parts, dim=lay.sample_dims[k])
        streams = {}
        for name in first._streams:
            rows = [b._streams[name] for b in batches]
            patches = [r.patches for r in rows if r.patches is not None]
            keys = dict.fromkeys(k for r in rows for k in r.extras)
            for i, r in enumerate(rows):
                missing = [k for k in keys if k not in r.extras and r.grid.shape[0]]
                if missing:
                    raise ValueError(f"batch {i} has {name}s but no {missing}; every batch with {name}s needs them")
            extras = {k: torch.cat([r.extras[k] for r in rows if k in r.extras]) for k in keys}
            streams[name] = _StreamRows(torch.cat([r.grid for r in rows]), torch.cat(patches) if patches else None,
                                        extras, tuple(c for r in rows for c in r.counts))
        order = tuple(dict.fromkeys(k for b in batches for k in b._order))
        return RaggedBatch(lay, first.token_ids, sample, streams, order)

    def to_padded(self) -> dict[str, torch.Tensor]:
        """The mapping view with image ``pixel_values`` padded to [N, P_max, D_p] (zeros), the layout
        colpali-engine and transformers' ColQwen2 use; videos stay flat. ``from_padded`` inverts it."""
        out = self.to_dict()
        rows = self._streams["image"]
        if rows.patches is not None:
            out[self._layout.stream("image").patches_key] = pad_patches(rows.patches, rows.patch_counts.to(rows.patches.device))
        return out

