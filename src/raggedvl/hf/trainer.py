"""``RaggedTrainer``: the HF ``Trainer`` with ragged Qwen-VL batches and exact contrastive losses.

Shape legend: B samples on this process, N = sum of B over processes, W processes, L tokens,
D embedding dim.

Three launch modes, one script:

- ``python train.py`` on several GPUs: the Trainer would wrap the model in ``nn.DataParallel``
  (even chunking cuts patches away from grids, case C01); here it is
  :class:`raggedvl.parallel.RaggedDataParallel` (whole samples per replica, cost-balanced).
- accelerate ``dispatch_batches`` (the default for an ``IterableDataset``): batches travel in
  wire form (:mod:`raggedvl.batch.wire`) and are sliced by whole samples
  (:mod:`raggedvl.parallel.dispatch`, case C03).
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

Repeated samples: when the dataset size is not a multiple of W x per-device batch, accelerate
completes the epoch's last batch with samples from the start of the epoch (``even_batches``;
an ``IterableDataset``'s dispatcher likewise). Each batch is marked as it leaves the
dataloader (:func:`raggedvl.parallel.real_sample_mask`, before the Trainer counts label tokens):
retrieval batches carry ``valid`` [B] bool, which the loss uses to drop the repeats on every
process (never a query nor a negative; N counts the real samples); SFT batches get ``-100``
labels on the repeats, so ``num_items_in_batch`` and the loss count real tokens only. The
logged loss and every gradient are those of the real global batch, with gradient
accumulation, GradCache steps and ``dataloader_drop_last=False`` alike. Evaluation returns,
on every process, the loss of each step's real global batch, which accelerate's
``gather_for_metrics`` weights by the step's real samples (for an ``IterableDataset`` read by
every process, ``dispatch_batches=False``, accelerate miscounts them and the last step weighs
a full batch; its loss is still real). A configuration whose repeats cannot be told apart (an
``IterableDataset`` without ``__len__`` under ``dispatch_batches=False``) raises
``ValueError`` before training.

Failures (as in ``raggedvl train``, :mod:`raggedvl.parallel.faults`): every collective of the
process group is bounded by ``collective_timeout_s`` (default ``args.ddp_timeout``); during
``train()`` / ``evaluate()`` a watchdog names a process that spends more than half of it in one
step (``raggedvl: rank R has spent X s in step S ...``, with its stack, left as a note in the
group's store), and a process whose call fails prints ``raggedvl: rank R failed in step S: ...``
followed by its peers' notes, aborts the group so peers fail fast, and re-raises.

Collectives: the losses' all-gathers (retrieval), one all-reduce per evaluation step, and
accelerate's own (dispatch broadcast, DDP all-reduce, token-count gather).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn
from transformers import Trainer

from raggedvl.batch import RaggedBatch
from raggedvl.gradcache import grad_cache_step
from raggedvl.losses import RetrievalLoss, make_retrieval_loss
from raggedvl.batch.wire import NUM_TOKENS, is_wire, unpack
from raggedvl.families import processor_batch_format
from raggedvl.models import Retriever, install_dummy_vision, install_linear_patch_embed
from raggedvl.models.retriever import is_saved_retriever
from raggedvl.models.weights import write_json
from raggedvl.parallel import (
    RaggedDataParallel,
    StallWatchdog,
    check_repeats_identifiable,
    install_ragged_dispatch,
    real_sample_mask,
    report_failure,
    set_collective_timeout,
)

from .collator import IGNORE_INDEX

TASKS = ("retrieval", "sft")


def default_retrieval_loss(model: nn.Module, temperature: float = 0.02) -> RetrievalLoss:
    """The late-interaction loss for a late-interaction retriever, InfoNCE for a bi-encoder
    (:func:`raggedvl.losses.make_retrieval_loss`)."""
    head = getattr(getattr(model, "config", None), "head", "late_interaction")
    return make_retrieval_loss("infonce" if head == "bi_encoder" else "late_interaction", temperature=temperature)


def _num_samples(data: Any) -> int | None:
    """Samples in a collated batch: a wire dict, a feature dict, a ragged batch, or a dict of them."""
    if is_wire(data):
        return int(data[NUM_TOKENS].shape[0])
    if isinstance(data, RaggedBatch):
        return data.num_samples
    if isinstance(data, Mapping) and "input_ids" in data:
        return int(data["input_ids"].shape[0])
    if isinstance(data, Mapping):
        return next((n for n in map(_num_samples, data.values()) if n is not None), None)
    return None


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
        collective_timeout_s: seconds after which any collective of the process group fails
            (default ``args.ddp_timeout``, which accelerate applied when it created the group);
            given, it is applied to the existing default group.
        expected_modalities: for ``task="sft"``, the vision inputs any process may see ("image",
            "video"); :func:`raggedvl.models.install_dummy_vision` makes every forward call the
            vision tower once per modality, with a zero-weight dummy input where the batch has
            none, so a process with text-only samples neither hangs DDP (which runs without
            ``find_unused_parameters`` under activation checkpointing) nor crosses FSDP's
            parameter gathers. A retriever carries its own (``RetrieverConfig``). With
            ``model_init`` instead of ``model``, call ``install_dummy_vision`` in it. The model's
            patch embedding becomes a matrix product (:func:`raggedvl.models.install_linear_patch_embed`:
            same weights, outputs equal to float32 rounding, 2.6-4.4x faster than the Conv3d on
            CPU); a retriever has it already;
            with ``model_init``, call it there too.
        false_negatives: retrieval only: "mask" (default) removes a candidate page that is one of
            the query's own pages (the batch's ``doc_keys`` / ``query_keys`` from
            :class:`~raggedvl.hf.RetrievalWireCollator`, on every process) from that query's
            softmax denominator, as ``raggedvl train`` does; "keep" scores every other page as a
            negative.

    Raises ``ValueError`` for an unknown task, a loss of the wrong kind or with parameters, a
    non-positive timeout, and for ``grad_cache_budget`` with SFT, below 1, with fp16 loss
    scaling or with ``RaggedDataParallel`` (several GPUs in one process: use torchrun).
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, *, processor: Any, task: str = "retrieval",
                 loss: nn.Module | None = None, grad_cache_budget: int | None = None,
                 collective_timeout_s: float | None = None, expected_modalities: Sequence[str] = ("image",),
                 false_negatives: str = "mask", **kwargs: Any) -> None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        if false_negatives not in ("mask", "keep"):
            raise ValueError(f"false_negatives must be 'mask' or 'keep', got {false_negatives!r}")
        if collective_timeout_s is not None and not collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0 seconds, got {collective_timeout_s}")
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
            if model is not None:  # before the Trainer wraps it (DDP / FSDP)
                install_dummy_vision(model, expected_modalities)
                install_linear_patch_embed(model)  # same weights, the Conv3d as a matrix product
        if args is not None and getattr(args, "ddp_find_unused_parameters", False) is None:
            # every parameter takes part in every forward (the dummy vision pass runs the tower on
            # processes without images): DDP's search for unused ones is an autograd walk per step
            args.ddp_find_unused_parameters = False
        super().__init__(model=model, args=args, **kwargs)
        self.task = task
        self.processor = processor
        self.retrieval_loss = loss
        self.grad_cache_budget = grad_cache_budget
        self.false_negatives = false_negatives
        self.layout, self.token_ids = processor_batch_format(processor)
        self.pad_token_id = int(getattr(getattr(processor, "tokenizer", processor), "pad_token_id", 0) or 0)
        if task == "retrieval":
            self.loss_is_scaled_for_ga = False
        if collective_timeout_s is not None:
            set_collective_timeout(collective_timeout_s)
        self.collective_timeout_s = float(collective_timeout_s or self.args.ddp_timeout)
        self._watchdog: StallWatchdog | None = None
        self._eval_tokens: torch.Tensor | None = None  # SFT evaluation: (loss sum, label tokens) so far

    # ------------------------------------------------------------------ failures
    @contextlib.contextmanager
    def _watched(self, phase: str) -> Iterator[None]:
        """Run a top-level call under the stall watchdog; report and abort if it raises (module
        docstring). Nested calls (evaluation inside ``train()``) only rename the phase."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        outer = self._watchdog is None
        if outer:
            self._watchdog = StallWatchdog(rank, self.collective_timeout_s, enabled=world > 1)
        previous = self._watchdog.phase
        self._watchdog.enter(phase)
        try:
            yield
        except Exception as exc:
            if outer and world > 1:
                report_failure(rank, self._watchdog.phase, exc)
            raise
        finally:
            if outer:
                self._watchdog.stop()
                self._watchdog = None
        if not outer:
            self._watchdog.enter(previous)

    def train(self, *args: Any, **kwargs: Any):
        with self._watched("before the first step"):
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        with self._watched(f"in evaluation after step {self.state.global_step}"):
            return super().evaluate(*args, **kwargs)

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

    def mark_real_samples(self, data: Any) -> Any:
        """Mark the repeats of the batch the active dataloader just yielded (module docstring):
        retrieval dicts get ``valid`` [B] bool, SFT batches IGNORE_INDEX labels on the repeats.
        Must run before the next batch is requested. No collective."""
        n = _num_samples(data)
        if n is None:
            return data
        valid = real_sample_mask(self.accelerator.gradient_state.active_dataloader, n,
                                 rank=self.accelerator.process_index, world_size=self.accelerator.num_processes)
        if self.task == "retrieval":
            return {**data, "valid": valid} if isinstance(data, Mapping) else data
        return data if bool(valid.all()) else _ignore_labels_of(data, valid)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        if self._watchdog is not None:
            self._watchdog.enter(f"in step {self.state.global_step + 1}")
        # Mark and decode each batch as it arrives, before the Trainer counts label tokens
        # (wire labels are flat per batch; the next batch changes the loader's end-of-data state).
        batches = (self.decode_batch(self.mark_real_samples(b)) for b in epoch_iterator)
        return super().get_batch_samples(batches, num_batches, device)

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
        loader = install_ragged_dispatch(super().get_train_dataloader(), self.layout, self.token_ids)
        check_repeats_identifiable(loader, self.accelerator.num_processes)
        return loader

    def get_eval_dataloader(self, eval_dataset=None):
        loader = install_ragged_dispatch(super().get_eval_dataloader(eval_dataset), self.layout, self.token_ids)
        check_repeats_identifiable(loader, self.accelerator.num_processes)
        return loader

    # ------------------------------------------------------------------ model wrapping
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
        if self.args.n_gpu > 1 and not quantized and not isinstance(model, nn.DataParallel):
            model = RaggedDataParallel(model, layout=self.layout, token_ids=self.token_ids)
        return super()._wrap_model(model, training, dataloader)

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
        if self.task == "retrieval":
            if isinstance(model, RaggedDataParallel):  # scatter each side by whole samples
                q, d = model(inputs["queries"]), model(inputs["docs"])
            else:
                q, d = model(queries=inputs["queries"], docs=inputs["docs"])
            loss = self.retrieval_loss(q, d, valid=inputs.get("valid"), **self._keys(inputs))
            return (loss, {"queries": q, "docs": d}) if return_outputs else loss
        return self._sft_loss(model, inputs, return_outputs, num_items_in_batch)

    def _keys(self, inputs: Any) -> dict[str, torch.Tensor]:
        """The false-negative keys of a retrieval batch for the loss (none with ``keep``)."""
        if self.false_negatives != "mask" or not isinstance(inputs, Mapping) or "doc_keys" not in inputs:
            return {}
        return {k: inputs[k] for k in ("doc_keys", "query_keys") if k in inputs}

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
        """Evaluation: the loss of this step's real global batch, the same value on every process
        (retrieval metrics: ``raggedvl.evaluate_benchmark``). Retrieval: the mean of the
        processes' shares ``L_r``; SFT: the token mean over every process's real label tokens.
        The Trainer repeats it per sample and ``gather_for_metrics`` keeps the real samples'
        copies, so the evaluation loss weights each step by its real samples. One all-reduce."""
        inputs = self._prepare_inputs(self.mark_real_samples(inputs))
        with torch.no_grad():
            if self.task == "retrieval" or isinstance(model, RaggedDataParallel):
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
        """The Trainer's loop; for SFT the loss it reports is the token mean over every real label
        token of the evaluation set (the training loss's normalisation), whatever the batch size
        and the number of processes, instead of the mean of per-step token means weighted by
        samples. The sums are all-reduced in each step, so every process reports the same value."""
        self._eval_tokens = torch.zeros(2, dtype=torch.float64) if self.task == "sft" else None
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            key = f"{metric_key_prefix}_loss"
            if self._eval_tokens is not None and self._eval_tokens[1] > 0 and key in output.metrics:
                output.metrics[key] = float(self._eval_tokens[0] / self._eval_tokens[1])
            return output
        finally:
            self._eval_tokens = None
