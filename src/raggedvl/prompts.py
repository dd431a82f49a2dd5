"""Retrieval prompts: the text a query or a page image is wrapped in before tokenisation.

A retriever is trained with one way of writing its inputs and must be served with the same one:
the prompts travel with the model (``RetrieverConfig.prompts``, saved with the weights) and the
collator reads them from there.

- ``COLPALI_PROMPTS`` (the default): what colpali-engine's ``ColQwen2Processor`` /
  ``ColQwen2_5_Processor`` build (checked token for token against colpali-engine 0.3.18's
  ``process_queries`` / ``process_images`` output, ``../shared/interop``): a query is the query
  text followed by ten ``<|endoftext|>`` augmentation tokens (extra query vectors for late
  interaction, Khattab & Zaharia 2020), no prefix; a document is colpali's visual prompt around
  one image block. colpali pads on the left.
- ``LEGACY_PROMPTS``: raggedvl < 0.2 wrote ``"Query: "`` before the query (an older colpali
  release's prefix); retrievers saved without prompts were trained with it.
- :func:`transformers_colqwen2_prompts`: what transformers' ``ColQwen2Processor`` builds
  (``query_prefix + query + pad_token * 10 + "\\n"``; the visual prompt prefix for images).

Padding side changes where the pad tokens sit, not the embeddings of the real tokens (position
ids follow the attention mask; masked keys get zero attention weight).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
DOC_TEMPLATE = "<|im_start|>user\n" + IMAGE_BLOCK + "Describe the image.<|im_end|><|endoftext|>"
QUERY_AUGMENTATION = "<|endoftext|>" * 10
QUERY_TEMPLATE = "{query}" + QUERY_AUGMENTATION
PADDING_SIDES = ("left", "right")
_VISUAL_MARKERS = ("<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class RetrievalPrompts:
    """How a retriever's inputs are written (module docstring).

    ``query_template``: contains ``{query}`` once and no visual placeholder.
    ``doc_template``: contains :data:`IMAGE_BLOCK` exactly once (the processor expands its
    ``<|image_pad|>`` to the image's visual tokens). ``padding_side``: "left" | "right".
    Raises ``ValueError`` for a template that breaks these rules.
    """

    query_template: str = QUERY_TEMPLATE
    doc_template: str = DOC_TEMPLATE
    padding_side: str = "right"

    def __post_init__(self) -> None:
        if self.query_template.count("{query}") != 1 or any(m in self.query_template for m in _VISUAL_MARKERS):
            raise ValueError(
                f"query_template must contain '{{query}}' once and no image placeholder, got {self.query_template!r}"
            )
        if self.doc_template.count(IMAGE_BLOCK) != 1 or self.doc_template.count("<|image_pad|>") != 1:
            raise ValueError(f"doc_template must contain {IMAGE_BLOCK!r} exactly once, got {self.doc_template!r}")
        if self.padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {self.padding_side!r}")

    def query(self, text: str) -> str:
        """The query text as the model reads it."""
        return self.query_template.replace("{query}", text)

    @property
    def query_prefix(self) -> str:
        """The text before ``{query}`` in ``query_template``."""
        return self.query_template.split("{query}")[0]

    def with_overrides(self, query_prefix: str | None = None, padding_side: str | None = None) -> RetrievalPrompts:
        """These prompts with the query prefix (the text before ``{query}``) replaced and/or the
        padding side changed; ``None`` keeps the current one. Raises ``ValueError`` as the
        constructor does (a prefix holding ``{query}`` or an image placeholder, a bad side)."""
        template = self.query_template
        if query_prefix is not None:
            template = query_prefix + "{query}" + template.split("{query}", 1)[1]
        return replace(self, query_template=template, padding_side=padding_side or self.padding_side)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RetrievalPrompts:
        return cls(**data)


COLPALI_PROMPTS = RetrievalPrompts(padding_side="left")
DEFAULT_PROMPTS = RetrievalPrompts()
LEGACY_PROMPTS = RetrievalPrompts(query_template="Query: {query}" + QUERY_AUGMENTATION)


def transformers_colqwen2_prompts(query_prefix: str, visual_prompt_prefix: str, pad_token: str,
                                  padding_side: str) -> RetrievalPrompts:
    """The prompts transformers' ``ColQwen2Processor`` applies, from its saved attributes."""
    return RetrievalPrompts(
        query_template=query_prefix + "{query}" + pad_token * 10 + "\n",
        doc_template=visual_prompt_prefix,
        padding_side=padding_side,
    )
