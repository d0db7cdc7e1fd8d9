"""WGSL helper functions for elementwise math that WGSL lacks or specifies too loosely.

WGSL has no ``erf``, ``log1p`` or ``expm1``; its ``pow`` is undefined for negative bases; its
``sin``/``cos`` are only required to reach an absolute error of 2^-11 on [-pi, pi], and its
``tanh`` may return NaN for large arguments on some drivers. The helpers here give the
PyTorch semantics with documented accuracy on every adapter, built only from ``+ - * /``,
``exp``, ``exp2``, ``log``, ``log2``, ``sqrt`` and bit casts. Accuracy figures are maximum
errors against float64 references measured on lavapipe (LLVM 15) and on an NVIDIA H200
(Vulkan), dense grids of 10^6 points; they rely on the adapter's ``exp``/``log`` reaching a few
ulp, as WGSL requires outside [0.5, 2] (``tests/codegen/test_elementwise_extra.py``).

Invariants: every helper is a pure function of f32 values; no helper source spells an inf
or NaN literal (the shader would be rejected); ``helper_source`` emits each helper once,
after the helpers it calls.
"""

from __future__ import annotations

from collections.abc import Iterable

# NaN and inf tests by bit pattern: drivers apply "inexact" rules that assume finite floats
# (Mesa folds ``x != x`` to false, and ``max``/``min`` return the non-NaN operand, IEEE
# maxNum), so no helper tests a float for NaN by comparing it.
_NONFINITE = """
fn is_nan_f32(x: f32) -> bool {
  return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}
fn is_inf_f32(x: f32) -> bool {
  return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u;
}
"""
# torch.maximum / amax semantics: NaN if either operand is NaN (the first one's bits).
_MAX_NAN = """
fn max_nan(a: f32, b: f32) -> f32 {
  return select(select(max(a, b), b, is_nan_f32(b)), a, is_nan_f32(a));
}
fn min_nan(a: f32, b: f32) -> f32 {
  return select(select(min(a, b), b, is_nan_f32(b)), a, is_nan_f32(a));
}
"""

# tanh: Cephes' tanhf polynomial below |x| = 0.625 (where 1 - 2e/(1+e) would cancel), and
# exp(-2|x|), which only underflows, above it; drivers' tanh can return NaN past |x| ~ 44.
_TANH = """
fn tanh_stable(x: f32) -> f32 {
  let a = abs(x);
  let z = x * x;
  let p = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
            + 1.33314422036e-1) * z - 3.33332819422e-1) * z * x + x;
  let e = exp(-2.0 * a);
  let r = 1.0 - 2.0 * e / (1.0 + e);
  return select(select(r, -r, x < 0.0), p, a < 0.625);
}
"""
# sigmoid: exp of a non-positive number never overflows; pick the form by sign.
_SIGMOID = """
fn sigmoid_stable(x: f32) -> f32 {
  let e = exp(-abs(x));
  return select(e / (1.0 + e), 1.0 / (1.0 + e), x >= 0.0);
}
"""

# erf / erfc: FreeBSD msun s_erff.c (Sun Microsystems 1993, "Permission to use, copy, modify,
# and distribute this software is freely granted, provided that this notice is preserved";
# float version by Ian Lance Taylor, Cygnus Support), the same code as musl's erff.c. Rational
# approximations on [0, 0.84375), [0.84375, 1.25) and, for erfc, [1.25, 1/0.35) and
# [1/0.35, 28) with exp(-x^2) split as exp(-z^2 - 0.5625) * exp((z - x)(z + x) + R/S) where z
# is x with its 12 low mantissa bits cleared (z^2 exact). Measured: erf within 0.99 ulp
# (lavapipe) / 0.84 ulp (H200) over [-7, 7] and tiny |x| (5.9e-8 absolute, 7.1e-8 relative);
# erfc within 3 ulp below 1.25 and 8e-6 relative on [1.25, 6.4] (the tail approximation's
# own 1e-6 plus the adapter's exp of arguments down to -41).
_ERF_RS = """
fn erf_small(x: f32) -> f32 {
  let z = x * x;
  let r = 1.2837916613e-01 + z * (-3.2504209876e-01 + z * (-2.8481749818e-02
          + z * (-5.7702702470e-03 + z * -2.3763017452e-05)));
  let s = 1.0 + z * (3.9791721106e-01 + z * (6.5022252500e-02 + z * (5.0813062117e-03
          + z * (1.3249473704e-04 + z * -3.9602282413e-06))));
  return r / s;
}
"""
_ERF_PQ = """
fn erf_mid(a: f32) -> f32 {
  let s = a - 1.0;
  let p = -2.3621185683e-03 + s * (4.1485610604e-01 + s * (-3.7220788002e-01
          + s * (3.1834661961e-01 + s * (-1.1089469492e-01 + s * (3.5478305072e-02
          + s * -2.1663755178e-03)))));
  let q = 1.0 + s * (1.0642088205e-01 + s * (5.4039794207e-01 + s * (7.1828655899e-02
          + s * (1.2617121637e-01 + s * (1.3637083583e-02 + s * 1.1984500103e-02)))));
  return p / q;
}
"""
_ERFC_TAIL = """
fn erfc_tail(a: f32) -> f32 {
  let s = 1.0 / (a * a);
  var r: f32;
  var q: f32;
  if (a < 2.857142857) {
    r = -9.8649440333e-03 + s * (-6.9385856390e-01 + s * (-1.0558626175e+01
        + s * (-6.2375331879e+01 + s * (-1.6239666748e+02 + s * (-1.8460508728e+02
        + s * (-8.1287437439e+01 + s * -9.8143291473e+00))))));
    q = 1.0 + s * (1.9651271820e+01 + s * (1.3765776062e+02 + s * (4.3456588745e+02
        + s * (6.4538726807e+02 + s * (4.2900814819e+02 + s * (1.0863500214e+02
        + s * (6.5702495575e+00 + s * -6.0424413532e-02)))))));
  } else {
    r = -9.8649431020e-03 + s * (-7.9928326607e-01 + s * (-1.7757955551e+01
        + s * (-1.6063638306e+02 + s * (-6.3756646729e+02 + s * (-1.0250950928e+03
        + s * -4.8351919556e+02)))));
    q = 1.0 + s * (3.0338060379e+01 + s * (3.2579251099e+02 + s * (1.5367296143e+03
        + s * (3.1998581543e+03 + s * (2.5530502930e+03 + s * (4.7452853394e+02
        + s * -2.2440952301e+01))))));
  }
  let z = bitcast<f32>(bitcast<u32>(a) & 0xfffff000u);
  return exp(-z * z - 0.5625) * exp((z - a) * (z + a) + r / q) / a;
}
"""
_ERF = """
fn erf_f32(x: f32) -> f32 {
  let a = abs(x);
  if (is_nan_f32(x)) {
    return x;
  }
  if (a < 0.84375) {
    return x + x * erf_small(x);
  }
  var r = 1.0;
  if (a < 1.25) {
    r = 8.4506291151e-01 + erf_mid(a);
  } else if (a < 6.0) {
    r = 1.0 - erfc_tail(a);
  }
  return select(r, -r, x < 0.0);
}
"""
_ERFC = """
fn erfc_f32(x: f32) -> f32 {
  let a = abs(x);
  if (is_nan_f32(x)) {
    return x;
  }
  if (a < 0.84375) {
    let y = erf_small(x);
    if (x < 0.25) {
      return 1.0 - (x + x * y);
    }
    return 0.5 - (x * y + (x - 0.5));
  }
  if (a < 1.25) {
    let pq = erf_mid(a);
    return select(1.0 + (8.4506291151e-01 + pq), 1.5493708849e-01 - pq, x >= 0.0);
  }
  if (a < 28.0) {
    let t = erfc_tail(a);
    return select(2.0 - t, t, x > 0.0);
  }
  return select(2.0, 0.0, x > 0.0);
}
"""

# sin / cos: Cephes sinf.c / cosf.c (Stephen L. Moshier, 1984-1992): reduction by pi/4 in
# three parts (DP1 + DP2 + DP3, exact products for |x| <= 8192), then the minimax polynomials
# on [-pi/4, pi/4] selected by the octant. Measured absolute error on [-8192, 8192]: 1.2e-7
# (lavapipe), 7.5e-8 (H200); accuracy degrades beyond 8192 as in Cephes (PyTorch reduces
# exactly at any magnitude).
_SINCOS = """
fn sin_cos_f32(x: f32, cosine: bool) -> f32 {
  let a = abs(x);
  var j = u32(a * 1.27323954473516);
  j = j + (j & 1u);
  let y = f32(j);
  let r = ((a - y * 0.78515625) - y * 2.4187564849853515625e-4) - y * 3.77489497744594108e-8;
  let z = r * r;
  let s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r;
  let c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2)
          * z * z - 0.5 * z + 1.0;
  let q = ((j >> 1u) + select(0u, 1u, cosine)) & 3u;
  var v = select(s, c, (q & 1u) == 1u);
  v = select(v, -v, q >= 2u);
  return select(v, -v, !cosine && x < 0.0);
}
"""

# log1p: 2 atanh(s) with s = x / (2 + x) on [sqrt(1/2) - 1, sqrt(2) - 1] (|s| <= 0.1716; the
# series through s^9 leaves < 3e-9 relative), log(1 + x) outside, where 1 + x rounds by less
# than the result's ulp. expm1: Taylor through x^9/9! on |x| <= 0.5 (< 3e-10 relative left),
# exp(x) - 1 outside, where the subtraction loses at most 1.3 bits. Measured near 0 (|x| from
# 1e-30 to 0.6): 3.2e-7 relative (log1p), 1.9e-7 (expm1).
_LOG1P = """
fn log1p_f32(x: f32) -> f32 {
  let s = x / (2.0 + x);
  let z = s * s;
  let p = 2.0 * s + s * z * (0.6666666667 + z * (0.4 + z * (0.2857142857 + z * 0.2222222222)));
  return select(log(1.0 + x), p, x > -0.2928932188 && x < 0.4142135624);
}
"""
_EXPM1 = """
fn expm1_f32(x: f32) -> f32 {
  let p = x * (1.0 + x * (0.5 + x * (1.6666666667e-1 + x * (4.1666666667e-2 + x * (8.3333333333e-3
          + x * (1.3888888889e-3 + x * (1.9841269841e-4 + x * (2.4801587302e-5
          + x * 2.7557319224e-6))))))));
  return select(exp(x) - 1.0, p, abs(x) <= 0.5);
}
"""

# exp2 that keeps exp2(+inf) = +inf and exp2(NaN) = NaN: lavapipe's exp2 returns 0 for both
# (its exp does not).
_EXP2 = """
fn exp2_f32(l: f32) -> f32 {
  return select(exp2(l), l, bitcast<u32>(l) == 0x7f800000u || is_nan_f32(l));
}
"""
# pow with torch.pow semantics: |a|^b as exp2(b * log2|a|) (what WGSL's pow is defined as);
# a negative base keeps the sign of an odd integer exponent, gives NaN (log2 of a negative
# number) for a non-integer one; b == 0 and a == 1 give 1 for every b and a; 0^b is 0 (b > 0)
# or inf (b < 0), signed for -0 and an odd exponent. Infinite results come from the
# arithmetic (log2(0) = -inf, overflow), never from literals. C99 pow's non-finite cases, as
# torch: a NaN operand gives NaN (except the two rules above), (-1)^(+-inf) = 1, and -inf to a
# non-integer power is +inf (b > 0) or 0 (b < 0), not the NaN of a finite negative base.
_POW = """
fn pow_f32(a: f32, b: f32) -> f32 {
  let m = exp2_f32(b * log2(abs(a)));
  let is_int = floor(b) == b;
  let half = b * 0.5;
  let odd = is_int && half != floor(half);
  let negative = (bitcast<u32>(a) >> 31u) == 1u;
  var r = select(m, -m, negative && odd);
  r = select(r, exp2(b * log2(a)), a < 0.0 && !is_int && !is_inf_f32(a));
  r = select(r, a + b, is_nan_f32(a) || is_nan_f32(b));
  return select(r, 1.0, b == 0.0 || a == 1.0 || (a == -1.0 && is_inf_f32(b)));
}
"""

# gelu, exact: x * Phi(x) with Phi(x) = erfc(-x / sqrt 2) / 2 (no cancellation for x < 0);
# derivative Phi(x) + x * exp(-x^2 / 2) / sqrt(2 pi) (PyTorch's GeluBackward, approximate
# "none"). tanh form: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3),
# the same function without the 1 + tanh cancellation and without overflow for any finite x;
# derivative s + 2 x s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 x^2), s = sigmoid(2u) (PyTorch's
# tanh backward rewritten with 1 + tanh(u) = 2s, 1 - tanh(u)^2 = 4 s (1 - s)); the second term
# is 0 for |x| > 20, where it underflows anyway but x^2 could overflow.
_GELU = """
fn gelu_erf(x: f32) -> f32 {
  return x * 0.5 * erfc_f32(x * -0.70710678118654752);
}
fn gelu_erf_grad(x: f32) -> f32 {
  let cdf = 0.5 * erfc_f32(x * -0.70710678118654752);
  return cdf + x * exp(-0.5 * x * x) * 0.39894228040143268;
}
fn gelu_tanh_inner(x: f32) -> f32 {
  return 1.5957691216057308 * (x + 0.044715 * x * x * x);
}
fn gelu_tanh(x: f32) -> f32 {
  return x * sigmoid_stable(gelu_tanh_inner(x));
}
fn gelu_tanh_grad(x: f32) -> f32 {
  let t = gelu_tanh_inner(x);
  let s = sigmoid_stable(t);
  let d = 1.5957691216057308 * x * s * sigmoid_stable(-t) * (1.0 + 0.134145 * x * x);
  return s + select(d, 0.0, abs(x) > 20.0);
}
"""
# silu = x * sigmoid(x); derivative s (1 + x (1 - s)) (PyTorch's silu_backward), with
# 1 - s = sigmoid(-x) so neither factor cancels.
_SILU = """
fn silu_grad(x: f32) -> f32 {
  return sigmoid_stable(x) * (1.0 + x * sigmoid_stable(-x));
}
"""
# softplus(t) = log(1 + e^t) = max(t, 0) + log1p(e^-|t|): never overflows, keeps tiny values.
_SOFTPLUS = """
fn softplus_f32(t: f32) -> f32 {
  return max(t, 0.0) + log1p_f32(exp(-abs(t)));
}
"""

HELPERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "is_nan_f32": (_NONFINITE, ()),
    "max_nan": (_MAX_NAN, ("is_nan_f32",)),
    "tanh_stable": (_TANH, ()),
    "sigmoid_stable": (_SIGMOID, ()),
    "erf_small": (_ERF_RS, ()),
    "erf_mid": (_ERF_PQ, ()),
    "erfc_tail": (_ERFC_TAIL, ()),
    "erf_f32": (_ERF, ("is_nan_f32", "erf_small", "erf_mid", "erfc_tail")),
    "erfc_f32": (_ERFC, ("is_nan_f32", "erf_small", "erf_mid", "erfc_tail")),
    "sin_cos_f32": (_SINCOS, ()),
    "log1p_f32": (_LOG1P, ()),
    "expm1_f32": (_EXPM1, ()),
    "exp2_f32": (_EXP2, ("is_nan_f32",)),
    "pow_f32": (_POW, ("exp2_f32",)),
    "gelu": (_GELU, ("erfc_f32", "sigmoid_stable")),
    "silu_grad": (_SILU, ("sigmoid_stable",)),
    "softplus_f32": (_SOFTPLUS, ("log1p_f32",)),
}


def helper_source(names: Iterable[str]) -> str:
    """WGSL source of the named helpers and everything they call, each once, callees first.

    Raises:
        KeyError: for an unknown helper name.
    """
    done: dict[str, None] = {}

    def visit(name: str) -> None:
        if name in done:
            return
        for dep in HELPERS[name][1]:
            visit(dep)
        done[name] = None

    for n in names:
        visit(n)
    return "\n".join(HELPERS[n][0].strip("\n") for n in done)
