"""Device checks of gpu_check: attention implementations, bf16 autocast, and the DataParallel
scatter on two logical replicas of one device.

Each check returns ``(result, detail)`` with result "pass", "FAIL" or "n/a"; a raised exception
is turned into a FAIL row by the caller. The model is the tiny ColQwen-style retriever
(late interaction, 128-dim) on documents from ``workload.make_pages`` at <= 64 visual tokens.

What one GPU can and cannot show (written into the report):
- can: ``RaggedDataParallel``'s boundary-aware scatter into two shards of whole samples placed
  on the same device, each run by the model, gathered back in order, outputs and gradients equal
  to the unsplit batch; whether ``nn.DataParallel``'s replicate/parallel_apply machinery accepts
  ``device_ids=[0, 0]`` (two replicas on one GPU) is tried and reported as found;
- can: packed rows (padding-free sequences) against the padded batch, with per-sequence SDPA
  and, when flash-attn is installed, flash-attention's varlen kernel;
- can: the patch embedding as a matrix product against the Conv3d it replaces (values and
  time, fp32 and bf16);
- cannot: NCCL between processes (NCCL refuses two ranks on one GPU, and at world size 1
  ``all_gather_variable`` issues no collective), DDP/FSDP2 across GPUs (``wrap_model`` leaves a
  1-rank model unwrapped). Those run in the ``gpu`` tests when 2 GPUs are present, and on
  gloo/CPU in CI (tests/dist).
"""

from __future__ import annotations

from typing import Any

from workload import make_pages  # tools/gpu is on sys.path (gpu_check.py puts it there)


def _setup(device, n_docs: int = 4):
    import torch

    from raggedvl.data import RetrievalCollator, build_processor
    from raggedvl.models import build_retriever

    processor = build_processor("tiny", max_pixels=50_176)
    batch = RetrievalCollator(processor)(make_pages(n_docs, seed=1))
    model = build_retriever("tiny", processor=processor, seed=0).to(device).float()
    return processor, model, batch["docs"].to(device), torch


def _max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def check_logical_replicas(device) -> tuple[str, str]:
    """Scatter a 4-document ragged batch into 2 shards on ``device``, run each, gather: the
    embeddings and every parameter gradient equal the unsplit batch's."""
    _, model, docs, torch = _setup(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # exact fp32 on GPUs
    try:
        return _compare_replicas(model, docs, device, torch)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _compare_replicas(model, docs, device, torch) -> tuple[str, str]:
    from raggedvl.parallel import gather_outputs, scatter_batch

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn()
        weights = torch.linspace(-1, 1, out.embeddings.shape[-1], device=out.embeddings.device)
        (out.embeddings * weights).sum().backward()
        return out.embeddings.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_g = run(lambda: model(**docs))
    shards = scatter_batch(docs, 2, devices=[device, device])
    got, got_g = run(lambda: gather_outputs([model(**s) for s in shards.shards], shards, device))
    emb = _max_diff(got, want)
    grad = max(_max_diff(got_g[n], want_g[n]) for n in want_g)
    sizes = [s.num_samples for s in shards.shards]
    ok = len(sizes) == 2 and emb < 1e-4 and grad < 1e-4 and got_g.keys() == want_g.keys()
    return ("pass" if ok else "FAIL"), (f"shards {sizes} samples, patches {[int(s.patch_counts().sum()) for s in shards.shards]}; "
                                        f"max |diff| embeddings {emb:.1e}, gradients {grad:.1e}")


def check_data_parallel_same_gpu(device) -> tuple[str, str]:
    """``RaggedDataParallel(model, device_ids=[i, i])``: two nn.DataParallel replicas on one GPU."""
    from raggedvl.parallel import RaggedDataParallel

    if device.type != "cuda":
        return "n/a", "needs CUDA"
    _, model, docs, torch = _setup(device)
    with torch.no_grad():
        want = model(**docs).embeddings
        dp = RaggedDataParallel(model, device_ids=[device.index or 0] * 2, layout=docs.layout_name,
                                token_ids=docs.token_ids)
        got = dp(docs).embeddings
    diff = _max_diff(got, want)
    return ("pass" if diff < 1e-3 else "FAIL"), f"2 replicas on {device}; max |diff| vs unsplit {diff:.1e}"


def check_bf16_autocast(device) -> tuple[str, str]:
    """Embeddings under bf16 autocast agree with float32 (min cosine over valid tokens)."""
    _, model, docs, torch = _setup(device)
    with torch.no_grad():
        ref = model(**docs)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            low = model(**docs)
    valid = ref.mask
    cos = torch.nn.functional.cosine_similarity(ref.embeddings[valid].float(), low.embeddings[valid].float(), dim=-1)
    worst = float(cos.min())
    return ("pass" if worst > 0.98 else "FAIL"), f"{int(valid.sum())} tokens; min cosine bf16 vs fp32 {worst:.4f}"


def check_attention(device) -> tuple[str, str]:
    """The attention implementation chosen for flash_attention_2, and sdpa (vision tower on
    cu_seqlens, no padding) vs eager on the same weights."""
    import warnings

    from raggedvl.models import build_retriever
    from raggedvl.models import resolve_attn_implementation

    processor, model, docs, torch = _setup(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = resolve_attn_implementation("flash_attention_2")
    impls = ["eager", "sdpa"] + (["flash_attention_2"] if chosen == "flash_attention_2" else [])
    outs: dict[str, Any] = {}
    for impl in impls:
        m = build_retriever("tiny", processor=processor, seed=0, attn_implementation=impl).to(device)
        m.load_state_dict(model.state_dict())
        dtype = torch.bfloat16 if impl == "flash_attention_2" else torch.float32
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            outs[impl] = m(**docs).embeddings
    diffs = {k: _max_diff(v, outs["eager"]) for k, v in outs.items() if k != "eager"}
    ok = diffs["sdpa"] < 1e-4 and diffs.get("flash_attention_2", 0.0) < 5e-2
    detail = f"flash_attention_2 -> {chosen}; " + ", ".join(f"{k} vs eager {v:.1e}" for k, v in diffs.items())
    return ("pass" if ok else "FAIL"), detail


def check_packing(device) -> tuple[str, str]:
    """Padding-free sequences (``Retriever.set_packing``): queries and documents packed into one
    row each give the padded batch's embeddings and gradients, float32 with SDPA (per-sequence
    SDPA on packed rows); on CUDA with flash-attn also flash_attention_2 under bf16 autocast
    (varlen kernel, ``cu_seqlens`` from the text positions) against flash_attention_2 padded."""
    import torch

    from raggedvl.data import RetrievalCollator, build_processor
    from raggedvl.losses import make_retrieval_loss
    from raggedvl.models import build_retriever
    from raggedvl.models.build import resolve_attn_implementation

    processor = build_processor("tiny", max_pixels=50_176)
    batch = RetrievalCollator(processor)(make_pages(4, seed=2))
    queries, docs = batch["queries"].to(device), batch["docs"].to(device)
    loss_fn = make_retrieval_loss("late_interaction", temperature=0.02)
    slots = sum(b["attention_mask"].numel() for b in (queries, docs))
    pad = 1 - sum(int(b["attention_mask"].sum()) for b in (queries, docs)) / slots

    def run(model, packing: bool, bf16: bool):
        model.set_packing(packing)
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            q, d = model(queries=queries, docs=docs)
        loss = loss_fn(q, d)
        loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        return torch.cat([q.embeddings.flatten(), d.embeddings.flatten()]).float(), float(loss), grads

    def compare(attn: str, bf16: bool) -> tuple[float, float, float]:
        model = build_retriever("tiny", processor=processor, seed=0, attn_implementation=attn).to(device).train()
        (e0, l0, g0), (e1, l1, g1) = run(model, False, bf16), run(model, True, bf16)
        return _max_diff(e1, e0), abs(l1 - l0), max(_max_diff(g1[n], g0[n]) for n in g0)

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # exact fp32 on GPUs
    try:
        emb, loss, grad = compare("sdpa", bf16=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    ok = emb < 1e-4 and loss < 1e-4 and grad < 1e-3
    detail = (f"padding tokens {pad:.1%} -> 0 %; fp32 sdpa: max |diff| embeddings {emb:.1e}, loss {loss:.1e}, "
              f"gradients {grad:.1e}")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flash = resolve_attn_implementation("flash_attention_2") == "flash_attention_2"
    if flash:
        emb, loss, grad = compare("flash_attention_2", bf16=True)
        ok = ok and emb < 5e-2 and loss < 5e-2
        detail += f"; bf16 flash_attention_2 varlen: embeddings {emb:.1e}, loss {loss:.1e}, gradients {grad:.1e}"
    else:
        detail += "; flash_attention_2: n/a (needs CUDA and flash-attn)"
    return ("pass" if ok else "FAIL"), detail


def check_patch_embed(device) -> tuple[str, str]:
    """The patch embedding as a matrix product (``WholePatchConv3d``) against transformers'
    ``Conv3d`` on this device (``benchmarks/patch_embed.py``'s ``compare``): forward + weight
    gradient at Qwen2-VL-2B's tower width (D 1,280, 8,000 patch rows; 256 rows at D 32 on CPU),
    fp32 and, on CUDA, bf16: relative differences of outputs and weight gradients, and
    milliseconds per call."""
    import torch
    from patch_embed import compare  # benchmarks/ is on sys.path (gpu_check.py puts it there)

    rows, dim = (8_000, 1_280) if device.type == "cuda" else (256, 32)
    parts, ok = [], True
    for dtype in ([torch.float32, torch.bfloat16] if device.type == "cuda" else [torch.float32]):
        r = compare(rows, dim, device, dtype)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        ok = ok and r["out_rel_diff"] < tol and r["grad_rel_diff"] < tol
        parts.append(f"{str(dtype).removeprefix('torch.')}: conv {r['conv_ms']:.2f} ms, matmul {r['matmul_ms']:.2f} ms "
                     f"({r['conv_ms'] / r['matmul_ms']:.2f}x), rel diff out {r['out_rel_diff']:.1e}, "
                     f"grad {r['grad_rel_diff']:.1e}")
    return ("pass" if ok else "FAIL"), f"{rows:,} rows x D {dim:,}; " + "; ".join(parts)

CHECKS = [
    ("DataParallel scatter, 2 logical replicas on one device", check_logical_replicas, False),
    ("RaggedDataParallel device_ids=[0, 0]", check_data_parallel_same_gpu, True),
    ("bf16 autocast vs fp32", check_bf16_autocast, True),
    ("attention: sdpa / flash-attn vs eager", check_attention, False),
    ("packing: packed vs padded rows", check_packing, False),
    ("patch embedding: matrix product vs Conv3d (fp32, bf16)", check_patch_embed, False),
]
"""(name, function, needs CUDA)."""
