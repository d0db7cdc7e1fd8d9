"""Text generation with a causal LM's KV cache: prefill in length buckets, then one compiled
decode program per token, the cache kept on the GPU between calls (chat).

A :class:`Generator` owns where the cache stands: the token ids its slots hold (``history``)
and, per sequence, the leading padding. Each call:

  1. finds the longest prefix of the new ids that the cache already holds (a chat's earlier
     turns) and rolls back to it (nothing is copied: slots past the attended length are never
     read, and are overwritten);
  2. prefills the rest in chunks of at most ``max(buckets)`` tokens, each right-padded to the
     smallest bucket that holds it, so a prompt of any length compiles at most one program
     per bucket (a bucket's first use costs a trace, a compile and pipeline creation; later
     prompts of any length in it cost nothing more). Prompts of a batch are left-padded to a
     common length first (their padding is masked and their positions shifted, so each
     sequence computes what it would alone);
  3. decodes one token per sequence per step with the decode program (input [B, 1], the slot a
     runtime value): greedy decoding takes the argmax on the GPU and reads back 4 bytes per
     sequence; sampling reads the last logits and draws on the host.

Sampling follows transformers' order: logits / temperature, then top-k, then top-p (nucleus:
the smallest set of most probable tokens whose probability reaches ``top_p``, Holtzman et al.
2020), then a draw from the renormalized distribution with ``numpy.random.default_rng(seed)``.
``temperature=0`` is greedy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

#: Prefill lengths compiled (a chunk of n tokens runs in the smallest bucket >= n).
PREFILL_BUCKETS = (16, 64, 256, 1024)
#: Cache lengths are rounded up to a multiple of this (a new length compiles new programs).
CACHE_GRANULE = 512


@dataclass
class GenerationOutput:
    """What :meth:`Generator.generate` produced.

    Attributes:
        sequences: per sequence, the generated token ids (a stop token that ended it
            included, as transformers includes eos).
        texts: per sequence, the decoded text of ``sequences`` without the stop token or
            string (None without a tokenizer).
        prompt_tokens: per sequence, the prompt's length in tokens.
        finish_reasons: per sequence, ``"stop"`` (a stop token or string) or ``"length"``.
        time_to_first_token: seconds from the call to the first generated token (prefill
            and the first sampling).
        decode_seconds: seconds spent producing the remaining tokens.
        tokens_per_second: tokens per sequence per second after the first
            (``(n - 1) / decode_seconds``; 0 for fewer than two tokens).
    """

    sequences: list[list[int]]
    texts: list[str] | None
    prompt_tokens: list[int]
    finish_reasons: list[str]
    time_to_first_token: float
    decode_seconds: float
    tokens_per_second: float = field(default=0.0)


def bucket_for(n: int, buckets: Sequence[int] = PREFILL_BUCKETS) -> int:
    """The smallest bucket holding ``n`` tokens (n <= max(buckets))."""
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ValueError(f"{n} tokens exceed the largest prefill bucket {max(buckets)}")


def sample(logits: np.ndarray, temperature: float, top_k, top_p, rng) -> np.ndarray:
    """Token ids int [B] drawn from logits f32 [B, V] (see the module docstring)."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return np.argmax(logits, axis=-1)
    z = logits / temperature
    if top_k:
        k = min(int(top_k), z.shape[-1])
        kth = np.partition(z, -k, axis=-1)[:, -k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the more probable tokens
        drop = np.zeros_like(p, bool)
        np.put_along_axis(drop, order, before >= top_p, axis=-1)
        p = np.where(drop, 0.0, p)
        p /= p.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p])


def _check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise ValueError(f"temperature must be a float >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


class Generator:
    """Generation for one model with a KV cache that persists between calls.

    Args:
        model: a ``meganeura.models.llama.LlamaForCausalLM`` (anything with its ``forward``
            cache arguments, ``setup_cache`` and ``config``).
        tokenizer: a ``meganeura.io.tokenizer.Tokenizer`` for text prompts (default: the
            model's own).
        max_length: slots of the cache per sequence (default: grown in steps of
            ``CACHE_GRANULE`` as needed; a chat keeps what it holds only while it fits).
        buckets: prefill lengths to compile.
        precision: ``"strict"`` (f32) or ``"fast"`` (``CompileOptions.precision``).
        device: a runtime Device (default: the default device).
        chain: greedy decoding submits ``greedy_step`` programs back to back (default);
            False runs one decode call per token, reading its token id back each time
            (for comparison).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        max_length: int | None = None,
        buckets=None,
        precision: str = "strict",
        device=None,
        chain: bool = True,
    ):
        from ..nn.compiled import CompiledModule

        self.model = model
        self.forward = CompiledModule(model, precision=precision, device=device)
        self._chains: dict = {}  # compiled greedy_step programs
        self._token = object()  # marks the model's cache as written by this generator
        self.chain = chain
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self.max_length = max_length
        self.buckets = tuple(sorted(buckets or PREFILL_BUCKETS))
        self.history: list[list[int]] = []  # prompt + generated ids, per sequence
        self.cached = 0  # leading ids of history[0] whose keys and values the cache holds
        self.pad: np.ndarray | None = None  # leading padding slots per sequence

    # ------------------------------------------------------------------------ inputs
    def _as_ids(self, prompt) -> tuple[list[list[int]], bool]:
        """(token id lists, whether the prompt was text)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (pass token ids instead)")
            return [self.tokenizer.encode(p) for p in prompt], True
        if (
            isinstance(prompt, (list, tuple))
            and prompt
            and all(isinstance(t, (int, np.integer)) for t in prompt)
        ):
            prompt = [prompt]
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be text, token ids, or a non-empty list of either")
        out = []
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompt):
            ids = [int(t) for t in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
            out.append(ids)
        return out, False

    # ------------------------------------------------------------------------ the cache
    def reset(self) -> None:
        """Forget what the cache holds (the next call prefills from slot 0)."""
        self.history, self.cached, self.pad = [], 0, None

    def _ensure_cache(self, batch: int, needed: int) -> bool:
        """Make the cache hold ``needed`` slots per sequence; False when it had to be
        reallocated (its content lost)."""
        shape = self.model.cache_shape
        if shape is not None and shape[0] == batch and shape[1] >= needed:
            return True
        length = self.max_length or -(-needed // CACHE_GRANULE) * CACHE_GRANULE
        if needed > length:
            raise ValueError(
                f"{needed} tokens do not fit the cache's max_length {length} (pass a larger "
                "max_length, or reset the conversation)"
            )
        self.model.setup_cache(batch, length)
        return False

    def _run(self, ids: np.ndarray, start: int, keep, greedy: bool):
        return self.forward(
            ids.astype(np.int32),
            cache_position=np.asarray(start, np.int32),
            pad=self.pad,
            logits_to_keep=keep,
            greedy=greedy,
        )

    def _prefill(self, suffixes: list[list[int]], start: int, greedy: bool):
        """Run ``suffixes`` (equal lengths) from slot ``start``; the last position's output."""
        n = len(suffixes[0])
        chunk = self.buckets[-1]
        out = None
        for c0 in range(0, n, chunk):
            part = [s[c0 : c0 + chunk] for s in suffixes]
            m = len(part[0])
            # The padded chunk must fit the cache: its slots past the end would not be
            # written, and the attended length would clip (a cache shorter than a bucket).
            room = self.model.cache_shape[1] - (start + c0)
            size = min(bucket_for(m, self.buckets), room)
            ids = np.zeros((len(part), size), np.int32)
            ids[:, :m] = part
            keep = np.asarray([m - 1], np.int32)  # runtime: no program per real length
            out = self._run(ids, start + c0, keep, greedy)
        return out

    # ------------------------------------------------------------------------ generation
    def generate(
        self,
        prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str | int] | None = None,
        streamer: Callable[[str], None] | None = None,
    ) -> GenerationOutput:
        """Continue ``prompt`` by up to ``max_new_tokens`` tokens per sequence.

        Args:
            prompt: text, a list of texts, token ids (a list of ints or an int array), or a
                list of id lists (a batch; lengths may differ).
            max_new_tokens: most tokens generated per sequence.
            temperature: 0 for greedy decoding (argmax on the GPU), else the softmax
                temperature of sampling.
            top_k, top_p: sampling filters (None: off).
            seed: seed of the sampling generator (None: fresh entropy).
            stop: stop token ids and/or strings (default: the tokenizer's stop tokens, else
                the config's eos ids). Generation of a sequence ends after one of them.
            streamer: called with each new piece of text of sequence 0 as it is produced
                (needs a tokenizer).

        Returns:
            :class:`GenerationOutput`.

        Raises:
            ValueError: bad arguments (named), a prompt with ids outside the vocabulary, or
                more tokens than the cache's ``max_length``.
        """
        _check_sampling(max_new_tokens, temperature, top_k, top_p)
        t0 = time.perf_counter()
        prompts, _ = self._as_ids(prompt)
        stop_ids, stop_strings = self._stops(stop)
        batch = len(prompts)
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        common = self._common_prefix(prompts)
        pad = np.asarray([longest - n for n in lengths], np.int32)
        kept = self._ensure_cache(batch, int(pad.max()) + longest + max_new_tokens)
        if not kept or self.model.__dict__.get("_cache_owner") is not self._token:
            common = 0  # reallocated, or another generator wrote the model's cache since
        object.__setattr__(self.model, "_cache_owner", self._token)
        if common == 0:
            self.pad = pad if pad.any() else None
            suffixes = [[0] * int(k) + ids for k, ids in zip(pad, prompts)]
        else:  # a conversation goes on (batch 1, no padding)
            suffixes = [prompts[0][common:]]
        start = common
        greedy = temperature == 0
        rng = np.random.default_rng(seed)
        self.history, self.cached = [], 0  # a prefill that fails leaves nothing to reuse
        out = self._prefill(suffixes, start, greedy)
        slot = start + len(suffixes[0])
        self.history = [list(p) for p in prompts]
        self.cached = len(prompts[0]) if batch == 1 else 0

        sequences: list[list[int]] = [[] for _ in range(batch)]
        done = [False] * batch
        reasons = ["length"] * batch
        streamed = 0

        def accept(tokens) -> bool:
            """Book one token per sequence; True when every sequence has finished."""
            nonlocal streamed
            for b in range(batch):
                if done[b]:
                    continue
                t = int(tokens[b])
                sequences[b].append(t)
                self.history[b].append(t)
                if t in stop_ids:
                    done[b], reasons[b] = True, "stop"
                elif stop_strings:
                    text = self.tokenizer.decode(sequences[b])
                    if any(x in text for x in stop_strings):
                        done[b], reasons[b] = True, "stop"
            if streamer is not None and self.tokenizer is not None:
                streamed = self._stream(streamer, sequences[0], stop_ids, streamed, done[0])
            return all(done)

        if greedy:
            first = np.asarray(out, np.int64).reshape(batch)
        else:
            first = sample(np.asarray(out).reshape(batch, -1), temperature, top_k, top_p, rng)
        ttft = time.perf_counter() - t0
        decode_start = time.perf_counter()
        finished = accept(first)
        remaining = max_new_tokens - 1
        if greedy and self.chain and not finished and remaining:
            self._chained(first, slot, remaining, accept, streamer is not None)
        else:
            tokens = first
            while not finished and remaining:
                feed = np.where(done, 0, tokens).astype(np.int32).reshape(batch, 1)
                out = self._run(feed, slot, 1, greedy)
                slot += 1
                self.cached += batch == 1
                if greedy:  # the decode program returned the argmax ids
                    tokens = np.asarray(out, np.int64).reshape(batch)
                else:
                    logits = np.asarray(out).reshape(batch, -1)
                    tokens = sample(logits, temperature, top_k, top_p, rng)
                finished = accept(tokens)
                remaining -= 1
        decode_seconds = time.perf_counter() - decode_start
        n = max(len(s) for s in sequences)
        texts = None
        if self.tokenizer is not None:
            texts = [self._final_text(s, stop_ids, stop_strings) for s in sequences]
        return GenerationOutput(
            sequences,
            texts,
            lengths,
            reasons,
            ttft,
            decode_seconds,
            (n - 1) / decode_seconds if n > 1 and decode_seconds > 0 else 0.0,
        )

    def _chained(self, first, slot: int, remaining: int, accept, streaming: bool) -> None:
        """Greedy decoding with no host round trip per token: the model's ``greedy_step``
        program is submitted ``block`` times back to back (each step reads the token the
        previous one wrote on the GPU), then the tokens are read in one go (``block`` is 8
        when streaming, for a steady output, else up to ``TOKEN_RING``)."""
        from ..models.llama import TOKEN_RING

        model = self.model
        batch = len(first)
        runner = self._chain_runner(self.pad is not None)
        model.next_tokens.copy_(np.asarray(first, np.int32).reshape(batch, 1))
        model.position.copy_(np.asarray([slot], np.int32))
        model.steps.copy_(np.zeros(1, np.int32))
        if self.pad is not None:
            model.pad.copy_(self.pad)
        block = 8 if streaming else TOKEN_RING
        done_steps = 0
        while remaining:
            k = min(block, remaining)
            for _ in range(k):
                runner.run({}, ())
            ring = model.generated.data
            for i in range(done_steps, done_steps + k):
                self.cached += batch == 1
                if accept(ring[:, i % TOKEN_RING]):
                    return
            done_steps += k
            remaining -= k

    def _chain_runner(self, padded: bool):
        """The compiled ``greedy_step`` program for the model's current cache and modes."""
        from ..compile import CompileOptions
        from ..nn.compiled import ProgramRunner, trace_call

        key = (self.model.signature_key(), padded)
        runner = self._chains.get(key)
        if runner is None:
            traced = trace_call(self.model, self.model.greedy_step, (), {"padded": padded})
            options = CompileOptions(
                precision=self.forward.options.precision,
                fuse=self.forward.options.fuse,
                shared_parameters=True,
            )
            runner = self._chains[key] = ProgramRunner(traced, options, self.forward.device)
            while len(self._chains) > 2:  # programs of an older cache: free their sessions
                self._chains.pop(next(iter(self._chains))).session.close()
        return runner

    def _common_prefix(self, prompts: list[list[int]]) -> int:
        """Tokens of a one-sequence prompt whose keys and values the cache already holds
        (a chat's earlier turns); 0 to start over (always for a batch)."""
        if len(prompts) != 1 or len(self.history) != 1 or self.pad is not None:
            return 0
        h, p = self.history[0], prompts[0]
        limit = min(self.cached, len(p) - 1)  # at least one token must run
        k = 0
        while k < limit and h[k] == p[k]:
            k += 1
        return k

    def _stops(self, stop) -> tuple[set[int], list[str]]:
        if stop is None:
            tok = self.tokenizer
            ids = getattr(tok, "stop_token_ids", None) if tok is not None else None
            return set(ids or self.model.config.stop_token_ids), []
        ids = {int(s) for s in stop if isinstance(s, (int, np.integer))}
        strings = [s for s in stop if isinstance(s, str)]
        if strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (pass stop token ids instead)")
        return ids, strings

    def _final_text(self, ids: list[int], stop_ids, stop_strings) -> str:
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in stop_strings:
            k = text.find(s)
            if k >= 0:
                text = text[:k]
        return text

    def _stream(self, streamer, ids: list[int], stop_ids, streamed: int, finished: bool) -> int:
        """Emit the new, complete text of ``ids`` past ``streamed`` characters."""
        body = ids[:-1] if ids and ids[-1] in stop_ids else ids
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        if text.endswith("\ufffd") and not finished:
            return streamed  # a multi-byte character is still incomplete
        if len(text) > streamed:
            streamer(text[streamed:])
        return len(text)
