"""Data collators for the HF Trainer: ragged batches in wire form, for retrieval and for SFT.

Shape legend: B samples, L tokens per sample, N images, P patch rows.

Both collators return tensors only (wire form, :mod:`raggedvl.batch.wire`), so the batch survives
every path the Trainer and accelerate take: per-process loading, ``dispatch_batches``
(concatenate, broadcast, slice), ``send_to_device``. :class:`raggedvl.hf.RaggedTrainer` turns
the wire form back into :class:`~raggedvl.batch.RaggedBatch` es before the forward pass.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from raggedvl.batch import RaggedBatch
from raggedvl.batch.wire import pack
from raggedvl.families import processor_batch_format
from raggedvl.images import ImagePolicy

IGNORE_INDEX = -100
logger = logging.getLogger(__name__)


class RetrievalWireCollator:
    """Wrap a retrieval collator (e.g. ``raggedvl.data.RetrievalCollator``) whose output holds
    ``queries`` and ``docs`` :class:`RaggedBatch` es; returns ``{"queries": wire, "docs": wire}``
    plus, when the wrapped collator gives them, ``doc_keys`` and ``query_keys`` (int64 ``[B]``:
    which page and which query text each sample holds, :mod:`raggedvl.data.keys`), which travel
    with their samples through accelerate's dispatch and let ``RaggedTrainer`` mask false
    negatives.

    ``ids`` (strings) are not passed on: accelerate cannot broadcast them and the Trainer does
    not use them. Examples the wrapped collator skipped (``skipped``: bad images under
    ``on_bad_image="skip"``) are logged as a warning and kept in ``self.skipped``. Raises
    ``TypeError`` when ``queries`` / ``docs`` are missing or not ragged batches, and
    ``ValueError`` when the batch holds hard negatives (``RaggedTrainer`` does not score them:
    they would be dropped; ``raggedvl train --negatives-column`` trains with them).
    """

    def __init__(self, collate: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
        self.collate = collate
        self.skipped: list[dict[str, Any]] = []

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
        out = self.collate(examples)
        if out.get("skipped"):
            self.skipped.extend(out["skipped"])
            logger.warning("skipped %d example(s) of this batch (%d so far): %s", len(out["skipped"]),
                           len(self.skipped), out["skipped"])
        if out.get("negatives") is not None:
            raise ValueError(
                f"this batch holds {out['negatives'].num_samples} hard negatives, which RaggedTrainer does not score "
                "(they would be dropped); remove the 'negatives' of the examples, or train with raggedvl train "
                "--negatives-column")
        for key in ("queries", "docs"):
            if not isinstance(out.get(key), RaggedBatch):
                raise TypeError(
                    f"the wrapped collator must return RaggedBatch under {key!r}, got {type(out.get(key)).__name__}"
                )
        keys = {k: out[k] for k in ("doc_keys", "query_keys") if isinstance(out.get(k), torch.Tensor)}
        return {"queries": pack(out["queries"]), "docs": pack(out["docs"]), **keys}


def _chat_text(processor: Any, n_images: int, prompt: str, answer: str) -> tuple[str, str]:
    """(prompt part, answer part) of one exchange rendered by the processor's own chat template:
    a user turn (the images, then the prompt) and the assistant's answer."""
    if not getattr(processor, "chat_template", None):
        raise ValueError(
            f"{type(processor).__name__} has no chat template: SFTCollator renders examples with "
            "processor.apply_chat_template; use the checkpoint's own processor (or set processor.chat_template)"
        )
    user = {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": prompt}]}
    assistant = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
    head = processor.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    full = processor.apply_chat_template([user, assistant], tokenize=False)
    if not full.startswith(head):
        raise ValueError(
            f"{type(processor).__name__}'s chat template renders the conversation without its generation prompt "
            f"as a prefix ({head[-40:]!r} vs {full[len(head) - 40:len(head)]!r}); the answer cannot be located for labels"
        )
    return head, full[len(head):]


class SFTCollator:
    """Supervised fine-tuning batches for a Qwen2-VL-family ``*ForConditionalGeneration``.

    Each example is ``{"images": [image, ...] (0 or more), "prompt": str, "answer": str}``,
    rendered by the processor's own chat template (``processor.apply_chat_template``: a user turn
    holding the images, then the prompt; the assistant turn holding the answer). An image is any
    ``raggedvl.images.ImageSource`` (path, bytes, ``{"bytes", "path"}`` dict, PIL image, a
    ``datasets`` ``Image()`` value) and goes through the same ``ImagePolicy`` as retrieval
    (orientation, RGB, padding of extreme strips, resize to the processor's size). ``labels`` [B, L] equal
    ``input_ids`` on the assistant turn after its header (the answer, its closing ``<|im_end|>`` and
    whatever the template writes after it, e.g. a newline) and are ``-100`` on the
    prompt, the image placeholders and the padding, so the model's causal-LM loss (which shifts
    labels itself) trains only on the answer. Returns the wire form of the
    :class:`RaggedBatch` (``input_ids``, ``attention_mask``, ``mm_token_type_ids``, ``labels``,
    ``pixel_values`` [P, 1176], ``image_grid_thw`` [N, 3]). ``layout``: default from the processor.

    Raises ``ValueError`` for a processor without a chat template, naming the sample when it is longer than ``max_length`` tokens (never
    truncates: cutting placeholders would misalign images, case C09) or when the tokenizer merged
    the answer's first token with the prompt; ``BadImageError`` (a ``ValueError``) naming the
    example and the image for an image that cannot be decoded or is out of limits;
    ``TypeError`` for a malformed example.
    """

    def __init__(self, processor: Any, *, max_length: int | None = None, layout: str | None = None) -> None:
        self.processor = processor
        self.max_length = max_length
        self.layout, self.token_ids = processor_batch_format(processor, layout)
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.image_policy = ImagePolicy.from_processor(processor)

    def _check(self, i: int, ex: dict[str, Any]) -> tuple[list[Any], str, str]:
        images = ex.get("images") or []
        if not isinstance(ex.get("prompt"), str) or not isinstance(ex.get("answer"), str):
            raise TypeError(f"SFT example {i} needs str 'prompt' and 'answer' (and a list 'images'); got keys {sorted(ex)}")
        if not isinstance(images, (list, tuple)):
            raise TypeError(f"SFT example {i}: 'images' must be a list of images, got {type(images).__name__}")
        which = f"SFT example {i}" + (f" (id {ex['id']!r})" if ex.get("id") is not None else "")
        prepared = [self.image_policy.prepare(image, name=f"image {j} of {which}") for j, image in enumerate(images)]
        return prepared, ex["prompt"], ex["answer"]

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        texts, answers, images = [], [], []
        for i, ex in enumerate(examples):
            imgs, prompt, answer = self._check(i, ex)
            head, tail = _chat_text(self.processor, len(imgs), prompt, answer)
            texts.append(head + tail)
            answers.append(self.tokenizer(tail, add_special_tokens=False)["input_ids"])
            images.extend(imgs)
        kwargs: dict[str, Any] = {"text": texts, "padding": True, "return_tensors": "pt", "return_mm_token_type_ids": True}
        if images:
            kwargs["images"] = images
        feats = dict(self.processor(**kwargs))
        ids_BL, mask_BL = feats["input_ids"], feats["attention_mask"].bool()
        labels_BL = torch.full_like(ids_BL, IGNORE_INDEX)
        for b, answer_ids in enumerate(answers):
            valid = ids_BL[b][mask_BL[b]]
            if self.max_length is not None and valid.numel() > self.max_length:
                raise ValueError(
                    f"SFT example {b} has {valid.numel()} tokens (image placeholders included) but max_length is "
                    f"{self.max_length}; raise max_length or lower the processor's max_pixels (never truncated: a cut "
                    "through image placeholders misaligns the images)"
                )
            n = len(answer_ids)
            if valid[valid.numel() - n:].tolist() != list(answer_ids):
                raise ValueError(
                    f"SFT example {b}: the answer's {n} tokens are not the last tokens of the rendered chat "
                    "(the tokenizer merged them with the prompt); end the prompt with whitespace"
                )
            pos = mask_BL[b].nonzero().flatten()[valid.numel() - n:]
            labels_BL[b, pos] = ids_BL[b, pos]
        feats["labels"] = labels_BL
        batch = RaggedBatch.from_features(feats, self.layout, token_ids=self.token_ids)
        return pack(batch)
