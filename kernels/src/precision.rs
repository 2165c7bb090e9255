//! Adaptive precision: which format each page of a layer keeps when pages are compressed, chosen
//! from the attention mass the kernels report for it (the more attention a page receives, the more
//! bits it keeps), at the bytes a uniform format would spend.
//!
//! A [`Ladder`] is three formats around the uniform one (`mid`): a step up (`hi`) and a step down
//! (`lo`). [`allocate_by_mass`] ranks a layer's pages by mass and gives
//!
//! ```text
//!   most mass                                                             least mass
//!   | hi: the top hi_share (fewer if lo pages cannot pay) | mid | lo: the fewest that pay |
//! ```
//!
//! Invariants of every allocation (`tests` below, and a property test):
//! - a page never gets fewer bits than a page with less mass; among equal masses the older page
//!   (lower index) gets no more bits than the newer one (the newer one is nearer the queries);
//! - the bytes never exceed the budget when the budget holds every page at `lo` (when it does not,
//!   every page is `lo`: nothing smaller exists).
//!
//! Measured offline (`kvmm-kv-quality`, `Scheme::Adaptive`) on SmolLM2's real K/V at uniform q4's
//! bytes: the q8/q4/q2 ladder with [`HI_SHARE`] beats uniform q4 on mean, p99 and max error.
//!
//! **Age-graded precision** ([`graded_hi_pages`], [`allocate_by_age`]) ranks by age instead: a
//! shorter recent window stays exact and the bytes it saves put the newest pages past it one step
//! up ([`age_step_up`], [`allocate_graded`]). It is the daemon's default adaptive precision
//! (`[policy] adaptive_ranking = "age"`) and the evaluation's `auto`; on SmolLM2's whole shipped
//! text it lowers uniform q4's mean KL by 32% at the same bytes (README), where the mass
//! ladder above does not.
//!
//! Pure: no I/O, no clocks; the daemon collects masses and applies the result.

use crate::format::{Format, PageShape};

/// Share of a layer's pages that keep the higher format. Measured on SmolLM2's K/V (2,048
/// positions): 5% beats uniform q4 on mean, p99 and max error; 10% and 20% have lower means but
/// worse tails (more pages at the lower format, some of which later draw attention).
pub const HI_SHARE: f64 = 0.05;

/// Three formats around a uniform one: `hi ≥ mid ≥ lo` in bytes per page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ladder {
    /// The format of the pages with the most mass.
    pub hi: Format,
    /// The uniform format whose bytes the allocation spends.
    pub mid: Format,
    /// The format of the pages with the least mass that pay for the `hi` ones.
    pub lo: Format,
}

impl Ladder {
    /// The ladder around the compressed format `mid` for pages whose own format is the 16-bit
    /// `element`: q8 steps up to `element` (the page stays as written) and down to q4; k8v4 to q8
    /// and q4; q4 to q8 and q2; q2 up to q4 and nowhere down. `None` when `mid` is 16-bit (a
    /// lossless demotion has no steps).
    pub fn around(mid: Format, element: Format) -> Option<Ladder> {
        debug_assert!(!element.is_quantized(), "a page's own format is 16-bit, not {element}");
        let (hi, lo) = match mid {
            Format::F16 | Format::Bf16 => return None,
            Format::Q8 => (element, Format::Q4),
            Format::K8V4 => (Format::Q8, Format::Q4),
            Format::Q4 => (Format::Q8, Format::Q2),
            Format::Q2 => (Format::Q4, Format::Q2),
        };
        Some(Ladder { hi, mid, lo })
    }
}

/// Formats for pages with attention masses `mass` (in page order, oldest first) on `ladder`,
/// spending at most `budget` bytes (uniform `mid`'s bytes is `mass.len() × page_bytes(mid)`):
///
/// 1. the top `hi_share` of the pages by mass (rounded to the nearest page) get `hi`, fewer if
///    the others all at `lo` could not pay for them;
/// 2. the fewest lowest-mass pages get `lo` so that the total is at most `budget`;
/// 3. the rest get `mid`.
///
/// Ties in mass go older first to fewer bits. When even every page at `lo` exceeds `budget`, every
/// page is `lo`. A non-finite or negative `hi_share` means none.
pub fn allocate_by_mass(shape: PageShape, mass: &[f64], ladder: Ladder, hi_share: f64, budget: u64) -> Vec<Format> {
    let n = mass.len();
    let bytes = |f: Format| shape.page_bytes(f) as u64;
    let (hi_bytes, mid_bytes, lo_bytes) = (bytes(ladder.hi), bytes(ladder.mid), bytes(ladder.lo));
    debug_assert!(hi_bytes >= mid_bytes && mid_bytes >= lo_bytes, "{ladder:?} is not ordered by size");
    // Most mass first; equal masses newer first, so the older page lands nearer the low end.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| mass[b].total_cmp(&mass[a]).then(b.cmp(&a)));
    let share = if hi_share.is_finite() { hi_share.clamp(0.0, 1.0) } else { 0.0 };
    let mut hi = ((share * n as f64).round() as usize).min(n);
    // No more hi pages than lo pages can pay for.
    while hi > 0 && hi as u64 * hi_bytes + (n - hi) as u64 * lo_bytes > budget {
        hi -= 1;
    }
    let mut formats = vec![ladder.mid; n];
    for &p in &order[..hi] {
        formats[p] = ladder.hi;
    }
    let mut total = hi as u64 * hi_bytes + (n - hi) as u64 * mid_bytes;
    for &p in order[hi..].iter().rev() {
        if total <= budget {
            break;
        }
        formats[p] = ladder.lo;
        total -= mid_bytes - lo_bytes;
    }
    formats
}

/// How many pages can take `hi` instead of `mid` for the bytes that `saved` pages kept at the
/// 16-bit `element` instead of `mid` would hold: the budget of age-graded precision, which keeps a
/// shorter recent window exact and spends what that saves on the pages just past it. `0` when
/// `hi` is no larger than `mid`.
pub fn graded_hi_pages(shape: PageShape, element: Format, hi: Format, mid: Format, saved: usize) -> usize {
    let (full, hi, mid) = (shape.page_bytes(element), shape.page_bytes(hi), shape.page_bytes(mid));
    match hi.checked_sub(mid) {
        Some(step) if step > 0 => saved * full.saturating_sub(mid) / step,
        _ => 0,
    }
}

/// Formats for `pages` candidate pages in age order (oldest first) under age-graded precision: the
/// newest `hi_pages` get `hi`, the others `mid`. Pure.
pub fn allocate_by_age(pages: usize, hi_pages: usize, hi: Format, mid: Format) -> Vec<Format> {
    let first_hi = pages.saturating_sub(hi_pages);
    (0..pages).map(|p| if p >= first_hi { hi } else { mid }).collect()
}

/// The step up of age-graded precision from the compressed format `mode`, for pages written as the
/// 16-bit `element`: q8 steps up to `element` (the page stays as written), k8v4 to q8, q4 to k8v4
/// (keys take the extra bits first: K8/V4 costs far less than K4/V8, and k8v4 is the cheapest
/// step above q4), q2 to q4. `None` when `mode` is 16-bit (a lossless demotion has no steps).
pub fn age_step_up(mode: Format, element: Format) -> Option<Format> {
    debug_assert!(!element.is_quantized(), "a page's own format is 16-bit, not {element}");
    match mode {
        Format::F16 | Format::Bf16 => None,
        Format::Q8 => Some(element),
        Format::K8V4 => Some(Format::Q8),
        Format::Q4 => Some(Format::K8V4),
        Format::Q2 => Some(Format::Q4),
    }
}

/// Formats for `pages` candidate pages in age order (oldest first) under age-graded precision
/// around the compressed `mode`, for pages written as `element`, when `saved` pages are kept at
/// `element` instead of `mode` (a shorter recent window): the newest [`graded_hi_pages`] at
/// [`age_step_up`], the others at `mode`. Never more bytes than `pages` at `mode` plus what the
/// `saved` pages would have cost at `element` beyond `mode`. Every page is `mode` when `mode` is
/// 16-bit. Pure.
pub fn allocate_graded(shape: PageShape, element: Format, mode: Format, pages: usize, saved: usize) -> Vec<Format> {
    match age_step_up(mode, element) {
        Some(hi) => allocate_by_age(pages, graded_hi_pages(shape, element, hi, mode, saved), hi, mode),
        None => vec![mode; pages],
    }
}

/// Uniform `format`'s bytes for `pages` pages: the budget [`allocate_by_mass`] spends around it.
pub fn uniform_bytes(shape: PageShape, format: Format, pages: usize) -> u64 {
    pages as u64 * shape.page_bytes(format) as u64
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// SmolLM2's page: q8 13,888 B, q4 7,744 B, q2 4,672 B, f16 25,408 B, so one q8 page costs
    /// exactly what two q2 pages save against q4, and one f16 page a little less than two q4
    /// pages save against q8.
    const SHAPE: PageShape = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };

    fn ladder(mid: Format) -> Ladder {
        Ladder::around(mid, Format::F16).unwrap()
    }

    fn names(formats: &[Format]) -> String {
        formats.iter().map(|f| f.name()).collect::<Vec<_>>().join(" ")
    }

    fn bits(f: Format) -> u32 {
        f.k_bits() + f.v_bits()
    }

    #[test]
    fn smollm2_page_sizes_make_the_trades_in_the_table_exact() {
        let b = |f: Format| SHAPE.page_bytes(f);
        assert_eq!((b(Format::F16), b(Format::Q8), b(Format::Q4), b(Format::Q2)), (25_408, 13_888, 7_744, 4_672));
    }

    #[test]
    fn ladders_step_once_each_way_around_the_mode_format() {
        let f = |mid, element| Ladder::around(mid, element).map(|l| (l.hi, l.mid, l.lo));
        use Format::*;
        assert_eq!(f(Q8, F16), Some((F16, Q8, Q4)));
        assert_eq!(f(Q8, Bf16), Some((Bf16, Q8, Q4)));
        assert_eq!(f(K8V4, F16), Some((Q8, K8V4, Q4)));
        assert_eq!(f(Q4, Bf16), Some((Q8, Q4, Q2)));
        assert_eq!(f(Q2, F16), Some((Q4, Q2, Q2)));
        assert_eq!(f(F16, F16), None);
        assert_eq!(f(Bf16, Bf16), None);
    }

    #[test]
    fn allocations_follow_mass_and_spend_the_uniform_bytes() {
        let ten = [3.0, 9.0, 1.0, 7.0, 5.0, 0.0, 2.0, 8.0, 6.0, 4.0];
        let twenty: Vec<f64> = (0..20).map(f64::from).collect();
        let cases: &[(&str, &[f64], Format, f64, &str)] = &[
            ("top page q8, the two lowest q2 pay for it", &ten, Format::Q4, 0.1, "q4 q8 q2 q4 q4 q2 q4 q4 q4 q4"),
            ("equal masses: newest up, oldest down", &[1.0; 10], Format::Q4, 0.1, "q2 q2 q4 q4 q4 q4 q4 q4 q4 q8"),
            ("no share: uniform", &ten, Format::Q4, 0.0, "q4 q4 q4 q4 q4 q4 q4 q4 q4 q4"),
            ("5% of 10 rounds to 1 page", &ten, Format::Q4, HI_SHARE, "q4 q8 q2 q4 q4 q2 q4 q4 q4 q4"),
            ("5% of 9 rounds to none", &ten[..9], Format::Q4, HI_SHARE, "q4 q4 q4 q4 q4 q4 q4 q4 q4"),
            ("all hi asked: only what lo pages pay for", &[1.0, 2.0, 3.0], Format::Q4, 1.0, "q2 q2 q8"),
            (
                "q8 mode: the top page stays f16, two q4 pages pay",
                &twenty,
                Format::Q8,
                HI_SHARE,
                "q4 q4 q8 q8 q8 q8 q8 q8 q8 q8 q8 q8 q8 q8 q8 q8 q8 q8 q8 f16",
            ),
            ("q2 mode: nothing below pays for q4", &ten, Format::Q2, 0.5, "q2 q2 q2 q2 q2 q2 q2 q2 q2 q2"),
            ("no pages", &[], Format::Q4, HI_SHARE, ""),
            ("one page: the mode's format", &[5.0], Format::Q4, HI_SHARE, "q4"),
            ("one page, all hi asked: nothing pays", &[5.0], Format::Q8, 1.0, "q8"),
            ("NaN share means none", &ten[..2], Format::Q4, f64::NAN, "q4 q4"),
        ];
        for &(what, mass, mid, share, want) in cases {
            let l = ladder(mid);
            let budget = uniform_bytes(SHAPE, mid, mass.len());
            let got = allocate_by_mass(SHAPE, mass, l, share, budget);
            assert_eq!(names(&got), want, "{what}");
            let spent: u64 = got.iter().map(|&f| SHAPE.page_bytes(f) as u64).sum();
            assert!(spent <= budget, "{what}: {spent} > {budget}");
        }
    }

    #[test]
    fn graded_precision_spends_a_shorter_windows_savings_on_the_newest_pages() {
        use Format::*;
        // SmolLM2: an f16 page saved against q4 pays for 5.75 pages at k8v4 instead of q4, and
        // for 2.87 at q8.
        let hi_pages = |hi, saved| graded_hi_pages(SHAPE, F16, hi, Q4, saved);
        assert_eq!([hi_pages(K8V4, 1), hi_pages(K8V4, 2), hi_pages(K8V4, 3), hi_pages(Q8, 2)], [5, 11, 17, 5]);
        assert_eq!((hi_pages(K8V4, 0), graded_hi_pages(SHAPE, F16, Q4, Q4, 3)), (0, 0), "nothing saved, no step");
        assert_eq!(graded_hi_pages(SHAPE, F16, Q2, Q4, 3), 0, "a smaller hi is no step up");
        assert_eq!(names(&allocate_by_age(5, 2, K8V4, Q4)), "q4 q4 q4 k8v4 k8v4");
        assert_eq!(names(&allocate_by_age(2, 5, K8V4, Q4)), "k8v4 k8v4");
        assert!(allocate_by_age(0, 3, K8V4, Q4).is_empty());
        // The allocation never spends more than uniform mid plus the savings.
        for saved in 0..4 {
            let n = 40;
            let got = allocate_by_age(n, hi_pages(K8V4, saved), K8V4, Q4);
            let spent: usize = got.iter().map(|&f| SHAPE.page_bytes(f)).sum();
            let budget = n * SHAPE.page_bytes(Q4) + saved * (SHAPE.page_bytes(F16) - SHAPE.page_bytes(Q4));
            assert!(spent <= budget, "{saved} saved: {spent} > {budget}");
        }
    }

    #[test]
    fn graded_allocations_step_up_once_from_the_mode_and_stay_within_the_savings() {
        use Format::*;
        let up = |mode, element| age_step_up(mode, element);
        assert_eq!(
            [up(Q8, F16), up(Q8, Bf16), up(K8V4, F16), up(Q4, F16), up(Q2, Bf16), up(F16, F16)],
            [Some(F16), Some(Bf16), Some(Q8), Some(K8V4), Some(Q4), None]
        );
        // SmolLM2, three pages saved: 17 k8v4 pages around q4, 3 f16 pages around q8.
        let graded = |mode, pages| names(&allocate_graded(SHAPE, F16, mode, pages, 3));
        assert_eq!(graded(Q4, 19), format!("q4 q4{}", " k8v4".repeat(17)));
        assert_eq!(graded(Q8, 5), "q8 q8 f16 f16 f16");
        assert_eq!(graded(F16, 2), "f16 f16", "a lossless mode has no steps");
        for mode in [Q8, K8V4, Q4, Q2] {
            for (pages, saved) in [(0, 3), (1, 0), (7, 1), (40, 3), (200, 6)] {
                let got = allocate_graded(SHAPE, F16, mode, pages, saved);
                assert_eq!(got.len(), pages);
                let spent: usize = got.iter().map(|&f| SHAPE.page_bytes(f)).sum();
                let budget = pages * SHAPE.page_bytes(mode) + saved * (SHAPE.page_bytes(F16) - SHAPE.page_bytes(mode));
                assert!(spent <= budget, "{mode} {pages} pages, {saved} saved: {spent} > {budget}");
                assert!(got.iter().all(|&f| f == mode || Some(f) == age_step_up(mode, F16)));
            }
        }
    }

    #[test]
    fn a_budget_below_every_page_at_lo_gives_every_page_lo() {
        let got = allocate_by_mass(SHAPE, &[1.0, 5.0, 3.0], ladder(Format::Q4), 0.5, 0);
        assert_eq!(names(&got), "q2 q2 q2");
        // A larger budget than uniform: the top pages go up and nothing goes down.
        let budget = uniform_bytes(SHAPE, Format::Q8, 3);
        let got = allocate_by_mass(SHAPE, &[1.0, 5.0, 3.0], ladder(Format::Q4), 0.34, budget);
        assert_eq!(names(&got), "q4 q8 q4");
    }

    proptest! {
        #[test]
        fn more_mass_never_means_fewer_bits_and_the_budget_holds(
            mass in proptest::collection::vec(0u8..6, 0..64),
            mid in prop_oneof![Just(Format::Q8), Just(Format::K8V4), Just(Format::Q4), Just(Format::Q2)],
            share in 0.0f64..1.0,
            bf16 in any::<bool>(),
        ) {
            let mass: Vec<f64> = mass.into_iter().map(f64::from).collect();
            let l = Ladder::around(mid, if bf16 { Format::Bf16 } else { Format::F16 }).unwrap();
            let budget = uniform_bytes(SHAPE, mid, mass.len());
            let got = allocate_by_mass(SHAPE, &mass, l, share, budget);
            prop_assert_eq!(got.len(), mass.len());
            let spent: u64 = got.iter().map(|&f| SHAPE.page_bytes(f) as u64).sum();
            prop_assert!(spent <= budget);
            for a in 0..mass.len() {
                prop_assert!([l.hi, l.mid, l.lo].contains(&got[a]));
                for b in a + 1..mass.len() {
                    if mass[a] > mass[b] {
                        prop_assert!(bits(got[a]) >= bits(got[b]));
                    } else if mass[a] < mass[b] {
                        prop_assert!(bits(got[a]) <= bits(got[b]));
                    } else {
                        prop_assert!(bits(got[a]) <= bits(got[b]), "equal masses: older first to fewer bits");
                    }
                }
            }
        }
    }
}
