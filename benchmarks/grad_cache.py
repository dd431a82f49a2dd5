"""GradCache benchmark: peak memory vs global batch, and time per step vs the non-cached step.

Single process, CPU, float32. The model is a small random-init Qwen2-VL retriever (text 4 x 128
with MLP 1024, vision 2 x 64; ``--head``); the data are B synthetic query/document pairs (queries: ~24 text
tokens; documents: one ``--grid`` x ``--grid``-patch image plus ~48 text tokens). A step is
encode + loss + backward (no optimizer): "plain" is one forward of each whole batch and one
backward (``Trainer.train_step`` without ``--grad-cache``), "cached" is
``raggedvl.gradcache.step.grad_cache_step`` with ``--budget`` patches + tokens per chunk.

Memory: every (B, mode) runs in a fresh subprocess started with ``MALLOC_MMAP_THRESHOLD_=65536``
(every allocation above 64 KiB gets its own mapping and goes back to the OS when freed, so RSS
follows live memory; with glibc's default adaptive threshold freed activations stay in the
heap and the high-water mark drifts with the number of allocations). After a warm-up step on
8 pairs and building the batch, the kernel's RSS high-water mark is reset
(``/proc/self/clear_refs``); ``step peak`` = ``VmHWM`` after one step minus ``VmRSS`` before it,
i.e. what the step itself needs (activations, graphs, cached embeddings, loss; the model, its
gradients and the batch's inputs are in the baseline). ``peak RSS`` is the whole process.

Time: per B one more subprocess with glibc's default allocator runs plain and cached steps
alternately ``--steps`` times each and keeps the fastest of each (``time.perf_counter``), so
a change of machine load hits both modes alike. One intra-op thread (``torch.set_num_threads(1)``).
Sizes are chosen so the default sweep finishes in about ten minutes on a loaded 2-core machine.
The default budget (768) holds 32 queries, so chunks are full from the smallest batch on.

Usage: python benchmarks/grad_cache.py [--head bi_encoder|late_interaction]
       [--batches 32 64 128 256 512] [--budget 768] [--steps 2] [--block-elements N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

TEXT_TOKENS = {"query": 24, "doc": 48}
DEFAULT_BLOCK_ELEMENTS = 1 << 23  # raggedvl.losses.scoring.DEFAULT_BLOCK_ELEMENTS (not imported: keeps the parent light)


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


MODEL_SIZES = {  # TinySizes keyword arguments
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024,
                 vision_depth=2, vision_embed_dim=64, vision_heads=4),
    "wide": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=2048,
                 vision_depth=4, vision_embed_dim=256, vision_heads=8),
}


def _model_and_tokens(head: str, model_size: str = "tiny"):
    from raggedvl.batch import TokenIds
    from raggedvl.data import build_processor
    from raggedvl.models import TinySizes, build_retriever

    processor = build_processor("tiny")
    sizes = TinySizes(**MODEL_SIZES[model_size])
    model = build_retriever("tiny", processor=processor, head=head, dim=128, tiny_sizes=sizes, seed=0).train()
    tok = processor.tokenizer
    ids = TokenIds(*(tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|video_pad|>")))
    return model, ids, tok


def _batches(n: int, grid: int, ids, tok, seed: int):
    """n query/document pairs with random text tokens; lengths vary by +-25% per sample."""
    import torch

    from raggedvl.batch import RaggedBatch

    gen = torch.Generator().manual_seed(seed)
    special = {ids.vision_start, ids.image, ids.video, tok.pad_token_id}
    vocab = torch.tensor([i for i in range(len(tok)) if i not in special and i >= 16])

    def text(k: int) -> list[int]:
        k = int(k * (0.75 + 0.5 * float(torch.rand((), generator=gen))))
        return vocab[torch.randint(len(vocab), (k,), generator=gen)].tolist()

    def pack(rows):
        length = max(map(len, rows))
        input_ids = torch.full((len(rows), length), tok.pad_token_id)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": (input_ids == ids.image).long()}

    queries = pack([text(TEXT_TOKENS["query"]) for _ in range(n)])
    placeholder = [ids.vision_start] + [ids.image] * (grid * grid // 4) + [tok.convert_tokens_to_ids("<|vision_end|>")]
    docs = pack([placeholder + text(TEXT_TOKENS["doc"]) for _ in range(n)])
    docs["image_grid_thw"] = torch.tensor([[1, grid, grid]] * n)
    docs["pixel_values"] = torch.randn(n * grid * grid, 1176, generator=gen)
    return (RaggedBatch.from_features(queries, token_ids=ids), RaggedBatch.from_features(docs, token_ids=ids))


def _setup(args):
    import torch

    from raggedvl.losses import make_retrieval_loss
    from raggedvl.gradcache import grad_cache_step

    torch.set_num_threads(1)
    model, ids, tok = _model_and_tokens(args.head, args.model_size)
    if args.head == "bi_encoder":
        loss_fn = make_retrieval_loss("infonce", temperature=0.02)
    else:
        loss_fn = make_retrieval_loss("late_interaction", temperature=0.02, block_elements=args.block_elements)

    def step(mode: str, queries, docs) -> float:
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        if mode == "cached":
            grad_cache_step(model, queries, docs, loss_fn, budget=args.budget)
        else:
            q, d = model(queries=queries, docs=docs)
            loss_fn(q, d).backward()
        return time.perf_counter() - t0

    warm = _batches(8, args.grid, ids, tok, seed=1)
    for mode in ("plain", "cached"):  # warm-up: kernels, allocator, .grad buffers
        step(mode, *warm)
    return step, _batches(args.batch, args.grid, ids, tok, seed=0)


def child_memory(args) -> None:
    step, (queries, docs) = _setup(args)
    base = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step(args.mode, queries, docs)
    peak = _status_mb("VmHWM")
    print(json.dumps({"peak_mb": peak, "step_peak_mb": peak - base}))


def child_time(args) -> None:
    step, (queries, docs) = _setup(args)
    times: dict[str, list[float]] = {"plain": [], "cached": []}
    for _ in range(args.steps):
        for mode in times:
            times[mode].append(step(mode, queries, docs))
    print(json.dumps({mode: min(t) for mode, t in times.items()}))


def _run(args, batch: int, kind: str, mode: str = "cached") -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--batch", str(batch), "--mode", mode, "--head", args.head,
           "--budget", str(args.budget), "--steps", str(args.steps), "--grid", str(args.grid),
           "--block-elements", str(args.block_elements), "--model-size", args.model_size]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kind == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", choices=("bi_encoder", "late_interaction"), default="bi_encoder")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--budget", type=int, default=768, help="GradCache chunk budget, patches + tokens")
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode and batch (the fastest is kept)")
    p.add_argument("--grid", type=int, default=8, help="document image grid h = w, in patches")
    p.add_argument("--block-elements", type=int, default=DEFAULT_BLOCK_ELEMENTS,
                   help="late interaction: MaxSim similarity entries per block (the loss's working memory)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny",
                   help="tiny: text 4x128, vision 2x64; wide: text 8x512, vision 4x256 (activations per chunk "
                        "grow with the model, the O(B) embedding-gradient cache and loss memory do not)")
    p.add_argument("--cached-memory-only", action="store_true",
                   help="measure only the cached step's memory (the plain step of a wide model at B = 512 "
                        "needs tens of GB)")
    p.add_argument("--child", choices=("memory", "time"), help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("cached", "plain"), default="cached", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        (child_memory if args.child == "memory" else child_time)(args)
        return
    import torch

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start; "
          f"torch {torch.__version__}; one thread per run")
    print(f"model: {args.model_size} Qwen2-VL retriever ({MODEL_SIZES[args.model_size]}), {args.head} head, float32; documents: one "
          f"{args.grid}x{args.grid}-patch image + ~{TEXT_TOKENS['doc']} tokens; queries ~{TEXT_TOKENS['query']} tokens; "
          f"GradCache budget {args.budget} patches + tokens per chunk; memory: VmHWM of a fresh subprocess"
          + (f"; MaxSim block {args.block_elements} entries" if args.head == "late_interaction" else ""))
    rows = []
    if args.cached_memory_only:
        peaks = []
        print("| global batch | cached step peak MB | x smallest batch | cached peak RSS MB |")
        print("|---:|---:|---:|---:|")
        for batch in args.batches:
            c = _run(args, batch, "memory", "cached")
            peaks.append(c["step_peak_mb"])
            print(f"| {batch} | {c['step_peak_mb']:.0f} | {c['step_peak_mb'] / peaks[0]:.2f} | {c['peak_mb']:.0f} |", flush=True)
        print(f"cached step peak, largest / smallest over global batch {args.batches[0]}..{args.batches[-1]}: "
              f"{max(peaks) / min(peaks):.2f}x (goal <= 1.2x); load average {os.getloadavg()[0]:.1f} at end")
        return
    for batch in args.batches:
        row = {"cached": _run(args, batch, "memory", "cached"), "plain": _run(args, batch, "memory", "plain"),
               "time": _run(args, batch, "time")}
        rows.append(row)
        _print_row(batch, row, rows[0], header=len(rows) == 1)
    peaks = [r["cached"]["step_peak_mb"] for r in rows]
    ratios = [r["time"]["cached"] / r["time"]["plain"] for r in rows]
    print(f"cached step peak, largest / smallest over global batch {args.batches[0]}..{args.batches[-1]}: "
          f"{max(peaks) / min(peaks):.2f}x (goal <= 1.2x); time cached / plain: "
          f"{min(ratios):.2f}x .. {max(ratios):.2f}x (goal <= 1.4x); load average {os.getloadavg()[0]:.1f} at end")


def _print_row(batch: int, row: dict, first: dict, header: bool) -> None:
    if header:
        print("| global batch | cached step peak MB | x smallest batch | cached peak RSS MB | plain step peak MB | "
              "plain peak RSS MB | cached step s | plain step s | time cached / plain |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    c, pl, t = row["cached"], row["plain"], row["time"]
    print(f"| {batch} | {c['step_peak_mb']:.0f} | {c['step_peak_mb'] / first['cached']['step_peak_mb']:.2f} | "
          f"{c['peak_mb']:.0f} | {pl['step_peak_mb']:.0f} | {pl['peak_mb']:.0f} | {t['cached']:.2f} | "
          f"{t['plain']:.2f} | {t['cached'] / t['plain']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
