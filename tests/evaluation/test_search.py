"""Chunked search and the on-disk index give exactly the top-k of a brute-force score matrix."""

import pytest
import torch

from raggedvl.evaluation import tie_keys, top_k
from raggedvl.evaluation.index import EmbeddingIndex, write_index, write_shard
from raggedvl.evaluation.search import chunks_of, pad_rows, search
from raggedvl.losses import late_interaction_scores


def corpus(n=57, dim=8, seed=0, quantise=True):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(int(torch.randint(1, 9, (1,), generator=g)), dim, generator=g) for _ in range(n)]
    if quantise:  # coarse values: many exact score ties
        rows = [r.round() for r in rows]
    rows[5] = rows[3].clone()  # identical documents tie exactly
    return rows


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_maxsim_search_equals_brute_force(chunk):
    docs = corpus()
    q, qm = pad_rows([torch.randn(4, 8).round(), torch.randn(2, 8).round(), torch.zeros(3, 8)])  # last query: all ties
    ids = [f"d{i}" for i in range(len(docs))]
    keys = tie_keys(ids)
    de, dm = pad_rows(docs)
    dense = late_interaction_scores(q.double(), qm, de.double(), dm)
    want = top_k(dense, 10, keys)
    got = search(q, qm, chunks_of(docs, chunk), 10, keys)
    assert torch.equal(got.indices, want.indices)
    assert torch.allclose(got.scores.double(), want.scores, atol=1e-5)
    # the all-tie query ranks by id descending, as trec_eval does
    assert [ids[i] for i in got.indices[2].tolist()] == sorted(ids, reverse=True)[:10]


def test_single_vector_search_and_index_roundtrip(tmp_path):
    g = torch.Generator().manual_seed(1)
    vectors = [torch.randn(6, generator=g).round() for _ in range(30)]
    ids = [f"v{i:02d}" for i in range(30)]
    keys = tie_keys(ids)
    q = torch.randn(3, 6, generator=g)
    want = top_k(q @ torch.stack(vectors).T, 5, keys)
    shards = [write_shard(tmp_path, 0, vectors[:13], ids[:13], dtype=torch.float32),
              write_shard(tmp_path, 1, vectors[13:], ids[13:], dtype=torch.float32)]
    write_index(tmp_path, shards, kind="single_vector", dim=6, dtype=torch.float32)
    index = EmbeddingIndex(tmp_path)
    assert index.ids == ids and not index.multi_vector
    got = search(q, None, index.chunks(4), 5, tie_keys(index.ids))
    assert torch.equal(got.indices, want.indices)


def test_multi_vector_index_keeps_ragged_rows(tmp_path):
    docs = corpus(n=20, quantise=False)
    ids = [f"p{i}" for i in range(20)]
    write_index(tmp_path, [write_shard(tmp_path, 0, docs, ids, dtype=torch.float32)], kind="multi_vector", dim=8, dtype=torch.float32)
    seen = {}
    for where, emb, mask in EmbeddingIndex(tmp_path).chunks(6):
        for j in range(emb.shape[0]):
            seen[where + j] = emb[j][mask[j]]
    assert all(torch.equal(seen[i], docs[i]) for i in range(20))
    with pytest.raises(ValueError, match="repeated document ids"):
        write_index(tmp_path, [{"file": "x", "documents": 2, "ids": ["a", "a"]}], kind="multi_vector", dim=8, dtype=torch.float32)


def test_index_shards_get_the_same_mode_as_index_json(tmp_path):
    """Both files are created under the process umask (0o666 & ~umask), readable by whoever may
    read index.json."""
    import os

    docs = corpus(n=6)  # small integers: exact in float16
    old = os.umask(0o022)
    try:
        write_index(tmp_path, [write_shard(tmp_path, 0, docs, list("abcdef"))], kind="multi_vector", dim=8,
                    dtype=torch.float16)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"index.json": 0o644, "shard-00000.safetensors": 0o644}
    (_, emb, mask), = EmbeddingIndex(tmp_path).chunks(6)
    assert all(torch.equal(emb[i][mask[i]].float(), docs[i]) for i in range(6))


def test_a_damaged_index_is_one_error_naming_the_file_and_the_fix(tmp_path):
    docs = corpus(n=8, quantise=False)
    shard = write_shard(tmp_path, 0, docs, [f"p{i}" for i in range(8)], dtype=torch.float32)
    meta = write_index(tmp_path, [shard], kind="multi_vector", dim=8, dtype=torch.float32)
    path = tmp_path / shard["file"]
    path.write_bytes(path.read_bytes()[:20])  # cut inside the header
    with pytest.raises(ValueError, match=rf"index shard {path} is damaged .*build the index again with raggedvl encode"):
        list(EmbeddingIndex(tmp_path).chunks())
    meta.write_text(meta.read_text()[:-3])
    with pytest.raises(ValueError, match=rf"{meta} is not readable JSON .*build it again with raggedvl encode"):
        EmbeddingIndex(tmp_path)
