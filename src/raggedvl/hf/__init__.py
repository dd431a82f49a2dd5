"""raggedvl.hf: the Hugging Face Trainer and accelerate with ragged Qwen-VL batches.

``RaggedTrainer`` (retrieval with exact cross-rank contrastive losses, or SFT with the model's
causal-LM loss) in all three launch modes; ``RetrievalWireCollator`` / ``SFTCollator`` produce
wire-form batches (``raggedvl.hf.wire``) that accelerate can dispatch by whole samples;
``apply_generation_lora`` puts peft LoRA on a generative model's language model.
"""

from raggedvl.models.lora import apply_generation_lora

from .collator import IGNORE_INDEX, RetrievalWireCollator, SFTCollator
from .dispatch import install_ragged_dispatch, ragged_slice_fn
from .trainer import RaggedTrainer, default_retrieval_loss
from .wire import is_wire, pack, slice_samples, unpack

__all__ = [
    "IGNORE_INDEX",
    "RaggedTrainer",
    "RetrievalWireCollator",
    "SFTCollator",
    "apply_generation_lora",
    "default_retrieval_loss",
    "install_ragged_dispatch",
    "is_wire",
    "pack",
    "ragged_slice_fn",
    "slice_samples",
    "unpack",
]
