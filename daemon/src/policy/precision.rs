//! Precision of demoted pages: which format each page takes when it leaves the device.
//!
//! A demotion ([`Demotion`]) combines what the mode in force sets (its format, `None` for a
//! lossless ladder) with what the `[policy]` table sets ([`PrecisionPolicy`]): adaptive precision,
//! how it ranks pages ([`Ranking`]) and per-layer floors. For one page ([`target_format`]):
//!
//! ```text
//!   not full, sink or recent window ─────────────────────► its own format
//!   mode lossless ───────────────────────────────────────► its own format
//!   adaptive ──► its layer's allocation among the candidates (full, not sink/recent):
//!       by age (default): the newest pages past a 32-token window one step up from the mode's
//!                format (q4 → k8v4), older ones the mode's format, paid for by the window's
//!                pages below the usual 128 tokens (kvmm_kernels::precision::allocate_graded);
//!                a page already quantized steps down to its allocation as it ages
//!       by mass: kvmm_kernels::precision::allocate_by_mass on the ladder around the mode's
//!                format, by the attention mass the client's kernels recorded, at uniform
//!                mode-format bytes; a page already quantized keeps its format (one-way)
//!   otherwise ──► the mode's format (a page already quantized keeps its own)
//!   then raised to the layer's floor (a 16-bit floor keeps the page's own format); a quantized
//!   page never goes up
//! ```
//!
//! Floors apply in every mode: powersave's q4 does not go below a q8 floor. A floor never lowers
//! a page, and a lossless configuration stays lossless whatever the floors say.
//!
//! Pure: the tier code collects the facts (tokens, masses) and applies the result.

use std::fmt;
use std::sync::Arc;

use kvmm_kernels::precision::{HI_SHARE, Ladder, allocate_by_mass, uniform_bytes};
use kvmm_kernels::{Format, PageShape};

/// The highest layer index a floor may name (geometry allows at most 512 layers).
pub const MAX_LAYER: u32 = 511;

/// One end of a floor's layer range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerBound {
    /// A layer index counted from the first layer (0).
    Index(u32),
    /// The session's last layer, whatever its layer count.
    Last,
}

impl LayerBound {
    fn parse(text: &str) -> Option<LayerBound> {
        match text.trim() {
            "first" => Some(LayerBound::Index(0)),
            "last" => Some(LayerBound::Last),
            n => n.parse().ok().filter(|&i| i <= MAX_LAYER).map(LayerBound::Index),
        }
    }

    /// The index in a session of `layers` layers (at least 1).
    fn resolve(self, layers: u32) -> u32 {
        match self {
            LayerBound::Index(i) => i,
            LayerBound::Last => layers.saturating_sub(1),
        }
    }
}

impl fmt::Display for LayerBound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerBound::Index(i) => write!(f, "{i}"),
            LayerBound::Last => f.write_str("last"),
        }
    }
}

/// A `[[policy.floor]]`: pages of layers `first..=last` are never stored below `format` by a
/// demotion (a 16-bit format: never compressed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerFloor {
    /// The first layer covered.
    pub first: LayerBound,
    /// The last layer covered (inclusive).
    pub last: LayerBound,
    /// The least precise format its pages may take.
    pub format: Format,
}

impl LayerFloor {
    /// Parses a floor as written in the configuration: `layers` is `N`, `N-M` (`N ≤ M`), `first`,
    /// `last` or `N-last`; `format` a format name. The error is one sentence naming the fix.
    pub fn parse(layers: &str, format: &str) -> Result<LayerFloor, String> {
        let bad_range = || {
            format!(
                "policy.floor layers \"{layers}\" is not a range of layers; write \"N\", \"N-M\" with N ≤ M ≤ \
                 {MAX_LAYER}, \"first\", \"last\" or \"N-last\""
            )
        };
        let (first, last) = match layers.split_once('-') {
            Some((a, b)) => (LayerBound::parse(a), LayerBound::parse(b)),
            None => (LayerBound::parse(layers), LayerBound::parse(layers)),
        };
        let (Some(first), Some(last)) = (first, last) else { return Err(bad_range()) };
        match (first, last) {
            (LayerBound::Index(a), LayerBound::Index(b)) if a > b => return Err(bad_range()),
            (LayerBound::Last, LayerBound::Index(_)) => return Err(bad_range()),
            _ => {}
        }
        let format = Format::from_name(format.trim()).ok_or_else(|| {
            format!(
                "policy.floor format \"{format}\" is not a page format; use \"f16\" or \"bf16\" (never compressed), \
                 \"q8\", \"k8v4\", \"q4\" or \"q2\""
            )
        })?;
        Ok(LayerFloor { first, last, format })
    }

    /// Whether the floor covers `layer` of a session with `layers` layers.
    pub fn covers(&self, layer: u32, layers: u32) -> bool {
        (self.first.resolve(layers)..=self.last.resolve(layers)).contains(&layer)
    }
}

impl fmt::Display for LayerFloor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}:{}", self.first, self.format)
        } else {
            write!(f, "{}-{}:{}", self.first, self.last, self.format)
        }
    }
}

/// Every configured floor (shared: cloned into each demotion).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Floors(Arc<[LayerFloor]>);

impl Floors {
    /// The floors, in configuration order.
    pub fn new(floors: Vec<LayerFloor>) -> Floors {
        Floors(floors.into())
    }

    /// The floor of `layer` in a session of `layers` layers: the most precise of the floors that
    /// cover it.
    pub fn of(&self, layer: u32, layers: u32) -> Option<Format> {
        self.0.iter().filter(|f| f.covers(layer, layers)).map(|f| f.format).max_by_key(|&f| bits(f))
    }

    /// The floors, in configuration order.
    pub fn iter(&self) -> impl Iterator<Item = &LayerFloor> {
        self.0.iter()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// How adaptive precision ranks a layer's pages (`[policy] adaptive_ranking`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ranking {
    /// By age (`"age"`, the default): a 32-token recent window, the newest pages past it one step
    /// up, older ones at the mode's format, stepping down as they age. Measured on SmolLM2's whole
    /// shipped text: 32% less mean KL than uniform q4 at q4's bytes (README).
    #[default]
    Age,
    /// By the attention mass the client's kernels recorded (`"mass"`): the 128-token window, the
    /// most attended pages up and the least down; a quantized page keeps its format.
    Mass,
}

impl Ranking {
    /// The name in the configuration and in `Status`.
    pub fn name(self) -> &'static str {
        match self {
            Ranking::Age => "age",
            Ranking::Mass => "mass",
        }
    }

    /// Parses a name as [`Ranking::name`] writes it.
    pub fn from_name(name: &str) -> Option<Ranking> {
        [Ranking::Age, Ranking::Mass].into_iter().find(|r| r.name() == name.trim())
    }
}

impl fmt::Display for Ranking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The precision settings of the `[policy]` table (the same in every mode; a reload replaces them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrecisionPolicy {
    /// Per-page formats on lossy demotion (`adaptive_precision`, default on).
    pub adaptive: bool,
    /// How adaptive precision ranks pages (`adaptive_ranking`, default by age).
    pub ranking: Ranking,
    /// Per-layer floors (`[[policy.floor]]`).
    pub floors: Floors,
}

impl Default for PrecisionPolicy {
    fn default() -> Self {
        PrecisionPolicy { adaptive: true, ranking: Ranking::default(), floors: Floors::default() }
    }
}

/// Everything one demotion needs to choose each page's format: the mode's format and the
/// `[policy]` precision settings, read together under the policy lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Demotion {
    /// The mode's format for full 16-bit pages; `None`: lossless, every page keeps its format.
    pub format: Option<Format>,
    /// Adaptive precision on.
    pub adaptive: bool,
    /// How adaptive precision ranks pages.
    pub ranking: Ranking,
    /// Per-layer floors.
    pub floors: Floors,
}

impl Demotion {
    /// Whether pages of a layer need an allocation (a lossy, adaptive demotion).
    pub fn ranks_pages(&self) -> bool {
        self.adaptive && self.format.is_some_and(Format::is_quantized)
    }

    /// Whether pages are allocated by age (a lossy, adaptive demotion ranking by age): the recent
    /// window is shorter and quantized pages step down to their allocation as they age.
    pub fn by_age(&self) -> bool {
        self.ranks_pages() && self.ranking == Ranking::Age
    }
}

/// Bits per element of keys and values together (to order formats by precision).
fn bits(f: Format) -> u32 {
    f.k_bits() + f.v_bits()
}

/// The formats adaptive precision gives a layer's candidate pages (full, not sink or recent
/// window) whose recorded attention masses are `mass` (oldest first), around the mode's
/// compressed format `mode` for pages written as the 16-bit `element`: the ladder around `mode`
/// ([`Ladder::around`]) at uniform `mode`'s bytes, [`HI_SHARE`] of the pages up.
pub fn layer_formats(shape: PageShape, element: Format, mode: Format, mass: &[f64]) -> Vec<Format> {
    match Ladder::around(mode, element) {
        Some(ladder) => allocate_by_mass(shape, mass, ladder, HI_SHARE, uniform_bytes(shape, mode, mass.len())),
        None => vec![mode; mass.len()],
    }
}

/// `format` raised to `floor` for a page whose own format is `own`: a more precise compressed
/// floor replaces it; a 16-bit floor keeps the page as it is.
pub fn raise(format: Format, floor: Option<Format>, own: Format) -> Format {
    match floor {
        Some(f) if !f.is_quantized() => own,
        Some(f) if bits(f) > bits(format) => f,
        _ => format,
    }
}

/// The format a page whose current format is `current` takes when demoted: `candidate` says it is
/// full and neither the sink page nor in the recent window; `allocated` is what adaptive precision
/// gave it (`None` when adaptive precision is off); `mode` the mode's format (`None`: lossless);
/// `floor` its layer's floor; `steps_down` whether a quantized page takes an allocation with fewer
/// bits (ranking by age) instead of keeping its format.
pub fn target_format(
    current: Format,
    candidate: bool,
    allocated: Option<Format>,
    mode: Option<Format>,
    floor: Option<Format>,
    steps_down: bool,
) -> Format {
    if !candidate {
        return current;
    }
    let Some(mode) = mode.filter(|f| f.is_quantized()) else { return current };
    if !current.is_quantized() {
        return raise(allocated.unwrap_or(mode), floor, current);
    }
    match allocated.map(|a| raise(a, floor, current)) {
        Some(to) if steps_down && bits(to) < bits(current) => to,
        _ => current,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Format::*;

    #[test]
    fn the_target_format_keeps_raises_or_follows_the_allocation() {
        /// (what, current, candidate, allocated, mode, floor, want); pages never step down.
        type Case = (&'static str, Format, bool, Option<Format>, Option<Format>, Option<Format>, Format);
        let cases: &[Case] = &[
            ("the mode's format", F16, true, None, Some(Q4), None, Q4),
            ("adaptive: the allocation's format", F16, true, Some(Q2), Some(Q4), None, Q2),
            ("adaptive hi in q8 mode: stays as written", Bf16, true, Some(Bf16), Some(Q8), None, Bf16),
            ("a q8 floor raises q4", F16, true, None, Some(Q4), Some(Q8), Q8),
            ("a q8 floor raises an adaptive q2", F16, true, Some(Q2), Some(Q4), Some(Q8), Q8),
            ("a floor never lowers", F16, true, Some(Q8), Some(Q4), Some(Q2), Q8),
            ("a q8 floor raises k8v4", F16, true, None, Some(K8V4), Some(Q8), Q8),
            ("a 16-bit floor is lossless", Bf16, true, Some(Q2), Some(Q4), Some(F16), Bf16),
            ("the sink page or recent window keeps", F16, false, Some(Q2), Some(Q4), None, F16),
            ("already quantized: lossy is one-way", Q4, true, Some(Q2), Some(Q2), None, Q4),
            ("already quantized below the floor stays", Q2, true, None, Some(Q4), Some(Q8), Q2),
            ("a lossless mode stays lossless under a floor", F16, true, None, None, Some(Q4), F16),
        ];
        for &(what, current, candidate, allocated, mode, floor, want) in cases {
            assert_eq!(target_format(current, candidate, allocated, mode, floor, false), want, "{what}");
        }
        // Ranking by age: a quantized page steps down to its allocation, never up, never below its
        // floor, and only where it is a candidate in a lossy mode.
        let steps: &[Case] = &[
            ("k8v4 aged out of the step up: q4", K8V4, true, Some(Q4), Some(Q4), None, Q4),
            ("q8 from an earlier q8 mode: q4", Q8, true, Some(Q4), Some(Q4), None, Q4),
            ("q4 allocated k8v4: stays q4", Q4, true, Some(K8V4), Some(Q4), None, Q4),
            ("a k8v4 floor stops the step", K8V4, true, Some(Q4), Some(Q4), Some(K8V4), K8V4),
            ("a q8 floor over k8v4: stays", K8V4, true, Some(Q4), Some(Q4), Some(Q8), K8V4),
            ("a 16-bit floor: stays", K8V4, true, Some(Q4), Some(Q4), Some(F16), K8V4),
            ("the recent window: stays", K8V4, false, Some(Q4), Some(Q4), None, K8V4),
            ("lossless now: stays", K8V4, true, Some(Q4), None, None, K8V4),
            ("no allocation: stays", K8V4, true, None, Some(Q4), None, K8V4),
            ("16-bit as before", F16, true, Some(K8V4), Some(Q4), None, K8V4),
        ];
        for &(what, current, candidate, allocated, mode, floor, want) in steps {
            assert_eq!(target_format(current, candidate, allocated, mode, floor, true), want, "{what}");
        }
    }

    #[test]
    fn layer_formats_rank_a_layers_candidates_on_the_ladder_around_the_mode() {
        let shape = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };
        // 20 candidates, page 7 drawing most attention: 5% is one page up, two pages pay.
        let mut mass: Vec<f64> = (0..20).map(|p| 1.0 + f64::from(p % 5)).collect();
        mass[7] = 100.0;
        let q4 = layer_formats(shape, F16, Q4, &mass);
        assert_eq!(q4[7], Q8);
        assert_eq!(q4.iter().filter(|&&f| f == Q2).count(), 2);
        assert_eq!((q4[0], q4[5]), (Q2, Q2), "the two oldest of the lowest mass");
        let q8 = layer_formats(shape, Bf16, Q8, &mass);
        assert_eq!(q8[7], Bf16, "q8 mode keeps the top page as written");
        assert_eq!(q8.iter().filter(|&&f| f == Q4).count(), 2);
        assert!(layer_formats(shape, F16, Q2, &mass).iter().all(|&f| f == Q2));
        assert!(layer_formats(shape, F16, Q4, &[]).is_empty());
    }

    #[test]
    fn floors_parse_cover_their_layers_and_the_most_precise_wins() {
        let floor = |l: &str, f: &str| LayerFloor::parse(l, f).unwrap();
        let floors =
            Floors::new(vec![floor("0-1", "q8"), floor("1", "f16"), floor("last", "q4"), floor("5-last", "q2")]);
        let of = |layer| floors.of(layer, 8);
        assert_eq!(
            [of(0), of(1), of(2), of(5), of(6), of(7)],
            [Some(Q8), Some(F16), None, Some(Q2), Some(Q2), Some(Q4)]
        );
        // `last` follows each session's layer count.
        assert_eq!(floors.of(3, 4), Some(Q4));
        assert_eq!(floors.of(7, 30), Some(Q2));
        assert_eq!(floor("first", "q8"), floor("0", "q8"));
        assert_eq!(floor(" 2 - 4 ", "k8v4").to_string(), "2-4:k8v4");
        assert_eq!(floor("last", "bf16").to_string(), "last:bf16");
        assert_eq!(floor("3-last", "q8").to_string(), "3-last:q8");
        for (layers, format, needle) in [
            ("2-1", "q8", "not a range"),
            ("last-2", "q8", "not a range"),
            ("512", "q8", "not a range"),
            ("x", "q8", "not a range"),
            ("", "q8", "not a range"),
            ("0-1", "q3", "\"q3\" is not a page format"),
        ] {
            let err = LayerFloor::parse(layers, format).unwrap_err();
            assert!(err.contains(needle), "{layers} {format}: {err}");
        }
    }

    #[test]
    fn only_a_lossy_adaptive_demotion_ranks_pages() {
        let d = |format, adaptive, ranking| Demotion { format, adaptive, ranking, floors: Floors::default() };
        assert!(d(Some(Q4), true, Ranking::Age).ranks_pages());
        assert!(!d(Some(Q4), false, Ranking::Age).ranks_pages());
        assert!(!d(None, true, Ranking::Age).ranks_pages());
        assert!(d(Some(Q4), true, Ranking::Age).by_age());
        assert!(!d(Some(Q4), true, Ranking::Mass).by_age());
        assert!(!d(Some(Q4), false, Ranking::Age).by_age());
        assert!(!d(None, true, Ranking::Age).by_age());
        assert_eq!(Ranking::from_name(" mass "), Some(Ranking::Mass));
        assert_eq!(Ranking::from_name("age").map(|r| r.to_string()), Some("age".to_owned()));
        assert_eq!(Ranking::from_name("heat"), None);
    }
}
