"""colpali-engine checkpoints: ColQwen2 / ColQwen2.5, full or as a peft LoRA adapter, to a Retriever.

Layouts (colpali-engine 0.3.x; checked against checkpoints 0.3.18 wrote, ``../shared/interop``):

- full (``ColQwen2.save_pretrained``): ``config.json`` is the backbone's Qwen2-VL / Qwen2.5-VL
  config with ``architectures: ["ColQwen2"]`` (``"ColQwen2_5"``); ``model.safetensors`` (or
  shards) holds the base model's tensors at top level (``language_model.*``, ``visual.*``; older
  releases ``model.*``) plus the projection ``custom_text_proj`` (``[128, hidden]`` + bias; the
  class fixes the dimension at 128).
- adapter (peft): ``adapter_config.json`` + ``adapter_model.safetensors`` on the base named by
  ``base_model_name_or_path`` (a hub id, or a folder; a relative folder is resolved against the
  adapter folder). colpali's recipe puts LoRA on the language model's q/k/v/o/gate/up/down
  projections and on ``custom_text_proj``; tensors are ``base_model.model.<module>.lora_A.weight``
  ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``; a module saved whole (``modules_to_save``) is
  ``base_model.model.<module>.weight`` / ``.bias``.
- the processor beside them: colpali's ``ColQwen2Processor`` (prompts in
  :data:`raggedvl.prompts.COLPALI_PROMPTS`, left padding).

Mapping onto :class:`~raggedvl.models.Retriever`: ``backbone.<name>`` <-> ``<name>`` and
``head.proj.*`` <-> ``custom_text_proj.*``; the forward is the same (last hidden state ->
projection -> L2 normalisation per token -> times the attention mask).

An adapter loads as a trainable adapter: LoRA (same r, alpha, dropout, targets) on the language
model with the stored A/B weights; the projection's LoRA is folded into the head, which raggedvl
trains in full. ``merge=True`` folds the language model's LoRA into its weights too (peft
``merge_and_unload``). Every check runs on safetensors headers before a weight is read, and an
error names the file and the tensor. BiQwen2 (single-vector, no projection) is not supported.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raggedvl.prompts import COLPALI_PROMPTS

from ..backbone import load_backbone
from raggedvl.families import family_of
from ..lora import LoraSettings
from ..retriever import Retriever, RetrieverConfig
from ..weights import TensorFiles
from .detect import ADAPTER_CONFIG, colpali_architecture, exported_prompts

PROJECTION = "custom_text_proj"
COLPALI_DIM = 128
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def load_colpali(folder: str | os.PathLike, *, lora: LoraSettings | None, attn_implementation: str,
                 dtype: torch.dtype | None, config: Any = None) -> Retriever:
    """A :class:`Retriever` with the weights of a full colpali checkpoint folder.

    ``lora``: wrap the loaded backbone with fresh LoRA adapters (colpali's way of fine-tuning a
    full ColQwen2). Raises ``ValueError`` naming the file and the tensor when the projection is
    missing, has a dimension other than 128 or does not match the backbone's hidden size, or
    when a backbone weight is missing or misshapen.
    """
    from transformers import AutoConfig

    folder = Path(folder)
    if config is None:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    files, weight, bias = check_colpali_files(folder, config)
    backbone = load_backbone(folder, attn_implementation=attn_implementation, dtype=dtype, config=config)
    prompts = exported_prompts(folder) or COLPALI_PROMPTS
    retriever = Retriever(backbone, RetrieverConfig(dim=COLPALI_DIM, lora=lora, source=str(folder), prompts=prompts))
    proj = files.load([weight, bias])
    retriever.head.proj.load_state_dict({"weight": proj[weight], "bias": proj[bias]})
    return retriever


def check_colpali_files(folder: Path, config: Any) -> tuple[TensorFiles, str, str]:
    """The weights of a full colpali checkpoint and the stored names of its projection's weight
    and bias, checked from the headers (no weight is read). Raises ``ValueError`` naming the file
    and the tensor for a missing projection or one of another shape, and for a backbone type
    raggedvl cannot wrap."""
    arch = colpali_architecture(getattr(config, "architectures", None)) or "ColQwen2"
    family_of(config)
    files = TensorFiles(folder)
    weight, bias = _projection_names(files)
    _check_projection(files, weight, bias, config.get_text_config().hidden_size, arch)
    return files, weight, bias


def _projection_names(files: TensorFiles) -> tuple[str, str]:
    for prefix in ("", PEFT_PREFIX):  # some releases stored the projection under the peft prefix
        if f"{prefix}{PROJECTION}.weight" in files:
            return f"{prefix}{PROJECTION}.weight", f"{prefix}{PROJECTION}.bias"
    raise ValueError(
        f"{files.label} has no {PROJECTION}.weight: a colpali ColQwen2 checkpoint stores its projection there "
        "(is this a plain Qwen2-VL checkpoint? load it as a backbone instead)"
    )


def _check_projection(files: TensorFiles, weight: str, bias: str, hidden: int, arch: str) -> None:
    shape = files.tensors[weight].shape
    if tuple(shape) != (COLPALI_DIM, hidden):
        raise ValueError(
            f"{files.tensors[weight].file}: tensor {weight!r} has shape {list(shape)}, but {arch} projects the "
            f"backbone's hidden size {hidden} to {COLPALI_DIM} dimensions (shape [{COLPALI_DIM}, {hidden}])"
        )
    if bias not in files or tuple(files.tensors[bias].shape) != (COLPALI_DIM,):
        found = list(files.tensors[bias].shape) if bias in files else "missing"
        raise ValueError(f"{files.label}: tensor {bias!r} must have shape [{COLPALI_DIM}], found {found}")


# ---------------------------------------------------------------------------------------------- adapters
def read_adapter_config(folder: Path) -> dict:
    """``adapter_config.json`` of a LoRA adapter, refusing what raggedvl cannot reproduce exactly
    (``ValueError`` naming the file and the field)."""
    path = folder / ADAPTER_CONFIG
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "use_rslora": bool(cfg.get("use_rslora")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "layers_to_transform": cfg.get("layers_to_transform") is not None,
        "bias": cfg.get("bias", "none") != "none",
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"{path}: {bad} set; raggedvl loads plain LoRA adapters (one r and alpha, no bias) only")
    return cfg


def resolve_base(folder: Path, name: str | None) -> str:
    """The adapter's base: an absolute folder, a folder relative to the adapter folder, or a hub id.

    Raises ``ValueError`` naming ``adapter_config.json`` when the base is not given, or looks like
    a local path that does not exist."""
    config_path = folder / ADAPTER_CONFIG
    if not name:
        raise ValueError(f"{config_path}: base_model_name_or_path is empty; set it to the base checkpoint")
    path = Path(name)
    candidate = path if path.is_absolute() else (folder / path)
    if candidate.is_dir():
        return str(candidate.resolve())
    if path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1:
        raise ValueError(
            f"{config_path}: base_model_name_or_path {name!r} is not a folder (looked for {candidate}); "
            "a relative path is resolved against the adapter folder"
        )
    return name  # a hub id such as "vidore/colqwen2-base"


def _adapter_modules(files: TensorFiles) -> dict[str, dict[str, str]]:
    """Module path (without the peft prefix) -> {"lora_A" | "lora_B" | "weight" | "bias": stored name}."""
    modules: dict[str, dict[str, str]] = {}
    for name in files.names():
        if not name.startswith(PEFT_PREFIX):
            raise ValueError(f"{files.label}: tensor {name!r} does not start with {PEFT_PREFIX!r} (not a peft adapter)")
        rest = name[len(PEFT_PREFIX):]
        for part in ("lora_A.weight", "lora_B.weight", "weight", "bias"):
            if rest.endswith("." + part):
                modules.setdefault(rest[: -len(part) - 1], {})[part.split(".")[0] if "lora" in part else part] = name
                break
        else:
            raise ValueError(f"{files.label}: tensor {name!r} is neither a LoRA matrix nor a saved module weight")
    return modules


def _check_lora_shapes(files: TensorFiles, module: str, entry: dict[str, str], linear: torch.nn.Linear,
                       r: int, base: str) -> None:
    want = {"lora_A": (r, linear.in_features), "lora_B": (linear.out_features, r)}
    for part, shape in want.items():
        if part not in entry:
            raise ValueError(f"{files.label}: module {module!r} has no {part} tensor")
        got = tuple(files.tensors[entry[part]].shape)
        if got != shape:
            raise ValueError(
                f"{files.tensors[entry[part]].file}: tensor {entry[part]!r} has shape {list(got)}, but the base "
                f"{base} has {module} with in/out features {linear.in_features}/{linear.out_features} (r={r} needs "
                f"{list(shape)}); the adapter was trained on another base"
            )


@dataclass
class Adapter:
    """A parsed adapter folder: its config, tensors and the modules they adapt."""

    folder: Path
    config: dict
    files: TensorFiles
    modules: dict[str, dict[str, str]]  # language-model module -> {"lora_A" | "lora_B": stored name}
    head: dict[str, str] | None  # the projection's entry (LoRA or saved whole), if any

    @property
    def r(self) -> int:
        return int(self.config["r"])

    @property
    def scale(self) -> float:
        return float(self.config["lora_alpha"]) / self.r


def read_adapter(folder: str | os.PathLike) -> Adapter:
    """Parse an adapter folder (config and safetensors headers; no weight is read). Raises
    ``ValueError`` for what raggedvl cannot reproduce, naming the file (and the tensor)."""
    folder = Path(folder)
    files = TensorFiles(folder, ADAPTER_WEIGHTS)
    modules = _adapter_modules(files)
    head = modules.pop(PROJECTION, None)
    for module, entry in modules.items():
        if not module.startswith("language_model."):
            raise ValueError(f"{files.label}: LoRA on {module!r} is outside the language model; raggedvl keeps the "
                             "vision tower frozen and adapts only the language model")
        if "weight" in entry or "bias" in entry:
            raise ValueError(f"{files.label}: {module!r} is saved whole (modules_to_save); only the projection may be")
    return Adapter(folder, read_adapter_config(folder), files, modules, head)


def check_adapter_fits(adapter: Adapter, linears: dict[str, torch.nn.Linear], head: torch.nn.Linear | None,
                       base_name: str) -> None:
    """Raise ``ValueError`` naming the adapter file and the tensor when the adapter does not fit
    its base: a module the base lacks, other in/out features, a projection of another shape, or
    no projection at all when the base has none (``head`` None: a plain backbone). ``linears``:
    the base's Linear modules by name (real or on the meta device)."""
    files = adapter.files
    for module, entry in adapter.modules.items():
        if module not in linears:
            raise ValueError(
                f"{files.label}: tensor {next(iter(entry.values()))!r} targets {module!r}, which the base {base_name} "
                "does not have; the adapter was trained on another base"
            )
        _check_lora_shapes(files, module, entry, linears[module], adapter.r, base_name)
    entry = adapter.head
    if head is None:
        if entry is None or "weight" not in entry:
            raise ValueError(
                f"{files.label} saves no {PROJECTION} weights and its base {base_name} is a plain backbone without one; "
                f"the adapter needs a ColQwen base or {PROJECTION} in modules_to_save"
            )
        return
    if entry is not None and "weight" in entry:
        shape = tuple(files.tensors[entry["weight"]].shape)
        if shape != tuple(head.weight.shape):
            raise ValueError(f"{files.label}: tensor {entry['weight']!r} has shape {list(shape)}, the base "
                             f"{base_name} projects with {list(head.weight.shape)}")
    elif entry is not None:
        _check_lora_shapes(files, PROJECTION, entry, head, adapter.r, base_name)


def apply_adapter(folder: str | os.PathLike, base: Retriever, *, base_name: str, base_has_head: bool,
                  merge: bool) -> Retriever:
    """``base`` (a retriever without LoRA, loaded from the adapter's base) with a colpali (peft
    LoRA) adapter folder applied (module docstring).

    ``base_has_head``: the base holds a trained projection (a ColQwen checkpoint), not a new one;
    ``merge``: fold the LoRA weights into the backbone (full training afterwards); otherwise the
    adapter stays a trainable LoRA adapter. Raises ``ValueError`` naming the file and the tensor
    when the adapter does not fit its base (:func:`check_adapter_fits`), or for adapter features
    raggedvl does not reproduce.
    """
    adapter = read_adapter(folder)
    linears = {n: m for n, m in base.backbone.named_modules() if isinstance(m, torch.nn.Linear)}
    check_adapter_fits(adapter, linears, base.head.proj if base_has_head else None, base_name)
    targets = tuple(sorted({m.rsplit(".", 1)[-1] for m in adapter.modules}))
    settings = LoraSettings(r=adapter.r, alpha=adapter.config["lora_alpha"],
                            dropout=float(adapter.config.get("lora_dropout") or 0.0), target_modules=targets) if targets else None
    config = RetrieverConfig(dim=base.config.dim, lora=settings, source=str(adapter.folder),
                             prompts=exported_prompts(adapter.folder) or COLPALI_PROMPTS)
    head_state = _adapted_head(adapter, base)
    retriever = Retriever(base.backbone, config)
    retriever.head.load_state_dict(head_state)
    if settings is not None:
        _load_lora_weights(retriever, adapter.files, adapter.modules)
    if merge:
        retriever.merge_lora()
    return retriever


def _adapted_head(adapter: Adapter, base: Retriever) -> dict[str, torch.Tensor]:
    """The head's weights after the adapter: saved whole, base + (alpha / r) B A, or the base's
    (shapes checked by :func:`check_adapter_fits`)."""
    state = {k: v.detach().clone() for k, v in base.head.state_dict().items()}
    entry, proj = adapter.head, base.head.proj
    if entry is None:
        return state
    if "weight" in entry:
        saved = adapter.files.load([entry["weight"]] + ([entry["bias"]] if "bias" in entry else []))
        state["proj.weight"] = saved[entry["weight"]].to(proj.weight.dtype)
        if "bias" in entry:
            state["proj.bias"] = saved[entry["bias"]].to(proj.bias.dtype)
        return state
    ab = adapter.files.load([entry["lora_A"], entry["lora_B"]])
    delta = adapter.scale * (ab[entry["lora_B"]].double() @ ab[entry["lora_A"]].double())
    state["proj.weight"] = (proj.weight.detach().double() + delta).to(proj.weight.dtype)
    return state


def _load_lora_weights(retriever: Retriever, files: TensorFiles, modules: dict[str, dict[str, str]]) -> None:
    from peft import set_peft_model_state_dict

    wrapped = {n[len(PEFT_PREFIX):] for n, m in retriever.backbone.named_modules()
               if n.startswith(PEFT_PREFIX) and hasattr(m, "lora_A")}
    if wrapped != set(modules):
        extra = sorted(wrapped - set(modules))
        raise ValueError(
            f"{files.label} adapts {len(modules)} modules, but LoRA with the same targets wraps {len(wrapped)} "
            f"(e.g. {extra[:3]} have no weights); adapters on part of the layers are not supported"
        )
    names = [entry[p] for entry in modules.values() for p in ("lora_A", "lora_B")]
    result = set_peft_model_state_dict(retriever.backbone, files.load(names))
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(f"{files.label}: peft did not place {unexpected[:3]} into the model")
