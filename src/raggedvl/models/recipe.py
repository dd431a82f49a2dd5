"""Recommended training hyper-parameters for the tiny preset (issue 4 item 7).

The tiny preset is a randomly initialised Qwen2-VL (``TinySizes``); it cannot read, so it can
only memorise the training pairs, and that is its job: the smoke test that proves the training
system learns. Measured on 256 rdocs train pairs, global batch 8, in-batch negatives, MaxSim
normalised by query length, temperature 0.02 (``benchmarks/tiny_recipe.py``; figures in
``benchmarks/results/tiny_recipe.md``):

- transformers' default init (std 0.02) with one learning rate of 5e-4..1e-3 (colpali's recipe)
  collapses within ~25 steps: documents become indistinguishable (mean pairwise cosine of
  mean-pooled document embeddings 0.9999-1.0000), the gradient norm falls to ~1e-5 and the
  loss sits at ln 8. The collapse is an attractor: with random features a low-temperature
  softmax scores worse than uniform, and the quickest way down is to make every score equal.
  Rendered pages are mostly white, so ~99% of the vision features are one shared vector from
  the start, which makes the attractor close.
- Init std 0.1 (``TinySizes.initializer_range``) widens the per-token differences, but a
  backbone learning rate of 5e-4 or more still collapses (both the vision tower, whose
  features become 99.9% one vector, and, with the tower frozen, the language model).
  Temperature 0.05 or 0.1 does not help (0.1 collapsed fastest).
- What learns without collapsing: init 0.1, backbone lr 2e-4 and a 10x larger lr (2e-3) for
  the projection head (``Retriever.parameter_groups``), images at most 100,352 pixels (128
  visual tokens per page: fewer white tokens per page, and ~2x faster steps than 200k).
- The L2-norm epsilon (1e-6, ``RetrievalHead``) only keeps the gradient finite for a
  near-zero vector; it neither causes nor prevents collapse.

Collapse monitoring: because pages are mostly white, the mean-pooled document embeddings of
a healthy tiny model still have mean pairwise cosine 0.96-0.999; a collapsed one reads
0.9999-1.0000 with a gradient norm below 1e-4.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TrainingRecipe:
    """Hyper-parameters the trainer should use for a model preset (read by ``raggedvl train``).

    ``lr``: AdamW peak learning rate of the backbone; ``head_lr``: that of the projection head
    (``Retriever.parameter_groups(lr, head_lr)``); linear warmup over ``warmup_steps``, cosine
    decay to 0 at ``max_steps``. ``global_batch_size`` counts (query, document) pairs over all
    ranks; ``max_train_samples`` the train pairs used; ``temperature`` divides the MaxSim
    score; ``max_pixels`` is the image processor's budget per image, in pixels;
    ``initializer_range`` is already applied by the preset's config (recorded for the report).
    """

    lr: float
    head_lr: float
    warmup_steps: int
    max_steps: int
    global_batch_size: int
    max_train_samples: int
    temperature: float
    weight_decay: float
    max_grad_norm: float
    max_pixels: int
    initializer_range: float
    l2_eps: float

    def to_dict(self) -> dict:
        return asdict(self)


TINY_TRAINING_DEFAULTS = TrainingRecipe(
    lr=2e-4,
    head_lr=2e-3,
    warmup_steps=10,
    max_steps=600,
    global_batch_size=8,
    max_train_samples=256,
    temperature=0.02,
    weight_decay=0.0,
    max_grad_norm=1.0,
    max_pixels=100_352,
    initializer_range=0.1,
    l2_eps=1e-6,
)
