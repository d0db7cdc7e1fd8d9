"""The audio front end (meganeura/audio.py) against transformers, torch and scipy (no GPU).

References: transformers' ``WhisperFeatureExtractor`` (its NumPy float64 path, and its default
torch float32 path) and ``mel_filter_bank``; Whisper's log-mel written in torch float64;
``scipy.signal.resample_poly`` with filters designed by ``scipy.signal.firwin``; WAV files
written by the standard library's ``wave`` or byte by byte, and by espeak-ng.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import wave

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import mel_filter_bank
from transformers.models.whisper import feature_extraction_whisper

from meganeura import audio
from meganeura.audio import (
    load_audio,
    log_mel_spectrogram,
    mel_filters,
    pad_or_trim,
    read_wav,
    resample,
    whisper_features,
)

SR = 16000
rng = np.random.default_rng(7)  # reseeded per test by tests/conftest.py


def _random() -> np.ndarray:
    return (0.1 * rng.standard_normal(5 * SR)).astype(np.float32)


def _chirp() -> np.ndarray:  # 100 Hz to 7.9 kHz over 3 s, linear
    t = np.arange(3 * SR) / SR
    return (0.5 * np.sin(2 * np.pi * (100 * t + 7800 / 6 * t**2))).astype(np.float32)


def _speech_like() -> np.ndarray:
    """Voiced syllables: a wobbling 120 Hz pitch, two formants, a faint noise floor, silences."""
    t = np.arange(2 * SR) / SR
    f0 = 120 + 20 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SR
    x = np.zeros_like(t)
    for k in range(1, 40):
        gain = np.exp(-(((k * f0 - 700) / 300) ** 2)) + 0.5 * np.exp(
            -(((k * f0 - 1800) / 400) ** 2)
        )
        x += gain * np.sin(k * phase) / k
    x = x * np.clip(np.sin(2 * np.pi * 1.5 * t), 0, None) + 0.003 * rng.standard_normal(t.size)
    x = np.concatenate([np.zeros(SR // 2), x, np.zeros(SR // 4)])
    return (0.5 * x / np.abs(x).max()).astype(np.float32)


SIGNALS = {"random": _random, "chirp": _chirp, "speech_like": _speech_like}


def _torch_float64_log_mel(x: np.ndarray, n_mels=80, n_fft=400, hop=160) -> np.ndarray:
    """Whisper's log_mel_spectrogram (openai/whisper audio.py) in torch float64."""
    w = torch.from_numpy(np.asarray(x, np.float64))
    stft = torch.stft(
        w, n_fft, hop, window=torch.hann_window(n_fft, dtype=torch.float64), return_complex=True
    )
    power = stft[..., :-1].abs() ** 2
    filters = mel_filter_bank(1 + n_fft // 2, n_mels, 0.0, SR / 2, SR, "slaney", "slaney")
    log_spec = (torch.from_numpy(filters).T @ power).clamp(min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).numpy()


def _transformers_features(x: np.ndarray) -> np.ndarray:
    return WhisperFeatureExtractor()(x, sampling_rate=SR, return_tensors="np").input_features[0]


# ---- mel filters and features ----


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_match_transformers(n_mels):
    ref = mel_filter_bank(201, n_mels, 0.0, 8000.0, SR, norm="slaney", mel_scale="slaney").T
    got = mel_filters(SR, 400, n_mels)
    assert got.shape == (n_mels, 201) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mel_filters(SR, 400, n_mels, dtype=np.float64), ref, atol=1e-15)


@pytest.mark.parametrize("name", list(SIGNALS))
def test_whisper_features_match_transformers_numpy_path(name, monkeypatch):
    """WhisperFeatureExtractor as it runs without torch: NumPy, float64, like ours."""
    x = SIGNALS[name]()
    monkeypatch.setattr(feature_extraction_whisper, "is_torch_available", lambda: False)
    ref = _transformers_features(x)
    got = whisper_features(x)
    assert got.shape == (80, 3000) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def _check_against_transformers_default(got: np.ndarray, x: np.ndarray) -> None:
    """transformers' default call (torch installed) takes the STFT in float32. Where a bin's
    power is 1e-6..1e-8 of the loudest (a tone's far leakage, a chance dip of noise), that
    rounding (about 1e-7 of the peak magnitude) moves its log by up to ~7e-5: the default path
    is that far from its own float64 twin. Ours equals the float64 computation to 1e-6, so it
    is within that rounding of the default path, and within 1e-5 where the rounding is."""
    ref32 = _transformers_features(x)
    ref64 = _torch_float64_log_mel(pad_or_trim(x))
    np.testing.assert_allclose(got, ref64, rtol=0, atol=1e-6)
    float32_error = np.abs(ref32 - ref64)
    assert np.all(np.abs(got - ref32) <= float32_error + 1e-6)
    small = float32_error <= 1e-6
    np.testing.assert_allclose(got[small], ref32[small], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(SIGNALS))
def test_whisper_features_match_transformers_default(name):
    x = SIGNALS[name]()
    got = whisper_features(x)
    _check_against_transformers_default(got, x)
    if name != "chirp":  # the chirp's leakage is the case where float32 rounding exceeds 1e-5
        np.testing.assert_allclose(got, _transformers_features(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_spectrogram_any_length_matches_torch_float64(n_mels):
    x = (0.3 * rng.standard_normal(12345)).astype(np.float32)
    got = log_mel_spectrogram(x, n_mels=n_mels)
    assert got.shape == (n_mels, 12345 // 160)
    np.testing.assert_allclose(got, _torch_float64_log_mel(x, n_mels), rtol=0, atol=1e-6)
    # ``padding`` appends zeros before the STFT, as Whisper's argument does
    padded = log_mel_spectrogram(x, n_mels=n_mels, padding=1000)
    assert padded.shape == (n_mels, 13345 // 160)
    np.testing.assert_allclose(padded, log_mel_spectrogram(np.pad(x, (0, 1000)), n_mels=n_mels))


def test_log_mel_spectrogram_in_frame_blocks_gives_the_same_values(monkeypatch):
    x = (0.3 * rng.standard_normal(5000)).astype(np.float32)
    whole = log_mel_spectrogram(x)
    monkeypatch.setattr(audio, "_STFT_FRAMES", 7)  # 31 frames in blocks of 7
    np.testing.assert_allclose(log_mel_spectrogram(x), whole, rtol=0, atol=1e-7)


def test_log_mel_spectrogram_rejects_bad_input():
    with pytest.raises(ValueError, match="1-D"):
        log_mel_spectrogram(np.zeros((2, 1000)))
    with pytest.raises(ValueError, match="200 samples; reflect padding needs more"):
        log_mel_spectrogram(np.zeros(200))


def test_pad_or_trim():
    x = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(pad_or_trim(x, 4), [0, 1, 2, 3])
    np.testing.assert_array_equal(pad_or_trim(x, 12), list(range(10)) + [0, 0])
    assert pad_or_trim(x, 10) is x
    assert pad_or_trim(x).shape == (480000,) and pad_or_trim(x).dtype == np.float32
    batch = np.ones((2, 5))
    np.testing.assert_array_equal(pad_or_trim(batch, 3, axis=0), [[1] * 5, [1] * 5, [0] * 5])
    np.testing.assert_array_equal(pad_or_trim(batch, 1, axis=0), [[1] * 5])
    np.testing.assert_array_equal(
        pad_or_trim(np.arange(12).reshape(3, 4), 2), [[0, 1], [4, 5], [8, 9]]
    )


# ---- resampling ----


@pytest.mark.parametrize("freq", [440.0, 3000.0, 6500.0])
def test_resample_22050_to_16000_keeps_a_sine(freq):
    n = 22050 // 2
    x = 0.8 * np.sin(2 * np.pi * freq * np.arange(n) / 22050)
    y = resample(x, 22050, 16000)
    assert y.dtype == np.float32 and y.shape == (-(-n * 16000 // 22050),)
    t = np.arange(y.size) / 16000
    inner = slice(800, -800)  # the filter reaches 4 ms past each end, where zeros come in
    expected = 0.8 * np.sin(2 * np.pi * freq * t)
    np.testing.assert_allclose(y[inner], expected[inner], rtol=0, atol=1e-3)
    # amplitude and phase by least squares at the input's frequency
    basis = np.stack([np.sin(2 * np.pi * freq * t), np.cos(2 * np.pi * freq * t)], 1)[inner]
    (a, b), *_ = np.linalg.lstsq(basis, y[inner].astype(np.float64), rcond=None)
    assert abs(np.hypot(a, b) - 0.8) < 1e-3 and abs(b) < 1e-3


def test_resample_rejects_tones_above_the_new_nyquist():
    x = np.sin(2 * np.pi * 9000.0 * np.arange(22050) / 22050)  # would alias to 7 kHz
    y = resample(x, 22050, 16000)
    assert np.sqrt(np.mean(y[800:-800].astype(np.float64) ** 2)) < 1e-5


@pytest.mark.parametrize(
    "orig_sr,target_sr,n",
    [(22050, 16000, 4001), (16000, 22050, 999), (48000, 16000, 3001), (8000, 16000, 1001)],
)
def test_resample_matches_scipy_resample_poly(orig_sr, target_sr, n):
    signal = pytest.importorskip("scipy.signal")
    x = rng.standard_normal(n)
    g = np.gcd(orig_sr, target_sr)
    up, down = target_sr // g, orig_sr // g
    # scipy's default filter: 10 zero crossings, cutoff at Nyquist, Kaiser beta 5
    scipy_default = signal.resample_poly(x, up, down)
    got = resample(x, orig_sr, target_sr, zero_crossings=10, rolloff=1.0, beta=5.0)
    np.testing.assert_allclose(got, scipy_default, rtol=0, atol=1e-6)
    # our default filter, designed by scipy.signal.firwin
    m = max(up, down)
    h = signal.firwin(2 * 64 * m + 1, audio._ROLLOFF / m, window=("kaiser", audio._BETA))
    np.testing.assert_allclose(
        resample(x, orig_sr, target_sr), signal.resample_poly(x, up, down, window=h), atol=1e-6
    )


def test_resample_in_row_blocks_gives_the_same_samples(monkeypatch):
    x = rng.standard_normal(3000)
    whole = resample(x, 22050, 16000)
    monkeypatch.setattr(audio, "_WINDOW_FLOATS", 1000)  # a few rows of windows at a time
    np.testing.assert_allclose(resample(x, 22050, 16000), whole, rtol=0, atol=1e-7)


def test_resample_edge_cases():
    x = np.arange(5.0)
    np.testing.assert_array_equal(resample(x, 16000, 16000), x.astype(np.float32))
    assert resample(np.zeros(0), 22050, 16000).shape == (0,)
    with pytest.raises(ValueError, match="orig_sr must be a positive integer in Hz, got 0"):
        resample(x, 0, 16000)
    with pytest.raises(ValueError, match=r"1-D \[samples\], got shape \(2, 3\)"):
        resample(np.zeros((2, 3)), 22050, 16000)


# ---- WAV files ----


def _write_wav(path, ints: np.ndarray, width: int, rate: int) -> None:
    """ints [frames, channels] -> a PCM WAV through the standard library's writer."""
    if width == 1:
        data = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        data = ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    else:
        data = ints.astype(f"<i{width}").tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(ints.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(data)


def _write_riff(path, tag: int, channels: int, rate: int, bits: int, data: bytes, ext=None):
    """A WAV built byte by byte; ``ext`` makes it WAVE_FORMAT_EXTENSIBLE with that subformat."""
    block = channels * (bits // 8)
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    if ext is not None:
        guid = struct.pack("<H", ext) + bytes.fromhex("000000001000800000aa00389b71")
        fmt += struct.pack("<HHI", 22, bits, 0) + guid
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data + b"\0" * (len(data) & 1)
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


@pytest.mark.parametrize("channels", [1, 2], ids=["mono", "stereo"])
@pytest.mark.parametrize("width", [1, 2, 3, 4], ids=["pcm8", "pcm16", "pcm24", "pcm32"])
def test_wav_round_trip(width, channels, tmp_path):
    lo, hi = -(2 ** (8 * width - 1)), 2 ** (8 * width - 1) - 1
    ints = rng.integers(lo, hi, size=(500, channels), endpoint=True, dtype=np.int64)
    ints[:2] = [[lo] * channels, [hi] * channels]  # the extremes: -1 and 1 - 2^(1 - bits)
    _write_wav(tmp_path / "a.wav", ints, width, 22050)
    samples, rate = read_wav(tmp_path / "a.wav")
    expected = ints / 2.0 ** (8 * width - 1)
    assert rate == 22050 and samples.dtype == np.float32 and samples.shape == (500, channels)
    np.testing.assert_array_equal(samples, expected.astype(np.float32))
    assert samples.min() == -1.0 and samples.max() <= 1.0  # 32-bit's top rounds to 1 in f32
    mono = load_audio(tmp_path / "a.wav", sr=22050)
    np.testing.assert_allclose(mono, expected.mean(axis=1), rtol=0, atol=1e-7)


def test_float_and_extensible_wavs(tmp_path):
    x = rng.uniform(-1, 1, size=(300, 2)).astype(np.float32)
    _write_riff(tmp_path / "f32.wav", 3, 2, 16000, 32, x.astype("<f4").tobytes())
    samples, rate = read_wav(tmp_path / "f32.wav")
    assert rate == 16000
    np.testing.assert_array_equal(samples, x)
    _write_riff(tmp_path / "f64.wav", 0xFFFE, 2, 16000, 64, x.astype("<f8").tobytes(), ext=3)
    np.testing.assert_array_equal(read_wav(tmp_path / "f64.wav")[0], x)
    ints = rng.integers(-(2**23), 2**23, size=(301, 1))
    data = ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()  # odd length: padded
    _write_riff(tmp_path / "ext24.wav", 0xFFFE, 1, 8000, 24, data, ext=1)
    samples, rate = read_wav(tmp_path / "ext24.wav")
    assert rate == 8000
    np.testing.assert_array_equal(samples, (ints / 2.0**23).astype(np.float32))


def test_truncated_wav_keeps_its_whole_frames(tmp_path):
    ints = np.arange(-50, 50).reshape(50, 2) * 300
    _write_wav(tmp_path / "a.wav", ints, 2, 16000)
    raw = (tmp_path / "a.wav").read_bytes()
    (tmp_path / "cut.wav").write_bytes(raw[:-3])  # the data chunk claims 3 bytes more than it has
    samples, _ = read_wav(tmp_path / "cut.wav")
    np.testing.assert_array_equal(samples, (ints[:49] / 32768.0).astype(np.float32))
    _write_riff(tmp_path / "f32.wav", 3, 2, 16000, 32, np.ones(7, "<f4").tobytes())
    assert read_wav(tmp_path / "f32.wav")[0].shape == (3, 2)


def test_load_audio_resamples_to_16k(tmp_path):
    ints = np.round(20000 * np.sin(2 * np.pi * 440 * np.arange(4410) / 22050))[:, None]
    _write_wav(tmp_path / "tone.wav", ints.astype(np.int64), 2, 22050)
    got = load_audio(tmp_path / "tone.wav")
    assert got.dtype == np.float32 and got.shape == (3200,)
    np.testing.assert_array_equal(got, resample(ints[:, 0] / 32768.0, 22050, 16000))
    t = np.arange(3200) / SR
    expected = 20000 / 32768 * np.sin(2 * np.pi * 440 * t)
    np.testing.assert_allclose(got[300:-300], expected[300:-300], atol=1e-3)


def test_bad_audio_files_name_the_file_and_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.wav"):
        load_audio(tmp_path / "nope.wav")
    (tmp_path / "notes.txt").write_text("hello, this is text")
    with pytest.raises(ValueError, match=r"notes.txt.*is not a WAV file: it starts with b'hello"):
        load_audio(tmp_path / "notes.txt")
    (tmp_path / "empty.wav").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.wav.*is not a WAV file"):
        read_wav(tmp_path / "empty.wav")
    _write_riff(tmp_path / "pcm40.wav", 1, 1, 16000, 40, b"\0" * 50)
    with pytest.raises(ValueError, match=r"pcm40.wav.*unsupported sample width: 40-bit integer"):
        read_wav(tmp_path / "pcm40.wav")
    _write_riff(tmp_path / "f16.wav", 3, 1, 16000, 16, b"\0" * 50)
    with pytest.raises(ValueError, match=r"f16.wav.*unsupported sample width: 16-bit IEEE float"):
        read_wav(tmp_path / "f16.wav")
    _write_riff(tmp_path / "alaw.wav", 6, 1, 8000, 8, b"\0" * 50)
    with pytest.raises(ValueError, match=r"alaw.wav.*unsupported WAV format tag 0x0006"):
        read_wav(tmp_path / "alaw.wav")
    (tmp_path / "bare.wav").write_bytes(b"RIFF\x04\0\0\0WAVE")
    with pytest.raises(ValueError, match="bare.wav.*malformed WAV file: no complete 'fmt ' chunk"):
        read_wav(tmp_path / "bare.wav")


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not on PATH")
def test_espeak_ng_wav(tmp_path, monkeypatch):
    path = tmp_path / "hello.wav"
    subprocess.run(["espeak-ng", "-w", str(path), "hello world"], check=True, timeout=30)
    samples, rate = read_wav(path)
    assert rate == 22050 and samples.shape[1] == 1 and samples.shape[0] > 22050 // 2
    x = load_audio(path)
    assert x.shape == (-(-samples.shape[0] * 16000 // 22050),)
    assert 0.05 < np.abs(x).max() <= 1.0  # speech, not silence or clipping garbage
    got = whisper_features(path)
    np.testing.assert_array_equal(got, whisper_features(x))
    _check_against_transformers_default(got, x)
    monkeypatch.setattr(feature_extraction_whisper, "is_torch_available", lambda: False)
    np.testing.assert_allclose(got, _transformers_features(x), rtol=1e-5, atol=1e-5)
