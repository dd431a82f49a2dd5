"""GradCache benchmark: peak memory vs global batch, and time per step vs the non-cached step.

Every configuration (global batch B, mode "cached" | "plain") runs in a fresh Python
subprocess, single process, so its memory high-water mark is its own. Per configuration the
child builds a small random-init Qwen2-VL retriever (late interaction, float32, train mode) and
B synthetic query/document pairs (queries: text; documents: one image of ``--grid`` patches
plus text), runs a warm-up step on 8 pairs, records its resident set size (RSS, which holds
the model, the optimizer-free gradients and the batch's inputs), then runs ``--steps`` full
steps (encode, loss, backward; no optimizer) and reports:

- ``peak RSS``: ``getrusage(RUSAGE_SELF).ru_maxrss`` after the steps (the process-wide high
  water mark, imports and inputs included);
- ``step peak``: that peak minus the RSS before the full steps: the memory the step itself
  needs (activations, graphs, cached embeddings, loss). GradCache's claim is about this one;
- ``step s``: the fastest of the ``--steps`` steps (wall clock, ``time.perf_counter``).

Children run with ``MALLOC_MMAP_THRESHOLD_=65536``: every tensor above 64 KiB gets its own
mapping and goes back to the OS when freed, so RSS follows live memory. With glibc's default
(a threshold that adapts upwards), freed activations stay in the heap and the high-water mark
drifts with the number of chunk allocations rather than with what is alive at once.

The table compares cached against plain at the same batch (time ratio) and each cached
configuration against the smallest batch (memory ratio). CPU only, one intra-op thread per
child (``torch.set_num_threads(1)``), so figures are comparable on a shared machine; sizes are
chosen so a sweep finishes in about ten minutes on a loaded 2-core machine. The default budget
(768) holds 32 queries of ~24 tokens, so chunks are full from the smallest batch on.

Usage: python benchmarks/grad_cache.py [--head bi_encoder|late_interaction]
       [--batches 32 64 128 256 512] [--budget 768] [--steps 2] [--plain-max 512]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

TEXT_TOKENS = {"query": 24, "doc": 48}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _model_and_tokens(head: str):
    from raggedvl.batch import TokenIds
    from raggedvl.data import build_processor
    from raggedvl.models import TinySizes, build_retriever

    processor = build_processor("tiny")
    sizes = TinySizes(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384,
                      vision_depth=2, vision_embed_dim=64, vision_heads=4)
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


def child(args) -> None:
    import torch

    from raggedvl.losses import InfoNCELoss, LateInteractionLoss
    from raggedvl.train.grad_cache import grad_cache_step

    torch.set_num_threads(1)
    model, ids, tok = _model_and_tokens(args.head)
    if args.head == "bi_encoder":
        info_nce = InfoNCELoss(temperature=0.02)
        loss_fn = lambda q, d: info_nce(q.embeddings, d.embeddings)  # noqa: E731
    else:
        maxsim = LateInteractionLoss(temperature=0.02)
        loss_fn = lambda q, d: maxsim(q.embeddings, q.mask, d.embeddings, d.mask)  # noqa: E731

    def step(queries, docs):
        model.zero_grad(set_to_none=False)
        if args.mode == "cached":
            grad_cache_step(model, queries, docs, loss_fn, budget=args.budget)
        else:
            q, d = model(queries=queries, docs=docs)
            loss_fn(q, d).backward()

    step(*_batches(8, args.grid, ids, tok, seed=1))  # warm-up: kernels, allocator, .grad buffers
    queries, docs = _batches(args.batch, args.grid, ids, tok, seed=0)
    base = _rss_mb()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(queries, docs)
        times.append(time.perf_counter() - t0)
    peak = _peak_mb()
    print(json.dumps({"peak_mb": peak, "step_peak_mb": peak - base, "step_s": min(times)}))


def _run(batch: int, mode: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--batch", str(batch), "--mode", mode, "--head", args.head,
           "--budget", str(args.budget),
           "--steps", str(args.steps), "--grid", str(args.grid)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--head", choices=("bi_encoder", "late_interaction"), default="bi_encoder")
    p.add_argument("--budget", type=int, default=768, help="GradCache chunk budget, patches + tokens")
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration (the fastest is kept)")
    p.add_argument("--grid", type=int, default=8, help="document image grid h = w, in patches")
    p.add_argument("--plain-max", type=int, default=512, help="largest batch run without GradCache")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("cached", "plain"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    import torch

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; one thread per run")
    print(f"model: tiny Qwen2-VL retriever (text 4x128, vision 2x64), {args.head} head, float32; documents: one "
          f"{args.grid}x{args.grid}-patch image + ~{TEXT_TOKENS['doc']} tokens; queries ~{TEXT_TOKENS['query']} tokens; "
          f"GradCache budget {args.budget} patches + tokens per chunk; memory: ru_maxrss of a fresh subprocess")
    rows, first = [], None
    for batch in args.batches:
        cached = _run(batch, "cached", args)
        plain = _run(batch, "plain", args) if batch <= args.plain_max else None
        first = first or cached
        rows.append((batch, cached, plain))
        _print_row(batch, cached, plain, first, header=len(rows) == 1)
    peaks = [c["step_peak_mb"] for _, c, _ in rows]
    ratios = [c["step_s"] / p["step_s"] for _, c, p in rows if p]
    print(f"cached step peak, largest / smallest over batches {args.batches[0]}..{args.batches[-1]}: "
          f"{max(peaks) / min(peaks):.2f}x (goal <= 1.2x); time cached / plain: "
          f"{min(ratios):.2f}x .. {max(ratios):.2f}x (goal <= 1.4x)")


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _print_row(batch, cached, plain, first, header: bool) -> None:
    if header:
        print("| global batch | cached step peak MB | x smallest | cached peak RSS MB | plain step peak MB | "
              "plain peak RSS MB | cached step s | plain step s | time cached / plain |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    get = (lambda k: plain[k]) if plain else (lambda k: None)  # noqa: E731
    ratio = cached["step_s"] / plain["step_s"] if plain else None
    print(f"| {batch} | {cached['step_peak_mb']:.0f} | {cached['step_peak_mb'] / first['step_peak_mb']:.2f} | "
          f"{cached['peak_mb']:.0f} | {_fmt(get('step_peak_mb'), '.0f')} | {_fmt(get('peak_mb'), '.0f')} | "
          f"{cached['step_s']:.2f} | {_fmt(get('step_s'), '.2f')} | {_fmt(ratio, '.2f')} |", flush=True)


if __name__ == "__main__":
    main()
