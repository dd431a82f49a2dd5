"""The retrieval loss through RaggedTrainer equals raggedvl's own training loop
(raggedvl.app.loop.Trainer) for the same seed, weights and data."""

import copy

import pytest

from raggedvl.hf import RaggedTrainer, RetrievalWireCollator
from raggedvl.parallel.runtime import init_distributed
from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import Trainer
from tests.hf.helpers import training_args

pytestmark = pytest.mark.slow


def test_trainer_loss_equals_the_raggedvl_loop_on_the_same_batch(tmp_path, small_data_cache):
    cfg = TrainConfig(max_train_samples=16, max_eval_samples=8, global_batch_size=4, max_steps=1,
                      eval_before=False, eval_after=False, output_dir=str(tmp_path / "run"),
                      data_cache=str(small_data_cache))
    loop = Trainer(cfg, init_distributed())  # one process: the model is not wrapped
    indices = next(iter(loop.c.sampler))
    examples = [loop.c.train_set[i] for i in indices]
    hf_model = copy.deepcopy(loop.c.model)  # the same seeded initial weights, before the loop steps

    trainer = RaggedTrainer(hf_model, training_args(tmp_path / "hf"), processor=loop.c.processor)
    inputs = trainer._prepare_inputs(RetrievalWireCollator(loop.c.collate)(examples))
    hf_loss = float(trainer.compute_loss(hf_model, inputs).detach())
    loop_loss = loop.train_step(loop.c.collate(examples)).loss

    assert len(indices) == 4
    assert hf_loss == pytest.approx(loop_loss, rel=1e-6, abs=1e-7)
