"""Encoder rebalancing: run the vision tower on whole images of overloaded ranks elsewhere.

Shape legend: W ranks; this rank owns I images with grids ``image_grid_thw`` [I, 3] (t, h, w in
patches) and ``pixel_values`` [P, patch_dim], P = sum t*h*w; the tower turns an image into
t*h*w / merge_size**2 visual tokens of size H (Qwen3-VL: plus one [tokens, H] deepstack feature
per deepstack layer, carried as extra columns).

:class:`VisionRebalancer` is called by :class:`raggedvl.models.Retriever` on the backbone inputs
of every encode call (queries and documents), on every rank, before the backbone runs:

1. one ragged ``all_gather`` (header + data, :func:`raggedvl.parallel.all_gather_variable`) of
   every rank's grids, with a validity row first (pixel rows agree with the grids), so a bad
   batch on one rank raises the same ``ValueError`` on every rank instead of a hang;
2. every rank computes the same plan (:func:`raggedvl.parallel.vision_plan.plan_vision_balance`,
   tower cost per image from :meth:`raggedvl.batch.CostModel.image_costs`). No image anywhere,
   or a plan that moves nothing: the inputs are returned unchanged (no further collective);
3. ``all_to_all`` of pixel rows: each rank sends the images it hands off, whole (no gradient
   flows to ``pixel_values``);
4. each rank runs ``get_image_features`` ONCE on the images it was given (its kept ones and the
   received ones); a rank given none runs the dummy input of
   :mod:`raggedvl.models.dummy_vision` instead (a [0, H] slice of its output is sent, so every
   tower parameter gets an exact zero gradient and every rank makes one tower call, as DDP and
   FSDP2 need);
5. ``all_to_all`` of the features back to their owners, autograd-aware: its backward is the
   reverse ``all_to_all`` of the feature gradients, so each image's gradient reaches the rank
   that ran the tower on it, and DDP's average of the tower's gradients is the same as without
   rebalancing (exact up to float summation order).

The returned inputs carry ``mm_encoder_outputs={"image": ...}`` (per-image features in the
owner's order, as transformers' ``get_image_features`` gives them) instead of
``pixel_values``; ``image_grid_thw`` stays (M-RoPE positions need it). A rank with no own image
gets one empty [0, H] feature tensor, which keeps its reverse ``all_to_all`` in the graph.
Collectives run on a dedicated process group (created on the first call, which every rank makes
at the same point), so they never interleave with DDP's or FSDP2's gradient collectives. Every
rank must call backward through an encode that moved images (as DDP requires anyway). Videos
are not rebalanced. Not for GradCache (ranks may run different numbers of chunks).
"""

from __future__ import annotations

from datetime import timedelta
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raggedvl.batch.costs import CostModel
from raggedvl.parallel.gather import all_gather_variable
from raggedvl.parallel.runtime import is_distributed
from raggedvl.parallel.vision_plan import DEFAULT_TOLERANCE, VisionPlan, plan_vision_balance


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all`` along dim 0: ``send_counts[c]`` rows of ``x`` go to rank c, and
    ``recv_counts[s]`` rows arrive from rank s, in rank order. Backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return _exchange(x.detach(), send_counts, recv_counts, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        send_counts, recv_counts = ctx.counts
        return _exchange(grad, recv_counts, send_counts, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group=None) -> torch.Tensor:
    """Exchange rows of ``x [sum(send_counts), *rest]`` (grouped by destination rank) for
    ``[sum(recv_counts), *rest]`` (grouped by source rank). Collective: one ``all_to_all``
    forward, one backward (gradients go back to the rows' senders). ``*rest`` and dtype must
    agree on every rank. Raises ``ValueError`` when ``x`` has not ``sum(send_counts)`` rows."""
    if x.shape[0] != sum(send_counts):
        raise ValueError(f"all_to_all_rows: x has {x.shape[0]} rows but send_counts sum to {sum(send_counts)}")
    return _AllToAllRows.apply(x, list(send_counts), list(recv_counts), group)


class VisionRebalancer:
    """The rebalancing step of the retriever's encode calls (module docstring).

    ``cost_model``: tower cost per image (default :class:`raggedvl.batch.CostModel`'s
    patches + patches**2 / 8192). ``tolerance``: leave ranks alone while the largest tower load
    is within (1 + tolerance) x max(mean load, largest image) (default 5 %). ``timeout_s``: timeout of the
    dedicated process group's collectives. ``last_plan``: the plan of the latest call that had
    images anywhere (None before). Without a process group or at world size 1 a call returns
    its inputs unchanged.
    """

    def __init__(self, cost_model: CostModel | None = None, tolerance: float = DEFAULT_TOLERANCE,
                 timeout_s: float | None = None) -> None:
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        self.cost_model = cost_model or CostModel()
        self.tolerance = tolerance
        self.timeout_s = timeout_s
        self.last_plan: VisionPlan | None = None
        self._group = None

    def group(self):
        if self._group is None:
            kwargs = {"timeout": timedelta(seconds=self.timeout_s)} if self.timeout_s else {}
            self._group = dist.new_group(backend=dist.get_backend(), **kwargs)
        return self._group

    def __call__(self, base: nn.Module, inputs: dict[str, Any],
                 dummy_inputs: Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        """``inputs`` of a Qwen-VL base model ``base`` -> the same inputs with image features in
        place of ``pixel_values`` when the plan moves images (module docstring).
        ``dummy_inputs(base.visual)``: zero pixel rows and their grid for a rank given no image
        (the retriever passes :func:`raggedvl.models.dummy_vision.dummy_vision_inputs`). Raises
        ``ValueError`` on every rank when any rank's pixel rows do not match its grids."""
        if not is_distributed() or dist.get_world_size() == 1:
            return inputs
        group = self.group()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        device = next(base.parameters()).device
        pixels, grid = inputs.get("pixel_values"), inputs.get("image_grid_thw")
        grid = torch.zeros(0, 3, dtype=torch.long, device=device) if grid is None else grid.to(torch.long)
        rows = grid.prod(-1)
        ok = (pixels is not None or grid.shape[0] == 0) and int(rows.sum()) == (0 if pixels is None else pixels.shape[0])
        header = torch.tensor([[int(ok), 0 if pixels is None else pixels.shape[0], int(rows.sum())]], device=device)
        gathered = all_gather_variable(torch.cat([header, grid]), group=group, tag="vision rebalance grids")
        table = gathered.values.cpu()
        heads = [table[o] for o in gathered.offsets]
        bad = [f"rank {r}: {int(h[1])} pixel rows, grids give {int(h[2])}" for r, h in enumerate(heads) if not h[0]]
        if bad:
            raise ValueError("vision rebalancing: pixel_values rows must equal sum(t*h*w) of image_grid_thw on every rank ("
                             + "; ".join(bad) + "); pass whole images with their grids")
        grids = [table[o + 1:o + n] for o, n in zip(gathered.offsets, gathered.counts)]
        if sum(g.shape[0] for g in grids) == 0:
            return inputs
        plan = plan_vision_balance([self.cost_model.image_costs(g).tolist() for g in grids], tolerance=self.tolerance)
        self.last_plan = plan
        if plan.moved == 0:
            return inputs
        return _encode_moved(base, inputs, plan, grids, rank, world, group, dummy_inputs)


def _row_index(sizes: list[int], order: list[int], device) -> torch.Tensor:
    """Row indices that take the blocks of ``sizes`` (consecutive in index order) in ``order``."""
    starts = torch.tensor([0, *sizes], dtype=torch.long).cumsum(0)[:-1].tolist()
    parts = [torch.arange(starts[i], starts[i] + sizes[i], dtype=torch.long) for i in order]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(device)


def _encode_moved(base: nn.Module, inputs: dict[str, Any], plan: VisionPlan, grids: list[torch.Tensor],
                  rank: int, world: int, group, dummy_inputs) -> dict[str, Any]:
    merge2 = base.visual.spatial_merge_size ** 2
    patches = [g.prod(-1).tolist() for g in grids]
    mine, assign = patches[rank], plan.assignment[rank]
    order = plan.sent_by(rank)
    computed = plan.computed_by(rank)
    # 3. pixel rows, grouped by destination; received grouped by source (= computed order)
    send_rows = [sum(mine[i] for i in order if assign[i] == c) for c in range(world)]
    recv_rows = [sum(patches[s][i] for s_, i in computed if s_ == s) for s in range(world)]
    dummy_pixels, dummy_grid = dummy_inputs(base.visual)  # also the tower's patch_dim and dtype
    pixels = inputs.get("pixel_values")
    pixels = dummy_pixels[:0] if pixels is None else pixels.detach().to(dummy_pixels.dtype)
    send = pixels[_row_index(mine, order, pixels.device)]
    received = _exchange(send, send_rows, recv_rows, group)
    # 4. one tower call on what this rank was given (or the dummy input)
    if computed:
        grid = torch.stack([grids[s][i] for s, i in computed]).to(dummy_grid.device)
        out = base.get_image_features(received, grid, return_dict=True)
    else:
        out = base.get_image_features(dummy_pixels, dummy_grid, return_dict=True)
    deep = list(getattr(out, "deepstack_features", None) or ())
    columns = [torch.cat(out.pooler_output)] + [torch.cat(f) for f in deep]
    width = columns[0].shape[-1]
    features = torch.cat(columns, dim=1)
    if not computed:
        features = features[:0]
    # 5. features back to their owners (autograd-aware), then into the owner's image order
    back_send = [sum(patches[s][i] // merge2 for s_, i in computed if s_ == s) for s in range(world)]
    back_recv = [sum(mine[i] // merge2 for i in order if assign[i] == c) for c in range(world)]
    got = all_to_all_rows(features, back_send, back_recv, group)
    tokens = [p // merge2 for p in mine]
    restore = torch.empty(len(order), dtype=torch.long)
    restore[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    got = got[_row_index([tokens[i] for i in order], restore.tolist(), got.device)] if order else got
    split = tokens if tokens else [0]
    pooled = tuple(torch.split(got[:, :width], split))
    fields: dict[str, Any] = {"pooler_output": pooled}
    if deep:
        fields["deepstack_features"] = [tuple(torch.split(got[:, width * (k + 1):width * (k + 2)], split))
                                        for k in range(len(deep))]
    outputs = dict(inputs)
    outputs.pop("pixel_values", None)
    outputs["mm_encoder_outputs"] = {**(inputs.get("mm_encoder_outputs") or {}), "image": type(out)(**fields)}
    return outputs
