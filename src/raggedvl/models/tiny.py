"""The tiny preset's backbone config: a small randomly initialised model of any registered
family (``raggedvl.families``), built from a config (no download).

Its vocab size and special-token ids (image, video, vision start/end, pad) come from the
tokenizer the data package builds, so that token ids and embedding rows always agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from raggedvl.families import family_of


@dataclass(frozen=True)
class TinySizes:
    """Sizes and initialisation of the tiny preset (defaults: Qwen2-VL, ~0.55 M parameters
    plus the embedding table, vocab x hidden_size).

    ``initializer_range`` is the std of every Linear/Embedding weight at init. transformers'
    default 0.02 makes a tiny random backbone collapse (all documents embed to one vector, see
    docs/tiny-model.md); 0.1 keeps token representations distinct.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vision_depth: int = 2
    vision_embed_dim: int = 64
    vision_heads: int = 4
    initializer_range: float = 0.1

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "vision_depth", "vision_embed_dim", "vision_heads"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"TinySizes.{name} must be positive, got {getattr(self, name)}")
        head_dim = self.hidden_size // self.num_heads
        if self.hidden_size % self.num_heads or head_dim % 8:
            raise ValueError(
                f"TinySizes: hidden_size {self.hidden_size} / num_heads {self.num_heads} must give an "
                f"integer head_dim divisible by 8 (mRoPE splits it in 3 sections); got {head_dim}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinySizes: num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.vision_embed_dim % self.vision_heads or (self.vision_embed_dim // self.vision_heads) % 4:
            raise ValueError(
                f"TinySizes: vision_embed_dim {self.vision_embed_dim} / vision_heads {self.vision_heads} "
                f"must give an integer head dim divisible by 4 (2-D rotary embedding)"
            )
        if self.initializer_range <= 0:
            raise ValueError(f"TinySizes.initializer_range must be > 0, got {self.initializer_range}")


TINY_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Families with a tiny preset."""

SPECIAL_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """Vocab size, pad id and Qwen-VL special-token ids read from a tokenizer.

    Raises ``ValueError`` naming the missing token when the tokenizer lacks one of
    ``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``, ``<|vision_end|>`` or a pad token.
    """
    ids: dict[str, int] = {}
    unk = getattr(tokenizer, "unk_token_id", None)
    for key, token in SPECIAL_TOKENS.items():
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or (unk is not None and tid == unk):
            raise ValueError(
                f"tokenizer has no {token} token; build the tiny processor with "
                f"raggedvl.data.build_processor('tiny') or add the Qwen-VL special tokens"
            )
        ids[key] = int(tid)
    pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError("tokenizer has no pad token; set tokenizer.pad_token (e.g. '<|endoftext|>')")
    ids["pad_token_id"] = int(pad)
    ids["vocab_size"] = max(len(tokenizer), max(ids.values()) + 1)
    return ids


def tiny_backbone_config(tokenizer: Any, family: str = "qwen2_vl", sizes: TinySizes | None = None) -> PretrainedConfig:
    """A small random-init backbone config of ``family`` whose vocabulary matches ``tokenizer``.

    Raises ``ValueError`` for a family without a tiny preset (only the three Qwen-VL ones have
    one: their vision configs name their sizes differently).
    """
    fam = family_of(family)  # ValueError for an unknown name
    if fam.name not in TINY_FAMILIES:
        raise ValueError(f"no tiny preset for family {fam.name!r}; tiny presets exist for {list(TINY_FAMILIES)}")
    s = sizes or TinySizes()
    ids = special_token_ids(tokenizer)
    head_dim = s.hidden_size // s.num_heads
    half = head_dim // 2  # mRoPE sections (t, h, w) split the rotary half-dimension
    hw_sec = half * 5 // 16 if fam.name == "qwen3_vl" else half * 3 // 8  # as Qwen3-VL [24,20,20] / Qwen2-VL [16,24,24]
    mrope = [half - 2 * hw_sec, hw_sec, hw_sec]
    text = dict(
        vocab_size=ids["vocab_size"], hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        max_position_embeddings=8192, initializer_range=s.initializer_range, pad_token_id=ids["pad_token_id"],
        bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
    )
    vision: dict[str, Any] = dict(
        depth=s.vision_depth, num_heads=s.vision_heads, patch_size=fam.patch_size,
        spatial_merge_size=fam.merge_size, temporal_patch_size=fam.temporal_patch_size,
        initializer_range=s.initializer_range,
    )
    if fam.name == "qwen2_vl":
        vision.update(embed_dim=s.vision_embed_dim, hidden_size=s.hidden_size, mlp_ratio=2)
    elif fam.name == "qwen2_5_vl":
        vision.update(hidden_size=s.vision_embed_dim, intermediate_size=2 * s.vision_embed_dim,
                      out_hidden_size=s.hidden_size, fullatt_block_indexes=[s.vision_depth - 1])
    else:  # qwen3_vl
        text.update(head_dim=head_dim)
        vision.update(hidden_size=s.vision_embed_dim, intermediate_size=2 * s.vision_embed_dim,
                      out_hidden_size=s.hidden_size, num_position_embeddings=256)
    if fam.deepstack:
        vision.update(deepstack_visual_indexes=list(range(min(2, s.vision_depth))))
    return fam.config_class(
        text_config=text, vision_config=vision, initializer_range=s.initializer_range,
        **{k: ids[k] for k in SPECIAL_TOKENS},
    )
