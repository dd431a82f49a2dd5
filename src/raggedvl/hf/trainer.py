"""``RaggedTrainer``: the HF ``Trainer`` training a retriever with exact contrastive losses on
ragged Qwen-VL batches, in every launch mode of :mod:`raggedvl.hf.trainer_base`.

Shape legend: B samples on this process, N = sum of B over processes, W processes, L tokens,
D embedding dim.

Loss: ``model(queries=q, docs=d)`` in one forward call, then a raggedvl loss
(:class:`~raggedvl.losses.LateInteractionLoss` for a late-interaction retriever,
:class:`~raggedvl.losses.InfoNCELoss` for a bi-encoder) that all-gathers the documents with
gradient and returns ``L_r = (W/N) * sum of this process's per-query terms`` (DESIGN.md
section 4). The Trainer neither multiplies nor divides it by W (no ``num_items_in_batch`` is
involved); it divides by the gradient-accumulation steps (``loss_is_scaled_for_ga = False``),
DDP averages gradients over W, so every parameter gets the gradient of the mean loss over the
global batch, and the logged loss (the Trainer's mean of ``L_r`` over processes) is that mean
loss exactly. With g accumulation steps the objective is the mean of the g micro-batch losses,
each over its own global micro-batch (see :mod:`raggedvl.losses`).

Repeats completing the epoch's last batch: batches carry ``valid`` [B] bool, which the loss
uses to drop them on every process (never a query nor a negative; N counts the real samples).

Collectives: the loss's all-gathers, one all-reduce per evaluation step, and accelerate's own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from raggedvl.gradcache import grad_cache_step
from raggedvl.losses import RetrievalLoss, make_retrieval_loss
from raggedvl.models import Retriever
from raggedvl.models.saved import is_saved_retriever
from raggedvl.models.weights import write_json
from raggedvl.parallel import RaggedDataParallel

from .trainer_base import RaggedTrainerBase

def default_retrieval_loss(model: nn.Module, temperature: float = 0.02) -> RetrievalLoss:
    """The late-interaction loss for a late-interaction retriever, InfoNCE for a bi-encoder
    (:func:`raggedvl.losses.make_retrieval_loss`)."""
    head = getattr(getattr(model, "config", None), "head", "late_interaction")
    return make_retrieval_loss("infonce" if head == "bi_encoder" else "late_interaction", temperature=temperature)


class RaggedTrainer(RaggedTrainerBase):
    """``transformers.Trainer`` for a :class:`raggedvl.models.Retriever` on batches from
    :class:`~raggedvl.hf.RetrievalWireCollator` (module docstring).

    Args (besides :class:`~raggedvl.hf.trainer_base.RaggedTrainerBase`'s: ``processor``,
    ``collective_timeout_s``, and the Trainer's own):
        loss: retrieval loss (default :func:`default_retrieval_loss`): a
            :class:`~raggedvl.losses.RetrievalLoss` (:func:`~raggedvl.losses.make_retrieval_loss`)
            or a raggedvl loss module, which is wrapped in one; it must not own trainable
            parameters (the optimizer and DDP only see the model's).
        grad_cache_budget: run each training step through GradCache
            (:func:`raggedvl.gradcache.grad_cache_step`) in chunks of at most this many patches +
            tokens, so activation memory is one chunk's whatever the batch size; the loss still
            spans the whole (global) batch and the gradients equal the plain step's. ``None``
            (default): the plain step.
        false_negatives: "mask" (default) removes a candidate page that is one of the query's own
            pages (the batch's ``doc_keys`` / ``query_keys`` from
            :class:`~raggedvl.hf.RetrievalWireCollator`, on every process) from that query's
            softmax denominator, as ``raggedvl train`` does; "keep" scores every other page as a
            negative.

    Raises ``ValueError`` for a loss of the wrong kind or with parameters, and for
    ``grad_cache_budget`` below 1, with fp16 loss scaling or with ``RaggedDataParallel``
    (several GPUs in one process: use torchrun).
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, *, processor: Any,
                 loss: nn.Module | None = None, grad_cache_budget: int | None = None,
                 false_negatives: str = "mask", **kwargs: Any) -> None:
        if false_negatives not in ("mask", "keep"):
            raise ValueError(f"false_negatives must be 'mask' or 'keep', got {false_negatives!r}")
        if grad_cache_budget is not None:
            if grad_cache_budget < 1:
                raise ValueError(f"grad_cache_budget must be >= 1 patches + tokens, got {grad_cache_budget}")
            if getattr(args, "fp16", False):
                raise ValueError("grad_cache_budget does not support fp16 loss scaling; use bf16 or fp32")
        loss = loss if loss is not None else default_retrieval_loss(model)
        if not isinstance(loss, RetrievalLoss):
            try:
                loss = RetrievalLoss(loss)
            except TypeError as exc:
                raise ValueError(f"loss must be a raggedvl RetrievalLoss or loss module: {exc}") from None
        if any(p.requires_grad for p in loss.parameters()):
            raise ValueError("the retrieval loss owns trainable parameters (learnable_scale=True); "
                             "use a fixed temperature with RaggedTrainer")
        super().__init__(model, args, processor=processor, **kwargs)
        self.retrieval_loss = loss
        self.grad_cache_budget = grad_cache_budget
        self.false_negatives = false_negatives
        self.loss_is_scaled_for_ga = False

    def mark_repeats(self, data: Any, valid: torch.Tensor) -> Any:
        """``valid`` [B] bool in the batch dict, for the loss."""
        return {**data, "valid": valid} if isinstance(data, Mapping) else data

    # ------------------------------------------------------------------ saving
    def _retriever(self, model: nn.Module | None = None) -> Retriever | None:
        model = self.accelerator.unwrap_model(model if model is not None else self.model, keep_torch_compile=False)
        model = model.module if isinstance(model, nn.DataParallel) else model
        return model if isinstance(model, Retriever) else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """``resume_from_checkpoint`` of a retriever: its weights file (``Retriever.load_saved_weights``;
        a LoRA checkpoint holds the adapters and the head, the base is already in place)."""
        retriever = self._retriever(model)
        if retriever is None or not is_saved_retriever(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        retriever.load_saved_weights(resume_from_checkpoint)
        return None

    def _load_best_model(self) -> None:
        """``load_best_model_at_end`` (and ``EarlyStoppingCallback``) with a retriever: the best
        checkpoint's weights file (``Retriever.load_saved_weights``), which the Trainer's own
        loader, looking for ``model.safetensors``, would not find."""
        retriever = self._retriever()
        best = self.state.best_model_checkpoint
        if retriever is None or best is None or not is_saved_retriever(best):
            return super()._load_best_model()
        retriever.load_saved_weights(best)
        return None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """``save_model`` / checkpoints of a retriever: a folder ``build_retriever`` loads
        (``Retriever.save_pretrained``: ``raggedvl_retriever.json`` + ``raggedvl_retriever.safetensors``, with
        LoRA on a named base only the adapters and the head), the processor beside it, and the
        training arguments as ``training_args.json``. Nothing is pickled (the stock Trainer
        writes ``training_args.bin`` with ``torch.save``). Other models: the Trainer's own save."""
        model = self._retriever()
        if model is None:
            return super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return None
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        model.save_pretrained(output_dir, state_dict=state_dict)
        self.processor.save_pretrained(output_dir)
        write_json(Path(output_dir) / "training_args.json", json.loads(self.args.to_json_string()))
        return None

    # ------------------------------------------------------------------ losses
    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch=None) -> torch.Tensor:
        """The Trainer's step, or with ``grad_cache_budget`` one :func:`grad_cache_step`: the
        loss divided by the accumulation steps (as the Trainer divides it), its gradient
        accumulated into ``.grad`` chunk by chunk; returns that loss, detached."""
        if self.grad_cache_budget is None:
            return super().training_step(model, inputs, num_items_in_batch)
        if isinstance(model, RaggedDataParallel):
            raise ValueError("grad_cache_budget with several GPUs in one process (RaggedDataParallel) is not "
                             "supported; launch one process per GPU (torchrun / accelerate launch)")
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        scale = 1.0 / self.current_gradient_accumulation_steps
        valid = inputs.get("valid")  # repeats completing the last batch (module docstring)
        keys = self._keys(inputs)
        step = grad_cache_step(model, inputs["queries"], inputs["docs"],
                               lambda q, d: self.retrieval_loss(q, d, valid=valid, **keys) * scale,
                               budget=self.grad_cache_budget, autocast=self.autocast_smart_context_manager())
        return step.loss.detach()

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch=None):
        inputs = self.decode_batch(inputs)
        if isinstance(model, RaggedDataParallel):  # scatter each side by whole samples
            q, d = model(inputs["queries"]), model(inputs["docs"])
        else:
            q, d = model(queries=inputs["queries"], docs=inputs["docs"])
        loss = self.retrieval_loss(q, d, valid=inputs.get("valid"), **self._keys(inputs))
        return (loss, {"queries": q, "docs": d}) if return_outputs else loss

    def _keys(self, inputs: Any) -> dict[str, torch.Tensor]:
        """The false-negative keys of a retrieval batch for the loss (none with ``keep``)."""
        if self.false_negatives != "mask" or not isinstance(inputs, Mapping) or "doc_keys" not in inputs:
            return {}
        return {k: inputs[k] for k in ("doc_keys", "query_keys") if k in inputs}

    def prediction_step(self, model: nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys=None):
        """Evaluation: the loss of this step's real global batch (the mean of the processes'
        shares ``L_r``), the same value on every process (retrieval metrics:
        ``raggedvl.evaluate_benchmark``). The Trainer repeats it per sample and
        ``gather_for_metrics`` keeps the real samples' copies, so the evaluation loss weights each
        step by its real samples. One all-reduce."""
        inputs = self._prepare_inputs(self.mark_real_samples(inputs))
        with torch.no_grad():
            loss = self.accelerator.reduce(self.compute_loss(model, inputs).detach(), "mean")
        return loss.detach(), None, None
