"""LoRA for generative fine-tuning: peft adapters on a ``*ForConditionalGeneration`` model.

The retriever applies LoRA through ``build_retriever(lora=LoraSettings(...))``
(:func:`raggedvl.models.apply_lora`, on the base model). A generative model nests the same
language model one level deeper (``model.language_model``); this wraps it with the same
:class:`~raggedvl.models.LoraSettings` and the same rule: only the language model's projections
get adapters, the vision tower and ``lm_head`` stay frozen.
"""

from __future__ import annotations

from torch import nn

from raggedvl.models import LoraSettings


def apply_generation_lora(model: nn.Module, settings: LoraSettings | None = None) -> nn.Module:
    """Wrap ``model`` in a peft ``PeftModel`` (task "CAUSAL_LM") with LoRA on its language model.

    Every base weight is frozen; only the LoRA A/B matrices train. Raises ``ValueError`` when no
    language-model module matches ``settings.target_modules``.
    """
    from peft import LoraConfig, get_peft_model

    settings = settings or LoraSettings()
    matched = [n for n, _ in model.named_modules()
               if ".language_model." in f".{n}" and n.rsplit(".", 1)[-1] in settings.target_modules]
    if not matched:
        raise ValueError(
            f"LoRA target_modules {list(settings.target_modules)} match no module of {type(model).__name__}'s "
            "language model; pass the projection names of this architecture"
        )
    pattern = rf"(.*\.)?language_model\..*\.({'|'.join(settings.target_modules)})"
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=pattern, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)
