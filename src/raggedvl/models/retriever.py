"""The retriever module: a Qwen-VL backbone, a retrieval head and the dummy vision pass; the
backbone's patch embedding runs as one matrix product (``raggedvl.models.patch_embed``).

Shape legend: B samples, L tokens per sample (padded), H backbone hidden size, D embedding dim,
P patch rows (``pixel_values``), I images.

``Retriever.forward(**batch)`` takes the backbone's inputs (``input_ids`` [B, L],
``attention_mask`` [B, L], ``mm_token_type_ids`` [B, L], ``pixel_values`` [P, patch_dim],
``image_grid_thw`` [I, 3], videos alike) and returns :class:`EmbeddingOutput`.
``Retriever.forward(queries=q, docs=d)`` encodes both in ONE forward call and returns
``(q_out, d_out)``: under DDP call the wrapped module this way (``ddp(queries=q, docs=d)``), so
DDP sees one forward per backward (two forwards per backward need ``static_graph`` and break
with gradient checkpointing); :meth:`Retriever.encode_pair` is the same call on an unwrapped
module.

The state dict is a plain ``nn.Module`` state dict (``backbone.*`` and ``head.*``); its files
(``save_pretrained`` / ``from_pretrained``) are described in :mod:`raggedvl.models.saved`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raggedvl.families import family_of
from raggedvl.prompts import DEFAULT_PROMPTS, LEGACY_PROMPTS, RetrievalPrompts

from .dummy_vision import check_modalities, drop_empty_vision, dummy_vision_inputs, install_dummy_vision
from .head_options import DEFAULT_DIM, DEFAULT_EPS, DEFAULT_HEAD, DEFAULT_POOLING
from .heads import EmbeddingOutput, RetrievalHead
from .lora import LoraSettings, apply_lora
from .packed_attention import set_packed_attention
from .packing import pack_batch, unpack_hidden
from .patch_embed import install_linear_patch_embed
from . import saved

@dataclass
class RetrieverConfig:
    """Head and wrapper settings saved in ``raggedvl_retriever.json``.

    ``expected_modalities``: the vision inputs any rank may see ("image", "video"); a batch
    lacking one of them runs a dummy tower pass for it (``raggedvl.models.dummy_vision``).
    ``source``: where the backbone came from ("tiny", a hub id or a directory), informational.
    ``prompts``: how queries and documents are written for this retriever
    (:class:`raggedvl.prompts.RetrievalPrompts`); a saved config without them was trained with
    ``LEGACY_PROMPTS``.
    ``base``: with LoRA, the checkpoint (hub id or absolute folder) the frozen weights load from;
    a saved retriever then holds only the trainable tensors (adapters and head) and
    ``build_retriever`` reloads the base. None: the weights are saved in full (the tiny preset,
    whose random base no checkpoint holds, or no LoRA).
    """

    head: str = DEFAULT_HEAD
    dim: int = DEFAULT_DIM
    pooling: str = DEFAULT_POOLING
    eps: float = DEFAULT_EPS
    expected_modalities: tuple[str, ...] = ("image",)
    lora: LoraSettings | None = None
    source: str = "tiny"
    prompts: RetrievalPrompts = field(default=DEFAULT_PROMPTS)
    base: str | None = None

    def __post_init__(self) -> None:
        self.expected_modalities = check_modalities(self.expected_modalities)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["expected_modalities"] = list(self.expected_modalities)
        data["lora"] = self.lora.to_dict() if self.lora else None
        data["prompts"] = self.prompts.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> RetrieverConfig:
        lora = LoraSettings.from_dict(data["lora"]) if data.get("lora") else None
        prompts = RetrievalPrompts.from_dict(data["prompts"]) if data.get("prompts") else LEGACY_PROMPTS
        return cls(**{**data, "lora": lora, "prompts": prompts})


class Retriever(nn.Module):
    """ColQwen-style (late interaction) or bi-encoder retriever over a Qwen-VL base model.

    ``backbone`` is a transformers ``Qwen2VLModel`` / ``Qwen2_5_VLModel`` / ``Qwen3VLModel``
    (optionally wrapped by peft; apply LoRA through ``config.lora`` at construction).
    Gradient: flows to the head, the trainable backbone parameters and, through the dummy pass
    (installed on the backbone at construction, run before the decoder), zeros to vision
    parameters unused by a text-only batch. Issues no collective.
    ``packing`` (:meth:`set_packing`, off by default): run the backbone on padding-free packed
    rows (``raggedvl.models.packing``); outputs equal the padded path's up to float rounding.
    """

    def __init__(self, backbone: nn.Module, config: RetrieverConfig | None = None) -> None:
        super().__init__()
        self.config = config or RetrieverConfig()
        self.family = family_of(backbone.config)
        if self.config.lora is not None:
            backbone = apply_lora(backbone, self.config.lora)
        self.backbone = backbone
        install_dummy_vision(backbone, self.config.expected_modalities)
        install_linear_patch_embed(backbone)
        hidden = self.base_model.config.text_config.hidden_size
        self.head = RetrievalHead(hidden, self.config.dim, self.config.head, self.config.pooling, self.config.eps)
        self.packing = False
        self.vision_rebalancer = None

    @property
    def base_model(self) -> nn.Module:
        """The transformers base model (inside the peft wrapper when LoRA is on)."""
        getter = getattr(self.backbone, "get_base_model", None)
        return getter() if callable(getter) and hasattr(self.backbone, "peft_config") else self.backbone

    def parameter_groups(self, lr: float, head_lr: float | None = None, weight_decay: float = 0.0) -> list[dict]:
        """Optimizer parameter groups: trainable backbone parameters at ``lr``, the head at
        ``head_lr`` (default ``lr``); frozen parameters are left out. Raises ``ValueError``
        for a non-positive learning rate."""
        head_lr = lr if head_lr is None else head_lr
        if lr <= 0 or head_lr <= 0:
            raise ValueError(f"learning rates must be > 0, got lr={lr}, head_lr={head_lr}")
        body = [p for p in self.backbone.parameters() if p.requires_grad]
        head = [p for p in self.head.parameters() if p.requires_grad]
        groups = [{"params": head, "lr": head_lr, "weight_decay": weight_decay, "name": "head"}]
        if body:
            groups.insert(0, {"params": body, "lr": lr, "weight_decay": weight_decay, "name": "backbone"})
        return groups

    def merge_lora(self) -> None:
        """Fold the LoRA adapters into the backbone's weights (peft ``merge_and_unload``): the same
        function, a plain backbone afterwards (``config.lora`` becomes None; every weight trains).
        No-op without LoRA."""
        if self.config.lora is None:
            return
        self.backbone = self.backbone.merge_and_unload()
        self.backbone.requires_grad_(True)  # peft froze the base weights
        self.config.lora = None
        self.config.base = None  # the merged weights are this retriever's own: saved in full

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Toggle activation checkpointing (non-reentrant) in the language model and vision tower."""
        if enabled:
            self.activation_checkpointing_enable({"use_reentrant": False})
        else:
            self.activation_checkpointing_disable()

    # transformers' checkpointing protocol (what Trainer calls for --gradient_checkpointing /
    # activation_checkpointing), delegated to the backbone's vision tower and language model
    supports_gradient_checkpointing = True

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Recompute the backbone's activations in backward (``torch.utils.checkpoint``;
        ``activation_checkpointing_kwargs`` default ``{"use_reentrant": False}``). With reentrant
        checkpointing the input embeddings are made to require grad (transformers does it), so
        LoRA adapters behind frozen layers still receive gradients."""
        self.base_model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=dict(activation_checkpointing_kwargs or {"use_reentrant": False}),
            every_n_layers=every_n_layers, offload=offload)

    def activation_checkpointing_disable(self) -> None:
        if self.base_model.is_activation_checkpointing:
            self.base_model.activation_checkpointing_disable()

    @property
    def is_activation_checkpointing(self) -> bool:
        return bool(self.base_model.is_activation_checkpointing)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs: Any) -> None:
        """transformers' older name of :meth:`activation_checkpointing_enable`."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.is_activation_checkpointing

    def set_packing(self, enabled: bool = True) -> None:
        """Toggle padding-free sequences: each encode call packs its samples into one row
        (``raggedvl.models.packing``); the language model's ``sdpa`` becomes per-sequence SDPA
        (``raggedvl.models.packed_attention``), flash-attention uses its varlen path."""
        self.packing = bool(enabled)
        set_packed_attention(self.base_model, self.packing)

    def set_vision_rebalancer(self, rebalancer: Any = None) -> None:
        """Encoder rebalancing (off with None): ``rebalancer(base_model, inputs, dummy_vision_inputs)
        -> inputs`` runs
        on every encode call's backbone inputs before the backbone, e.g.
        :class:`raggedvl.parallel.VisionRebalancer`, which moves whole images of overloaded
        ranks to less loaded ones for the vision tower only (a collective on every call: every
        rank must encode the same number of times)."""
        self.vision_rebalancer = rebalancer

    def forward(self, queries: Any = None, docs: Any = None, **batch: Any):
        if queries is not None or docs is not None:
            if queries is None or docs is None or batch:
                raise TypeError(
                    "Retriever.forward takes either the model inputs (**batch) or both queries= and docs= "
                    f"(got queries={'set' if queries is not None else None}, docs={'set' if docs is not None else None}, "
                    f"other keys {sorted(batch)})"
                )
            return self._encode(dict(queries.items())), self._encode(dict(docs.items()))
        return self._encode(batch)

    def encode_pair(self, queries: Any, docs: Any) -> tuple[EmbeddingOutput, EmbeddingOutput]:
        """Encode a query batch and a document batch in one ``forward`` call (see module docstring)."""
        return self(queries=queries, docs=docs)

    def _encode(self, batch: dict) -> EmbeddingOutput:
        accepted = self.family.layout.model_inputs
        unknown = sorted(set(batch) - accepted)
        if unknown:
            raise TypeError(f"{self.family.name} Retriever got inputs {unknown} it does not use; accepted: {sorted(accepted)}")
        for key in ("input_ids", "attention_mask"):
            if batch.get(key) is None:
                raise ValueError(f"Retriever needs {key!r} [B, L]; got keys {sorted(batch)}")
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if ids.dim() != 2 or tuple(ids.shape) != tuple(mask.shape):
            raise ValueError(
                f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must both be [B, L]"
            )
        for stream in self.family.streams:
            if (batch.get(stream.patches_key) is None) != (batch.get(stream.grid_key) is None):
                raise ValueError(f"{stream.patches_key} and {stream.grid_key} must be given together (batch has only one)")
        inputs = drop_empty_vision({k: v for k, v in batch.items() if v is not None}, self.family)
        if self.vision_rebalancer is not None:
            inputs = self.vision_rebalancer(self.base_model, inputs, dummy_vision_inputs)
        # the backbone's pre-hook runs the dummy vision pass before the decoder (raggedvl.models.dummy_vision)
        if self.packing:
            packed = pack_batch(self.base_model, inputs)
            hidden_BLH = unpack_hidden(self.backbone(**packed.inputs, use_cache=False).last_hidden_state, packed)
        else:
            hidden_BLH = self.backbone(**inputs, use_cache=False).last_hidden_state
        return self.head(hidden_BLH, mask)

    @property
    def saves_trainable_only(self) -> bool:
        """True when a save holds only the trainable tensors: LoRA on a base a checkpoint holds."""
        return self.config.lora is not None and self.config.base is not None

    def trainable_state_names(self) -> set[str]:
        """State-dict names of the parameters that train (LoRA matrices and head, or all)."""
        return {n for n, p in self.named_parameters() if p.requires_grad}

    def weights_to_save(self, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The tensors a save holds: ``state_dict`` (default: this module's; under FSDP2 pass the
        gathered full state dict) restricted to :meth:`trainable_state_names` when
        :attr:`saves_trainable_only`, else all of it."""
        state = self.state_dict() if state_dict is None else state_dict
        if not self.saves_trainable_only:
            return dict(state)
        keep = self.trainable_state_names()
        return {k: v for k, v in state.items() if k in keep}

    def save_pretrained(self, directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write ``raggedvl_retriever.json`` and ``raggedvl_retriever.safetensors`` into ``directory``
        (:mod:`raggedvl.models.saved`).

        The weights are :meth:`weights_to_save` (``state_dict``: the full state dict when this
        module's own is sharded): with LoRA on a named base only the adapters and the head, the
        frozen base stays in its checkpoint (``config.base``). Each file is written to a
        temporary name and renamed, so a crash leaves no torn file; files get the permissions the
        umask gives a plain ``open()``.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        saved.write_weights(out, self.weights_to_save(state_dict))
        self.save_settings(out)
        return out

    def save_settings(self, directory: str | os.PathLike) -> Path:
        """Write ``raggedvl_retriever.json`` (head settings, prompts, base, backbone config) into
        ``directory``: beside a ``raggedvl_retriever.safetensors`` of :meth:`weights_to_save`, the folder
        loads with ``build_retriever`` (training checkpoints write both this way)."""
        return saved.write_settings(directory, family=self.family.name, trainable_only=self.saves_trainable_only,
                                    retriever=self.config.to_dict(), backbone_config=self.base_model.config.to_dict())

    def load_saved_weights(self, directory: str | os.PathLike, *, trainable_only: bool | None = None) -> None:
        """Load the weights file of a folder written by :meth:`save_pretrained` (or a training
        checkpoint) into this module. ``trainable_only`` (default: what the folder's settings
        say): the file may leave out frozen parameters, but must hold every trainable one.
        Raises ``ValueError`` naming the file and the missing / unexpected keys."""
        if trainable_only is None:
            trainable_only = saved.saves_trainable_only(saved.read_retriever_meta(directory)[0])
        saved.load_weights(self, directory, required=self.trainable_state_names() if trainable_only else None)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, attn_implementation: str | None = None,
                        torch_dtype: torch.dtype | None = None, backbone: nn.Module | None = None) -> Retriever:
        """Rebuild a retriever saved by :meth:`save_pretrained` (offline, safetensors only).

        A save that holds only the trainable tensors needs ``backbone``: the base model loaded
        from ``config.base`` (``build_retriever`` does this). Raises ``ValueError`` when the
        directory is not a raggedvl retriever, when ``backbone`` is missing or has other sizes
        than the saved backbone config, or when the weights do not match the architecture
        (listing missing / unexpected keys).
        """
        path = Path(directory)
        meta, config_file = saved.read_retriever_meta(path)
        config = RetrieverConfig.from_dict(meta["retriever"])
        trainable_only = saved.saves_trainable_only(meta)
        if trainable_only:
            if backbone is None:
                raise ValueError(
                    f"{path} holds only the trainable weights (LoRA and head) of a retriever on the base {config.base}; "
                    "load it with raggedvl.models.build_retriever, which loads that base first"
                )
            saved.check_same_base(meta, config_file, backbone)
        else:
            backbone = saved.backbone_from_settings(meta, attn_implementation)
        model = cls(backbone, config)
        model.load_saved_weights(path, trainable_only=trainable_only)
        if torch_dtype is not None:
            model.backbone.to(torch_dtype)  # the head stays float32 (heads.RetrievalHead)
        return model
