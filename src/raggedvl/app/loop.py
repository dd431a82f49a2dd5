"""The training loop of ``raggedvl train``: one process per device (torchrun), DDP or FSDP2.

Per optimizer step every rank: takes its cost-balanced share of the global batch from the
sampler (per-rank sample counts may differ), encodes its queries and documents, computes the
exact cross-rank contrastive loss (documents, and queries where needed, are all-gathered with
gradient; DESIGN.md section 4) and steps. After DDP's gradient average every parameter holds
the single-process gradient of the global batch. All ranks run the same number of steps (the
sampler guarantees it). ``Trainer.run`` sequences the run's components: its record
(``raggedvl.app.run_log``), its evaluations (``raggedvl.app.dev_evaluation``) and its checkpoints
(``raggedvl.app.checkpointer``).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from raggedvl.parallel import (
    DistInfo,
    StallWatchdog,
    VisionRebalancer,
    all_gather_floats,
    barrier,
    init_distributed,
    is_distributed,
    report_failure,
    shutdown,
    unwrap_model,
    wrap_model,
)
from raggedvl.batch import RaggedBatch
from raggedvl.data.positives import EpochPositives
from raggedvl.evaluation.metrics import mean_pairwise_cosine
from raggedvl.losses import loss_with_negatives
from raggedvl.app.batches import StepIndices, default_workers, step_batches, usable_cores
from raggedvl.app.agent import as_input_error
from raggedvl.app.checkpoint import list_checkpoints
from raggedvl.app.checkpointer import Checkpointer, TrainingState
from raggedvl.app.collapse import CollapseCheck, chance_loss
from raggedvl.app.config import TRAIN_CONFIG_NAME, TrainConfig, default_warmup_steps
from raggedvl.app.dev_evaluation import DevEvaluation
from raggedvl.app.fault_injection import FAULT_ENV, inject_fault
from raggedvl.app.interrupts import ignore_sigint, peer_interrupted, restore_sigint, stop_interrupted
from raggedvl.gradcache import grad_cache_step
from raggedvl.app.preemption import PreemptionRequest, report_preempted
from raggedvl.app.report import write_summary
from raggedvl.app.progress import PADDING_KEYS, batch_padding, peak_memory_mib
from raggedvl.app.rundir import check_output_dir
from raggedvl.app.setup import (
    RunData,
    build_components,
    row_sources,
    sources_text,
    training_pairs_text,
)
from raggedvl.app.lr_schedule import make_scheduler
from raggedvl.app.startup import StartupClock
from raggedvl.app.run_log import RunLog
from raggedvl.app.wording import counted


@dataclass
class RankStep:
    """One rank's share of a step, as gathered by every rank."""

    n_local: int  # samples trained on (after on_bad_image="skip")
    encode_s: float  # host seconds of the encode (GPU work still queued is not waited for)
    skipped: int  # examples the collator dropped under on_bad_image="skip"
    negatives: int  # hard negatives encoded (rows of the collator's "negatives"; 0 without them)
    padding: dict[str, int]  # batch_padding(...) of this rank's batch
    peak_memory_mib: float  # progress.peak_memory_mib of this rank so far
    false_negatives: int  # (query, candidate) pairs of this rank's queries the loss masked (0 with keep)
    log_candidates: float  # sum over this rank's queries of ln(candidates left after masking); nan with keep
    signal_age_s: float  # seconds since this rank received SIGTERM / SIGUSR1 (raggedvl.app.preemption); -1: none

    def to_floats(self) -> list[float]:
        """The fields in declaration order (``padding`` as its ``PADDING_KEYS`` values), for one
        float64 gather; :meth:`from_floats` reads them back by field."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            out.extend(value[k] for k in PADDING_KEYS) if f.name == "padding" else out.append(value)
        return [float(v) for v in out]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> "RankStep":
        values, kwargs = list(values), {}
        for f in fields(cls):
            if f.name == "padding":
                kwargs["padding"] = {k: int(values.pop(0)) for k in PADDING_KEYS}
            else:
                value = values.pop(0)
                kwargs[f.name] = int(value) if f.type == "int" else value
        return cls(**kwargs)


@dataclass
class StepResult:
    loss: float  # the global loss: mean over ranks of L_r (the same float on every rank)
    grad_norm: float  # global L2 norm of the gradient before clipping
    step_s: float  # this rank's wall seconds, the batch's host-to-device copy to the gathered statistics
    ranks: list[RankStep]  # every rank's share, indexed by rank
    lrs: list[float]  # every parameter group's learning rate used by this step (before the scheduler stepped)
    doc_cosine: float = float("nan")  # this rank's documents: mean pairwise cosine of mean-pooled embeddings
    applied: bool = True  # False: the gradient norm was not finite, the optimizer and schedule skipped the step

    @property
    def pairs(self) -> int:
        """Query/document pairs trained on in this step, all ranks."""
        return sum(p.n_local for p in self.ranks)

    @property
    def hard_negatives(self) -> int:
        """Hard negatives in this step, all ranks: each is a candidate for every query."""
        return sum(p.negatives for p in self.ranks)

    def chance_loss(self, loss: str) -> float:
        """The loss at equal scores for this step's candidates: ``chance_loss`` of its pairs and
        hard negatives, or, where false negatives were masked, the mean over queries of
        ln(candidates left) for the softmax losses."""
        if not self.pairs:
            return math.nan
        if loss != "pairwise" and not any(math.isnan(p.log_candidates) for p in self.ranks):
            return sum(p.log_candidates for p in self.ranks) / self.pairs
        return chance_loss(loss, self.pairs, self.hard_negatives)

    @property
    def false_negatives(self) -> int:
        """(query, candidate) pairs of the global batch removed from the loss as false negatives."""
        return sum(p.false_negatives for p in self.ranks)


_NAN = float("nan")


class NonFiniteTraining(RuntimeError):
    """``max_nonfinite_steps`` steps in a row had a NaN or infinite gradient norm."""


class Trainer:
    """Owns the model, optimizer, schedule, sampler and run directory of one training run."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, data: RunData | None = None,
                 clock: StartupClock | None = None, step_hooks: Sequence[Callable[[int, int], None]] = (),
                 resume_checked: bool = False) -> None:
        """``data``: what the launcher prepared (a single-process run reuses it), else built here;
        ``clock``: the start-up phases so far. ``step_hooks``: called as ``hook(rank, step)`` before
        each optimizer step (0-based ``step`` = steps done), after the stall watchdog entered it;
        ``train`` installs ``raggedvl.parallel.faults.inject_fault`` there when ``RAGGEDVL_FAULT`` is set.
        ``resume_checked``: the launcher checked the ``--resume`` settings and printed their line."""
        self.cfg = cfg
        self.info = info
        self.resume_checked = resume_checked
        self.clock = clock or StartupClock()
        self.step_hooks = tuple(step_hooks)
        self.watchdog = StallWatchdog(info.rank, cfg.collective_timeout_s, enabled=info.world_size > 1)
        self.run_dir = Path(cfg.output_dir)
        check_output_dir(cfg)  # every rank sees the same directory: all raise, before any collective
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.c = build_components(cfg, info, data)  # its refusals (data, overlap, model) leave the output dir as it was
        if info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir / TRAIN_CONFIG_NAME)  # not config.json: transformers would read it as a model
        self.clock.add(self.c.phases_s)
        for bad in self.c.costs.skipped if info.is_main else ():  # on_bad_image="skip"; same list on every rank
            print(f"warning: skipping {bad['name']}: {bad['reason']}", file=sys.stderr, flush=True)  # the short cause
        where = getattr(self.c.train_set, "where", None)  # several datasets: each row names its own
        self.empty_query_rows = [{"dataset": where, **r} for r in getattr(self.c.train_set, "skipped_rows", [])]
        if self.empty_query_rows and info.is_main:
            print(empty_query_warning(self.empty_query_rows), file=sys.stderr, flush=True)
        if cfg.rebalance_vision and info.world_size > 1:  # before wrapping: the retriever calls it in forward
            self.c.model.set_vision_rebalancer(VisionRebalancer(timeout_s=cfg.collective_timeout_s))
        self.model = wrap_model(self.c.model.to(info.device), strategy=cfg.strategy, device=info.device,
                                shard_degree=cfg.shard_degree, timeout_s=cfg.collective_timeout_s)
        groups = unwrap_model(self.model).parameter_groups(cfg.lr, cfg.head_lr, cfg.weight_decay)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.optimizer.zero_grad(set_to_none=True)  # train_step expects none: it frees them after each step
        self.steps_per_epoch = len(self.c.sampler)
        self.total_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        self.scheduler = make_scheduler(self.optimizer, cfg, self.total_steps)
        self.collapse = CollapseCheck(chance_loss(cfg.loss, cfg.global_batch_size), cfg.collapse_patience)
        warning = warmup_warning(cfg.warmup_steps, self.total_steps, cfg.lr)
        if warning and info.is_main:
            print(warning, file=sys.stderr, flush=True)
        self.stopped_by_collapse = False
        self.step = 0
        self.epoch = 0
        self.sampler_position = (0, 0)  # (epoch, steps of it consumed) after the last trained batch
        self.step_source: str | None = None  # the source of the last trained batch (one-source batches)
        self.source_steps: dict[str, int] = {}  # steps per source in this process's run (one-source batches)
        self.skipped = 0  # examples dropped by on_bad_image="skip" on all ranks in this process's run
        self.false_negatives = 0  # (query, page) pairs the loss masked, all ranks, in this process's run
        self.nonfinite_streak = 0  # steps in a row not applied for a non-finite gradient norm
        self.preemption = PreemptionRequest()  # train() installs the signal handlers
        self.checkpoints = Checkpointer(cfg, info, self.run_dir)  # removes a killed writer's half checkpoint
        # bf16 autocast: by default on CUDA; on CPU only when asked for explicitly (slow there).
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and info.device.type == "cuda")
        self.autocast = torch.autocast(info.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        self.evaluation = DevEvaluation(cfg, info, self.c.collate,
                                        {"train": self.c.train_eval_set, "dev": self.c.eval_set}, self.autocast)

    def training_state(self) -> TrainingState:
        """What a checkpoint of this step saves (``raggedvl.app.checkpointer``)."""
        return TrainingState(self.model, self.optimizer, self.scheduler, self.c.sampler, self.c.processor,
                             self.step, self.epoch, self.sampler_position)

    # ----------------------------------------------------------------- steps
    def log(self, msg: str) -> None:
        if self.info.is_main:
            tqdm.write(msg)

    def batch_stream(self) -> Iterator[dict[str, Any]]:
        """This rank's collated batches, one per step, continuing across epochs (and after
        resume): ``cfg.data_workers`` processes (default: ``raggedvl.app.batches.default_workers``) collate ahead of the training
        (``raggedvl.app.batches``), from this call on. Sets ``sampler_position`` (what a
        checkpoint saves), ``step_source`` (its source under one-source batches, else None) and
        ``epoch`` to those of the batch just handed out."""
        cuda = self.info.device.type == "cuda"
        workers = self.cfg.data_workers
        if workers is None:
            workers = default_workers(cuda=cuda, ranks_on_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                      threads_per_rank=torch.get_num_threads(), cores=usable_cores())
        indices = StepIndices(self.c.sampler, self.epoch, with_epoch=True)
        rows = EpochPositives(self.c.train_set, self.cfg.positive_sampling, self.cfg.seed)  # each epoch's positive
        stream = step_batches(rows, self.c.collate, indices, workers=workers,
                              pin_memory=cuda)  # the workers start collating now

        def claimed() -> Iterator[dict[str, Any]]:
            for batch in stream:
                self.sampler_position = indices.positions.popleft()
                self.step_source = indices.sources.popleft()
                self.epoch = self.sampler_position[0]
                yield batch
                del batch  # not alive while the next one is collated (see run)

        return claimed()

    def train_step(self, batch: dict[str, Any]) -> StepResult:
        """One optimizer step on this rank's collated ``batch`` (``batch_stream``; the collator's
        ``queries``, ``docs`` and ``skipped``). Collective (every rank calls it): the model's and
        the loss's, then one ``all_gather_floats`` of this rank's statistics (loss share, gradient
        norm, counts, padding, memory): the step's only host sync besides the collectives."""
        t0 = time.perf_counter()
        for bad in batch.get("skipped", ()):  # on_bad_image="skip": dropped, never silently
            print(f"warning: rank {self.info.rank} skipped example {bad['id']!r}: {bad['reason']}", file=sys.stderr, flush=True)
        padding = batch_padding(batch["queries"], batch["docs"], packed=self.cfg.packing)  # on the host copy
        queries = batch["queries"].to(self.info.device, non_blocking=True)
        docs, n_docs = batch["docs"], batch["docs"].num_samples
        if batch.get("negatives") is not None:  # hard negatives: one document encode, positives first
            docs = RaggedBatch.concat([docs, batch["negatives"]])  # same length: split from one processor call
        docs = docs.to(self.info.device, non_blocking=True)

        # each query's own number of hard negatives (it differs per query and per rank; used locally, never gathered)
        keys = {} if "neg_counts" not in batch else {"neg_counts": batch["neg_counts"].to(self.info.device)}
        if self.cfg.false_negatives == "mask":  # every rank passes the same names: the keys are gathered
            keys.update({name: batch[name].to(self.info.device, non_blocking=True)
                         for name in ("doc_keys", "neg_keys", "query_keys", "relevant_keys", "relevant_counts")})
            if batch.get("negatives") is None:
                keys.pop("neg_keys")

        def loss_fn(q, d):
            return loss_with_negatives(self.c.loss, q, d, n_docs, **keys)

        self.model.train()
        t1 = time.perf_counter()
        if self.cfg.grad_cache:  # chunked encode, one loss, replayed backward (raggedvl.gradcache)
            cached = grad_cache_step(self.model, queries, docs, loss_fn, budget=self.cfg.grad_cache_budget,
                                     autocast=self.autocast)
            loss, t2 = cached.loss, t1 + cached.encode_s
            doc_cosine = None
        else:
            with self.autocast:  # one forward call per backward, as DDP expects
                q, d = self.model(queries=queries, docs=docs)
            t2 = time.perf_counter()
            loss = loss_fn(q, d)
            doc_cosine = _doc_cosine(d)
            loss.backward()
        # the norm before clipping (0: measured, not clipped); FSDP2 returns a DTensor. A tensor: read below
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm or float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        # the norm of the averaged gradient: the same value on every rank, so every rank skips alike
        applied = bool(torch.isfinite(norm))
        if applied:
            self.optimizer.step()
        # freed now, not before the next backward: the next forward's activations never sit beside
        # a full set of last step's gradients (parameter-sized; the peak is at the forward/backward turn)
        self.optimizer.zero_grad(set_to_none=True)
        lrs = self.scheduler.get_last_lr()  # the rates this step used; after step() they are the next step's
        if applied:
            self.scheduler.step()
        fn_count, fn_log = self._false_negative_stats()
        local = RankStep(
            n_local=queries.num_samples, encode_s=t2 - t1, skipped=len(batch.get("skipped", ())),
            negatives=batch["negatives"].num_samples if batch.get("negatives") is not None else 0,
            padding={k: padding[k] for k in PADDING_KEYS}, peak_memory_mib=peak_memory_mib(self.info.device),
            false_negatives=fn_count, log_candidates=fn_log, signal_age_s=self.preemption.seconds_since())
        # the device values first (no host sync before the gather), then this rank's RankStep by field
        device_values = [loss.detach(), norm.detach(), _NAN if doc_cosine is None else doc_cosine]
        stats = torch.cat([torch.stack([torch.as_tensor(v, dtype=torch.float64, device=norm.device) for v in device_values]),
                           torch.tensor(local.to_floats(), dtype=torch.float64).to(norm.device, non_blocking=True)])
        gathered = all_gather_floats(stats)
        ranks = [RankStep.from_floats(g[len(device_values):]) for g in gathered]
        # L_r = (W/N) sum of local terms, so the global loss is the mean of L_r over ranks.
        global_loss = sum(g[0] for g in gathered) / len(gathered)
        mine = gathered[self.info.rank]
        return StepResult(global_loss, mine[1], time.perf_counter() - t0, ranks, list(lrs), mine[2], applied)

    def _stop_preempted(self, signal_age_s: float) -> dict[str, Any]:
        """After the step in which some rank had received SIGTERM / SIGUSR1: a checkpoint of this
        step (unless one was just written, or ``preemption_grace_s`` has passed since the signal),
        rank 0's one line, and the summary ``{"preempted": True, ...}``. Collective."""
        cfg = self.cfg
        late = signal_age_s > cfg.preemption_grace_s
        saved = self.checkpoints.saved_step == self.step
        if not saved and not late and cfg.checkpoint_on_signal:
            self.watchdog.enter(f"writing the checkpoint of step {self.step} (preempted)")
            self.checkpoints.save(self.training_state())
            saved = True
        self.checkpoints.finish_pending()
        newest = self.checkpoints.newest()
        where = str(newest) if newest else "none"
        if late and not saved:
            what = (f"not saved: {signal_age_s:.0f} s after the signal, past --preemption-grace-s "
                    f"{cfg.preemption_grace_s:g}; last checkpoint: {where}")
        elif not saved:
            what = f"not saved (--checkpoint-on-signal false); last checkpoint: {where}"
        else:
            what = f"checkpoint: {where}"
        line = f"raggedvl: preempted at step {self.step} ({self.preemption.name} after {signal_age_s:.0f} s); {what}"
        line += "; resume with --resume" if newest else ""
        if self.info.is_main:
            print(line, file=sys.stderr, flush=True)
            report_preempted(line)
        self.run_log.write({"event": "preempted", "step": self.step, "signal_age_s": signal_age_s,
                            "checkpoint": where if saved else None})
        self.run_log.close()
        barrier()
        return {"preempted": True, "step": self.step, "checkpoint": where if newest else None}

    def _count_nonfinite(self, r: StepResult) -> None:
        """Counts steps in a row whose gradient norm was not finite (not applied; the same verdict
        on every rank); raises ``NonFiniteTraining`` on every rank at ``max_nonfinite_steps``."""
        if r.applied:
            self.nonfinite_streak = 0
            return
        self.nonfinite_streak += 1
        cfg = self.cfg
        what = f"step {self.step}: loss {r.loss:.6g}, gradient norm {r.grad_norm:.6g}"
        if self.nonfinite_streak < cfg.max_nonfinite_steps:
            self.log(f"warning: {what}: not finite, the step was not applied "
                     f"({self.nonfinite_streak} of --max-nonfinite-steps {cfg.max_nonfinite_steps} in a row)")
            return
        raise NonFiniteTraining(
            f"{counted(self.nonfinite_streak, 'step')} in a row had a non-finite gradient (last: {what}); none was "
            "applied and "
            f"no checkpoint holds them. Likely causes: a learning rate too high (--lr {cfg.lr:g}), a temperature too "
            f"low (--temperature {cfg.temperature:g}) or bf16 overflow (--precision fp32); resume from the last "
            "checkpoint with a lower --lr")

    def _duplicates(self) -> tuple[int, int]:
        """The training set's repeated queries and pairs (``RetrievalDataset.duplicates``)."""
        find = getattr(self.c.train_set, "duplicates", None)
        return find() if callable(find) else (0, 0)

    def _false_negative_stats(self) -> tuple[int, float]:
        """The last loss call's masked pairs and sum of ln(candidates kept) over this rank's queries."""
        loss = self.c.loss.loss
        if loss.candidates_kept is None:
            return 0, _NAN
        return int(loss.false_negatives), float(torch.log(loss.candidates_kept.double()).sum())

    def _vision_balance(self) -> dict[str, Any]:
        """With --rebalance-vision: the last document encode's tower max/mean rank load before
        and after rebalancing, and the images moved (the plan is the same on every rank)."""
        plan = getattr(getattr(unwrap_model(self.model), "vision_rebalancer", None), "last_plan", None)
        if plan is None:
            return {}
        return {"vision_max_over_mean": [plan.max_over_mean_before, plan.max_over_mean_after],
                "vision_images_moved": plan.moved}

    # ----------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        cfg, info = self.cfg, self.info
        resumed = self.checkpoints.resume(self.training_state(), checked=self.resume_checked) if cfg.resume else None
        if resumed is not None:
            self.step, self.epoch, self.sampler_position = resumed.step, resumed.epoch, resumed.sampler_position
        log = self.run_log = RunLog(cfg, self.run_dir, enabled=info.is_main,
                                    resume_step=self.step if resumed else None, world_size=info.world_size,
                                    costs=self.c.costs, checkpoint_world_size=resumed.world_size if resumed else None)
        batches = self.batch_stream()  # the data workers collate the first batches during what follows
        self.watchdog.enter("in evaluation before training", watch=False)
        before = None if resumed else self.evaluation.before_training(self.model, log, self.clock)
        if info.is_main:
            pairs = training_pairs_text(cfg, self.c.costs, getattr(self.c.train_set, "part_sizes", None),
                                        self._duplicates(), row_sources(cfg, self.c.train_set))
            self.log(
                f"training {counted(self.total_steps, 'step')}, world size {info.world_size} "
                f"({run_place(info.world_size, info.backend, info.device.type)}), "
                f"global batch {cfg.global_batch_size}, {pairs}"
            )
            sources = sources_text(cfg, self.c.sampler.mixture)
            if sources:
                self.log(sources)
        log.start_loop(self.step, self.total_steps)
        group_names = [g.get("name", str(i)) for i, g in enumerate(self.optimizer.param_groups)]
        while self.step < self.total_steps:
            self.watchdog.enter(f"in step {self.step + 1}")
            batch = next(batches)
            for hook in self.step_hooks:
                hook(info.rank, self.step)
            r = self.train_step(batch)
            del batch  # free its pixel rows before the next batch is collated (with --data-workers 0, here)
            self.step += 1
            self.skipped += sum(p.skipped for p in r.ranks)
            self.false_negatives += r.false_negatives
            if self.step_source is not None:
                self.source_steps[self.step_source] = self.source_steps.get(self.step_source, 0) + 1
            log.step(self.step, self.epoch, r, clock=self.clock, group_names=group_names, skipped=self.skipped,
                     vision_balance=self._vision_balance(), source=self.step_source,
                     last=self.step == self.total_steps)
            self._count_nonfinite(r)  # after the step's record: a stop still logs it
            # the step's own chance value: its pairs and hard negatives (a last, smaller step; skipped pairs)
            chance = r.chance_loss(cfg.loss)
            warning = self.collapse.update(self.step, r.loss, r.doc_cosine, chance=chance)  # same verdict on every rank
            if warning:
                self.log(warning + ("; stopping (--stop-on-collapse)" if cfg.stop_on_collapse else
                                    "; --stop-on-collapse would stop the run here"))
                log.write({"event": "collapse", "step": self.step, "loss": r.loss, "chance": self.collapse.chance,
                           "pairs": r.pairs, "hard_negatives": r.hard_negatives,
                           "doc_cosine_rank0": r.doc_cosine, "message": warning})
                self.stopped_by_collapse = cfg.stop_on_collapse
            if self.step % cfg.checkpoint_every == 0 or self.step == self.total_steps or self.stopped_by_collapse:
                self.watchdog.enter(f"writing the checkpoint of step {self.step}")
                self.checkpoints.save(self.training_state())
                if cfg.save_best is not None:
                    self.watchdog.enter(f"evaluating step {self.step} for --save-best", watch=False)
                    self.checkpoints.save_best(self.training_state(), self.evaluation, log)
            if self.stopped_by_collapse:
                break
            signal_age = max(p.signal_age_s for p in r.ranks)  # the same on every rank
            if signal_age >= 0:
                log.close_progress()
                return self._stop_preempted(signal_age)
        log.close_progress()
        self.watchdog.enter(f"completing the checkpoint of step {self.step}")
        self.checkpoints.finish_pending()
        self.watchdog.enter("in evaluation after training", watch=False)
        after = self.evaluation.after_training(self.model)
        records = log.finish(self.step, after)
        summary: dict[str, Any] = {}
        if info.is_main:
            summary = write_summary(
                self.run_dir, records, before, after, self.evaluation.random_baselines(), steps=self.step,
                global_batch_size=cfg.global_batch_size, world_size=info.world_size,
                place=run_place(info.world_size, info.backend, info.device.type),
                loss=cfg.loss, on_bad_image=cfg.on_bad_image, skipped_examples=self.skipped,
                rejected_pairs=len(self.c.costs.skipped), estimated_pairs=len(self.c.costs.costs),
                notes=self._collapse_notes() + self._false_negative_notes() + self._source_notes()
                + self._empty_query_notes(),
            )
            summary.update(collapsed=self.collapse.fired, stopped_by_collapse=self.stopped_by_collapse,
                           false_negatives=self.false_negatives)
        barrier()
        return summary

    def _empty_query_notes(self) -> list[str]:
        if self.cfg.on_empty_query != "skip":
            return []
        return [f"training rows left out for an empty or non-string query (on_empty_query='skip'): "
                f"{len(self.empty_query_rows)}"]

    def _false_negative_notes(self) -> list[str]:
        if self.cfg.false_negatives == "keep":
            return ["false negatives kept as negatives (--false-negatives keep)"]
        return [f"false negatives removed from the loss (a query's own page among its candidates; "
                f"--false-negatives mask): {counted(self.false_negatives, '(query, page) pair')} in the steps this "
                "invocation "
                "trained"]

    def _source_notes(self) -> list[str]:
        if not self.source_steps:
            return []
        counts = ", ".join(f"{name} {self.source_steps.get(name, 0)}" for name in self.c.sampler.source_names)
        return [f"one-source global batches (--batch-sampling one-source), steps per source in this invocation: {counts}"]

    def _collapse_notes(self) -> list[str]:
        chance = f"the loss sat at its chance value {self.collapse.chance:.4f}"
        if self.stopped_by_collapse:
            return [f"STOPPED at step {self.step} of {self.total_steps}: {chance} (collapse; --stop-on-collapse)"]
        if self.collapse.fired:
            return [f"WARNING: {chance} for {counted(self.collapse.patience, 'step')} in a row (collapse); see "
                    "metrics.jsonl "
                    "event 'collapse'"]
        return []


def run_place(world_size: int, backend: str, device_type: str) -> str:
    """Where a run ran, for its start line, ``summary.md`` and ``report.png``: ``"single process,
    cpu"`` for one process (no process group), else the backend and device type (``"gloo, cpu"``)."""
    return f"single process, {device_type}" if world_size == 1 else f"{backend}, {device_type}"


def empty_query_warning(rows: list[dict[str, Any]], shown: int = 3) -> str:
    """The one warning line for the training rows ``on_empty_query="skip"`` left out (a
    dataset's ``skipped_rows``: ``row``, ``id``, and with several datasets ``dataset``): their
    count and the first ``shown`` of them."""
    def name(r: dict[str, Any]) -> str:
        return (f"{r['dataset']} " if r.get("dataset") else "") + f"row {r['row']} (id {r['id']!r})"

    more = f" and {len(rows) - shown} more" if len(rows) > shown else ""
    return (f"warning: left out {counted(len(rows), 'training row')} with an empty or non-string "
            f"query (--on-empty-query skip): {', '.join(name(r) for r in rows[:shown])}{more}")


def warmup_warning(warmup_steps: int | None, total_steps: int, lr: float) -> str | None:
    """The one-line warning for a given ``--warmup-steps`` the run cannot hold (``warmup_steps >
    total_steps - 1``; ``make_scheduler`` then cuts it to ``total_steps - 1``, so the learning rate
    rises for the whole run, reaches its peak ``lr`` only at the last step and never decays), with
    the numbers and the fix (the default warmup for this many steps); None when the warmup fits or
    is not given (None: the default fits every run). A 1-step run has no warmup: its step runs at
    the peak ``lr``; in a 2-step run only no warmup (0) decays."""
    cut = max(0, total_steps - 1)
    if warmup_steps is None or warmup_steps <= cut:
        return None
    if total_steps == 1:
        return (f"warning: --warmup-steps {warmup_steps} does not fit in a 1-step run: its one step runs at the peak "
                f"learning rate (--lr {lr:g}), with no warmup; for a warmup, pass more --max-steps")
    return (f"warning: --warmup-steps {warmup_steps} does not fit in this run's {total_steps} steps (at most "
            f"{cut}): the warmup is cut to {counted(cut, 'step')}, so the learning rate rises for the whole run, "
            "reaches its "
            f"peak (--lr {lr:g}) only at the last step and never decays; for a warmup then a decay, leave out "
            f"--warmup-steps (the default for {counted(total_steps, 'step')}: {default_warmup_steps(total_steps)}) "
            "or pass more --max-steps")


def _doc_cosine(docs) -> torch.Tensor:
    """Mean pairwise cosine of this rank's documents' mean-pooled embeddings, a 0-dim float64
    tensor on their device (NaN for one document; not read here: no host sync); ``docs`` is
    the model's document ``EmbeddingOutput``. No collective."""
    with torch.no_grad():
        emb = docs.embeddings.detach()
        if docs.mask is not None:  # multi-vector: mean over each document's real tokens
            mask = docs.mask.unsqueeze(-1).to(emb.dtype)
            emb = (emb * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return mean_pairwise_cosine(emb, as_tensor=True)


def release_wrapped_model(trainer: Trainer) -> None:
    """Free ``trainer``'s DDP / FSDP2 wrapper while the process group is still registered.
    DDP's reducer holds a reference to the group; freed after ``destroy_process_group`` it is
    the last one, and ``~ProcessGroupGloo`` then joins gloo's threads while holding the GIL
    that a finishing gloo work item waits for: the rank hangs after its summary (seen once in
    33 two-process runs; pytorch/pytorch#56297). Freed here, ``destroy_process_group`` drops
    the group's last reference itself."""
    trainer.model = None
    if is_distributed():
        gc.collect()  # DDP's wrapper sits in reference cycles (its hooks)


def train(cfg: TrainConfig, *, data: RunData | None = None, clock: StartupClock | None = None,
          resume_checked: bool = False) -> dict[str, Any]:
    """Run one training job in this process (one rank of a torchrun job, or a single process).

    ``data``: what the launcher prepared (``raggedvl.app.setup.prepare_run_data``), reused by a
    single-process run; ``clock``: the start-up phases so far (``metrics.jsonl``'s ``startup``);
    ``resume_checked``: the launcher checked the ``--resume`` settings and printed their line.

    Every collective is bounded by ``cfg.collective_timeout_s`` seconds. When this rank fails
    (its own error, or a collective that failed or timed out because a peer failed), it prints
    ``raggedvl: rank R failed in step S: ...`` plus any note a peer left, aborts the process
    group so peers fail fast, and re-raises (parallel/faults.py lists each situation).

    Ctrl-C (``KeyboardInterrupt`` on any rank, or a peer's interruption note after a failed
    collective): further SIGINTs are ignored until it returns, rank 0 prints ``raggedvl:
    interrupted at step S; last checkpoint: PATH; resume with --resume`` (or ``none``), the
    process group is torn down, and ``TrainingInterrupted`` (a ``KeyboardInterrupt``) is raised
    (``raggedvl.app.interrupts``)."""
    info = init_distributed(timeout_s=cfg.collective_timeout_s)
    trainer = None
    sigint = None  # the SIGINT handler to restore after an interruption
    preemption = PreemptionRequest().install()  # a SIGTERM during setup is acted on after the first step
    try:
        try:
            trainer = Trainer(cfg, info, data, clock, step_hooks=(inject_fault,) if os.environ.get(FAULT_ENV) else (),
                              resume_checked=resume_checked)
            trainer.preemption = preemption
            return trainer.run()
        except Exception as exc:
            if info.world_size > 1 and peer_interrupted(info.rank):  # a peer's Ctrl-C ended the group, no failure
                raise KeyboardInterrupt from exc
            if info.world_size > 1:
                report_failure(info.rank, trainer.watchdog.phase if trainer else "during setup", exc)
                if trainer is None and isinstance(exc, ValueError):  # bad input: the agent's line says so
                    as_input_error(exc)
            raise
    except KeyboardInterrupt:
        sigint = ignore_sigint()
        if trainer is not None:
            trainer.watchdog.stop()
        newest = list_checkpoints(Path(cfg.output_dir) / "checkpoints")  # complete ones (written atomically)
        raise stop_interrupted(info.rank, trainer.step if trainer else None, newest[0] if newest else None) from None
    finally:
        preemption.uninstall()
        if trainer is not None:
            trainer.watchdog.stop()
            release_wrapped_model(trainer)
        shutdown()
        if sigint is not None:
            restore_sigint(sigint)
