//! Quality of kvmm's compressed pages on real K/V: what storing old pages in a quantized format, or
//! reading only the pages selection keeps, does to the attention output a model consumes.
//!
//! The input is a [`KvTrace`] (a `.kvfx` fixture): per layer, the real post-RoPE queries, keys and
//! values of `T` positions. Per layer, the context is cut into pages of `block_tokens` tokens, as a
//! kvmm session would hold it; the pages that end at or before position `T − exact_tokens` are the
//! old ones, stored in the format under test (written into an f16 page with `init_page` and
//! `write_rows`, then `quantize`d, one page per block); the rest stay f16, the recent tokens a
//! client keeps exact. The last `queries` positions are scored:
//!
//! ```text
//!   position  0                          T − exact_tokens                          T − 1
//!             |-- old pages: the format --|--------- f16 pages (exact_tokens) ----------|
//!                                         |<-------- scored query positions t -------->|  (queries = exact_tokens)
//!   query t attends causally to 0..=t: every page before t's page whole, t's page partial
//! ```
//!
//! For each scored position `t`, the real query `q_t` attends to tokens `0..=t` twice:
//!
//! - the **candidate**: kvmm's fused kernel ([`DecodeAttention`]) over the mixed pages, read in
//!   place (the page holding `t` with `t + 1 − page start` tokens); or, for
//!   [`Scheme::Selected`], only the pages [`select_pages`] keeps under a budget; or, for
//!   [`Scheme::PerTokenKeysQ4`], dense dequantized rows into [`reference_attention_f32`];
//! - the **truth**: [`reference_attention_f32`] (`f64` inside) over the original `f32` keys and
//!   values, with no f16 rounding, computed once per [`Evaluation`].
//!
//! Both use the scale `1 / sqrt(head_dim)`. Metrics per (layer, position), over the layer's whole
//! attention output `o` (`q_heads × head_dim`, what `o_proj` consumes): relative error
//! `‖o − o_ref‖₂ / ‖o_ref‖₂` and cosine similarity. A [`Summary`] aggregates them: mean, p99
//! (nearest rank: the `⌈0.99·n⌉`-th smallest), max relative error, mean and min cosine. The f16
//! "format" measures the floor: f16 storage and the kernel's `f32` arithmetic alone.
//!
//! **Padding.** Page geometry needs `head_dim` a multiple of 16 (stories260K has 8). Queries, keys
//! and values are zero-padded per head to the next multiple of 16: zero channels add nothing to a
//! score nor to the real output channels, and the padded output channels are dropped, so this is
//! exact for f16 pages. In quantized pages a zero key channel is a constant group (stored exactly),
//! but the padding zeros join the value groups (one group per token when the padded width is at
//! most 32), whose range then includes 0: the same range as the real channels' when theirs
//! already straddles 0, wider (coarser codes) when it does not. The per-token baseline groups its
//! padded keys the same way, so the KIVI comparison stays like for like.
//!
//! Layers are evaluated in parallel, one scoped thread per available CPU.

pub mod per_token;
pub mod report;

use std::sync::atomic::{AtomicUsize, Ordering};

use kvmm_kernels::{
    AttnShape, DecodeAttention, Format, KernelError, PageShape, PageView, decode_attention_selected, dequantize,
    init_page, quantize, reference_attention_f32, select_pages, write_rows,
};

use crate::error::InferError;
use crate::trace::KvTrace;

/// How the context is cut and which positions are scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QualityOptions {
    /// Tokens per page: a power of two in `8..=256`. Default 32.
    pub block_tokens: usize,
    /// The last this many positions are never quantized: only pages that end at or before
    /// `T − exact_tokens` are stored in the format. Default 128.
    pub exact_tokens: usize,
    /// The last this many positions are scored, `1..=T`. Default 128. When it exceeds
    /// `exact_tokens`, some queries read their own page quantized, with the parameters of the
    /// whole page.
    pub queries: usize,
}

impl Default for QualityOptions {
    fn default() -> Self {
        QualityOptions { block_tokens: 32, exact_tokens: 128, queries: 128 }
    }
}

/// What stands in for the old pages, and how attention reads them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scheme {
    /// Old pages in `format` (f16 for the floor), every page of the context read by the fused
    /// kernel.
    Pages(Format),
    /// Old pages in `format`; attention reads only the pages [`select_pages`] keeps under a
    /// budget of `⌈fraction × context pages⌉` (the sink page and the two most recent pages always
    /// kept, per the kernels' rules). `fraction` in `(0, 1]`.
    Selected {
        /// The format of the old pages.
        format: Format,
        /// The page budget as a fraction of the pages of each query's context.
        fraction: f64,
    },
    /// Adaptive precision at uniform q4's bytes: each layer's old pages ranked by the attention
    /// mass the fused kernel reported for them over the [`ADAPTIVE_HISTORY`] positions before the
    /// scored ones (what a running daemon knows), the top [`ADAPTIVE_Q8_SHARE`] stored as q8, the
    /// fewest lowest-mass pages as q2 that bring the bytes back to uniform q4's, the rest q4.
    Adaptive,
    /// A per-layer floor at uniform q4's bytes over all layers: the layers in the bit mask never
    /// store an old page below `format` ([`allocate_by_mass_above`]); the others share what is
    /// left, each within an equal budget by [`allocate_by_mass_sparing_q2`] (they give up q8 pages
    /// before they take more q2 pages than [`Scheme::Adaptive`] has).
    Floored {
        /// Bit `l` set: layer `l` is floored.
        layers: u64,
        /// The fewest bits an old page of a floored layer gets.
        format: Format,
    },
    /// The KIVI comparison at 4 bits: old keys quantized per token in groups of 32 channels
    /// ([`per_token`]), old values as in q4 (dequantized from the q4 page); simulated in `f32`,
    /// since it is not a page format (dense rows into [`reference_attention_f32`]).
    PerTokenKeysQ4,
}

impl Scheme {
    /// A short label for tables: `q4`, `f16 top 25%`, `q4 per-token keys`.
    pub fn label(&self) -> String {
        match self {
            Scheme::Pages(format) => format.name().to_owned(),
            Scheme::Selected { format, fraction } => format!("{} top {}%", format.name(), fraction * 100.0),
            Scheme::PerTokenKeysQ4 => "q4 per-token keys".to_owned(),
            Scheme::Adaptive => "adaptive q8/q4/q2".to_owned(),
            Scheme::Floored { layers, format } => {
                let noun = if layers.count_ones() == 1 { "layer" } else { "layers" };
                format!("adaptive, {noun} {} never below {}", layer_ranges(*layers), format.name())
            }
        }
    }

    /// The format of the old pages.
    pub fn format(&self) -> Format {
        match self {
            Scheme::Pages(format) | Scheme::Selected { format, .. } => *format,
            Scheme::PerTokenKeysQ4 | Scheme::Adaptive | Scheme::Floored { .. } => Format::Q4,
        }
    }
}

/// The layers of a bit mask as inclusive ranges, the way a policy names them: `7..=8, 18`; `none`
/// for an empty mask.
pub fn layer_ranges(mask: u64) -> String {
    let mut ranges = Vec::new();
    let mut l = 0;
    while l < 64 {
        if mask >> l & 1 == 0 {
            l += 1;
            continue;
        }
        let first = l;
        while l + 1 < 64 && mask >> (l + 1) & 1 == 1 {
            l += 1;
        }
        ranges.push(if first == l { l.to_string() } else { format!("{first}..={l}") });
        l += 1;
    }
    if ranges.is_empty() { "none".to_owned() } else { ranges.join(", ") }
}

/// Positions before the scored ones whose attention mass ranks the pages of [`Scheme::Adaptive`].
pub const ADAPTIVE_HISTORY: usize = 128;
/// Share of the old pages [`Scheme::Adaptive`] keeps at q8. Measured on SmolLM2's K/V (2,048
/// positions, `kvmm-kv-quality`): 5% beats uniform q4 on mean, p99 and max error; 10% and 20% have
/// lower means still but worse tails (more q2 pages, some of which later draw attention).
pub const ADAPTIVE_Q8_SHARE: f64 = 0.05;

/// Formats for pages with attention masses `mass` (in page order): the top `q8_share` by mass q8
/// (fewer if q2 pages cannot pay for them),
/// then the fewest lowest-mass pages as q2 that bring the total bytes to at most uniform q4's, the
/// rest q4. A page never gets fewer bits than one with less mass (ties by position, older first
/// to fewer bits).
pub fn allocate_by_mass(shape: PageShape, mass: &[f64], q8_share: f64) -> Vec<Format> {
    let budget = mass.len() as u64 * shape.page_bytes(Format::Q4) as u64;
    allocate_by_mass_within(shape, mass, q8_share, budget)
}

/// [`allocate_by_mass`] within `budget` bytes instead of uniform q4's (all q2 when even that does
/// not fit).
pub fn allocate_by_mass_within(shape: PageShape, mass: &[f64], q8_share: f64, budget: u64) -> Vec<Format> {
    let ladder = kvmm_kernels::precision::Ladder { hi: Format::Q8, mid: Format::Q4, lo: Format::Q2 };
    kvmm_kernels::precision::allocate_by_mass(shape, mass, ladder, q8_share, budget)
}

/// Bits per K/V element pair of `format`'s codes: the order in which a floor compares formats.
fn code_bits(format: Format) -> u32 {
    format.k_bits() + format.v_bits()
}

/// [`allocate_by_mass`] with every page below `floor` raised to it: at a q4 floor the top
/// `q8_share` by mass q8 and the rest q4 (no q2 page), at k8v4 the rest k8v4, at q8 every page q8.
/// Such a layer spends more than uniform q4's bytes whenever `floor` has more bits than q2; what it
/// spends depends only on the number of pages, not on their masses.
pub fn allocate_by_mass_above(shape: PageShape, mass: &[f64], q8_share: f64, floor: Format) -> Vec<Format> {
    allocate_by_mass(shape, mass, q8_share)
        .into_iter()
        .map(|f| if code_bits(f) < code_bits(floor) { floor } else { f })
        .collect()
}

/// [`allocate_by_mass_within`] `budget`, where a budget below uniform q4's is met first by giving
/// up q8 pages (the lowest-mass ones) and only then by more q2 pages: while a q8 page is left, no
/// more q2 pages than [`allocate_by_mass`] has at uniform q4's bytes.
///
/// Measured on SmolLM2's K/V (`kvmm-kv-quality`): a q2 page is what a layer pays for a wrong
/// ranking (a page with little mass in the history that draws attention later: layer 7's max
/// error jumps from 21% to 76% with its ninth q2 page), while a q8 page given up costs it only the
/// difference between q8's error and q4's on that page.
pub fn allocate_by_mass_sparing_q2(shape: PageShape, mass: &[f64], q8_share: f64, budget: u64) -> Vec<Format> {
    let n = mass.len();
    if n == 0 {
        return Vec::new();
    }
    let q2_pages = |formats: &[Format]| formats.iter().filter(|&&f| f == Format::Q2).count();
    let most_q2 = q2_pages(&allocate_by_mass(shape, mass, q8_share));
    let mut q8 = ((q8_share * n as f64).round() as usize).min(n);
    loop {
        // `q8 / n` of `n` pages rounds back to `q8`.
        let formats = allocate_by_mass_within(shape, mass, q8 as f64 / n as f64, budget);
        if q8 == 0 || q2_pages(&formats) <= most_q2 {
            return formats;
        }
        q8 -= 1;
    }
}

/// The score of one query position of one layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QueryScore {
    /// `‖o − o_ref‖₂ / ‖o_ref‖₂` over the layer's attention output.
    pub rel_error: f64,
    /// Cosine similarity of `o` and `o_ref`.
    pub cosine: f64,
    /// Fraction of the context's pages attention read (1 unless selecting).
    pub pages_read: f64,
    /// Attention mass (of full attention over the same pages) on the pages read (1 unless
    /// selecting).
    pub mass_kept: f64,
}

/// Aggregates of [`QueryScore`]s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Scores aggregated.
    pub queries: usize,
    /// Mean relative error.
    pub mean_rel_error: f64,
    /// 99th percentile (nearest rank) of the relative error.
    pub p99_rel_error: f64,
    /// Largest relative error.
    pub max_rel_error: f64,
    /// Mean cosine similarity.
    pub mean_cosine: f64,
    /// Smallest cosine similarity.
    pub min_cosine: f64,
    /// Mean fraction of the context's pages read.
    pub mean_pages_read: f64,
    /// Mean attention mass on the pages read.
    pub mean_mass_kept: f64,
    /// Smallest attention mass on the pages read.
    pub min_mass_kept: f64,
}

impl Summary {
    /// Aggregates `scores`; `None` when empty.
    pub fn of(scores: &[QueryScore]) -> Option<Summary> {
        if scores.is_empty() {
            return None;
        }
        let n = scores.len();
        let mean = |f: fn(&QueryScore) -> f64| scores.iter().map(f).sum::<f64>() / n as f64;
        let mut errors: Vec<f64> = scores.iter().map(|s| s.rel_error).collect();
        errors.sort_by(f64::total_cmp);
        let rank = (0.99 * n as f64).ceil() as usize;
        Some(Summary {
            queries: n,
            mean_rel_error: mean(|s| s.rel_error),
            p99_rel_error: errors[rank.clamp(1, n) - 1],
            max_rel_error: errors[n - 1],
            mean_cosine: mean(|s| s.cosine),
            min_cosine: scores.iter().map(|s| s.cosine).fold(f64::INFINITY, f64::min),
            mean_pages_read: mean(|s| s.pages_read),
            mean_mass_kept: mean(|s| s.mass_kept),
            min_mass_kept: scores.iter().map(|s| s.mass_kept).fold(f64::INFINITY, f64::min),
        })
    }
}

/// The result of one [`Scheme`] over a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Quality {
    /// What was measured.
    pub scheme: Scheme,
    /// Per layer, every scored position in order.
    pub scores: Vec<Vec<QueryScore>>,
    /// Per layer.
    pub layers: Vec<Summary>,
    /// Over every layer and position.
    pub overall: Summary,
    /// Pages per layer stored in the format (the rest are f16).
    pub quantized_pages: usize,
    /// Pages per layer.
    pub pages: usize,
    /// Bits per K/V element of the old pages, metadata included, over every layer.
    pub old_bits_per_element: f64,
}

/// Sizes derived from a trace and options, checked once.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    /// Positions in the trace (`T`).
    positions: usize,
    /// Query heads.
    heads: usize,
    /// KV heads.
    kv_heads: usize,
    /// The model's head_dim.
    head_dim: usize,
    /// head_dim rounded up to a multiple of 16: the pages' head_dim.
    padded: usize,
    /// The pages' attention geometry (padded).
    shape: AttnShape,
    /// `1 / sqrt(head_dim)`.
    scale: f32,
    /// The first scored position, `T − queries`.
    first_query: usize,
    /// Pages per layer, `⌈T / block_tokens⌉`.
    pages: usize,
    /// Leading pages stored in the format: those ending at or before `T − exact_tokens`.
    quantized_pages: usize,
}

impl Geometry {
    fn new(trace: &KvTrace, options: &QualityOptions) -> Result<Geometry, InferError> {
        let c = &trace.config;
        let positions = trace.positions();
        if options.queries == 0 || options.queries > positions {
            return Err(InferError::InvalidArgument(format!(
                "{} query positions were asked for, but the trace has {positions} positions; score 1..={positions}",
                options.queries
            )));
        }
        let padded = c.head_dim.next_multiple_of(16);
        let shape =
            AttnShape { q_heads: c.heads, kv_heads: c.kv_heads, head_dim: padded, block_tokens: options.block_tokens };
        shape.validate().map_err(|source| InferError::Kernel {
            what: format!(
                "lay out {}-token pages of this model's heads (head_dim {}, {padded} in pages)",
                options.block_tokens, c.head_dim
            ),
            source,
        })?;
        let b = options.block_tokens;
        Ok(Geometry {
            positions,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            padded,
            shape,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            first_query: positions - options.queries,
            pages: positions.div_ceil(b),
            quantized_pages: positions.saturating_sub(options.exact_tokens) / b,
        })
    }

    fn page_shape(&self) -> PageShape {
        self.shape.page_shape()
    }

    /// `rows` rows of `head_dim` floats, each zero-padded to `padded`.
    fn pad(&self, src: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; src.len() / self.head_dim * self.padded];
        for (dst, row) in out.chunks_exact_mut(self.padded).zip(src.chunks_exact(self.head_dim)) {
            dst[..self.head_dim].copy_from_slice(row);
        }
        out
    }

    /// Drops the padded channels of `q_heads` padded rows.
    fn unpad(&self, src: &[f32], out: &mut [f32]) {
        for (dst, row) in out.chunks_exact_mut(self.head_dim).zip(src.chunks_exact(self.padded)) {
            dst.copy_from_slice(&row[..self.head_dim]);
        }
    }
}

fn kernel(what: impl Into<String>) -> impl FnOnce(KernelError) -> InferError {
    let what = what.into();
    move |source| InferError::Kernel { what, source }
}

/// One layer's context as pages: `(format, bytes, tokens)` per page, in order.
struct LayerPages {
    pages: Vec<(Format, Vec<u8>, usize)>,
}

impl LayerPages {
    /// Pages of `layer` (padded rows `k`, `v`), the first `quantized_pages` in `format`.
    fn build(g: &Geometry, format: Format, k: &[f32], v: &[f32]) -> Result<LayerPages, InferError> {
        LayerPages::build_with(g, &vec![format; g.quantized_pages], k, v)
    }

    /// Pages of `layer`, old page `p` in `formats[p]` (f16 pages stay f16).
    fn build_with(g: &Geometry, formats: &[Format], k: &[f32], v: &[f32]) -> Result<LayerPages, InferError> {
        let shape = g.page_shape();
        let (b, row) = (shape.block_tokens, g.kv_heads * g.padded);
        let mut pages = Vec::with_capacity(g.pages);
        for p in 0..g.pages {
            let tokens = b.min(g.positions - p * b);
            let rows = p * b * row..(p * b + tokens) * row;
            let mut page = vec![0u8; shape.page_bytes(Format::F16)];
            init_page(shape, Format::F16, &mut page).map_err(kernel("start an f16 page"))?;
            write_rows(shape, Format::F16, &mut page, 0, &k[rows.clone()], &v[rows])
                .map_err(kernel(format!("write page {p}")))?;
            if let Some(&format) = formats.get(p).filter(|&&f| p < g.quantized_pages && f != Format::F16) {
                let mut q = vec![0u8; shape.page_bytes(format)];
                quantize(shape, Format::F16, &page, tokens, format, &mut q)
                    .map_err(kernel(format!("quantize page {p} to {format}")))?;
                pages.push((format, q, tokens));
            } else {
                pages.push((Format::F16, page, tokens));
            }
        }
        Ok(LayerPages { pages })
    }

    /// The views of the context of position `t` (pages up to `t`'s, that one partial).
    fn views(&self, b: usize, t: usize) -> Vec<PageView<'_>> {
        let last = t / b;
        self.pages[..=last]
            .iter()
            .enumerate()
            .map(|(p, (format, bytes, tokens))| PageView {
                bytes,
                format: *format,
                tokens: if p == last { t + 1 - p * b } else { *tokens },
            })
            .collect()
    }

    /// The pages decoded back into dense padded rows, token-major.
    fn dense(&self, g: &Geometry) -> Result<(Vec<f32>, Vec<f32>), InferError> {
        let shape = g.page_shape();
        let row = g.kv_heads * g.padded;
        let (mut k, mut v) = (vec![0.0; g.positions * row], vec![0.0; g.positions * row]);
        let b = shape.block_tokens;
        for (p, (format, bytes, tokens)) in self.pages.iter().enumerate() {
            let rows = p * b * row..(p * b + tokens) * row;
            dequantize(shape, *format, bytes, *tokens, &mut k[rows.clone()], &mut v[rows])
                .map_err(kernel(format!("decode page {p}")))?;
        }
        Ok((k, v))
    }
}

/// Relative error and cosine of `o` against `truth`, in `f64`.
fn compare(o: &[f32], truth: &[f32]) -> (f64, f64) {
    let (mut diff, mut norm_o, mut norm_r, mut dot) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&a, &b) in o.iter().zip(truth) {
        let (a, b) = (f64::from(a), f64::from(b));
        diff += (a - b) * (a - b);
        norm_o += a * a;
        norm_r += b * b;
        dot += a * b;
    }
    let rel = if norm_r > 0.0 { (diff / norm_r).sqrt() } else { diff.sqrt() };
    let cosine = if norm_o > 0.0 && norm_r > 0.0 {
        dot / (norm_o.sqrt() * norm_r.sqrt())
    } else if norm_o == norm_r {
        1.0
    } else {
        0.0
    };
    (rel, cosine)
}

/// Runs `work` for every layer `0..layers` on scoped threads (one per available CPU), results in
/// layer order; the first error (by layer) wins.
fn per_layer<T: Send>(
    layers: usize,
    work: impl Fn(usize) -> Result<T, InferError> + Sync,
) -> Result<Vec<T>, InferError> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, layers.max(1));
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, Result<T, InferError>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let layer = next.fetch_add(1, Ordering::Relaxed);
                        if layer >= layers {
                            return mine;
                        }
                        mine.push((layer, work(layer)));
                    }
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect()
    });
    done.sort_by_key(|(layer, _)| *layer);
    done.into_iter().map(|(_, r)| r).collect()
}

/// A trace with its ground truth computed: score any number of [`Scheme`]s against it.
#[derive(Debug)]
pub struct Evaluation<'a> {
    /// The trace evaluated.
    trace: &'a KvTrace,
    /// The options it was set up with.
    options: QualityOptions,
    /// Sizes derived from both.
    geometry: Geometry,
    /// Per layer, `queries × q_heads × head_dim`: the reference output of each scored position.
    truth: Vec<Vec<f32>>,
}

impl<'a> Evaluation<'a> {
    /// Checks `options` against `trace` and computes the ground truth (the `f64` reference over
    /// the original `f32` keys and values) for every layer and scored position.
    pub fn new(trace: &'a KvTrace, options: QualityOptions) -> Result<Evaluation<'a>, InferError> {
        let g = Geometry::new(trace, &options)?;
        let q_dim = g.heads * g.head_dim;
        let kv_dim = g.kv_heads * g.head_dim;
        let truth = per_layer(trace.layers.len(), |layer| {
            let data = &trace.layers[layer];
            let mut out = vec![0.0; (g.positions - g.first_query) * q_dim];
            for (t, o) in (g.first_query..g.positions).zip(out.chunks_exact_mut(q_dim)) {
                let (q, context) = (&data.q[t * q_dim..][..q_dim], ..(t + 1) * kv_dim);
                reference_attention_f32(
                    g.heads,
                    g.kv_heads,
                    g.head_dim,
                    q,
                    &data.k[context],
                    &data.v[context],
                    g.scale,
                    o,
                )
                .map_err(kernel(format!("compute the reference attention of layer {layer} at position {t}")))?;
            }
            Ok(out)
        })?;
        Ok(Evaluation { trace, options, geometry: g, truth })
    }

    /// The options in use.
    pub fn options(&self) -> QualityOptions {
        self.options
    }

    /// Pages per layer and how many of them are stored in the format under test.
    pub fn pages(&self) -> (usize, usize) {
        (self.geometry.pages, self.geometry.quantized_pages)
    }

    /// Scores `scheme` against the ground truth, every layer and scored position.
    pub fn score(&self, scheme: Scheme) -> Result<Quality, InferError> {
        if let Scheme::Selected { fraction, .. } = scheme
            && !(fraction > 0.0 && fraction <= 1.0)
        {
            return Err(InferError::InvalidArgument(format!(
                "a page budget of {fraction} of the context was asked for; it must be in (0, 1]"
            )));
        }
        let scored = per_layer(self.trace.layers.len(), |layer| self.score_layer(scheme, layer))?;
        let g = &self.geometry;
        let old_bytes: u64 = scored.iter().map(|(_, bytes)| bytes).sum();
        let old_elements = (scored.len() * g.quantized_pages * g.page_shape().region_elements() * 2) as f64;
        let old_bits_per_element = if old_elements > 0.0 { old_bytes as f64 * 8.0 / old_elements } else { 0.0 };
        let scores: Vec<Vec<QueryScore>> = scored.into_iter().map(|(s, _)| s).collect();
        let summary = |s: &[QueryScore]| Summary::of(s).expect("options.queries ≥ 1 was checked");
        let layers = scores.iter().map(|s| summary(s)).collect();
        let all: Vec<QueryScore> = scores.iter().flatten().copied().collect();
        Ok(Quality {
            scheme,
            layers,
            overall: summary(&all),
            scores,
            quantized_pages: self.geometry.quantized_pages,
            pages: self.geometry.pages,
            old_bits_per_element,
        })
    }

    /// The attention mass the fused kernel reports for each old page of `layer` over f16 pages,
    /// summed over the [`ADAPTIVE_HISTORY`] positions before the scored ones (what a running daemon
    /// knows): what ranks the pages of [`Scheme::Adaptive`] and [`Scheme::Floored`].
    fn page_mass(&self, layer: usize, k: &[f32], v: &[f32]) -> Result<Vec<f64>, InferError> {
        let g = &self.geometry;
        let data = &self.trace.layers[layer];
        let pages = LayerPages::build(g, Format::F16, k, v)?;
        let b = g.shape.block_tokens;
        let q_dim = g.heads * g.head_dim;
        let mut mass = vec![0.0f64; g.quantized_pages];
        let mut out = vec![0.0; g.heads * g.padded];
        for t in g.first_query.saturating_sub(ADAPTIVE_HISTORY)..g.first_query {
            let q = g.pad(&data.q[t * q_dim..][..q_dim]);
            let views = pages.views(b, t);
            let mut page_mass = vec![0.0; views.len()];
            kvmm_kernels::decode_attention(g.shape, &q, g.scale, &views, &mut out, &mut page_mass)
                .map_err(kernel(format!("attention mass of layer {layer} at position {t}")))?;
            for (m, pm) in mass.iter_mut().zip(&page_mass) {
                *m += f64::from(*pm);
            }
        }
        Ok(mass)
    }

    /// The formats `scheme` gives the old pages of `layer` (padded rows `k`, `v`), page by page;
    /// `None` for the schemes with one format for every old page.
    fn layer_formats(
        &self,
        scheme: Scheme,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<Option<Vec<Format>>, InferError> {
        let shape = self.geometry.page_shape();
        let formats = match scheme {
            Scheme::Adaptive => allocate_by_mass(shape, &self.page_mass(layer, k, v)?, ADAPTIVE_Q8_SHARE),
            Scheme::Floored { layers, format } if layers >> layer & 1 == 1 => {
                allocate_by_mass_above(shape, &self.page_mass(layer, k, v)?, ADAPTIVE_Q8_SHARE, format)
            }
            Scheme::Floored { layers, format } => allocate_by_mass_sparing_q2(
                shape,
                &self.page_mass(layer, k, v)?,
                ADAPTIVE_Q8_SHARE,
                self.floored_budget(layers, format),
            ),
            _ => return Ok(None),
        };
        Ok(Some(formats))
    }

    /// Bytes each layer outside the floor (`mask`, at `format`) may spend on its old pages so that
    /// all layers together spend at most uniform q4's bytes; 0 when the floored layers alone spend
    /// more.
    fn floored_budget(&self, mask: u64, format: Format) -> u64 {
        let g = &self.geometry;
        let shape = g.page_shape();
        let layers = self.trace.layers.len() as u64;
        let floored = (0..layers).filter(|l| mask >> l & 1 == 1).count() as u64;
        // What a floored layer spends depends only on its page count, not on the masses.
        let floored_layer: u64 =
            allocate_by_mass_above(shape, &vec![0.0; g.quantized_pages], ADAPTIVE_Q8_SHARE, format)
                .iter()
                .map(|&f| shape.page_bytes(f) as u64)
                .sum();
        let uniform_q4 = g.quantized_pages as u64 * shape.page_bytes(Format::Q4) as u64;
        (layers * uniform_q4).saturating_sub(floored * floored_layer) / (layers - floored).max(1)
    }

    /// Scores of one layer, and the bytes of its old pages.
    fn score_layer(&self, scheme: Scheme, layer: usize) -> Result<(Vec<QueryScore>, u64), InferError> {
        let g = &self.geometry;
        let data = &self.trace.layers[layer];
        let (k, v) = (g.pad(&data.k), g.pad(&data.v));
        let pages = match self.layer_formats(scheme, layer, &k, &v)? {
            Some(formats) => LayerPages::build_with(g, &formats, &k, &v)?,
            None => LayerPages::build(g, scheme.format(), &k, &v)?,
        };
        let old_bytes: u64 = pages.pages[..g.quantized_pages].iter().map(|(_, bytes, _)| bytes.len() as u64).sum();
        let (q_dim, padded_q_dim) = (g.heads * g.head_dim, g.heads * g.padded);
        let b = g.shape.block_tokens;
        let mut out_padded = vec![0.0; padded_q_dim];
        let mut out = vec![0.0; q_dim];
        let mut scores = Vec::with_capacity(g.positions - g.first_query);
        let at = |t: usize| format!("attend layer {layer} at position {t}");

        // The per-token baseline's dense rows: in the old pages, the f16 keys quantized per token
        // at 4 bits and the q4 page's values; f16 rows after them.
        let dense = match scheme {
            Scheme::PerTokenKeysQ4 => {
                let (mut k, _) = LayerPages::build(g, Format::F16, &k, &v)?.dense(g)?;
                let (_, v) = pages.dense(g)?;
                let old = g.quantized_pages * b * g.kv_heads * g.padded;
                per_token::quantize_rows(&mut k[..old], g.padded, 4);
                Some((k, v))
            }
            _ => None,
        };
        let mut attention: Option<DecodeAttention> = None;

        for (i, t) in (g.first_query..g.positions).enumerate() {
            let q = g.pad(&data.q[t * q_dim..][..q_dim]);
            let truth = &self.truth[layer][i * q_dim..][..q_dim];
            let (mut pages_read, mut mass_kept) = (1.0, 1.0);
            match (scheme, &dense) {
                (_, Some((k, v))) => {
                    let context = ..(t + 1) * g.kv_heads * g.padded;
                    reference_attention_f32(
                        g.heads,
                        g.kv_heads,
                        g.padded,
                        &q,
                        &k[context],
                        &v[context],
                        g.scale,
                        &mut out_padded,
                    )
                    .map_err(kernel(at(t)))?;
                }
                (Scheme::Selected { fraction, .. }, None) => {
                    let views = pages.views(b, t);
                    let n = views.len();
                    let budget = ((fraction * n as f64).ceil() as usize).max(1);
                    let chosen = select_pages(g.shape, &q, g.scale, &views, budget).map_err(kernel(at(t)))?;
                    let mut full_mass = vec![0.0; n];
                    let mut full_out = vec![0.0; padded_q_dim];
                    kvmm_kernels::decode_attention(g.shape, &q, g.scale, &views, &mut full_out, &mut full_mass)
                        .map_err(kernel(at(t)))?;
                    let mut mass = vec![0.0; n];
                    decode_attention_selected(g.shape, &q, g.scale, &views, &chosen, &mut out_padded, &mut mass)
                        .map_err(kernel(at(t)))?;
                    pages_read = chosen.len() as f64 / n as f64;
                    mass_kept = chosen.iter().map(|&p| f64::from(full_mass[p])).sum();
                }
                _ => {
                    let views = pages.views(b, t);
                    let run = match attention.as_mut() {
                        Some(run) => {
                            run.reset(&q, g.scale).map_err(kernel(at(t)))?;
                            run
                        }
                        None => attention.insert(DecodeAttention::new(g.shape, &q, g.scale).map_err(kernel(at(t)))?),
                    };
                    run.reserve_pages(views.len());
                    for view in &views {
                        run.page(*view).map_err(kernel(at(t)))?;
                    }
                    let mut mass = vec![0.0; views.len()];
                    run.write_output(&mut out_padded, &mut mass).map_err(kernel(at(t)))?;
                }
            }
            g.unpad(&out_padded, &mut out);
            let (rel_error, cosine) = compare(&out, truth);
            scores.push(QueryScore { rel_error, cosine, pages_read, mass_kept });
        }
        Ok((scores, old_bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::trace::LayerTrace;

    /// A random trace: `layers` layers of `positions` positions, heads 4/2, the given head_dim.
    fn trace(layers: usize, positions: usize, head_dim: usize) -> KvTrace {
        let config = ModelConfig {
            dim: 4 * head_dim,
            hidden_dim: 8,
            layers,
            heads: 4,
            kv_heads: 2,
            head_dim,
            vocab_size: 16,
            seq_len: positions,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
        };
        let mut state = 0x9e37_79b9_u32;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        };
        let layers = (0..layers)
            .map(|_| LayerTrace {
                q: (0..positions * config.q_dim()).map(|_| next()).collect(),
                k: (0..positions * config.kv_dim()).map(|_| next()).collect(),
                v: (0..positions * config.kv_dim()).map(|_| next()).collect(),
            })
            .collect();
        KvTrace { config, tokens: vec![1; positions], layers }
    }

    fn options() -> QualityOptions {
        QualityOptions { block_tokens: 16, exact_tokens: 32, queries: 32 }
    }

    #[test]
    fn f16_pages_match_the_f32_truth_to_f16_precision_even_padded() {
        for head_dim in [8, 16] {
            let trace = trace(2, 100, head_dim);
            let eval = Evaluation::new(&trace, options()).unwrap();
            let q = eval.score(Scheme::Pages(Format::F16)).unwrap();
            assert_eq!((q.pages, q.quantized_pages), (7, 4));
            assert_eq!(q.overall.queries, 64);
            assert!(q.overall.max_rel_error < 2e-3, "head_dim {head_dim}: {:?}", q.overall);
            assert!(q.overall.min_cosine > 0.99999, "head_dim {head_dim}: {:?}", q.overall);
        }
    }

    #[test]
    fn fewer_bits_give_larger_errors() {
        let trace = trace(1, 128, 32);
        let eval = Evaluation::new(&trace, options()).unwrap();
        let error = |s: Scheme| eval.score(s).unwrap().overall.mean_rel_error;
        let (f16, q8, q4, q2) = (
            error(Scheme::Pages(Format::F16)),
            error(Scheme::Pages(Format::Q8)),
            error(Scheme::Pages(Format::Q4)),
            error(Scheme::Pages(Format::Q2)),
        );
        assert!(f16 < q8 && q8 < q4 && q4 < q2, "{f16} {q8} {q4} {q2}");
    }

    #[test]
    fn adaptive_allocation_spends_uniform_q4_bytes_and_gives_more_mass_more_bits() {
        let shape = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };
        let mass: Vec<f64> = (0..60).map(|p| ((p * 37) % 60) as f64).collect();
        for share in [0.0, 0.05, 0.2, 0.5] {
            let formats = allocate_by_mass(shape, &mass, share);
            let bytes: usize = formats.iter().map(|&f| shape.page_bytes(f)).sum();
            assert!(bytes <= 60 * shape.page_bytes(Format::Q4), "share {share}: {bytes}");
            let q8 = formats.iter().filter(|&&f| f == Format::Q8).count();
            if share <= 0.2 {
                assert_eq!(q8, (share * 60.0_f64).round() as usize);
            } else {
                assert!(q8 > 12 && q8 < 30, "as many q8 pages as q2 pages pay for: {q8}");
            }
            let bits = |f: Format| f.k_bits() + f.v_bits();
            for a in 0..60 {
                for b in 0..60 {
                    if mass[a] > mass[b] {
                        assert!(bits(formats[a]) >= bits(formats[b]), "share {share}: page {a} vs {b}");
                    }
                }
            }
        }
        assert!(allocate_by_mass(shape, &mass, 0.0).iter().all(|&f| f == Format::Q4));
        assert!(allocate_by_mass(shape, &[], 0.2).is_empty());
    }

    #[test]
    fn the_adaptive_scheme_stores_old_pages_in_uniform_q4_bytes() {
        let trace = trace(2, 512, 64);
        let eval = Evaluation::new(&trace, options()).unwrap();
        let q4 = eval.score(Scheme::Pages(Format::Q4)).unwrap();
        let adaptive = eval.score(Scheme::Adaptive).unwrap();
        assert!(adaptive.old_bits_per_element <= q4.old_bits_per_element, "{adaptive:?}");
        assert!(adaptive.old_bits_per_element > q4.old_bits_per_element * 0.97);
        let q8 = eval.score(Scheme::Pages(Format::Q8)).unwrap();
        assert!(q8.old_bits_per_element > q4.old_bits_per_element * 1.5);
        assert!(adaptive.overall.mean_rel_error.is_finite() && adaptive.overall.min_cosine > 0.5);
    }

    #[test]
    fn a_floor_never_stores_a_page_below_its_format_and_keeps_the_q8_pages() {
        let shape = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };
        let mass: Vec<f64> = (0..60).map(|p| ((p * 37) % 60) as f64).collect();
        let adaptive = allocate_by_mass(shape, &mass, 0.05);
        assert_eq!(allocate_by_mass_above(shape, &mass, 0.05, Format::Q2), adaptive);
        let bytes = |formats: &[Format]| formats.iter().map(|&f| shape.page_bytes(f)).sum::<usize>();
        for floor in [Format::Q4, Format::K8V4, Format::Q8] {
            let formats = allocate_by_mass_above(shape, &mass, 0.05, floor);
            for (p, (&f, &a)) in formats.iter().zip(&adaptive).enumerate() {
                assert!(code_bits(f) >= code_bits(floor), "{floor}: page {p} is {f}");
                assert_eq!(f == Format::Q8, a == Format::Q8 || floor == Format::Q8, "{floor}: page {p}");
            }
            assert!(bytes(&formats) > 60 * shape.page_bytes(Format::Q4), "{floor} costs more than uniform q4");
            // What a floored layer spends does not depend on the masses (the budget relies on it).
            let reversed: Vec<f64> = mass.iter().rev().copied().collect();
            assert_eq!(bytes(&allocate_by_mass_above(shape, &reversed, 0.05, floor)), bytes(&formats));
        }
    }

    #[test]
    fn a_smaller_budget_gives_up_q8_pages_before_it_takes_more_q2_pages() {
        let shape = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };
        let mass: Vec<f64> = (0..60).map(|p| ((p * 37) % 60) as f64).collect();
        let count = |formats: &[Format], format: Format| formats.iter().filter(|&&f| f == format).count();
        let bytes = |formats: &[Format]| formats.iter().map(|&f| shape.page_bytes(f) as u64).sum::<u64>();
        let adaptive = allocate_by_mass(shape, &mass, 0.05);
        let (q8_adaptive, q2_adaptive) = (count(&adaptive, Format::Q8), count(&adaptive, Format::Q2));
        assert_eq!((q8_adaptive, q2_adaptive), (3, 6));
        let uniform_q4 = 60 * shape.page_bytes(Format::Q4) as u64;
        assert_eq!(allocate_by_mass_sparing_q2(shape, &mass, 0.05, uniform_q4), adaptive);
        let step = (shape.page_bytes(Format::Q4) - shape.page_bytes(Format::Q2)) as u64;
        let mut last_q8 = q8_adaptive;
        for short in 1..=30 {
            let budget = uniform_q4 - short * step;
            let formats = allocate_by_mass_sparing_q2(shape, &mass, 0.05, budget);
            let (q8, q2) = (count(&formats, Format::Q8), count(&formats, Format::Q2));
            assert!(bytes(&formats) <= budget, "{short} pages short: {} > {budget}", bytes(&formats));
            assert!(q8 <= last_q8, "{short} pages short: {q8} q8 pages, {last_q8} with more bytes");
            if q8 > 0 {
                assert!(q2 <= q2_adaptive, "{short} pages short: {q2} q2 pages while {q8} q8 pages are left");
            }
            // allocate_by_mass_within keeps the q8 pages and pays with q2 pages instead.
            let within = allocate_by_mass_within(shape, &mass, 0.05, budget);
            assert_eq!(count(&within, Format::Q8), q8_adaptive);
            assert!(count(&within, Format::Q2) > q2, "{short} pages short");
            let bits = |f: Format| code_bits(f);
            for a in 0..60 {
                for b in 0..60 {
                    if mass[a] > mass[b] {
                        assert!(bits(formats[a]) >= bits(formats[b]), "{short} short: page {a} vs {b}");
                    }
                }
            }
            last_q8 = q8;
        }
        assert_eq!(last_q8, 0, "30 pages short, no q8 page is left");
        assert!(allocate_by_mass_sparing_q2(shape, &[], 0.05, 0).is_empty());
    }

    #[test]
    fn a_floor_on_one_layer_is_paid_for_by_the_others_within_uniform_q4_bytes() {
        let trace = trace(4, 256, 64);
        let eval = Evaluation::new(&trace, options()).unwrap();
        let g = &eval.geometry;
        let shape = g.page_shape();
        let q4 = eval.score(Scheme::Pages(Format::Q4)).unwrap();
        let adaptive = eval.score(Scheme::Adaptive).unwrap();
        let formats = |scheme: Scheme, layer: usize| {
            let data = &trace.layers[layer];
            eval.layer_formats(scheme, layer, &g.pad(&data.k), &g.pad(&data.v)).unwrap().unwrap()
        };
        let bytes = |formats: &[Format]| formats.iter().map(|&f| shape.page_bytes(f)).sum::<usize>();
        for format in [Format::Q4, Format::K8V4, Format::Q8] {
            let scheme = Scheme::Floored { layers: 1, format };
            let floored = eval.score(scheme).unwrap();
            let bits = floored.old_bits_per_element;
            assert!(bits <= q4.old_bits_per_element, "{format}: {bits}");
            assert!(bits > q4.old_bits_per_element * 0.97, "{format}: {bits}");
            assert!(floored.layers[0].mean_rel_error < adaptive.layers[0].mean_rel_error, "{format}");
            let floor = formats(scheme, 0);
            assert!(floor.iter().all(|&f| code_bits(f) >= code_bits(format)), "{format}: {floor:?}");
            assert!(bytes(&floor) > bytes(&formats(Scheme::Adaptive, 0)), "{format}");
            for layer in 1..4 {
                let (paying, before) = (formats(scheme, layer), formats(Scheme::Adaptive, layer));
                assert!(bytes(&paying) < bytes(&before), "{format}: layer {layer} pays");
            }
        }
    }

    #[test]
    fn a_trace_prefix_is_the_trace_cut_after_its_first_positions() {
        let whole = trace(2, 128, 16);
        let cut = whole.prefix(100);
        assert_eq!(cut.positions(), 100);
        cut.validate().unwrap();
        for (layer, t) in [(0, 0), (1, 57), (1, 99)] {
            assert_eq!(
                (cut.q(layer, t), cut.k(layer, t), cut.v(layer, t)),
                (whole.q(layer, t), whole.k(layer, t), whole.v(layer, t))
            );
        }
        assert_eq!(whole.prefix(1000), whole);
    }

    #[test]
    fn floored_layers_read_as_ranges() {
        assert_eq!(layer_ranges(0), "none");
        assert_eq!(layer_ranges(1 << 18), "18");
        assert_eq!(layer_ranges(0b110 | 1 << 8 | 1 << 63), "1..=2, 8, 63");
        assert_eq!(layer_ranges(u64::MAX), "0..=63");
        assert_eq!(
            Scheme::Floored { layers: 1 << 18, format: Format::K8V4 }.label(),
            "adaptive, layer 18 never below k8v4"
        );
        assert_eq!(
            Scheme::Floored { layers: 0b1100, format: Format::Q4 }.label(),
            "adaptive, layers 2..=3 never below q4"
        );
    }

    #[test]
    fn a_full_page_budget_selects_every_page_and_equals_full_attention() {
        let trace = trace(1, 128, 16);
        let eval = Evaluation::new(&trace, options()).unwrap();
        let full = eval.score(Scheme::Pages(Format::Q8)).unwrap();
        let all = eval.score(Scheme::Selected { format: Format::Q8, fraction: 1.0 }).unwrap();
        assert_eq!(all.overall.mean_pages_read, 1.0);
        assert!((all.overall.min_mass_kept - 1.0).abs() < 1e-5);
        for (a, b) in all.scores[0].iter().zip(&full.scores[0]) {
            assert!((a.rel_error - b.rel_error).abs() < 1e-6, "{a:?} vs {b:?}");
        }
        let quarter = eval.score(Scheme::Selected { format: Format::Q8, fraction: 0.25 }).unwrap();
        assert!(quarter.overall.mean_pages_read < 1.0);
        assert!(quarter.overall.min_mass_kept < 1.0 + 1e-5);
    }

    #[test]
    fn the_per_token_baseline_is_a_4_bit_error_not_a_floor() {
        let trace = trace(1, 128, 32);
        let eval = Evaluation::new(&trace, options()).unwrap();
        let f16 = eval.score(Scheme::Pages(Format::F16)).unwrap().overall.mean_rel_error;
        let per_token = eval.score(Scheme::PerTokenKeysQ4).unwrap().overall.mean_rel_error;
        assert!(per_token > 5.0 * f16, "{per_token} vs {f16}");
    }

    #[test]
    fn the_fused_kernel_over_quantized_pages_matches_attention_over_their_decoded_rows() {
        // The per-token baseline is simulated over decoded rows while the formats run the fused
        // kernel; the comparison is fair only if both paths agree on the same pages.
        let trace = trace(1, 128, 32);
        let eval = Evaluation::new(&trace, options()).unwrap();
        let g = &eval.geometry;
        let data = &trace.layers[0];
        let pages = LayerPages::build(g, Format::Q4, &g.pad(&data.k), &g.pad(&data.v)).unwrap();
        let (k, v) = pages.dense(g).unwrap();
        for t in [96, 111, 127] {
            let q = g.pad(trace.q(0, t));
            let views = pages.views(16, t);
            let (mut fused, mut dense) = (vec![0.0; q.len()], vec![0.0; q.len()]);
            let mut mass = vec![0.0; views.len()];
            kvmm_kernels::decode_attention(g.shape, &q, g.scale, &views, &mut fused, &mut mass).unwrap();
            let context = ..(t + 1) * g.kv_heads * g.padded;
            reference_attention_f32(g.heads, g.kv_heads, g.padded, &q, &k[context], &v[context], g.scale, &mut dense)
                .unwrap();
            let (rel, _) = compare(&fused, &dense);
            // Far below q4's own error (percents); loose enough for kernels that round the query
            // (an int8 dot-product path differs by ~4e-5).
            assert!(rel < 1e-3, "position {t}: {rel}");
        }
    }

    #[test]
    fn nearest_rank_p99_of_a_hundred_scores_is_the_99th() {
        let scores: Vec<QueryScore> = (1..=100)
            .rev()
            .map(|i| QueryScore { rel_error: i as f64, cosine: 1.0, pages_read: 1.0, mass_kept: 1.0 })
            .collect();
        let s = Summary::of(&scores).unwrap();
        assert_eq!((s.p99_rel_error, s.max_rel_error, s.mean_rel_error), (99.0, 100.0, 50.5));
        assert_eq!(Summary::of(&[]), None);
    }

    #[test]
    fn too_many_queries_and_bad_budgets_are_refused_with_a_sentence() {
        let trace = trace(1, 40, 16);
        let err = Evaluation::new(&trace, QualityOptions { queries: 41, ..options() }).unwrap_err();
        assert!(err.to_string().contains("the trace has 40 positions"), "{err}");
        let eval = Evaluation::new(&trace, options()).unwrap();
        let err = eval.score(Scheme::Selected { format: Format::F16, fraction: 0.0 }).unwrap_err();
        assert!(err.to_string().contains("must be in (0, 1]"), "{err}");
        let err = Evaluation::new(&trace, QualityOptions { block_tokens: 12, ..options() }).unwrap_err();
        let reason = std::error::Error::source(&err).map(|e| e.to_string()).unwrap_or_default();
        assert!(err.to_string().contains("12-token pages"), "{err}");
        assert!(reason.contains("block_tokens"), "{reason}");
    }
}
