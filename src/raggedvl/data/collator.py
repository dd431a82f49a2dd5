"""``RetrievalCollator``: (query, page image) examples -> ragged query and document batches.

Prompts (:class:`raggedvl.prompts.RetrievalPrompts`, default colpali-engine's ColQwen2 prompts):
a document is an instruction around exactly one ``<|vision_start|><|image_pad|><|vision_end|>``
block, which the processor expands to ``t*h*w / merge_size**2`` ``<|image_pad|>`` tokens; a
query is the query text followed by ten ``<|endoftext|>`` augmentation tokens. A retriever
carries its own prompts (``Retriever.config.prompts``, padding side included); pass them here.

Each image goes through ``raggedvl.images.ImagePolicy.prepare`` (the policy the sampler's size
estimate uses: orientation, RGB, padding of extreme strips, resize to exactly the size the
processor's own rule chooses), so the processor leaves the size unchanged with the PIL or the
torchvision backend and each document's patch rows equal ``estimate_costs``'s count. No image
is padded to the batch: ``pixel_values`` stays one flat [sum t*h*w, patch_dim] tensor owned per
sample through ``RaggedBatch``. Text is padded to the batch's longest row on the prompts' side.

Hard negatives: an example may hold ``"negatives"``, a list of its own images (any number,
0 included; examples differ). They go through the same image policy and are written and
encoded exactly like documents, in the same processor call as the positives (one padding for
both), and come back as ``"negatives"``: a RaggedBatch of M = sum of the counts documents,
query-major, with ``"neg_counts"`` [B] int64 saying how many belong to each example, the
layout the losses take (no negative is padded or repeated). Under ``on_bad_image="skip"`` a
bad negative drops its whole example.

Truncation (case C09): queries are text only and are truncated to ``max_length`` tokens.
Documents are never truncated, because a cut would fall inside an image's placeholder run:
a document longer than ``max_length`` raises ValueError naming the example, its length, its
visual tokens and the fix (raise ``max_length`` or lower ``max_pixels``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from raggedvl.batch import RaggedBatch
from raggedvl.data.keys import image_key, text_key
from raggedvl.families import processor_batch_format
from raggedvl.images import BadImageError, BadImagePolicy, ImagePolicy, check_bad_image_policy
from raggedvl.prompts import DEFAULT_PROMPTS, DOC_TEMPLATE, IMAGE_BLOCK, QUERY_AUGMENTATION, QUERY_TEMPLATE, RetrievalPrompts

__all__ = ["DOC_TEMPLATE", "IMAGE_BLOCK", "QUERY_AUGMENTATION", "QUERY_TEMPLATE", "RetrievalCollator"]
_VISUAL_MARKERS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


class RetrievalCollator:
    """Collate retrieval examples into ``{"queries", "docs", "ids", "skipped"}``.

    Args:
        processor: a Qwen2-VL-family processor (``build_processor``).
        max_length: token cap per sample, or None. Queries are truncated to it; a longer
            document raises (see module docstring).
        prompts: how queries and documents are written and padded (a retriever's
            ``config.prompts``); default :data:`raggedvl.prompts.DEFAULT_PROMPTS`.
        on_bad_image: "error" raises ``BadImageError`` naming the example; "skip" drops the
            example and reports it in ``"skipped"``.
        layout: RaggedBatch layout name; default: the processor's family's
            (``raggedvl.families.family_of``; ``ValueError`` for a processor of no registered family).

    Output: ``queries`` (text-only RaggedBatch, B rows), ``docs`` (RaggedBatch, B rows, one image
    each), ``ids`` (B example ids, in order), ``skipped`` (list of ``{"id", "reason"}``, the reason
    the short cause, ``BadImageError.reason``), and,
    when the examples hold hard negatives, ``neg_counts`` [B] int64 (each example's count) and,
    when that sums to more than 0, ``negatives`` (RaggedBatch, M rows, query-major).
    ``doc_keys`` [B], ``neg_keys`` [M] and ``query_keys`` [B] (int64) name each positive's and
    hard negative's page (an example's ``doc_key`` / ``negative_keys``, else the key of the
    decoded image) and each query's text (:mod:`raggedvl.data.keys`); ``relevant_keys`` [R]
    with ``relevant_counts`` [B] (int64, query-major) list each example's further relevant
    pages (its ``relevant_keys``: its other positives; none by default): the losses'
    false-negative keys.

    Raises:
        ValueError: an example without ``query``/``image``, an empty query or one containing a
            visual placeholder token, a document longer
            than ``max_length``, ``negatives`` that is not a list (or held by some examples
            only), or a batch where every example was skipped.
    """

    def __init__(
        self,
        processor,
        max_length: int | None = None,
        *,
        prompts: RetrievalPrompts = DEFAULT_PROMPTS,
        on_bad_image: BadImagePolicy = "error",
        layout: str | None = None,
    ) -> None:
        if not isinstance(prompts, RetrievalPrompts):
            raise TypeError(f"prompts must be a raggedvl.prompts.RetrievalPrompts, got {type(prompts).__name__}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
        check_bad_image_policy(on_bad_image)
        self.processor = processor
        self.max_length = max_length
        self.prompts = prompts
        self.on_bad_image = on_bad_image
        self.layout, self.token_ids = processor_batch_format(processor, layout)
        self.image_policy = ImagePolicy.from_processor(processor)

    def _prepare(self, examples: Sequence[dict[str, Any]], with_query: bool = True, allow_empty: bool = False):
        kept, images, negatives, skipped, keys = [], [], [], [], []
        with_negatives = _holds_negatives(examples) if with_query else False
        for position, example in enumerate(examples):
            ident = str(example.get("id", position))
            missing = [k for k in (("query", "image") if with_query else ("image",)) if k not in example]
            if missing:
                raise ValueError(f"example {position} (id {ident!r}) lacks {missing}; keys present: {sorted(example)}")
            query = example.get("query")
            if with_query:
                _check_query(query, f"example {position} (id {ident!r})")
            part = None  # the hard negative being prepared, if any
            try:
                image = example["image"]
                if image is None:  # the dataset's reason (on_bad_image="skip"), else no image at all
                    reason = example.get("image_error", "no image")
                    raise BadImageError(f"example {ident!r}: {reason}", reason=reason)
                image = self.image_policy.prepare(image, name=f"image of example {ident!r}")
                negs = []
                for j, neg in enumerate(example["negatives"] if with_negatives else ()):
                    part = f"hard negative {j}"
                    negs.append(self.image_policy.prepare(neg, name=f"{part} of example {ident!r}"))
                neg_keys = example.get("negative_keys") or [image_key(neg) for neg in negs]
            except BadImageError as exc:
                if self.on_bad_image == "error":
                    raise
                # the short cause (BadImageError.reason): the id names the example
                skipped.append({"id": ident, "reason": exc.reason if part is None else f"{part}: {exc.reason}"})
                continue
            kept.append((ident, query))
            images.append(image)
            negatives.extend(negs)
            doc_key = example.get("doc_key")
            keys.append((image_key(image) if doc_key is None else doc_key, list(neg_keys),
                         list(example.get("relevant_keys") or ())))
        if not kept and not allow_empty:
            raise ValueError(f"every example of this batch was rejected: {skipped}")
        return kept, images, (negatives if with_negatives else None), skipped, keys

    def _check_doc_lengths(self, ids: list[str], features) -> None:
        if self.max_length is None:
            return
        lengths = features["attention_mask"].sum(dim=1).tolist()
        visual = (features["input_ids"] == self.token_ids.image).sum(dim=1).tolist()
        for ident, length, n_visual in zip(ids, lengths, visual):
            if length > self.max_length:
                raise ValueError(
                    f"document of example {ident!r} has {length} tokens ({n_visual} image placeholder tokens "
                    f"+ {length - n_visual} text tokens), above max_length={self.max_length}; truncating would "
                    "cut through the image placeholders. Raise max_length or lower max_pixels"
                )

    def collate_queries(self, queries: Sequence[str]) -> RaggedBatch:
        """A text-only RaggedBatch of ``queries`` (query template applied, truncated to
        ``max_length``). Raises ValueError for an empty query or one holding a visual marker."""
        for position, query in enumerate(queries):
            _check_query(query, f"query {position}")
        query_kwargs = {"truncation": True, "max_length": self.max_length} if self.max_length else {}
        features = self.processor(
            text=[self.prompts.query(q) for q in queries], padding="longest", padding_side=self.prompts.padding_side,
            return_tensors="pt", **query_kwargs,
        )
        return RaggedBatch.from_features(features, layout=self.layout, image_counts=[0] * len(queries), token_ids=self.token_ids)

    def _collate_images(self, ids: list[str], images: list[Any]) -> RaggedBatch:
        # the images are at their target size already (ImagePolicy.prepare): the processor's own
        # resize would be the identity, at the cost of a PIL round trip per image
        features = self.processor(text=[self.prompts.doc_template] * len(images), images=images, padding="longest",
                                  padding_side=self.prompts.padding_side, return_tensors="pt", do_resize=False)
        self._check_doc_lengths(ids, features)
        return RaggedBatch.from_features(features, layout=self.layout, image_counts=[1] * len(images), token_ids=self.token_ids)

    def collate_documents(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """``{"docs", "ids", "skipped"}`` for examples holding an ``image`` (any query is ignored):
        the document side of :meth:`__call__`. Under ``on_bad_image="skip"`` a batch whose every
        image is skipped gives ``docs`` None and no ids (a document index leaves them out; a
        training batch raises instead, see :meth:`__call__`)."""
        kept, images, _, skipped, _ = self._prepare(examples, with_query=False, allow_empty=True)
        ids = [ident for ident, _ in kept]
        return {"docs": self._collate_images(ids, images) if ids else None, "ids": ids, "skipped": skipped}

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        kept, images, negatives, skipped, keys = self._prepare(examples)
        ids = [ident for ident, _ in kept]
        out = {"queries": self.collate_queries([q for _, q in kept]), "ids": ids, "skipped": skipped,
               "doc_keys": torch.tensor([doc for doc, _, _ in keys], dtype=torch.int64),
               "neg_keys": torch.tensor([n for _, negs, _ in keys for n in negs], dtype=torch.int64),
               "query_keys": torch.tensor([text_key(q) for _, q in kept], dtype=torch.int64),
               "relevant_keys": torch.tensor([r for _, _, rel in keys for r in rel], dtype=torch.int64),
               "relevant_counts": torch.tensor([len(rel) for _, _, rel in keys], dtype=torch.int64)}
        if negatives is not None:
            out["neg_counts"] = torch.tensor([len(negs) for _, negs, _ in keys], dtype=torch.int64)
        if not negatives:
            return {**out, "docs": self._collate_images(ids, images)}
        neg_ids = [f"{ident} (hard negative {j})" for ident, (_, negs, _) in zip(ids, keys) for j in range(len(negs))]
        docs, negs = self._collate_images(ids + neg_ids, images + negatives).split([len(ids), len(negatives)])
        return {**out, "docs": docs, "negatives": negs}


def _holds_negatives(examples: Sequence[dict[str, Any]]) -> bool:
    """Whether the examples hold hard negatives (a list each, of any length; rows without an
    image are not looked at: they are dropped). Raises ``ValueError`` when ``negatives`` is
    not a list, or some examples hold a list and others none."""
    held = []
    for position, example in enumerate(examples):
        negs = example.get("negatives")
        if example.get("image") is None:  # a row the dataset rejected (on_bad_image="skip"): dropped later
            continue
        if negs is not None and not isinstance(negs, (list, tuple)):
            raise ValueError(f"example {position} (id {example.get('id', position)!r}): 'negatives' must be a list "
                             f"of images, got {type(negs).__name__} {negs!r:.80}")
        held.append((position, negs is not None))
    if len({h for _, h in held}) > 1:
        raise ValueError(f"examples {[i for i, h in held if not h]} hold no 'negatives' list while others "
                         "do; give every example a list (empty for none)")
    return bool(held) and held[0][1]


def _check_query(query: Any, name: str) -> None:
    if not isinstance(query, str) or not query.strip():
        raise ValueError(f"{name} has an empty or non-string query {query!r}")
    marker = next((m for m in _VISUAL_MARKERS if m in query), None)
    if marker is not None:
        raise ValueError(
            f"{name}: the query text contains {marker!r}, which the tokenizer reads as a visual placeholder; "
            "remove it from the query"
        )
