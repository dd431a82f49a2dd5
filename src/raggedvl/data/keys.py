"""Keys that say when two training samples hold the same document or the same query.

A key is a signed 64-bit integer (what the losses' ``doc_keys`` / ``query_keys`` take,
:mod:`raggedvl.losses.modules`): the first 8 bytes of a BLAKE2b digest. Equal keys mean equal
content; two different contents share a key with probability about 2**-64 per pair.

- :func:`bytes_key`: a page as stored (the encoded file bytes): byte-identical files match.
- :func:`image_key`: a decoded image (mode, size and pixels): the same page stored in two
  encodings matches once decoded to the same pixels.
- :func:`text_key`: a query's exact text (after nothing: the string as given).
"""

from __future__ import annotations

import hashlib

from PIL import Image


def _key(data: bytes, domain: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=domain).digest(), "little", signed=True)


def bytes_key(data: bytes) -> int:
    """Key of an encoded image file's bytes."""
    return _key(data, b"raggedvl-bytes")


def image_key(image: Image.Image) -> int:
    """Key of a decoded image: its mode, size and pixel bytes."""
    return _key(repr((image.mode, image.size)).encode() + image.tobytes(), b"raggedvl-image")


def text_key(text: str) -> int:
    """Key of a query's text (UTF-8)."""
    return _key(text.encode("utf-8", "surrogatepass"), b"raggedvl-text")
