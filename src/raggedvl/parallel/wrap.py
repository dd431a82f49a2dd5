"""Wrapping a model for data parallelism and moving its state in and out of the wrapper.

DDP (the default) replicates the model on every rank and all-reduces (averages) gradients
during backward; FSDP2 (``torch.distributed.fsdp.fully_shard``) shards parameters, gradients
and optimizer state across ranks; HSDP shards within groups of ranks (e.g. a node) and
replicates across the groups, keeping the sharded all-gathers inside a group. All give the same
optimizer step; sharding trades extra communication for memory.

State dicts go through ``torch.distributed.checkpoint.state_dict``: sharded (each rank's own
FSDP2 shards, whole tensors under DDP; what ``raggedvl.parallel.sharded_state`` writes and
reads) or full (unsharded CPU tensors, for single-file weights). With FSDP2 these helpers are
collectives: every rank must call them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raggedvl.parallel.runtime import is_distributed, set_collective_timeout


def wrap_model(
    model: nn.Module,
    *,
    strategy: str = "ddp",
    device: torch.device | None = None,
    shard_degree: int | None = None,
    timeout_s: float | None = None,
) -> nn.Module:
    """Wrap ``model`` for data parallelism; returns it unchanged without a process group.

    ``strategy``: ``"ddp"`` (DistributedDataParallel, ``find_unused_parameters=False``: the
    retriever's dummy vision pass keeps every parameter in the graph), ``"fsdp2"``
    (``fully_shard`` on every decoder/vision block, then on the root, sharding over all ranks) or
    ``"hsdp"`` (the same ``fully_shard`` calls on a 2-D device mesh, ``mesh_dim_names``
    ``("replicate", "shard")`` of shape ``(world_size // shard_degree, shard_degree)``: each group
    of ``shard_degree`` consecutive ranks holds one sharded copy of the model, e.g. one group per
    node; backward reduce-scatters gradients within a group, then all-reduces the shards across
    groups, so every strategy gives the same averaged gradients). ``timeout_s`` bounds the
    collectives of the mesh's sub-groups, which are created here (none: PyTorch's default).
    Raises ``ValueError`` for another strategy, for ``"hsdp"`` whose ``shard_degree`` is not a
    divisor of the world size, or for ``"fsdp2"`` / ``"hsdp"`` on a torch without
    ``torch.distributed.fsdp.fully_shard`` (< 2.6). FSDP2 and HSDP run on gloo (CPU) as well as NCCL.
    """
    if strategy not in ("ddp", "fsdp2", "hsdp"):
        raise ValueError(f"strategy must be 'ddp', 'fsdp2' or 'hsdp', got {strategy!r}")
    if not is_distributed() or dist.get_world_size() == 1:
        return model
    if strategy == "ddp":
        device_ids = [device.index] if device is not None and device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=False)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 has it only under torch.distributed._composable
        raise ValueError(
            f"strategy={strategy!r} needs torch.distributed.fsdp.fully_shard (torch >= 2.6); this is torch "
            f"{torch.__version__}: upgrade torch or use strategy='ddp'"
        ) from None
    mesh = _hsdp_mesh(shard_degree, device, timeout_s) if strategy == "hsdp" else None  # None: all ranks
    for module in model.modules():
        # Shard transformer blocks individually (text decoder layers and vision blocks).
        if type(module).__name__.endswith(("DecoderLayer", "VisionBlock", "Block")) and module is not model:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _hsdp_mesh(shard_degree: int | None, device: torch.device | None, timeout_s: float | None):
    """The ``("replicate", "shard")`` device mesh of HSDP (a collective: every rank calls it):
    rank ``r`` sits at ``(r // shard_degree, r % shard_degree)``. Raises ``ValueError`` when
    ``shard_degree`` is missing, below 1 or does not divide the world size."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if shard_degree is None or shard_degree < 1 or world % shard_degree:
        raise ValueError(f"strategy='hsdp' needs a shard_degree that divides the world size {world}, got "
                         f"{shard_degree}; use a divisor of {world}")
    mesh = init_device_mesh(device.type if device is not None else "cpu", (world // shard_degree, shard_degree),
                            mesh_dim_names=("replicate", "shard"))
    if timeout_s is not None:
        for name in mesh.mesh_dim_names:
            set_collective_timeout(timeout_s, mesh.get_group(name))
    return mesh


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 modifies the module in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def sharded_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's model and optimizer state dicts without gathering: under FSDP2 the values
    are DTensors holding this rank's shards, under DDP and on one process the parameters and
    optimizer tensors themselves (no copy). An optimizer that has not stepped gets its state
    created first (a step at learning rate 0 with zero gradients,
    ``torch.distributed.checkpoint.state_dict``), so the result is also the template a load
    fills. Collective under FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(unwrap_model(model), optimizer, options=StateDictOptions(full_state_dict=False))


def load_sharded_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict[str, Any], optim_sd: dict[str, Any]
) -> None:
    """Load state dicts shaped like :func:`sharded_state_dicts`'s (filled by
    ``raggedvl.parallel.sharded_state.read_sharded``) into a (wrapped) model and its optimizer.
    ``model_sd`` may leave out frozen parameters, as in :func:`load_full_state_dicts`, whose
    ``ValueError`` it raises alike. Collective under FSDP2."""
    _load_state_dicts(model, optimizer, model_sd, optim_sd, full=False)


def load_full_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None
) -> None:
    """Load full (unsharded) state dicts, such as those of a single-file checkpoint, into a (wrapped) model.

    ``model_sd`` may leave out frozen parameters (a LoRA checkpoint holds only the adapters and
    the head; the frozen base is already in the model, loaded from its own checkpoint). Raises
    ``ValueError`` naming the keys when a trainable parameter is missing or a key is unknown."""
    _load_state_dicts(model, optimizer, model_sd, optim_sd, full=True)


def _load_state_dicts(model, optimizer, model_sd, optim_sd, *, full: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    module = unwrap_model(model)
    opts = StateDictOptions(full_state_dict=full, strict=False)
    if optimizer is None or optim_sd is None:
        result = set_model_state_dict(module, model_sd, options=opts)
    else:
        result = set_state_dict(module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=opts)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    missing = sorted(set(result.missing_keys) & trainable)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the checkpoint's model state does not fit this model: {len(missing)} trainable parameters missing "
            f"(e.g. {missing[:3]}), {len(result.unexpected_keys)} unknown keys (e.g. {list(result.unexpected_keys)[:3]})"
        )

