//! What one step of a pass contributes to its scores: log-softmax over the whole vocabulary in
//! `f64`, the KL divergence from the reference's distribution, the top-2 margin, and the running
//! tally ([`Tally`]) a pass accumulates.
//!
//! For logits `z` over the vocabulary `V`, with `p` the reference's distribution and `q` the
//! pass's, at a step whose true next token is `y`:
//!
//! ```text
//!   log softmax(z)_i = z_i − (max z + ln Σ_j exp(z_j − max z))        (f64)
//!   NLL              = −log q_y                  perplexity = exp(mean NLL over the steps)
//!   KL(p ‖ q)        = Σ_i p_i (log p_i − log q_i)                   (every i in V)
//!   margin           = z_(1) − z_(2)             (the reference's two largest logits)
//! ```

/// Writes `log softmax(logits)` into `out` (same length) in `f64`; `false` when a logit is not
/// finite (nothing useful is written then).
pub fn log_softmax(logits: &[f32], out: &mut [f64]) -> bool {
    let mut max = f64::NEG_INFINITY;
    for &z in logits {
        if !z.is_finite() {
            return false;
        }
        max = max.max(f64::from(z));
    }
    let sum: f64 = logits.iter().map(|&z| (f64::from(z) - max).exp()).sum();
    let lse = max + sum.ln();
    for (o, &z) in out.iter_mut().zip(logits) {
        *o = f64::from(z) - lse;
    }
    true
}

/// `KL(p ‖ q) = Σ p_i (log p_i − log q_i)` from the reference's probabilities `p`, its
/// log-probabilities `log_p` and the pass's log-probabilities `log_q`. Exactly 0 when `log_q`
/// equals `log_p` element for element; never negative (rounding is clamped).
pub fn kl_divergence(p: &[f64], log_p: &[f64], log_q: &[f64]) -> f64 {
    let kl: f64 = p.iter().zip(log_p).zip(log_q).map(|((&p, &lp), &lq)| p * (lp - lq)).sum();
    kl.max(0.0)
}

/// The index of the largest logit (the first of equals) and its margin over the second largest
/// (`+∞` for a single logit).
pub fn top2(logits: &[f32]) -> (u32, f32) {
    let (mut best, mut first, mut second) = (0usize, f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (i, &z) in logits.iter().enumerate() {
        if z > first {
            (second, first, best) = (first, z, i);
        } else if z > second {
            second = z;
        }
    }
    (best as u32, first - second)
}

/// A pass's scores so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tally {
    /// Steps scored.
    pub steps: usize,
    /// Σ −log q(true next token).
    pub nll: f64,
    /// Σ KL(reference ‖ pass).
    pub kl: f64,
    /// The largest KL of a step.
    pub max_kl: f64,
    /// Steps whose reference margin reached the threshold.
    pub counted: usize,
    /// Of those, steps whose top-1 token equals the reference's.
    pub agree: usize,
    /// The KL of every step, in order (for its quantiles).
    pub kls: Vec<f64>,
}

impl Tally {
    /// An empty tally with room for `steps` steps.
    pub fn with_capacity(steps: usize) -> Tally {
        Tally { kls: Vec::with_capacity(steps), ..Tally::default() }
    }

    /// Adds one step: the pass's NLL of the true token, its KL from the reference, and, when the
    /// step counts for agreement, whether the top-1 tokens agree.
    pub fn add(&mut self, nll: f64, kl: f64, agreement: Option<bool>) {
        self.steps += 1;
        self.nll += nll;
        self.kl += kl;
        self.max_kl = self.max_kl.max(kl);
        self.kls.push(kl);
        if let Some(agree) = agreement {
            self.counted += 1;
            self.agree += usize::from(agree);
        }
    }

    /// `exp(mean NLL)`; 1 before any step.
    pub fn perplexity(&self) -> f64 {
        if self.steps == 0 { 1.0 } else { (self.nll / self.steps as f64).exp() }
    }

    /// Mean KL per step; 0 before any step.
    pub fn mean_kl(&self) -> f64 {
        if self.steps == 0 { 0.0 } else { self.kl / self.steps as f64 }
    }

    /// The `q`-quantile of the steps' KL by nearest rank (the `⌈q·n⌉`-th smallest); 0 before any
    /// step.
    pub fn kl_quantile(&self, q: f64) -> f64 {
        let mut sorted = self.kls.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        if n == 0 {
            return 0.0;
        }
        sorted[((q * n as f64).ceil() as usize).clamp(1, n) - 1]
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn log_softmax_sums_to_one_and_is_shift_invariant() {
        let logits = [1.0f32, -3.0, 250.0, 249.5];
        let mut a = [0.0; 4];
        assert!(log_softmax(&logits, &mut a));
        let total: f64 = a.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-12, "{total}");
        let mut b = [0.0; 4];
        assert!(log_softmax(&logits.map(|z| z - 100.0), &mut b));
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-9);
        }
        assert!(!log_softmax(&[0.0, f32::NAN], &mut [0.0; 2]));
        assert!(!log_softmax(&[0.0, f32::INFINITY], &mut [0.0; 2]));
    }

    #[test]
    fn kl_is_zero_for_the_same_distribution_and_matches_a_hand_computation() {
        let mut lp = [0.0; 3];
        log_softmax(&[0.0, 1.0, 2.0], &mut lp);
        let p = lp.map(f64::exp);
        assert_eq!(kl_divergence(&p, &lp, &lp), 0.0);
        let (p2, q2) = ([0.5f64, 0.5], [0.25f64, 0.75]);
        let want = 0.5 * (0.5f64 / 0.25).ln() + 0.5 * (0.5f64 / 0.75).ln();
        let got = kl_divergence(&p2, &p2.map(f64::ln), &q2.map(f64::ln));
        assert!((got - want).abs() < 1e-15, "{got} vs {want}");
    }

    #[test]
    fn top2_finds_the_first_best_and_its_margin() {
        assert_eq!(top2(&[0.0, 3.0, 1.0, 2.5]), (1, 0.5));
        assert_eq!(top2(&[2.0, 2.0, 1.0]), (0, 0.0));
        assert_eq!(top2(&[5.0, 1.0, 0.0]), (0, 4.0));
        assert_eq!(top2(&[-1.0]), (0, f32::INFINITY));
    }

    #[test]
    fn a_tally_averages_its_steps_and_counts_only_margin_steps() {
        let mut t = Tally::default();
        assert_eq!((t.perplexity(), t.mean_kl()), (1.0, 0.0));
        t.add(2.0f64.ln(), 0.1, Some(true));
        t.add(8.0f64.ln(), 0.3, None);
        t.add(4.0f64.ln(), 0.2, Some(false));
        assert!((t.perplexity() - 4.0).abs() < 1e-12);
        assert!((t.mean_kl() - 0.2).abs() < 1e-12);
        assert_eq!((t.max_kl, t.counted, t.agree, t.steps), (0.3, 2, 1, 3));
        assert_eq!((t.kl_quantile(0.5), t.kl_quantile(0.99), t.kl_quantile(0.0)), (0.2, 0.3, 0.1));
    }
}
