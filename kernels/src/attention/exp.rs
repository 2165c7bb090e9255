//! The `exp` the SIMD kernels vectorize, written once here in scalar form.
//!
//! Softmax needs `exp(x)` for `x ≤ SLACK` (scores minus a running reference, see `kernel.rs`). The
//! kernels use the Cephes `expf` scheme: `x = n·ln2 + r` with `n = round(x·log2 e)` and
//! `|r| ≤ ln2/2`, a degree-7 polynomial for `exp(r)` in Horner form, then a scale by `2^n`. Accuracy
//! is about 1 ulp (relative error below 2.5e-7) on `[-87.33, 88.0]`. Below that, results are 0 or
//! subnormal, as with `f32::exp`: the AVX-512 kernel clamps at [`EXP_FLOOR`] and scales with
//! `vscalefps`, the AVX2 kernel builds `2^n` in the exponent bits and flushes inputs below
//! [`EXP_MIN`] to 0. Either way `−∞` gives exactly 0, though kernels still mask unfilled lanes by
//! selection and never rely on it.
//!
//! [`exp_poly`] is the scalar transcription; the unit test here pins its accuracy against `f64::exp`,
//! and the property tests pin every SIMD kernel against the scalar kernel, which uses `f32::exp`.

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, reason = "only the x86-64 kernels vectorize this exp"))]

/// Below this the AVX2 kernel flushes `exp` to 0 (`ln` of the smallest normal f32 is −87.336).
pub(crate) const EXP_MIN: f32 = -87.33;
/// The AVX-512 kernel clamps inputs to at least this: `exp(−104)` is below the smallest subnormal,
/// and the clamp turns `−∞` into a finite input (no `∞ − ∞` in the reduction).
pub(crate) const EXP_FLOOR: f32 = -104.0;
/// Inputs are clamped to at most this, so `n ≤ 127` and `2^n` stays a normal f32.
pub(crate) const EXP_MAX: f32 = 88.0;
/// log2(e).
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two so `n·LN2_HI` is exact for the `n` that occur.
pub(crate) const LN2_HI: f32 = 0.693_359_4;
/// The rest of ln 2.
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// Polynomial coefficients, highest degree first: `exp(r) ≈ (((P0·r + P1)·r + …)·r + 1)·r + 1`.
pub(crate) const P: [f32; 8] =
    [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5, 1.0, 1.0];

/// Scalar transcription of the vector `exp` (same operations, same order, fused multiply-adds).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn exp_poly(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < EXP_MIN {
        return 0.0;
    }
    let xc = x.min(EXP_MAX);
    let n = (xc * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, xc);
    let r = (-n).mul_add(LN2_LO, r);
    let mut y = P[0];
    for c in &P[1..] {
        y = y.mul_add(r, *c);
    }
    y * 2f32.powi(n as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_poly_is_within_two_ulp_over_the_softmax_range() {
        let mut worst = 0.0f64;
        let steps = 200_000;
        for i in 0..=steps {
            let x = EXP_MIN + (0.0 - EXP_MIN) * (i as f32 / steps as f32);
            let want = (x as f64).exp();
            let got = exp_poly(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
    }

    #[test]
    fn exp_poly_flushes_masked_scores_to_exact_zero() {
        assert_eq!(exp_poly(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_poly(-100.0), 0.0);
        assert_eq!(exp_poly(0.0), 1.0);
    }
}
