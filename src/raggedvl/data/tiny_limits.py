"""The tiny preset's page budgets, declared in one place (no torch: the command line's config
reads them before any process starts).

- ``TINY_MIN_PIXELS`` / ``TINY_MAX_PIXELS``: the tiny processor's defaults
  (``build_processor("tiny")``): 3,136 to 200,704 pixels, i.e. 16 to 1,024 patch rows, 4 to
  256 visual tokens per image;
- ``TINY_TRAIN_MAX_PIXELS``: what ``raggedvl train`` gives the tiny model when ``--max-pixels``
  is not set: 100,352 pixels, at most 128 visual tokens per page (docs/tiny-model.md says why).
"""

TINY_MIN_PIXELS = 56 * 56
TINY_MAX_PIXELS = 448 * 448
TINY_TRAIN_MAX_PIXELS = 100_352
