"""Audio front end for speech models: WAV reading, resampling and Whisper's log-mel spectrogram.

Role in the pipeline: the host-side input stage of Whisper (``meganeura transcribe``). It turns a
WAV file into the ``f32[80, 3000]`` log-mel features the encoder takes, in NumPy only (no torch,
librosa, scipy or ffmpeg at run time).

Invariants:
    * ``load_audio`` returns float32 mono in [-1, 1] at the requested rate; integer PCM of width
      ``w`` bytes is scaled by ``2 ** (8 * w - 1)`` (8-bit is unsigned with offset 128), as
      ffmpeg, libsndfile and Whisper's ``load_audio`` do.
    * ``log_mel_spectrogram`` is Whisper's (openai/whisper ``whisper/audio.py``); the arithmetic
      runs in float64 and the result is cast to float32 once. It equals transformers'
      ``WhisperFeatureExtractor`` within 1e-5 on its float64 NumPy path; its default path
      (torch float32 STFT) is up to ~4e-5 off in low-power bins by its own rounding.
    * ``resample`` is a zero-phase polyphase FIR (Kaiser-windowed sinc) with
      ``scipy.signal.resample_poly``'s alignment and zero padding at the ends: with
      ``zero_crossings=10, rolloff=1.0, beta=5.0`` it is ``resample_poly(x, up, down)``.

Formula sources are listed in docs/audio.md.
"""

from __future__ import annotations

import math
import os
import struct
import wave
from pathlib import Path

import numpy as np

__all__ = [
    "CHUNK_LENGTH",
    "HOP_LENGTH",
    "N_FFT",
    "N_FRAMES",
    "N_SAMPLES",
    "SAMPLE_RATE",
    "load_audio",
    "log_mel_spectrogram",
    "mel_filters",
    "pad_or_trim",
    "read_wav",
    "resample",
    "whisper_features",
]

# Whisper's constants (openai/whisper, whisper/audio.py).
SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_LENGTH = 30
N_SAMPLES = CHUNK_LENGTH * SAMPLE_RATE  # 480000 samples in a 30-second chunk
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 frames in a mel spectrogram input

# Resampling filter of resampy's "kaiser_best" (Smith, "Digital Audio Resampling"; resampy's
# filters.py): 64 zero crossings a side, cutoff at 0.9476 of the lower Nyquist rate, Kaiser beta
# 14.77 (about 140 dB stopband). The passband is flat to < 1e-6 up to about 0.87 of Nyquist.
_ZERO_CROSSINGS = 64
_ROLLOFF = 0.9475937167399596
_BETA = 14.769656459379492

_WINDOW_FLOATS = 1 << 21  # resample copies input windows 16 MB at a time
_STFT_FRAMES = 4096  # log_mel_spectrogram transforms frames 13 MB of spectra at a time

_WAVE_FORMAT_PCM = 0x0001
_WAVE_FORMAT_IEEE_FLOAT = 0x0003
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE
_SUPPORTED = "8, 16, 24 or 32-bit integer PCM, or 32 or 64-bit IEEE float"


def read_wav(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Read a WAV file as it is stored: all channels, its own sample rate.

    Integer PCM goes through the standard library's ``wave`` module; IEEE float WAVs
    (WAVE_FORMAT_IEEE_FLOAT) and WAVE_FORMAT_EXTENSIBLE files, which ``wave`` rejects before
    Python 3.12, are read by a small RIFF chunk parser here (Microsoft's "Multimedia Programming
    Interface and Data Specifications 1.0", 1991, and the WAVEFORMATEXTENSIBLE docs).

    Args:
        path: the ``.wav`` file.

    Returns:
        ``(samples, sample_rate)``: samples float32 ``[frames, channels]`` in [-1, 1] for
        integer PCM (float files are passed through as stored), sample rate in Hz.

    Raises:
        FileNotFoundError: no file at ``path``.
        IsADirectoryError: ``path`` is a folder.
        ValueError: not a RIFF/WAVE file, a malformed header, an unsupported format or sample
            width (naming the file and what it holds).
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a folder, expected a WAV file")
    if not path.is_file():
        raise FileNotFoundError(f"audio file {str(path)!r} does not exist (or is not a file)")
    with open(path, "rb") as f:
        head = f.read(12)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise ValueError(
            f"{str(path)!r} is not a WAV file: it starts with {head!r}, expected b'RIFF....WAVE' "
            f"(convert other formats first, e.g. ffmpeg -i in.mp3 -ar 16000 -ac 1 out.wav)"
        )
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            data = w.readframes(w.getnframes())
    except wave.Error:  # a format tag ``wave`` does not read: parse the chunks ourselves
        return _read_riff(path)
    except EOFError as e:
        raise ValueError(f"{str(path)!r} is a truncated WAV file: {e}") from None
    return _decode(path, data, channels, width, is_float=False), rate


def _read_riff(path: Path) -> tuple[np.ndarray, int]:
    raw = path.read_bytes()
    pos, fmt, data = 12, None, None
    while pos + 8 <= len(raw) and (fmt is None or data is None):
        chunk_id, size = raw[pos : pos + 4], struct.unpack_from("<I", raw, pos + 4)[0]
        body = raw[pos + 8 : pos + 8 + size]
        if chunk_id == b"fmt ":
            fmt = body
        elif chunk_id == b"data":
            data = body
        pos += 8 + size + (size & 1)  # chunks are padded to an even size
    if fmt is None or len(fmt) < 16:
        raise ValueError(f"{str(path)!r}: malformed WAV file: no complete 'fmt ' chunk")
    if data is None:
        raise ValueError(f"{str(path)!r}: malformed WAV file: no 'data' chunk")
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _WAVE_FORMAT_EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack_from("<H", fmt, 24)[0]  # first two bytes of the SubFormat GUID
    if tag not in (_WAVE_FORMAT_PCM, _WAVE_FORMAT_IEEE_FLOAT):
        raise ValueError(
            f"{str(path)!r}: unsupported WAV format tag 0x{tag:04x} ({bits}-bit); "
            f"supported: {_SUPPORTED}"
        )
    if channels < 1:
        raise ValueError(f"{str(path)!r}: malformed WAV file: {channels} channels")
    width = block_align // channels
    if width * 8 < bits or width < 1:
        raise ValueError(
            f"{str(path)!r}: malformed WAV file: {bits}-bit samples in a {block_align}-byte "
            f"block of {channels} channels"
        )
    return _decode(path, data, channels, width, is_float=tag == _WAVE_FORMAT_IEEE_FLOAT), rate


def _decode(path: Path, data: bytes, channels: int, width: int, *, is_float: bool) -> np.ndarray:
    """Interleaved little-endian sample bytes -> float32 [frames, channels]."""
    data = data[: len(data) - len(data) % (channels * width)]  # a truncated file's partial frame
    if is_float:
        if width not in (4, 8):
            raise ValueError(
                f"{str(path)!r}: unsupported sample width: {8 * width}-bit IEEE float; "
                f"supported: {_SUPPORTED}"
            )
        x = np.frombuffer(data, dtype="<f4" if width == 4 else "<f8").astype(np.float32)
    elif width == 1:  # 8-bit WAV is unsigned, silence at 128
        x = (np.frombuffer(data, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(data, np.uint8).reshape(-1, 3).astype(np.int32)
        # the three bytes go to the top of an int32; the arithmetic shift back sign-extends
        v = ((b[:, 0] << 8) | (b[:, 1] << 16) | (b[:, 2] << 24)) >> 8
        x = v.astype(np.float64) / float(1 << 23)
    elif width == 4:
        x = np.frombuffer(data, "<i4").astype(np.float64) / float(1 << 31)
    else:
        raise ValueError(
            f"{str(path)!r}: unsupported sample width: {8 * width}-bit integer PCM; "
            f"supported: {_SUPPORTED}"
        )
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1, channels)


def load_audio(path: str | os.PathLike, sr: int = SAMPLE_RATE) -> np.ndarray:
    """Read a WAV file as float32 mono at ``sr`` Hz (Whisper's ``load_audio`` calls ffmpeg).

    Channels are averaged; the signal is then resampled with ``resample`` when the file's rate
    differs (espeak-ng writes 22050 Hz, Whisper takes 16000).

    Args:
        path: the ``.wav`` file (integer PCM 8/16/24/32-bit, or 32/64-bit float).
        sr: output sample rate in Hz.

    Returns:
        float32 ``[samples]``, in [-1, 1] for integer PCM input.

    Raises:
        FileNotFoundError, ValueError: as ``read_wav``.
    """
    samples, rate = read_wav(path)
    mono = samples.mean(axis=1, dtype=np.float64) if samples.shape[1] > 1 else samples[:, 0]
    return resample(mono, rate, sr)


def resample(
    audio: np.ndarray,
    orig_sr: int,
    target_sr: int,
    *,
    zero_crossings: int = _ZERO_CROSSINGS,
    rolloff: float = _ROLLOFF,
    beta: float = _BETA,
) -> np.ndarray:
    """Band-limited resampling by a rational factor: a polyphase Kaiser-windowed-sinc FIR.

    With ``up / down = target_sr / orig_sr`` in lowest terms, the low-pass filter at the
    upsampled rate is ``h[i] = w[i] * sinc(rolloff * (i - H) / max(up, down))``, ``H =
    zero_crossings * max(up, down)``, ``w`` a Kaiser window of ``2H + 1`` taps, scaled to a DC
    gain of ``up`` (``scipy.signal.firwin``'s design); output sample ``n`` is
    ``sum_m x[m] * h[H + n * down - m * up]`` (zero-phase, zeros beyond the ends), its
    polyphase branches computed as blocks of one matrix product. Sources: J. O. Smith,
    "Digital Audio Resampling Home Page" (ccrma.stanford.edu/~jos/resample);
    scipy.signal.resample_poly.

    Args:
        audio: float ``[samples]``.
        orig_sr, target_sr: rates in Hz (positive integers).
        zero_crossings: sinc zero crossings on each side of the filter (its half length).
        rolloff: cutoff as a fraction of the lower of the two Nyquist rates.
        beta: Kaiser window shape; larger trades a wider transition for more stopband rejection.

    Returns:
        float32 ``[ceil(samples * target_sr / orig_sr)]``; ``audio`` as float32 when the rates
        are equal.

    Raises:
        ValueError: a rate that is not a positive integer, or ``audio`` not 1-D.
    """
    x = np.asarray(audio, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"resample: audio must be 1-D [samples], got shape {x.shape}")
    for name, rate in (("orig_sr", orig_sr), ("target_sr", target_sr)):
        if int(rate) != rate or rate <= 0:
            raise ValueError(f"resample: {name} must be a positive integer in Hz, got {rate!r}")
    g = math.gcd(int(orig_sr), int(target_sr))
    up, down = int(target_sr) // g, int(orig_sr) // g
    if up == down:
        return x.astype(np.float32)
    n_in = x.shape[0]
    n_out = -(-n_in * up // down)
    if n_out == 0:
        return np.zeros(0, np.float32)
    h = _lowpass(up, down, zero_crossings, rolloff, beta)
    half = (h.shape[0] - 1) // 2
    taps = -(-h.shape[0] // up)  # taps per polyphase branch
    h = np.concatenate([h, np.zeros(taps * up - h.shape[0])])
    # Output n applies h[t % up + k * up] to x[t // up - k], k < taps, t = n * down + half.
    # Every `period` outputs (a multiple of `up`) the inputs move by `stride`, so with
    # Y[j, c] = y[j * period + c], a block of columns is one product of a matrix of input
    # windows (a row per j) and one of weights (each column its branch at its offset): BLAS does
    # that far faster than a loop over branches. The columns of a block span about 2 * taps
    # inputs, so about half of the weights are zeros.
    cols = max(1, -(-taps * up // down))  # outputs whose inputs move by about `taps`
    period = up * -(-cols // up)
    stride = period // up * down
    t = np.arange(period) * down + half
    newest, phase = t // up, t % up
    rows = -(-n_out // period)
    pad = taps - 1  # x[m] is xpad[m + pad]
    right = max(0, int(newest[-1]) + (rows - 1) * stride + 1 - n_in)
    xpad = np.concatenate([np.zeros(pad), x, np.zeros(right)])
    out = np.empty((rows, period))
    for c0 in range(0, period, cols):
        c1 = min(period, c0 + cols)
        lo = int(newest[c0]) - (taps - 1)
        span = int(newest[c1 - 1]) - lo + 1
        k = newest[None, c0:c1] - lo - np.arange(span)[:, None]  # [span, c1 - c0]
        inside = (k >= 0) & (k < taps)
        weights = np.where(inside, h[np.where(inside, phase[c0:c1] + k * up, 0)], 0.0)
        windows = np.lib.stride_tricks.sliding_window_view(xpad, span)[lo + pad :: stride]
        block = max(1, _WINDOW_FLOATS // span)
        for j in range(0, rows, block):
            rows_j = np.ascontiguousarray(windows[j : min(rows, j + block)])
            out[j : j + rows_j.shape[0], c0:c1] = rows_j @ weights
    y = out.reshape(-1)[:n_out]
    return y.astype(np.float32)


def _lowpass(up: int, down: int, zero_crossings: int, rolloff: float, beta: float) -> np.ndarray:
    """scipy.signal.firwin(2H + 1, rolloff / max_rate, window=("kaiser", beta)) * up."""
    max_rate = max(up, down)
    half = zero_crossings * max_rate
    i = np.arange(-half, half + 1, dtype=np.float64)
    h = np.sinc(rolloff * i / max_rate) * np.kaiser(2 * half + 1, beta)
    return h * (up / h.sum())


def pad_or_trim(audio: np.ndarray, length: int = N_SAMPLES, *, axis: int = -1) -> np.ndarray:
    """Zero-pad or cut ``audio`` to ``length`` samples along ``axis`` (Whisper's pad_or_trim).

    Args:
        audio: ``[..., samples]`` (any dtype).
        length: samples to keep; 480000 is Whisper's 30-second input.
        axis: the time axis.

    Returns:
        The array with ``shape[axis] == length``, same dtype (a view when it is cut).
    """
    audio = np.asarray(audio)
    n = audio.shape[axis]
    if n > length:
        index = [slice(None)] * audio.ndim
        index[axis] = slice(0, length)
        return audio[tuple(index)]
    if n < length:
        widths = [(0, 0)] * audio.ndim
        widths[axis] = (0, length - n)
        return np.pad(audio, widths)
    return audio


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    # Slaney's Auditory Toolbox scale: linear below 1 kHz (3 mels per 200 Hz), log above.
    f = np.asarray(f, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(
        f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / log_step, f / (200 / 3)
    )


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(log_step * (m - 15.0)), m * (200 / 3))


def mel_filters(
    sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = 80, *, dtype=np.float32
) -> np.ndarray:
    """Slaney-style triangular mel filter bank, as librosa.filters.mel(sr, n_fft, n_mels).

    ``n_mels + 2`` points equally spaced on the Slaney mel scale from 0 Hz to ``sr / 2`` are the
    edges and centres of triangles over the FFT bin frequencies ``k * sr / n_fft``; each
    triangle is scaled by ``2 / (f[i + 2] - f[i])`` (Slaney's area normalization), so each
    filter has about constant energy. Whisper ships this matrix (float32) as
    ``assets/mel_filters.npz``; transformers computes it with ``mel_filter_bank(...,
    norm="slaney", mel_scale="slaney")``. Computed in float64.

    Args:
        sr: sample rate in Hz.
        n_fft: FFT length.
        n_mels: number of filters (Whisper: 80, large-v3: 128).
        dtype: of the result.

    Returns:
        ``[n_mels, 1 + n_fft // 2]`` weights (Whisper's orientation: ``filters @ power``).

    Raises:
        ValueError: ``n_fft < 2`` or ``n_mels < 1``.
    """
    if n_fft < 2 or n_mels < 1:
        raise ValueError(f"mel_filters: need n_fft >= 2 and n_mels >= 1, got {n_fft}, {n_mels}")
    fft_freqs = np.linspace(0.0, sr / 2, 1 + n_fft // 2)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sr / 2), n_mels + 2))
    width = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]  # [n_mels + 2, bins]
    lower = -ramps[:-2] / width[:-1, None]
    upper = ramps[2:] / width[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(dtype)


def log_mel_spectrogram(
    audio: np.ndarray | str | os.PathLike,
    n_mels: int = 80,
    n_fft: int = N_FFT,
    hop_length: int = HOP_LENGTH,
    padding: int = 0,
    *,
    sr: int = SAMPLE_RATE,
) -> np.ndarray:
    """Whisper's log-mel spectrogram (openai/whisper ``whisper/audio.py``).

    ``audio`` plus ``padding`` zeros is reflect-padded by ``n_fft // 2`` on both sides (centred
    frames, as ``torch.stft(center=True)``), cut into frames every ``hop_length`` samples,
    windowed by a periodic Hann window ``0.5 - 0.5 cos(2 pi n / n_fft)``; ``|rfft|^2`` of each
    frame, the last frame dropped, is mapped by ``mel_filters``; then ``x = log10(max(mel,
    1e-10))``, ``x = max(x, x.max() - 8)``, ``(x + 4) / 4``. The floor uses the maximum of this
    whole call, so features of a 30-second chunk depend on what else is in the chunk.

    Args:
        audio: float ``[samples]`` at ``sr`` Hz, or the path of a WAV file (``load_audio``).
        n_mels: mel bins (80; 128 for large-v3).
        n_fft: FFT length (400 = 25 ms at 16 kHz).
        hop_length: frame step (160 = 10 ms at 16 kHz).
        padding: zeros appended to ``audio`` first (Whisper's ``padding`` argument).
        sr: sample rate, for the mel filters.

    Returns:
        float32 ``[n_mels, frames]``, ``frames = (samples + padding) // hop_length``.

    Raises:
        ValueError: ``audio`` not 1-D, or too short to reflect-pad (needs more than
            ``n_fft // 2`` samples).
    """
    if isinstance(audio, (str, os.PathLike)):
        audio = load_audio(audio, sr)
    x = np.asarray(audio, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"log_mel_spectrogram: audio must be 1-D [samples], got shape {x.shape}")
    if padding > 0:
        x = np.pad(x, (0, padding))
    if x.shape[0] <= n_fft // 2:
        raise ValueError(
            f"log_mel_spectrogram: audio has {x.shape[0]} samples; reflect padding needs more "
            f"than n_fft // 2 = {n_fft // 2}"
        )
    x = np.pad(x, n_fft // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop_length][:-1]
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann
    filters = mel_filters(sr, n_fft, n_mels, dtype=np.float64)
    mel = np.empty((n_mels, frames.shape[0]))
    step = _STFT_FRAMES  # an hour of audio would need 2.3 GB of spectra at once
    for i in range(0, frames.shape[0], step):
        spectrum = np.fft.rfft(frames[i : i + step] * window, axis=-1)
        mel[:, i : i + step] = filters @ (spectrum.real**2 + spectrum.imag**2).T
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def whisper_features(audio: np.ndarray | str | os.PathLike, n_mels: int = 80) -> np.ndarray:
    """The encoder's input: 16 kHz audio padded or cut to 30 s, then ``log_mel_spectrogram``.

    Equal to ``WhisperFeatureExtractor()(audio, sampling_rate=16000).input_features[0]`` (its
    default pads with zeros to 480000 samples and truncates longer input).

    Args:
        audio: float ``[samples]`` at 16 kHz, or the path of a WAV file (``load_audio``).
        n_mels: mel bins (80; 128 for large-v3).

    Returns:
        float32 ``[n_mels, 3000]``.
    """
    if isinstance(audio, (str, os.PathLike)):
        audio = load_audio(audio, SAMPLE_RATE)
    return log_mel_spectrogram(pad_or_trim(np.asarray(audio, dtype=np.float32)), n_mels)
