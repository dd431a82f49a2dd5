"""``RaggedSFTTrainer``: supervised fine-tuning of a Qwen-VL ``*ForConditionalGeneration`` model
with ragged batches (:class:`raggedvl.hf.SFTCollator`), in every launch mode of
:mod:`raggedvl.hf.trainer_base`.

Loss: the model's own causal-LM loss on ``labels`` with the Trainer's ``num_items_in_batch``
(label tokens of every accumulated micro-batch, summed over processes when
``average_tokens_across_devices``, the default): the token mean over the global batch. Under
``RaggedDataParallel`` every replica divides its token sum by the process's exact count and the
replica losses are summed. Repeats completing the epoch's last batch get ``-100`` labels, so
``num_items_in_batch`` and the loss count real tokens only. Evaluation reports the token mean
over every real label token of the set.

Collectives: one all-reduce per evaluation step, besides accelerate's own.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from raggedvl.batch import RaggedBatch
from raggedvl.batch.wire import NUM_TOKENS, is_wire
from raggedvl.models import install_dummy_vision, install_linear_patch_embed
from raggedvl.parallel import RaggedDataParallel

from .collator import IGNORE_INDEX
from .trainer_base import RaggedTrainerBase


def _ignore_labels_of(data: Any, valid: torch.Tensor) -> Any:
    """``data`` with ``labels`` set to IGNORE_INDEX on the samples where ``valid`` is False (a copy)."""
    if not isinstance(data, Mapping) or "labels" not in data:
        return data
    labels = data["labels"]
    keep = valid.to(labels.device)
    if is_wire(data):  # labels are flat over tokens: each sample owns ragged_num_tokens[b] of them
        keep = keep.repeat_interleave(data[NUM_TOKENS].to(labels.device))
    else:
        keep = keep.view(-1, *([1] * (labels.dim() - 1)))
    return {**data, "labels": labels.masked_fill(~keep, IGNORE_INDEX)}


class RaggedSFTTrainer(RaggedTrainerBase):
    """``transformers.Trainer`` for SFT of a ``*ForConditionalGeneration`` model on batches from
    :class:`~raggedvl.hf.SFTCollator` (module docstring).

    Args (besides :class:`~raggedvl.hf.trainer_base.RaggedTrainerBase`'s; ``processing_class``
    defaults to ``processor``):
        expected_modalities: the vision inputs any process may see ("image", "video");
            :func:`raggedvl.models.install_dummy_vision` makes every forward call the vision
            tower once per modality, with a zero-weight dummy input where the batch has none, so
            a process with text-only samples neither hangs DDP (which runs without
            ``find_unused_parameters`` under activation checkpointing) nor crosses FSDP's
            parameter gathers. The model's patch embedding becomes a matrix product
            (:func:`raggedvl.models.install_linear_patch_embed`: same weights, outputs equal to
            float32 rounding). With ``model_init`` instead of ``model``, call both there.

    Raises ``ValueError`` for ``loss=`` (the model's own loss is used) and
    ``grad_cache_budget=`` (GradCache caches embedding gradients: retrieval only).
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, *, processor: Any,
                 expected_modalities: Sequence[str] = ("image",), **kwargs: Any) -> None:
        if kwargs.get("loss") is not None:
            raise ValueError("RaggedSFTTrainer uses the model's own causal-LM loss; do not pass loss=")
        if kwargs.get("grad_cache_budget") is not None:
            raise ValueError("grad_cache_budget is for retrieval (GradCache caches embedding gradients): "
                             "use RaggedTrainer")
        kwargs.pop("loss", None)
        kwargs.pop("grad_cache_budget", None)
        kwargs.setdefault("processing_class", processor)  # a Retriever's config is no PretrainedConfig
        if model is not None:  # before the Trainer wraps it (DDP / FSDP)
            install_dummy_vision(model, expected_modalities)
            install_linear_patch_embed(model)
        super().__init__(model, args, processor=processor, **kwargs)
        self._eval_tokens: torch.Tensor | None = None  # evaluation: (loss sum, label tokens) so far

    def mark_repeats(self, data: Any, valid: torch.Tensor) -> Any:
        """IGNORE_INDEX labels on the repeats."""
        return data if bool(valid.all()) else _ignore_labels_of(data, valid)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        if self.args.n_gpu <= 1 or not batch_samples or "labels" not in batch_samples[0]:
            return super()._get_num_items_in_batch(batch_samples, device)
        # RaggedDataParallel: one process, exact count (the Trainer would divide it by n_gpu).
        return sum(int(b["labels"][..., 1:].ne(-100).sum()) for b in batch_samples)

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch=None):
        batch = self.decode_batch(inputs)
        if not isinstance(batch, RaggedBatch) or "labels" not in batch:
            raise ValueError("RaggedSFTTrainer needs batches from raggedvl.hf.SFTCollator (a ragged batch with labels)")
        kwargs: dict[str, Any] = {"use_cache": False}
        scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        if scaled:
            kwargs["num_items_in_batch"] = num_items_in_batch
        if isinstance(model, RaggedDataParallel):
            outputs = model(batch, **kwargs)
            loss = outputs.loss.sum() if scaled else outputs.loss.mean()
        else:
            outputs = model(**batch.to_dict(), **kwargs)
            loss = outputs.loss
            if scaled and self.args.average_tokens_across_devices:
                loss = loss * self.accelerator.num_processes  # DDP's average divides it back out
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model: nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys=None):
        """Evaluation: the token mean over every process's real label tokens of this step, the
        same value on every process. One all-reduce."""
        inputs = self._prepare_inputs(self.mark_real_samples(inputs))
        with torch.no_grad():
            if isinstance(model, RaggedDataParallel):
                loss = self.accelerator.reduce(self.compute_loss(model, inputs).detach(), "mean")
            else:
                outputs = model(**inputs.to_dict(), use_cache=False)  # mean over this process's label tokens
                tokens = inputs["labels"][..., 1:].ne(IGNORE_INDEX).sum().to(outputs.loss.dtype)
                local = torch.where(tokens > 0, outputs.loss * tokens, torch.zeros_like(outputs.loss))
                total = self.accelerator.reduce(torch.stack([local, tokens]), "sum")
                loss = total[0] / total[1]
                if self._eval_tokens is not None:  # the evaluation's token mean (evaluation_loop)
                    self._eval_tokens += total.detach().double().cpu()
        return loss.detach(), None, None

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """The Trainer's loop; the loss it reports is the token mean over every real label token
        of the evaluation set (the training loss's normalisation), whatever the batch size and
        the number of processes, instead of the mean of per-step token means weighted by
        samples. The sums are all-reduced in each step, so every process reports the same value."""
        self._eval_tokens = torch.zeros(2, dtype=torch.float64)
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            key = f"{metric_key_prefix}_loss"
            if self._eval_tokens[1] > 0 and key in output.metrics:
                output.metrics[key] = float(self._eval_tokens[0] / self._eval_tokens[1])
            return output
        finally:
            self._eval_tokens = None
