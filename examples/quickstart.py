"""raggedvl in one page: a flat Qwen2-VL batch that splits, selects and scatters by whole
samples, a tiny ColQwen-style retriever, and the cross-rank late-interaction loss.

    python examples/quickstart.py            # CPU, offline, a few seconds

The block between the README markers is the README's "Using the library" code (a test keeps
them identical).
"""

from __future__ import annotations

from PIL import Image, ImageDraw


def make_pages() -> list[Image.Image]:
    """Three synthetic 'document pages' of different sizes and aspect ratios."""
    pages = []
    for i, (w, h) in enumerate([(448, 448), (224, 224), (560, 280)]):
        page = Image.new("RGB", (w, h), "white")
        ImageDraw.Draw(page).text((10, 10 + 20 * i), f"page {i}: sample quantiles", fill="black")
        pages.append(page)
    return pages


def main() -> dict:
    pages = make_pages()
    # --- README: quickstart ---
    # pages: a list of PIL images (examples/quickstart.py makes three synthetic ones)
    from raggedvl import LateInteractionLoss, RaggedBatch, build_processor, build_retriever, scatter_batch

    processor = build_processor("tiny")  # or build_processor("Qwen/Qwen2-VL-2B-Instruct")
    texts = [
        "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>Two pages.",
        "No image in this sample.",
        "<|vision_start|><|image_pad|><|vision_end|>One wide page.",
    ]
    features = processor(text=texts, images=pages, return_tensors="pt", padding=True)
    batch = RaggedBatch.from_features(features, layout="qwen2_vl", token_ids=processor)  # validated
    print(batch.image_counts)              # [2, 0, 1]: derived from the placeholder tokens
    first, rest = batch.split([1, 2])      # whole samples: patches, grids and tokens stay together
    picked = batch.select([2, 0])          # exactly these samples, in this order
    shards = scatter_batch(batch, num_replicas=2)  # cost-balanced whole-sample shards
    # shards.shards[r] is replica r's RaggedBatch; a shard without images has no pixel_values

    model = build_retriever("tiny", processor=processor)  # ColQwen-style: 128-d multi-vector
    docs = model(**picked)                 # a RaggedBatch is a mapping: model(**batch) works
    queries = model(**RaggedBatch.from_features(
        processor(text=["Query: wide page", "Query: two pages"], return_tensors="pt", padding=True),
        token_ids=processor))
    loss = LateInteractionLoss(temperature=0.02)(queries.embeddings, queries.mask, docs.embeddings, docs.mask)
    loss.backward()  # under torchrun + DDP: exactly the single-process gradient of the global batch
    # --- end README ---
    return {
        "image_counts": batch.image_counts,
        "split": [first.num_samples, rest.num_samples],
        "picked_counts": picked.image_counts,
        "shard_samples": [s.num_samples for s in shards.shards],
        "loss": float(loss.detach()),
    }


if __name__ == "__main__":
    print(main())
