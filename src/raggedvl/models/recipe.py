"""Recommended training hyper-parameters for the tiny preset (issue 4 item 7).

The tiny preset is a randomly initialised Qwen2-VL (``TinySizes``); it cannot read, so it can
only memorise the training pairs, and that is its job: the smoke test that proves the training
system learns. Measured facts behind the numbers (``benchmarks/tiny_recipe.py``, results in
``benchmarks/results/tiny_recipe.md``):

- transformers' default init (std 0.02) collapses: the final hidden states of every token are
  ~96% one shared vector already at init (GELU/SiLU outputs have a positive mean that each
  random Linear maps to a fixed direction; RMSNorm does not centre), so all MaxSim scores are
  nearly equal; AdamW then drives the model into full collapse (mean pairwise cosine of
  documents 0.9999+, gradient norm ~1e-5, loss stuck at ln G).
- std 0.1 (``TinySizes.initializer_range``) keeps per-token differences large enough for the
  in-batch loss to act on, and with lr 1e-3 the model memorises the pairs.
- the L2-norm epsilon (1e-6, ``RetrievalHead``) only guards the gradient of a near-zero vector;
  it does not prevent collapse, the initialisation does.
- temperature 0.02 (logits = MaxSim score normalised by query length / 0.02) as in ColPali;
  a fixed temperature is what ``raggedvl.losses.LateInteractionLoss`` takes.

Note for collapse monitoring: rendered pages are mostly white, so the mean-pooled document
embeddings of even a healthy tiny model have mean pairwise cosine ~0.99; the distinguishing
signal sits in a few content tokens, which MaxSim uses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TrainingRecipe:
    """Hyper-parameters the trainer should use for a model preset (read by ``raggedvl train``).

    ``lr``: AdamW peak learning rate (linear warmup over ``warmup_steps``, cosine decay to 0 at
    ``max_steps``); ``temperature`` divides the MaxSim score; ``global_batch_size`` counts
    (query, document) pairs over all ranks; ``max_pixels`` is the image processor's budget per
    image in pixels; ``initializer_range`` is already applied by the preset's config and is
    recorded here for the report.
    """

    lr: float
    warmup_steps: int
    max_steps: int
    global_batch_size: int
    temperature: float
    weight_decay: float
    max_grad_norm: float
    max_pixels: int
    initializer_range: float
    l2_eps: float

    def to_dict(self) -> dict:
        return asdict(self)


TINY_TRAINING_DEFAULTS = TrainingRecipe(
    lr=1e-3,
    warmup_steps=10,
    max_steps=300,
    global_batch_size=8,
    temperature=0.02,
    weight_decay=0.0,
    max_grad_norm=1.0,
    max_pixels=200_704,
    initializer_range=0.1,
    l2_eps=1e-6,
)
