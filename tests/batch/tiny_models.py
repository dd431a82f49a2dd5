"""Tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL models built from configs (no downloads), for
exactness tests.

2 text layers of width 64, a 2-block vision tower of width 32; patch and merge sizes as in the
real models (patch_dim 1176, Qwen3-VL 1536). Token ids match ``synth.SMALL_IDS``.
"""

from __future__ import annotations

import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLModel,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLModel,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLModel,
)

from .synth import SMALL_IDS, VISION_END

TEXT = dict(vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "mrope_section": [2, 3, 3]})
IDS = dict(image_token_id=SMALL_IDS.image, video_token_id=SMALL_IDS.video,
           vision_start_token_id=SMALL_IDS.vision_start, vision_end_token_id=VISION_END)


GENERATORS = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
              "qwen3_vl": Qwen3VLForConditionalGeneration}


def tiny_config(family: str = "qwen2_vl"):
    """The config of the tiny ``family`` model ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"), eager attention."""
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        cfg = Qwen2VLConfig(text_config=dict(TEXT), vision_config=vision, **IDS)
    elif family == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2,
                      window_size=56, fullatt_block_indexes=[1])
        cfg = Qwen2_5_VLConfig(text_config=dict(TEXT), vision_config=vision, **IDS)
    else:
        text = dict(TEXT, head_dim=16, rope_parameters={**TEXT["rope_parameters"], "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
        cfg = Qwen3VLConfig(text_config=text, vision_config=vision, **IDS)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(family: str = "qwen2_vl", seed: int = 0) -> torch.nn.Module:
    """A float32 eval-mode tiny base model of ``family`` (``Qwen2VLModel`` etc.), eager attention."""
    torch.manual_seed(seed)
    cls = {"qwen2_vl": Qwen2VLModel, "qwen2_5_vl": Qwen2_5_VLModel, "qwen3_vl": Qwen3VLModel}[family]
    return cls(tiny_config(family)).float().eval()


def tiny_generator(family: str = "qwen2_vl", seed: int = 0) -> torch.nn.Module:
    """A float32 eval-mode tiny ``*ForConditionalGeneration`` of ``family``, eager attention."""
    torch.manual_seed(seed)
    return GENERATORS[family](tiny_config(family)).float().eval()
