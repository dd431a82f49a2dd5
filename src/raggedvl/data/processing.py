"""Processors: the tiny default's offline tokenizer, real checkpoints' own processors, pixel limits.

``build_processor("tiny")`` returns a transformers ``Qwen2VLProcessor`` whose tokenizer is a
Qwen2-style byte-level BPE (Qwen2's pre-tokenizer regex, NFC, byte-level decoder) trained with
``tokenizers`` on the vendored R manuals' text, with Qwen2-VL's special tokens at ids 0..13
(``<|endoftext|>`` = 0 is also the pad token). Training is deterministic (the same
tokenizer.json across processes), takes about 3 s of CPU, and is cached under
``<cache root>/tiny-tokenizer-<version>-<vocab size>``.

The image side is transformers' PIL backend ``Qwen2VLImageProcessorPil`` (torchvision cannot be
imported beside some torch builds). transformers 5's ``Qwen2VLProcessor`` also wants a video
processor, whose base class needs torchvision; so "tiny", and a checkpoint whose standard
processor cannot be built here, get ``Qwen2VLImageTextProcessor``: a subclass of
``Qwen2VLProcessor`` without the video slot (videos unsupported). With torchvision installed
(the usual GPU setup) a checkpoint's standard processor loads unchanged. A retrieval checkpoint's
ColQwen2 processor (colpali-engine or transformers) gives its tokenizer and image processor to a
plain processor; the prompts come with the retriever (``RetrieverConfig.prompts``). Both emit the same
keys: ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (1 = image placeholder, 2 =
video), ``pixel_values`` [P, 1176] and ``image_grid_thw`` [n_images, 3]; each image becomes
``t*h*w / merge_size**2`` ``<|image_pad|>`` tokens.
"""

from __future__ import annotations

import json
import os
import shutil

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoProcessor, AutoTokenizer, PretrainedConfig, Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from raggedvl.data.cache import cache_root
from raggedvl.data.tiny_limits import TINY_MAX_PIXELS, TINY_MIN_PIXELS

TOKENIZER_VERSION = "v1"
QWEN2_VL_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
TINY_VOCAB_SIZE = 4096
# The tiny processor's chat template: Qwen's ChatML (each turn "<|im_start|>ROLE\n...<|im_end|>\n",
# an image as <|vision_start|><|image_pad|><|vision_end|>), without the default system turn.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without a video processor, for environments without torchvision.

    Same text and image behaviour as the parent (placeholder expansion, ``mm_token_type_ids``);
    passing ``videos`` raises.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("this processor has no video processor (torchvision is missing); install torchvision for videos")
        return super().__call__(images=images, text=text, **kwargs)


def corpus_texts() -> list[str]:
    """Training text for the tiny tokenizer: every page of the seven guides and every fourth
    page of the reference manual (about 1,300 pages, 2.9 M characters), in a fixed order."""
    from raggedvl.data.rdocs import open_manuals

    texts = []
    for name, doc in open_manuals().items():
        step = 4 if name == "refman.pdf" else 1
        texts.extend(doc[i].get_textpage().get_text_range() for i in range(0, len(doc), step))
    return texts


def train_tiny_tokenizer(texts: list[str], vocab_size: int = TINY_VOCAB_SIZE) -> Qwen2Tokenizer:
    """Train a Qwen2-style byte-level BPE on ``texts`` (deterministic for equal input).

    Raises ValueError when ``vocab_size`` cannot hold the 256 byte symbols and special tokens.
    """
    minimum = 256 + len(QWEN2_VL_SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} is below {minimum} (256 byte symbols + {len(QWEN2_VL_SPECIAL_TOKENS)} special tokens)")
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(QWEN2_VL_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, padding_side="right")
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_VL_SPECIAL_TOKENS], special_tokens=True)
    return tokenizer


def build_tiny_tokenizer(cache_dir: str | os.PathLike | None = None, vocab_size: int = TINY_VOCAB_SIZE):
    """The tiny default's tokenizer, trained on first use and cached (atomic rename)."""
    target = cache_root(cache_dir) / f"tiny-tokenizer-{TOKENIZER_VERSION}-{vocab_size}"
    if not (target / "tokenizer.json").is_file():
        tokenizer = train_tiny_tokenizer(corpus_texts(), vocab_size)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
            if not (target / "tokenizer.json").is_file():
                raise
    return AutoTokenizer.from_pretrained(str(target))


def set_pixel_limits(processor, min_pixels: int | None, max_pixels: int | None):
    """Set the image processor's resize limits (pixels of the resized image); returns processor."""
    image_processor = processor.image_processor
    size = {k: v for k, v in dict(image_processor.size or {}).items() if v is not None}
    if min_pixels is not None:
        size["shortest_edge"] = int(min_pixels)
    if max_pixels is not None:
        size["longest_edge"] = int(max_pixels)
    if size.get("shortest_edge", 0) > size.get("longest_edge", float("inf")):
        raise ValueError(f"min_pixels={size['shortest_edge']} is above max_pixels={size['longest_edge']}")
    image_processor.size = size
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and hasattr(image_processor, name):
            setattr(image_processor, name, int(value))
    return processor


def is_retrieval_processor(processor) -> bool:
    """True for a ColQwen2-style processor (transformers' ``ColQwen2Processor``, the class that
    colpali-engine's saved ``processor_config.json`` also resolves to): it writes prompts itself
    and refuses text and images in one call, so raggedvl uses its tokenizer and image processor
    in a plain processor and applies the retriever's own prompts (``RetrieverConfig.prompts``)."""
    return hasattr(processor, "visual_prompt_prefix") and hasattr(processor, "image_processor")


def checkpoint_model_type(model: str) -> str | None:
    """The transformers ``model_type`` a checkpoint's ``config.json`` states (a ColQwen2 config:
    its ``vlm_config``'s), or None when it has no readable config (e.g. a LoRA adapter)."""
    try:
        data, _ = PretrainedConfig.get_config_dict(model)
    except (OSError, ValueError):
        return None
    vlm = data.get("vlm_config")
    return vlm.get("model_type") if isinstance(vlm, dict) and vlm.get("model_type") else data.get("model_type")


def _image_text_processor(model: str, image_processor, tokenizer,
                          chat_template: str | None = None) -> Qwen2VLImageTextProcessor:
    """A ``Qwen2VLImageTextProcessor`` standing in for ``model``'s own processor, with the
    checkpoint's chat template; it carries the checkpoint's ``model_type`` (when stated) so
    ``raggedvl.families.family_of`` finds its family."""
    processor = Qwen2VLImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)
    model_type = checkpoint_model_type(model)
    if model_type is not None:
        processor.model_type = model_type  # not saved: to_dict keeps __init__ arguments only
    return processor


def _load_pretrained(model: str, trust_remote_code: bool):
    """The checkpoint's own processor; falls back to its tokenizer + the PIL image processor
    when the standard processor cannot be built (no torchvision for the video processor)."""
    try:
        processor = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
        if is_retrieval_processor(processor):
            return _image_text_processor(model, processor.image_processor, processor.tokenizer,
                                         getattr(processor, "chat_template", None))
        if isinstance(processor, ProcessorMixin) and getattr(processor, "image_processor", None) is not None:
            return processor
        first_error: Exception = TypeError(f"AutoProcessor gave a {type(processor).__name__}, not a multimodal processor")
    except (ImportError, AttributeError, TypeError, ValueError, OSError) as exc:
        first_error = exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load a processor for {model!r}: {first_error}; the PIL fallback failed too: {exc}. "
            "Pass 'tiny', a hub id of a Qwen2-VL-family checkpoint, or a local directory holding its processor files"
        ) from exc
    return _image_text_processor(model, image_processor, tokenizer, getattr(tokenizer, "chat_template", None))


def build_processor(
    model: str = "tiny",
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
):
    """A Qwen2-VL-family processor (an instance of transformers' ``Qwen2VLProcessor`` for
    Qwen2-VL / "tiny").

    Args:
        model: "tiny" (offline tokenizer + PIL image processor), a hub id
            (``Qwen/Qwen2-VL-2B-Instruct``) or a local directory with processor files.
        min_pixels, max_pixels: resize limits, in pixels of the resized image. None keeps the
            checkpoint's own; for "tiny" the defaults are ``TINY_MIN_PIXELS`` and
            ``TINY_MAX_PIXELS`` (:mod:`raggedvl.data.tiny_limits`).
        cache_dir: cache root for the tiny tokenizer (default ``$RAGGEDVL_CACHE`` or
            ``~/.cache/raggedvl``).
        trust_remote_code: passed to ``from_pretrained``; never on by default.

    Raises:
        ValueError: the processor cannot be loaded, or min_pixels > max_pixels.
    """
    if model == "tiny":
        tokenizer = build_tiny_tokenizer(cache_dir)
        image_processor = Qwen2VLImageProcessorPil(
            min_pixels=TINY_MIN_PIXELS if min_pixels is None else min_pixels,
            max_pixels=TINY_MAX_PIXELS if max_pixels is None else max_pixels,
        )
        return Qwen2VLImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                         chat_template=TINY_CHAT_TEMPLATE)
    return set_pixel_limits(_load_pretrained(model, trust_remote_code), min_pixels, max_pixels)
