"""Single-process, several-device data parallelism for ragged batches (DESIGN.md section 3.1,
case C01).

``nn.DataParallel`` chunks every tensor evenly along dim 0, which cuts ``pixel_values`` away from
``image_grid_thw``. Here each replica receives whole samples, chosen by cost
(``raggedvl.sampling.partition.partition_costs``), and the gather puts every output back in the
original sample (and image) order, even when replicas return different numbers of per-image
outputs (transformers 5.x returns per-image ``pooler_output`` tuples).

Shape legend: B samples, R replicas, B_r samples on replica r, N_r images on replica r,
P_r patch rows on replica r. No collective is issued: this is one process.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from raggedvl.batch import CostModel, RaggedBatch, get_layout
from raggedvl.batch.padded import ranges
from raggedvl.sampling.partition import partition_costs


@dataclass(frozen=True)
class ScatteredBatch:
    """Result of ``scatter_batch``: ``shards[r]`` holds the original samples ``indices[r]``
    (ascending). Replicas that would get no sample are left out, so ``len(shards) <= R``."""

    shards: list[RaggedBatch]
    indices: list[list[int]]
    source: RaggedBatch
    partial: bool = False  # only some shards (gathering visual outputs absent on text-only shards)

    def subset(self, keep: Sequence[int]) -> "ScatteredBatch":
        """The shards ``keep`` only; per-sample outputs cannot be gathered from a subset."""
        return ScatteredBatch([self.shards[r] for r in keep], [self.indices[r] for r in keep], self.source, True)

    def item_index(self, stream: str) -> list[torch.Tensor]:
        """Per shard, the original batch index of each of its items of ``stream`` ([N_r] int64)."""
        counts = torch.tensor(self.source.counts(stream), dtype=torch.int64)
        starts = self.source.item_offsets(stream)
        return [ranges(starts[idx], counts[idx]) for idx in map(torch.tensor, self.indices)]

    def patch_index(self, stream: str) -> list[torch.Tensor]:
        """Per shard, the original row of each of its patch rows of ``stream`` ([P_r] int64)."""
        rows, starts = self.source.patch_counts(stream), self.source.patch_offsets(stream)
        return [ranges(starts[items], rows[items]) for items in self.item_index(stream)]


def scatter_batch(
    batch: RaggedBatch,
    num_replicas: int,
    costs: Sequence[float] | torch.Tensor | None = None,
    *,
    devices: Sequence[Any] | None = None,
) -> ScatteredBatch:
    """Partition ``batch`` into at most ``num_replicas`` shards of whole samples, balancing cost.

    ``costs``: per-sample costs [B] (default ``batch.sample_costs()``); the partition is
    ``partition_costs(costs, num_replicas)`` (deterministic). ``devices``: optional device per
    replica; shard r is moved to ``devices[r]``. A shard whose samples own no image has no
    ``pixel_values`` / ``image_grid_thw`` keys (the model receives ``None``), never zero rows.
    With fewer samples than replicas, only B shards are returned (the spare replicas do not run).

    Raises ``ValueError`` if ``num_replicas < 1``, ``len(costs) != B`` or ``len(devices) < R``.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if devices is not None and len(devices) < num_replicas:
        raise ValueError(f"{len(devices)} devices given for {num_replicas} replicas")
    cost_list = (batch.sample_costs() if costs is None else torch.as_tensor(costs, dtype=torch.float64)).tolist()
    if len(cost_list) != batch.num_samples:
        raise ValueError(f"got {len(cost_list)} costs for a batch of {batch.num_samples} samples; give one per sample")
    parts = [p for p in partition_costs(cost_list, num_replicas) if p]
    shards = [batch.select(p) for p in parts]
    if devices is not None:
        shards = [s.to(devices[r]) for r, s in enumerate(shards)]
    return ScatteredBatch(shards, parts, batch)


_VISUAL_WORDS = ("image", "video", "patch", "pixel", "vision", "visual")


def _kind(path: str, values: list[torch.Tensor], scattered: ScatteredBatch) -> tuple[str, str]:
    """("sample" | "patch", stream) of a tensor output, from its dim-0 size on every replica; when
    both fit, a path naming visual content (e.g. ``image_outputs.last_hidden_state``) means patch."""
    stream = "video" if "video" in path else "image"
    sizes = [v.shape[0] for v in values]
    fits = {"sample": not scattered.partial and sizes == [len(i) for i in scattered.indices],
            "patch": sizes == [int(s.patch_counts(stream).sum()) for s in scattered.shards]}
    order = ("patch", "sample") if any(w in path.lower() for w in _VISUAL_WORDS) else ("sample", "patch")
    for kind in order:
        if fits[kind]:
            return kind, stream
    raise ValueError(
        f"cannot gather output {path!r}: its dim-0 sizes per replica {sizes} match neither the samples "
        f"{[len(i) for i in scattered.indices]} nor the {stream} patch rows; return per-sample tensors"
    )


def _gather(values: list[Any], scattered: ScatteredBatch, device: Any, path: str) -> Any:
    present = [r for r, v in enumerate(values) if v is not None]
    if not present:
        return None
    if len(present) < len(values):  # e.g. video_outputs: None on shards without videos
        stream = "video" if "video" in path else "image"
        absent = [r for r in range(len(values)) if r not in present]
        if any(scattered.shards[r].num_videos if stream == "video" else scattered.shards[r].num_images for r in absent):
            raise ValueError(f"output {path!r} is None on replicas {absent}, which hold {stream}s; cannot gather it")
        return _gather([values[r] for r in present], scattered.subset(present), device, path)
    first = values[0]
    if isinstance(first, torch.Tensor):
        values = [v.to(device) for v in values]
        if first.dim() == 0:
            return torch.stack(values)  # one scalar per replica, as nn.DataParallel does
        kind, stream = _kind(path, values, scattered)
        order = torch.cat([torch.as_tensor(i) for i in scattered.indices]) if kind == "sample" \
            else torch.cat(scattered.patch_index(stream))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return torch.cat(values).index_select(0, inverse.to(device))
    if isinstance(first, Mapping):
        keys = dict.fromkeys(k for v in values for k in v.keys())  # a ModelOutput lists only non-None keys
        gathered = {k: _gather([v.get(k) for v in values], scattered, device, f"{path}.{k}") for k in keys}
        return type(first)(**gathered) if hasattr(first, "to_tuple") else type(first)(gathered)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{
            f.name: _gather([getattr(v, f.name) for v in values], scattered, device, f"{path}.{f.name}")
            for f in dataclasses.fields(first) if f.init
        })
    if isinstance(first, (tuple, list)):
        stream = "video" if "video" in path else "image"
        item_counts = [s.num_videos if stream == "video" else s.num_images for s in scattered.shards]
        is_items = [len(v) for v in values] == item_counts and all(isinstance(x, torch.Tensor) for v in values for x in v)
        per_sample = all(len(v) == len(first) for v in values) and all(
            isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == len(i)
            for v, i in zip(values, scattered.indices) for x in v
        )
        if is_items and not per_sample:
            flat = [x.to(device) for v in values for x in v]  # per-item outputs, any count per replica
            order = torch.cat(scattered.item_index(stream)).tolist()
            out: list[Any] = [None] * len(flat)
            for pos, x in zip(order, flat):
                out[pos] = x
            return type(first)(out) if isinstance(first, list) else tuple(out)
        if all(len(v) == len(first) for v in values):
            items = [_gather(list(col), scattered, device, f"{path}[{j}]") for j, col in enumerate(zip(*values))]
            return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
        raise ValueError(f"output {path!r} has lengths {[len(v) for v in values]} per replica; cannot gather it")
    if isinstance(first, (int, float, str, bool)) and all(v == first for v in values):
        return first
    raise TypeError(
        f"cannot gather output {path!r} of type {type(first).__name__} (e.g. a KV cache): "
        "call the model with use_cache=False, or return tensors"
    )


def gather_outputs(outputs: Sequence[Any], scattered: ScatteredBatch, output_device: Any = None) -> Any:
    """Merge per-replica outputs back into the original order on ``output_device``.

    Tensors with dim 0 == B_r are per sample (reordered to B rows); tensors with dim 0 == P_r are
    per patch (reordered to the source's patch rows; when both fit, an output whose path names
    image/video/patch/pixel/vision content is taken as per patch); tuples/lists with one tensor per image
    (per video, when the output's path contains "video") are per item and may differ in length
    between replicas; 0-dim tensors are stacked to [R] (as ``nn.DataParallel`` does). A visual
    output that is ``None`` (or missing) on replicas without images / videos is gathered from the
    others. Mappings,
    ``ModelOutput``s, dataclasses and tuples are walked recursively. Gradients flow through
    (``.to`` / ``cat`` / ``index_select`` are differentiable). Raises ``ValueError`` /
    ``TypeError`` naming an output that fits none of these kinds.
    """
    if len(outputs) != len(scattered.shards):
        raise ValueError(f"{len(outputs)} outputs for {len(scattered.shards)} shards")
    device = output_device if output_device is not None else "cpu"
    if isinstance(device, int):
        device = torch.device("cuda", device)
    return _gather(list(outputs), scattered, device, "output")


class RaggedDataParallel(nn.DataParallel):
    """``nn.DataParallel`` that scatters whole samples of a ragged batch (``scatter_batch``) and
    gathers with ``gather_outputs``.

    Call it as ``dp(**features)`` or ``dp(batch)`` with a ``RaggedBatch`` or feature dict; each
    replica runs ``module(**shard, **extras)``. Keyword arguments the layout does not know (e.g.
    ``use_cache=False``, ``output_hidden_states=True``) are passed unchanged to every replica;
    unknown tensor arguments raise ``ValueError`` (their split is undefined). Without CUDA it
    runs the module on the whole (validated) batch, like ``nn.DataParallel``. Only ``dim=0``.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0, *,
                 layout: str = "qwen2_vl", token_ids: Any = None, cost_model: CostModel | None = None):
        if dim != 0:
            raise ValueError(f"RaggedDataParallel scatters samples along dim 0; got dim={dim}")
        super().__init__(module, device_ids, output_device, dim)
        self.layout, self.token_ids, self.cost_model = layout, token_ids, cost_model

    def _batch_and_extras(self, inputs: tuple, kwargs: dict) -> tuple[RaggedBatch, dict]:
        if len(inputs) > 1:
            raise ValueError(f"pass one batch (or keyword features), got {len(inputs)} positional inputs")
        keys = get_layout(self.layout).known_keys
        features = {k: v for k, v in kwargs.items() if k in keys}
        extras = {k: v for k, v in kwargs.items() if k not in keys}
        for k, v in extras.items():
            if isinstance(v, torch.Tensor):
                raise ValueError(f"tensor argument {k!r} is not part of layout {self.layout!r}; its split is undefined")
        if inputs:
            if features:
                raise ValueError(f"pass the batch either positionally or as keywords, not both ({sorted(features)})")
            features = inputs[0]
        return RaggedBatch.from_features(features, self.layout, token_ids=self.token_ids), extras

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            batch, extras = self._batch_and_extras(inputs, kwargs)
            return self.module(**batch.to_dict(), **extras)
        for t in itertools.chain(self.module.parameters(), self.module.buffers()):
            if t.device != self.src_device_obj:
                raise RuntimeError(f"module must have its parameters and buffers on device {self.src_device_obj} "
                                   f"(device_ids[0]) but found one of them on device: {t.device}")
        batch, extras = self._batch_and_extras(inputs, kwargs)
        devices = [torch.device(self.src_device_obj.type, i) for i in self.device_ids]
        scattered = scatter_batch(batch, len(devices), batch.sample_costs(self.cost_model), devices=devices)
        kwargs_per_replica = [{**shard.to_dict(), **extras} for shard in scattered.shards]
        if len(kwargs_per_replica) == 1:
            outputs = [self.module(**kwargs_per_replica[0])]
        else:
            replicas = self.replicate(self.module, self.device_ids[: len(kwargs_per_replica)])
            outputs = self.parallel_apply(replicas, [()] * len(replicas), kwargs_per_replica)
        return gather_outputs(outputs, scattered, torch.device(self.src_device_obj.type, self.output_device))
