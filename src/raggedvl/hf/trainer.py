"""``RaggedTrainer``: the HF ``Trainer`` with ragged Qwen-VL batches and exact contrastive losses.

Shape legend: B samples on this process, N = sum of B over processes, W processes, L tokens,
D embedding dim.

Three launch modes, one script:

- ``python train.py`` on several GPUs: the Trainer would wrap the model in ``nn.DataParallel``
  (even chunking cuts patches away from grids, case C01); here it is
  :class:`raggedvl.parallel.RaggedDataParallel` (whole samples per replica, cost-balanced).
- accelerate ``dispatch_batches`` (the default for an ``IterableDataset``): batches travel in
  wire form (:mod:`raggedvl.hf.wire`) and are sliced by whole samples
  (:mod:`raggedvl.hf.dispatch`, case C03).
- ``torchrun`` / ``accelerate launch``: accelerate's DDP; each process collates its own batch.

Batches arrive as wire-form tensor dicts (:mod:`raggedvl.hf.collator`) and are rebuilt into
validated :class:`~raggedvl.batch.RaggedBatch` es before counting label tokens and before the
forward pass; ``remove_unused_columns`` is ignored (the collators pick their own fields).

Losses (``task``):

- ``"retrieval"``: ``model(queries=q, docs=d)`` in one forward call, then a raggedvl loss
  (:class:`~raggedvl.losses.LateInteractionLoss` for a late-interaction retriever,
  :class:`~raggedvl.losses.InfoNCELoss` for a bi-encoder) that all-gathers the documents with
  gradient and returns ``L_r = (W/N) * sum of this process's per-query terms`` (DESIGN.md
  section 4). The Trainer neither multiplies nor divides it by W (no ``num_items_in_batch`` is
  involved); it divides by the gradient-accumulation steps (``loss_is_scaled_for_ga = False``),
  DDP averages gradients over W, so every parameter gets the gradient of the mean loss over the
  global batch, and the logged loss (the Trainer's mean of ``L_r`` over processes) is that mean
  loss exactly. With g accumulation steps the objective is the mean of the g micro-batch losses,
  each over its own global micro-batch (see :mod:`raggedvl.losses`).
- ``"sft"``: the model's own causal-LM loss on ``labels`` with the Trainer's
  ``num_items_in_batch`` (label tokens of every accumulated micro-batch, summed over processes
  when ``average_tokens_across_devices``, the default): the loss is the token mean over the
  global batch. Under ``RaggedDataParallel`` every replica divides its token sum by the
  process's exact count and the replica losses are summed.

Collectives: the losses' all-gathers (retrieval) and accelerate's own (dispatch broadcast,
DDP all-reduce, token-count gather); none is issued by this module directly.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from transformers import Trainer

from raggedvl.batch import RaggedBatch
from raggedvl.gradcache import grad_cache_step
from raggedvl.losses import RetrievalLoss, make_retrieval_loss
from raggedvl.parallel import RaggedDataParallel

from .dispatch import install_ragged_dispatch
from .wire import is_wire, unpack

TASKS = ("retrieval", "sft")


def _layout_of(processor: Any) -> str:
    from raggedvl.data.collator import layout_for

    return layout_for(processor)


def _token_ids_of(processor: Any):
    from raggedvl.data.collator import token_ids_for

    return token_ids_for(processor)


def default_retrieval_loss(model: nn.Module, temperature: float = 0.02) -> RetrievalLoss:
    """The late-interaction loss for a late-interaction retriever, InfoNCE for a bi-encoder
    (:func:`raggedvl.losses.make_retrieval_loss`)."""
    head = getattr(getattr(model, "config", None), "head", "late_interaction")
    return make_retrieval_loss("infonce" if head == "bi_encoder" else "late_interaction", temperature=temperature)


class RaggedTrainer(Trainer):
    """``transformers.Trainer`` for Qwen2-VL-family ragged batches (module docstring).

    Args (besides the Trainer's own; for SFT ``processing_class`` defaults to ``processor``):
        processor: the model's processor (placeholder token ids, pad id, layout).
        task: "retrieval" (a :class:`raggedvl.models.Retriever`, batches from
            :class:`~raggedvl.hf.RetrievalWireCollator`) or "sft" (a ``*ForConditionalGeneration``
            model, batches from :class:`~raggedvl.hf.SFTCollator`).
        loss: retrieval loss (default :func:`default_retrieval_loss`): a
            :class:`~raggedvl.losses.RetrievalLoss` (:func:`~raggedvl.losses.make_retrieval_loss`)
            or a raggedvl loss module, which is wrapped in one; it must not own trainable
            parameters (the optimizer and DDP only see the model's).
        grad_cache_budget: retrieval only: run each training step through GradCache
            (:func:`raggedvl.gradcache.grad_cache_step`) in chunks of at most this many patches +
            tokens, so activation memory is one chunk's whatever the batch size; the loss still
            spans the whole (global) batch and the gradients equal the plain step's. ``None``
            (default): the plain step.

    Raises ``ValueError`` for an unknown task, a loss of the wrong kind or with parameters, and
    for ``grad_cache_budget`` with SFT, below 1, with fp16 loss scaling or with
    ``RaggedDataParallel`` (several GPUs in one process: use torchrun).
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, *, processor: Any, task: str = "retrieval",
                 loss: nn.Module | None = None, grad_cache_budget: int | None = None, **kwargs: Any) -> None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        if grad_cache_budget is not None:
            if task != "retrieval":
                raise ValueError("grad_cache_budget is for task='retrieval' (GradCache caches embedding gradients)")
            if grad_cache_budget < 1:
                raise ValueError(f"grad_cache_budget must be >= 1 patches + tokens, got {grad_cache_budget}")
            if getattr(args, "fp16", False):
                raise ValueError("grad_cache_budget does not support fp16 loss scaling; use bf16 or fp32")
        if task == "retrieval":
            loss = loss if loss is not None else default_retrieval_loss(model)
            if not isinstance(loss, RetrievalLoss):
                try:
                    loss = RetrievalLoss(loss)
                except TypeError as exc:
                    raise ValueError(f"loss must be a raggedvl RetrievalLoss or loss module: {exc}") from None
            if any(p.requires_grad for p in loss.parameters()):
                raise ValueError("the retrieval loss owns trainable parameters (learnable_scale=True); "
                                 "use a fixed temperature with RaggedTrainer")
        elif loss is not None:
            raise ValueError("task='sft' uses the model's own causal-LM loss; do not pass loss=")
        if task == "sft":  # a Retriever's config is no PretrainedConfig: the Trainer cannot align its tokens
            kwargs.setdefault("processing_class", processor)
        super().__init__(model=model, args=args, **kwargs)
        self.task = task
        self.retrieval_loss = loss
        self.grad_cache_budget = grad_cache_budget
        self.layout = _layout_of(processor)
        self.token_ids = _token_ids_of(processor)
        self.pad_token_id = int(getattr(getattr(processor, "tokenizer", processor), "pad_token_id", 0) or 0)
        if task == "retrieval":
            self.loss_is_scaled_for_ga = False

    # ------------------------------------------------------------------ batches
    def decode_batch(self, data: Any) -> Any:
        """Rebuild every wire-form dict and every plain feature dict (has ``input_ids``) in
        ``data`` (nested dicts / lists) as a validated :class:`RaggedBatch` on ``args.device``;
        other values pass through. Raises ``ValueError`` naming the broken invariant."""
        if isinstance(data, RaggedBatch):
            return data.to(self.args.device)
        if is_wire(data):
            return unpack(data, self.layout, token_ids=self.token_ids, pad_token_id=self.pad_token_id).to(self.args.device)
        if isinstance(data, Mapping) and "input_ids" in data:
            return RaggedBatch.from_features(data, self.layout, token_ids=self.token_ids).to(self.args.device)
        if isinstance(data, Mapping):
            return {k: self.decode_batch(v) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(self.decode_batch(v) for v in data)
        return data

    def _prepare_inputs(self, inputs: Any) -> Any:
        return self._prepare_input(self.decode_batch(inputs))

    def _prepare_input(self, data: Any) -> Any:
        if isinstance(data, RaggedBatch):
            return data.to(self.args.device)
        return super()._prepare_input(data)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        # Decode before the Trainer counts label tokens: wire labels are flat per batch.
        return super().get_batch_samples(map(self.decode_batch, epoch_iterator), num_batches, device)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        if self.args.n_gpu <= 1 or not batch_samples or "labels" not in batch_samples[0]:
            return super()._get_num_items_in_batch(batch_samples, device)
        # RaggedDataParallel: one process, exact count (the Trainer would divide it by n_gpu).
        return sum(int(b["labels"][..., 1:].ne(-100).sum()) for b in batch_samples)

    def _get_collator_with_removed_columns(self, data_collator, description: str | None = None):
        return data_collator  # ragged collators choose their own fields; never drop columns

    def _remove_unused_columns(self, dataset, description: str | None = None):
        return dataset

    def get_train_dataloader(self):
        return install_ragged_dispatch(super().get_train_dataloader(), self.layout, self.token_ids)

    def get_eval_dataloader(self, eval_dataset=None):
        return install_ragged_dispatch(super().get_eval_dataloader(eval_dataset), self.layout, self.token_ids)

    # ------------------------------------------------------------------ model wrapping
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
        if self.args.n_gpu > 1 and not quantized and not isinstance(model, nn.DataParallel):
            model = RaggedDataParallel(model, layout=self.layout, token_ids=self.token_ids)
        return super()._wrap_model(model, training, dataloader)

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
        step = grad_cache_step(model, inputs["queries"], inputs["docs"], lambda q, d: self.retrieval_loss(q, d) * scale,
                               budget=self.grad_cache_budget, autocast=self.autocast_smart_context_manager())
        return step.loss.detach()

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch=None):
        inputs = self.decode_batch(inputs)
        if self.task == "retrieval":
            if isinstance(model, RaggedDataParallel):  # scatter each side by whole samples
                q, d = model(inputs["queries"]), model(inputs["docs"])
            else:
                q, d = model(queries=inputs["queries"], docs=inputs["docs"])
            loss = self.retrieval_loss(q, d)
            return (loss, {"queries": q, "docs": d}) if return_outputs else loss
        return self._sft_loss(model, inputs, return_outputs, num_items_in_batch)

    def _sft_loss(self, model: nn.Module, batch: RaggedBatch, return_outputs: bool, num_items_in_batch):
        if not isinstance(batch, RaggedBatch) or "labels" not in batch:
            raise ValueError("task='sft' needs batches from raggedvl.hf.SFTCollator (a ragged batch with labels)")
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
        """Evaluation: the loss only (retrieval metrics live in ``raggedvl.train.evaluate``)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)  # sft: this process's token mean (no num_items_in_batch)
        return loss.detach(), None, None
