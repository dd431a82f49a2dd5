"""raggedvl.hf: the Hugging Face Trainer and accelerate with ragged Qwen-VL batches.

``RaggedTrainer`` (retrieval with exact cross-rank contrastive losses) and ``RaggedSFTTrainer``
(SFT with the model's causal-LM loss), over one base (``RaggedTrainerBase``), in all three
launch modes; ``RetrievalWireCollator`` / ``SFTCollator`` produce
wire-form batches (:mod:`raggedvl.batch.wire`, re-exported here) that accelerate can dispatch
by whole samples (:class:`raggedvl.parallel.RaggedDispatchSlicer`, re-exported);
``apply_generation_lora`` puts peft LoRA on a generative model's language model.
"""

from raggedvl.models.lora import apply_generation_lora

from raggedvl.batch.wire import is_wire, pack, slice_samples, unpack
from raggedvl.parallel import RaggedDispatchSlicer, install_ragged_dispatch

from .collator import IGNORE_INDEX, RetrievalWireCollator, SFTCollator
from .sft_trainer import RaggedSFTTrainer
from .trainer import RaggedTrainer, default_retrieval_loss
from .trainer_base import RaggedTrainerBase

__all__ = [
    "IGNORE_INDEX",
    "RaggedDispatchSlicer",
    "RaggedSFTTrainer",
    "RaggedTrainer",
    "RaggedTrainerBase",
    "RetrievalWireCollator",
    "SFTCollator",
    "apply_generation_lora",
    "default_retrieval_loss",
    "install_ragged_dispatch",
    "is_wire",
    "pack",
    "slice_samples",
    "unpack",
]
