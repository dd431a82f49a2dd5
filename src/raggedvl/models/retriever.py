"""The retriever module: a Qwen-VL backbone, a retrieval head and the dummy vision pass.

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

The state dict is a plain ``nn.Module`` state dict (``backbone.*`` and ``head.*``);
``save_pretrained(dir)`` writes it as ``model.safetensors`` beside ``raggedvl_retriever.json``
(the head settings, the prompts and the backbone config), and ``Retriever.from_pretrained(dir)``
rebuilds the module offline from those two files (no code is executed from the directory). The
settings file is deliberately not called ``config.json``: transformers would read one as its own
model config (``ColQwen2ForRetrieval.from_pretrained`` then builds its default 80-layer model);
without one it says that the folder is not a transformers checkpoint. Folders written before
this name (``config.json`` with ``"format": "raggedvl-retriever"``) still load.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from raggedvl.families import FAMILIES, family_of
from raggedvl.prompts import DEFAULT_PROMPTS, LEGACY_PROMPTS, RetrievalPrompts

from .attention import resolve_attn_implementation
from .dummy_vision import check_modalities, drop_empty_vision, install_dummy_vision
from .heads import EmbeddingOutput, RetrievalHead
from .lora import LoraSettings, apply_lora
from .packed_attention import set_packed_attention
from .packing import pack_batch, unpack_hidden
from .weights import save_tensors, write_json

CONFIG_NAME = "raggedvl_retriever.json"
LEGACY_CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1


@dataclass
class RetrieverConfig:
    """Head and wrapper settings saved in ``raggedvl_retriever.json``.

    ``expected_modalities``: the vision inputs any rank may see ("image", "video"); a batch
    lacking one of them runs a dummy tower pass for it (``raggedvl.models.dummy_vision``).
    ``source``: where the backbone came from ("tiny", a hub id or a directory), informational.
    ``prompts``: how queries and documents are written for this retriever
    (:class:`raggedvl.prompts.RetrievalPrompts`); a saved config without them was trained with
    ``LEGACY_PROMPTS``.
    """

    head: str = "late_interaction"
    dim: int = 128
    pooling: str = "last"
    eps: float = 1e-6
    expected_modalities: tuple[str, ...] = ("image",)
    lora: LoraSettings | None = None
    source: str = "tiny"
    prompts: RetrievalPrompts = field(default=DEFAULT_PROMPTS)

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
        hidden = self.base_model.config.text_config.hidden_size
        self.head = RetrievalHead(hidden, self.config.dim, self.config.head, self.config.pooling, self.config.eps)
        self.packing = False

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

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Toggle activation checkpointing (non-reentrant) in the language model and vision tower."""
        if enabled:
            self.base_model.activation_checkpointing_enable({"use_reentrant": False})
        elif self.base_model.is_activation_checkpointing:
            self.base_model.activation_checkpointing_disable()

    def set_packing(self, enabled: bool = True) -> None:
        """Toggle padding-free sequences: each encode call packs its samples into one row
        (``raggedvl.models.packing``); the language model's ``sdpa`` becomes per-sequence SDPA
        (``raggedvl.models.packed_attention``), flash-attention uses its varlen path."""
        self.packing = bool(enabled)
        set_packed_attention(self.base_model, self.packing)

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
        # the backbone's pre-hook runs the dummy vision pass before the decoder (raggedvl.models.dummy_vision)
        if self.packing:
            packed = pack_batch(self.base_model, inputs)
            hidden_BLH = unpack_hidden(self.backbone(**packed.inputs, use_cache=False).last_hidden_state, packed)
        else:
            hidden_BLH = self.backbone(**inputs, use_cache=False).last_hidden_state
        return self.head(hidden_BLH, mask)

    def _collator(self, processor: Any):
        from raggedvl.data import RetrievalCollator

        processor = processor if processor is not None else getattr(self, "processor", None)
        if processor is None:
            raise ValueError("encoding needs the model's processor: pass processor= (raggedvl.data.build_processor(...)) "
                             "or build the model with build_retriever(..., processor=...)")
        return RetrievalCollator(processor, prompts=self.config.prompts, layout=self.family.name)

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def encode_queries(self, texts, *, batch_size: int = 32, processor: Any = None, progress: bool = True, padded: bool = False):
        """Embeddings of query texts, in input order, without gradient: a list of ``[L_i, D]``
        (valid vectors only), ``(emb [n, L_max, D], bool mask [n, L_max])`` with ``padded=True``,
        or ``[n, D]`` for the bi-encoder. Batches are bucketed by text length; a tqdm bar shows
        progress. ``processor``: default the one given to ``build_retriever``."""
        from raggedvl.evaluation.encode import encode_queries

        return encode_queries(self, self._collator(processor), texts, batch_size=batch_size, device=self._device(),
                              progress=progress, padded=padded)

    def encode_documents(self, images, *, batch_size: int = 8, processor: Any = None, progress: bool = True, padded: bool = False):
        """Embeddings of document images (PIL images, paths, bytes, or a RetrievalDataset), in
        input order, bucketed by image area; same return forms as :meth:`encode_queries`.
        Raises ``BadImageError`` (a ``ValueError``) naming an unreadable image."""
        from raggedvl.evaluation.encode import encode_documents

        return encode_documents(self, self._collator(processor), images, batch_size=batch_size, device=self._device(),
                                progress=progress, padded=padded)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``raggedvl_retriever.json`` and ``model.safetensors`` (the full state dict) into
        ``directory``.

        Each file is written to a temporary name and renamed, so a crash leaves no torn file;
        files get the permissions the umask gives a plain ``open()``.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": "raggedvl-retriever",
            "format_version": FORMAT_VERSION,
            "family": self.family.name,
            "retriever": self.config.to_dict(),
            "backbone_config": self.base_model.config.to_dict(),
        }
        save_tensors(out / WEIGHTS_NAME, self.state_dict())
        write_json(out / CONFIG_NAME, meta)
        return out

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, attn_implementation: str | None = None,
                        torch_dtype: torch.dtype | None = None) -> Retriever:
        """Rebuild a retriever saved by :meth:`save_pretrained` (offline, safetensors only).

        Raises ``ValueError`` when the directory is not a raggedvl retriever or when the weights
        do not match the architecture (listing missing / unexpected keys).
        """
        path = Path(directory)
        meta, config_file = read_retriever_meta(path)
        family = FAMILIES[meta["family"]]
        backbone_config = family.config_class.from_dict(meta["backbone_config"])
        backbone = family.model_class._from_config(
            backbone_config, attn_implementation=resolve_attn_implementation(attn_implementation)
        )
        model = cls(backbone, RetrieverConfig.from_dict(meta["retriever"]))
        state = load_file(str(path / WEIGHTS_NAME))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{path / WEIGHTS_NAME} does not match the architecture in {config_file}: "
                f"{len(missing)} missing keys (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
            )
        if torch_dtype is not None:
            model.backbone.to(torch_dtype)  # the head stays float32 (heads.RetrievalHead)
        return model


def retriever_config_file(directory: str | os.PathLike) -> Path | None:
    """The settings file of a saved retriever in ``directory`` (new or legacy name), or None."""
    directory = Path(directory)
    if (directory / CONFIG_NAME).is_file():
        return directory / CONFIG_NAME
    legacy = directory / LEGACY_CONFIG_NAME
    try:
        if legacy.is_file() and json.loads(legacy.read_text()).get("format") == "raggedvl-retriever":
            return legacy
    except (OSError, json.JSONDecodeError):
        return None
    return None


def read_retriever_meta(directory: Path) -> tuple[dict, Path]:
    """Parsed settings of a saved retriever and the file they came from; ``ValueError`` if the
    folder is not one."""
    cfg = retriever_config_file(directory)
    if cfg is None or not (directory / WEIGHTS_NAME).is_file():
        raise ValueError(f"{directory} is not a saved raggedvl retriever (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    meta = json.loads(cfg.read_text())
    if meta.get("format") != "raggedvl-retriever":
        raise ValueError(f"{cfg} is not a raggedvl retriever config (format={meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION or meta.get("family") not in FAMILIES:
        raise ValueError(
            f"{cfg}: unsupported format_version {meta.get('format_version')} / family {meta.get('family')!r}"
        )
    return meta, cfg


def is_saved_retriever(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds settings written by :meth:`Retriever.save_pretrained`."""
    return retriever_config_file(directory) is not None
