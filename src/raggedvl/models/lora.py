"""LoRA adapters on a Qwen-VL language model, through peft: a retriever's backbone (base model,
``language_model.*``) or a generative ``*ForConditionalGeneration`` model (one level deeper,
``model.language_model.*``), one rule for both.

Default targets follow ColQwen2 (colpali-engine): the language model's attention and MLP
projections (q, k, v, o, gate, up, down); the vision tower (and ``lm_head``) stays frozen. The
retrieval head is not part of the backbone and stays fully trainable.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters (Hu et al. 2021): ``W + (alpha / r) * B A``, dropout on the input.

    ``target_modules``: projection names matched inside ``language_model`` only (a regex is
    built so that the vision tower's layers of the same name are never wrapped).
    """

    r: int = 32
    alpha: int = 32
    dropout: float = 0.1
    target_modules: tuple[str, ...] = field(default=DEFAULT_TARGETS)

    def __post_init__(self) -> None:
        if self.r <= 0 or self.alpha <= 0:
            raise ValueError(f"LoraSettings: r and alpha must be positive, got r={self.r}, alpha={self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings: dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("LoraSettings: target_modules is empty; name at least one projection")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    def to_dict(self) -> dict:
        return {**asdict(self), "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, data: dict) -> LoraSettings:
        return cls(**{**data, "target_modules": tuple(data["target_modules"])})


def apply_lora(model: nn.Module, settings: LoraSettings, *, task_type: str | None = None) -> nn.Module:
    """Wrap ``model`` in a peft ``PeftModel``: LoRA on the projections of its ``language_model``
    (at the top, as in a retriever's backbone, or nested, as in a generative model).

    ``task_type``: peft's task (``"CAUSAL_LM"`` for a generative model; ``None`` for a backbone).
    Every base weight is frozen; only the LoRA A/B matrices are trainable. Raises
    ``ValueError`` when no Linear of the language model matches ``settings.target_modules``.
    """
    from peft import LoraConfig, get_peft_model

    linear_names = {n: n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    matched = [n for n, leaf in linear_names.items() if ".language_model." in f".{n}" and leaf in settings.target_modules]
    if not matched:
        raise ValueError(
            f"LoRA target_modules {list(settings.target_modules)} match no Linear of {type(model).__name__}'s "
            f"language model; its Linear layers are named {sorted(set(linear_names.values()))}"
        )
    pattern = rf"(.*\.)?language_model\..*\.({'|'.join(settings.target_modules)})"
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=pattern, bias="none", task_type=task_type)
    with warnings.catch_warnings():
        # peft (<= 0.21.2, the newest release) reads transformers' deprecated `is_gradient_checkpointing`
        # in PeftModel.__init__, which transformers 5 answers with a FutureWarning; the value is
        # still right (it is `is_activation_checkpointing`), only that one warning is hidden.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def apply_generation_lora(model: nn.Module, settings: LoraSettings | None = None) -> nn.Module:
    """LoRA for generative fine-tuning: :func:`apply_lora` with peft's ``"CAUSAL_LM"`` task on a
    ``*ForConditionalGeneration`` model (default :class:`LoraSettings`); same rule and errors."""
    return apply_lora(model, settings or LoraSettings(), task_type="CAUSAL_LM")
