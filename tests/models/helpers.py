"""Small offline tokenizer and input builders for the model tests.

The tokenizer is a byte-level BPE trained in memory on a few sentences, with the Qwen-VL
special tokens; inputs are built the way Qwen2VLProcessor builds them (one
<|vision_start|> + t*h*w/4 <|image_pad|> + <|vision_end|> per image, mm_token_type_ids 1 on
the placeholders), with pixel_values drawn from a seeded generator.
"""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
CORPUS = [
    "sample quantiles of a vector", "biplot of multivariate data", "writing R extensions",
    "the quick brown fox jumps over the lazy dog", "an introduction to R", "R data import and export",
]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")


def make_batch(texts, grids_per_sample, *, patch_dim=1176, seed=0, dtype=torch.float32, padding_side="right"):
    """Model inputs for samples ``texts[i]`` each preceded by images with grids ``grids_per_sample[i]``."""
    tok = tiny_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    rows, grids = [], []
    for text, sample_grids in zip(texts, grids_per_sample):
        seq = []
        for t, h, w in sample_grids:
            seq += [ids["<|vision_start|>"]] + [ids["<|image_pad|>"]] * (t * h * w // 4) + [ids["<|vision_end|>"]]
            grids.append([t, h, w])
        seq += tok(text, add_special_tokens=False)["input_ids"]
        rows.append(seq)
    L = max(len(r) for r in rows)
    pad = tok.pad_token_id
    input_ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if padding_side == "right" else slice(L - len(r), L)
        input_ids[i, sl] = torch.tensor(r)
        mask[i, sl] = 1
    batch = {"input_ids": input_ids, "attention_mask": mask,
             "mm_token_type_ids": (input_ids == ids["<|image_pad|>"]).int()}
    if grids:
        grid = torch.tensor(grids, dtype=torch.long)
        gen = torch.Generator().manual_seed(seed)
        batch["pixel_values"] = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=gen).to(dtype)
        batch["image_grid_thw"] = grid
    return batch
