"""A small ``RaggedTrainer`` retrieval job for ``tests/dist/test_hf_faults.py``, run under torchrun.

``python -m torch.distributed.run --nproc_per_node 2 -m tests.dist.hf_fault_job TIMEOUT_S OUT_DIR``
trains the tiny retriever for 4 steps on 16 synthetic pairs with ``collective_timeout_s=TIMEOUT_S``;
``RAGGEDVL_FAULT=KIND:RANK:STEP`` (see ``raggedvl.parallel.faults.inject_fault``, installed here
as a ``TrainerCallback`` at the start of each step) makes one process fail.
"""

import sys

from transformers import TrainerCallback

from raggedvl.app.fault_injection import inject_fault


class InjectFault(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        inject_fault(args.process_index, state.global_step)


# printed by process 0 once every process built its trainer: start-up is over (tests/jobs.py)
READY = "hf_fault_job: every process is ready"


def main(timeout_s: float, out_dir: str) -> None:
    from raggedvl.data import RetrievalCollator
    from raggedvl.hf import RaggedTrainer, RetrievalWireCollator
    from tests.hf.helpers import retrieval_examples, tiny_processor, tiny_retriever, training_args

    proc = tiny_processor()
    trainer = RaggedTrainer(tiny_retriever(), training_args(out_dir, max_steps=4), processor=proc,
                            collective_timeout_s=timeout_s, train_dataset=retrieval_examples(16),
                            data_collator=RetrievalWireCollator(RetrievalCollator(proc)), callbacks=[InjectFault()])
    trainer.accelerator.wait_for_everyone()
    if trainer.accelerator.is_main_process:
        print(READY, flush=True)
    trainer.train()


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
