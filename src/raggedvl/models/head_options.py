"""The retrieval head's choices and defaults, in one place (no torch import: the CLI's options
read them before any process starts)."""

HEADS = ("late_interaction", "bi_encoder")
POOLINGS = ("last", "mean")

DEFAULT_HEAD = "late_interaction"
DEFAULT_DIM = 128
DEFAULT_POOLING = "last"
DEFAULT_EPS = 1e-6
