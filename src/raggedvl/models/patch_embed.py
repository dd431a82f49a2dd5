"""The vision tower's patch embedding as one matrix product instead of a 3-D convolution.

Shape legend: P patch rows (``pixel_values`` rows), C channels, T frames, p pixels per patch
side, K = C * T * p * p values per row (1,176 for Qwen2-VL's 3 x 2 x 14 x 14; 1,536 for
Qwen3-VL's 16 x 16 patches), D embed dim.

Every Qwen-VL family (``PatchEmbed`` of Qwen2-VL, ``Qwen2_5_VisionPatchEmbed``,
``Qwen3VLVisionPatchEmbed``) embeds patches with ``nn.Conv3d(C, D, kernel_size=(T, p, p),
stride=(T, p, p))`` applied to the rows viewed as [P, C, T, p, p]: the kernel covers the whole
input and never slides, so the convolution is exactly ``x [P, K] @ W.view(D, K).T (+ bias)``
with the same weight tensor. The general convolution kernels are slower on this shape, the
weight gradient most (``benchmarks/patch_embed.py``, BENCHMARKS.md "Patch embedding"). Both
agree to float32 rounding (summation order only; float64 to its own rounding), so a model that runs the convolution (transformers,
colpali-engine, peft on an exported folder) gives embeddings within float32 rounding of
raggedvl's, not bit-equal. In bf16 on CPU the matrix product is the more accurate of the two
(its weight gradient is far closer to a float64 reference than the convolution's).

:func:`install_linear_patch_embed` turns such a convolution into a :class:`WholePatchConv3d`
(a ``nn.Conv3d`` subclass, the same object with the same parameters): ``state_dict`` keys,
checkpoints, ``isinstance(m, nn.Conv3d)``, DDP / FSDP2 wrapping, ``nn.DataParallel`` replicas,
pickling and peft see the module they know. An input that is not [P, C, T, p, p] goes through
the ordinary convolution. No collective; gradients reach the weight and bias as through the
convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class WholePatchConv3d(nn.Conv3d):
    """A ``nn.Conv3d`` whose kernel equals its stride, run as a matrix product on inputs
    [P, C, T, p, p] that hold exactly one kernel window each (module docstring): output
    [P, D, 1, 1, 1], as the convolution's. Any other input runs the convolution."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5 or x.shape[1] != self.in_channels or list(x.shape[2:]) != list(self.kernel_size):
            return self._conv_forward(x, self.weight, self.bias)  # nn.Conv3d.forward (TorchScript has no super())
        out = F.linear(x.flatten(1), self.weight.flatten(1), self.bias)
        return out.view(x.shape[0], self.out_channels, 1, 1, 1)


def _is_whole_patch_conv(conv: nn.Module) -> bool:
    """True for a plain ``nn.Conv3d`` (or an already switched one) whose kernel equals its
    stride, with no padding, dilation or groups: a matrix product on one-window inputs."""
    return (type(conv) in (nn.Conv3d, WholePatchConv3d) and tuple(conv.kernel_size) == tuple(conv.stride)
            and tuple(conv.padding) == (0, 0, 0) and tuple(conv.dilation) == (1, 1, 1) and conv.groups == 1)


def install_linear_patch_embed(model: nn.Module) -> int:
    """Switch the patch embedding of every Qwen-VL vision tower inside ``model`` (the ``proj``
    Conv3d of each module whose class name ends in ``PatchEmbed``) to :class:`WholePatchConv3d`
    (module docstring). Idempotent. Returns how many patch embeddings have a
    :class:`WholePatchConv3d` as their ``proj`` now; one whose ``proj`` is another module (e.g. a
    peft LoRA layer, even around a switched convolution) is left alone and not counted. Call it
    before wrapping the model for DDP / FSDP2 or compiling it."""
    switched = 0
    for module in model.modules():
        proj = getattr(module, "proj", None)
        if type(module).__name__.endswith("PatchEmbed") and proj is not None and _is_whole_patch_conv(proj):
            proj.__class__ = WholePatchConv3d
            switched += 1
    return switched
