"""Dummy vision pass: every forward calls the vision tower once per expected modality, before the decoder.

Why (case C04 of the failure cases): under DDP without ``find_unused_parameters``
(what the HF Trainer picks with activation checkpointing) a rank whose batch has no image never
uses the vision tower's parameters; its reducer never sees their gradients and the job hangs in
the first backward (or fails with "Expected to have finished reduction in the prior
iteration"). FSDP2 / ZeRO-3 all-gather each sharded block's parameters when the block runs, so
every rank must run the same blocks in the same order: a rank that calls the tower fewer times,
or after the decoder instead of before it, crosses the gathers (gloo: "Received data size
doesn't match expected size").

Fix, for every Qwen-VL base model (``Qwen2VLModel``, ``Qwen2_5_VLModel``, ``Qwen3VLModel``,
inside a retriever, a ``*ForConditionalGeneration`` generator or a peft wrapper alike):
:func:`install_dummy_vision` registers a forward pre-hook on the base model. For each modality
in ``expected`` ("image", "video") that the call lacks, the hook runs the smallest valid input,
one ``[t, h, w] = [1, 2, 2]`` grid (4 patch rows of zeros, one merged visual token), through the
tower and adds ``0.0 * sum(outputs)`` to the input embeddings (a forward hook on the embedding
layer), where real visual features go too. So on every rank the forward runs: embedding, one
tower call per expected modality (dummies first, then the real ones), then the decoder; the
backward mirrors it. Properties:

- value: ``x + 0.0 * s == x`` exactly for finite ``x`` (zero input keeps ``s`` finite), so the
  loss is bit-identical;
- gradient: every vision parameter receives a gradient of exactly zero (a tensor, not ``None``),
  so DDP's reducer sees every parameter used on every rank and all-reduces zeros;
- call order: the same tower calls before the decoder on every rank, so sharded wrappers issue
  the same collectives everywhere (the tower is one module: a dummy and a real call gather the
  same parameters);
- Qwen3-VL: its deepstack features (one per deepstack layer) are summed into the term too, so
  the deepstack mergers also receive zero gradients.

Pixel tensors with zero rows count as absent (they are dropped before the model sees them).
Decoding steps with a filled KV cache run no dummy (no rank runs the tower there). Works with
activation checkpointing (the tower's blocks checkpoint the dummy like any input) and under
``nn.DataParallel`` replicas (the hooks use the module they are called on). Issues no
collective. Shapes: pixel rows [4, patch_dim], grid [1, 3]; patch_dim = 3 * temporal_patch * patch**2.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from raggedvl.families import FAMILIES, Family, VisualStream, family_of
_PENDING = "_raggedvl_dummy_vision_term"  # per-call term, set on the embedding module by the pre-hook
_HOOK = "_raggedvl_dummy_vision"  # the installed DummyVisionPass, on the base model


def dummy_vision_inputs(visual: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero pixel rows ``[4, patch_dim]`` and grid ``[[1, 2, 2]]`` in the tower's dtype/device."""
    cfg = visual.config
    patch = cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0]
    temporal = cfg.temporal_patch_size if isinstance(cfg.temporal_patch_size, int) else cfg.temporal_patch_size[0]
    merge = cfg.spatial_merge_size
    param = next(visual.parameters())
    rows = merge * merge
    pixels = torch.zeros(rows, cfg.in_channels * temporal * patch * patch, dtype=param.dtype, device=param.device)
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=param.device)
    return pixels, grid


def vision_streams(family: Family | str | None = None) -> dict[str, VisualStream]:
    """The visual streams (modality name -> stream) of ``family``'s layout; with None, those of
    every registered family (``raggedvl.families.FAMILIES``)."""
    families = FAMILIES.values() if family is None else (family_of(family),)
    streams: dict[str, VisualStream] = {}
    for fam in families:
        for stream in fam.streams:
            streams.setdefault(stream.name, stream)
    return streams


def missing_modalities(batch: dict, expected: Iterable[str], family: Family | str | None = None) -> list[str]:
    """Modalities of ``expected`` whose pixel tensor is absent (or has zero rows) in ``batch``;
    pixel keys from ``family``'s layout (default: any registered family's)."""
    streams = vision_streams(family)
    missing = []
    for modality in check_modalities(expected, family):
        pixels = batch.get(streams[modality].patches_key)
        if pixels is None or pixels.shape[0] == 0:
            missing.append(modality)
    return missing


def dummy_vision_term(visual: nn.Module, count: int = 1) -> torch.Tensor | None:
    """``0.0 * sum(tower outputs)`` for ``count`` dummy tower calls; ``None`` when ``count`` is 0.

    The result is a scalar with ``requires_grad`` when the tower has trainable parameters;
    adding it to any tensor changes neither values nor gradients (module docstring).
    """
    term = None
    for _ in range(count):
        pixels, grid = dummy_vision_inputs(visual)
        out = visual(pixels, grid_thw=grid)
        total = out.pooler_output.float().sum()
        for feature in getattr(out, "deepstack_features", None) or ():
            total = total + feature.float().sum()
        term = total * 0.0 if term is None else term + total * 0.0
    return term


def drop_empty_vision(inputs: dict[str, Any], family: Family | str | None = None) -> dict[str, Any]:
    """A copy of the model inputs ``inputs`` without the pixel tensors that have zero rows and
    their per-item tensors (they carry no image or video; the model would run the tower on
    nothing); keys from ``family``'s layout (default: any registered family's)."""
    inputs = dict(inputs)
    for stream in vision_streams(family).values():
        pixels = inputs.get(stream.patches_key)
        if pixels is not None and pixels.shape[0] == 0:
            for key in (stream.patches_key, stream.grid_key, *stream.item_keys):
                inputs.pop(key, None)
    return inputs


def check_modalities(expected: Iterable[str], family: Family | str | None = None) -> tuple[str, ...]:
    """``expected`` as a tuple; ``ValueError`` for a modality ``family`` (default: every
    registered family) has no stream for ("image", "video" for the Qwen-VL families)."""
    expected = tuple(expected)
    known = vision_streams(family)
    bad = [m for m in expected if m not in known]
    if bad:
        raise ValueError(f"unknown vision modality {bad}; expected_modalities must be a subset of {sorted(known)}")
    return expected


def vision_base_model(model: nn.Module) -> nn.Module:
    """The Qwen-VL base model (``Qwen2VLModel`` / ``Qwen2_5_VLModel`` / ``Qwen3VLModel``) in ``model``:
    ``model`` itself, a ``*ForConditionalGeneration``'s ``.model``, inside a peft or DDP wrapper or
    a :class:`~raggedvl.models.Retriever`. Raises ``ValueError`` when there is none."""
    classes = tuple(f.model_class for f in FAMILIES.values())
    for module in model.modules():
        if isinstance(module, classes):
            return module
    raise ValueError(
        f"{type(model).__name__} holds no Qwen-VL base model ({', '.join(c.__name__ for c in classes)}); "
        "the dummy vision pass applies to Qwen2-VL, Qwen2.5-VL and Qwen3-VL models"
    )


class DummyVisionPass:
    """Forward pre-hook of a Qwen-VL base model (module docstring); holds no module, so replicas
    and deep copies of the model share or copy it safely. ``expected``: the modalities any rank
    may see (a subset of ``family``'s streams); ``family``: the base model's family."""

    def __init__(self, expected: Iterable[str], family: Family) -> None:
        self.family = family
        self.expected = check_modalities(expected, family)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if args:  # name positional inputs (input_ids, attention_mask, ...) by the forward's signature
            names = list(inspect.signature(module.forward).parameters)
            kwargs = {**dict(zip(names, args)), **kwargs}
        kwargs = drop_empty_vision(kwargs, self.family)
        embeddings = module.get_input_embeddings()
        embeddings.__dict__.pop(_PENDING, None)  # left over only if an earlier forward raised
        if _decoding(kwargs):
            return (), kwargs
        encoded = kwargs.get("mm_encoder_outputs") or {}
        missing = [m for m in missing_modalities(kwargs, self.expected, self.family) if encoded.get(m) is None]
        term = dummy_vision_term(module.visual, len(missing))
        if term is not None:
            if kwargs.get("inputs_embeds") is not None:
                kwargs["inputs_embeds"] = kwargs["inputs_embeds"] + term.to(kwargs["inputs_embeds"].dtype)
            else:
                embeddings.__dict__[_PENDING] = term
        return (), kwargs


def _decoding(kwargs: dict[str, Any]) -> bool:
    """True for a generation step after the prefill (the KV cache already holds tokens)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    length = getattr(cache, "get_seq_length", None)
    return callable(length) and int(length()) > 0


def _add_pending_term(module: nn.Module, args: tuple, output: torch.Tensor):
    term = module.__dict__.pop(_PENDING, None)
    return None if term is None else output + term.to(output.dtype)


def install_dummy_vision(model: nn.Module, expected: Iterable[str] = ("image",)) -> nn.Module:
    """Make every forward of ``model``'s Qwen-VL base model call the vision tower once per modality
    of ``expected``, real or dummy, before the decoder (module docstring). Returns the base model.

    Call it before wrapping the model for DDP / FSDP2 (hooks on inner modules survive both).
    Installing again only replaces ``expected``. Gradient: zeros (tensors) for vision parameters
    a batch does not use; values and other gradients unchanged. Raises ``ValueError`` for an
    unknown modality or a model without a Qwen-VL base model.
    """
    base = vision_base_model(model)
    family = family_of(base.config)
    expected = check_modalities(expected, family)
    hook = base.__dict__.get(_HOOK)
    if hook is None:
        hook = DummyVisionPass(expected, family)
        base.register_forward_pre_hook(hook, with_kwargs=True)
        base.get_input_embeddings().register_forward_hook(_add_pending_term)
        base.__dict__[_HOOK] = hook
    hook.expected = expected
    return base
