//! Query-aware page selection (Quest): attend over the pages that can matter, read only those.
//!
//! Every page carries per-channel key bounds `[lo_d, hi_d]` ([`crate::format::bounds`]), so for a
//! query head `q` no key of the page scores above
//!
//! ```text
//!   U(q, page) = Σ_d max(q_d × lo_d, q_d × hi_d) = Σ_d min(q_d, 0) × lo_d + max(q_d, 0) × hi_d
//! ```
//!
//! (the second form is one dot product of a rearranged query with the pairs a page stores; an empty
//! 16-bit page, bounds `±∞`, gives NaN or `+∞`, and is kept).
//!
//! [`page_score_bounds`] computes `U` for every query head of one page (reading only the page's
//! header and bounds, about 3% of a 16-bit page, the key parameters of a quantized one).
//!
//! **Ranking.** Pages are read whole, all heads at once, so one rank per page is needed. Raw
//! bounds of different heads are not comparable (heads differ in scale and in how peaked their
//! scores are), so each head's bounds are turned into a softmax over the pages, the share of the
//! head's attention each page would take if every page's best possible key were present, and a page
//! ranks by its largest share over all query heads (every GQA group, every KV head):
//!
//! ```text
//!   share_qh(page) = exp(scale·U(q_qh, page)) / Σ_p exp(scale·U(q_qh, p))
//!   rank(page)     = max_qh share_qh(page)                     (NaN or +∞ bounds rank first)
//! ```
//!
//! A head whose bounds are flat spreads its shares evenly (about `1 / pages` each) and cannot crowd
//! out the pages a peaked head needs (shares near `1 / hot pages`). Relative bounds (`U − max_p U`)
//! with a max over heads would: every page looks near-best to a flat head. Summing shares over
//! heads would let several mildly interested heads outvote the one head that needs a page; the max
//! keeps any page one head needs.
//!
//! **Selection.** [`select_pages`] keeps the first page (the attention sink) and the last
//! [`RECENT_PAGES`] pages (the local window, including a partial tail page) always, and fills the
//! rest of the budget with the best-ranked other pages; when the budget covers every page it returns
//! all of them, and attention is exact. [`decode_attention_selected`] then attends over the chosen
//! pages only (a documented pattern: any [`super::DecodeAttention`] fed just those pages does the
//! same).

use std::cell::OnceCell;

use crate::error::KernelError;
use crate::format::header::HeaderCheck;
use crate::format::read::PageReader;

#[cfg(target_arch = "x86_64")]
use super::isa::Isa;
use super::{AttnShape, DecodeAttention, PageView};

/// Pages at the end of the sequence that selection always keeps.
pub const RECENT_PAGES: usize = 2;

/// Pages at the start of the sequence that selection always keeps (the attention sink).
pub const SINK_PAGES: usize = 1;

/// Pages whose bounds one kernel call computes at most: each coefficient vector loaded is used for
/// this many pages, so the query's coefficients (32 KiB for Llama-3-8B, more than L1 holds beside
/// the pages) are read once per batch rather than once per page.
pub(crate) const BATCH: usize = 4;

/// How many pages ahead [`select_pages`] prefetches the key bounds it reads: one batch.
const SELECT_AHEAD: usize = BATCH;

/// The query rearranged so a page's score bound is one dot product with the pair region its page
/// stores per KV head (`head_dim` pairs, contiguous): 16-bit pages store `(lo, hi)`, so
/// `U = Σ_d min(q_d, 0)·lo_d + max(q_d, 0)·hi_d`; quantized pages store `(scale, min)` with
/// `hi = min + L·scale`, so `U = Σ_d L·max(q_d, 0)·scale_d + q_d·min_d`. Each arrangement is built
/// when a page of its kind first asks for it.
#[derive(Debug)]
pub(crate) struct BoundQuery<'q> {
    q: &'q [f32],
    /// `q_heads × 2·head_dim`: `[min(q_d, 0), max(q_d, 0)]` per channel, for 16-bit pages.
    wide: OnceCell<Aligned>,
    /// The same for quantized pages with 8-, 4- and 2-bit keys: `[L·max(q_d, 0), q_d]`.
    quant: [OnceCell<Aligned>; 3],
}

impl<'q> BoundQuery<'q> {
    /// Rearranges `q` (`q_heads × head_dim`, checked by the caller).
    pub fn new(q: &'q [f32]) -> BoundQuery<'q> {
        BoundQuery { q, wide: OnceCell::new(), quant: Default::default() }
    }

    /// The coefficients for 16-bit pages.
    fn wide(&self) -> &[f32] {
        self.wide.get_or_init(|| Aligned::pairs(self.q, |x| [x.min(0.0), x.max(0.0)])).get()
    }

    /// The coefficients for pages of `format`.
    #[cfg_attr(
        not(target_arch = "x86_64"),
        allow(dead_code, reason = "only the x86-64 kernel reads the pairs directly")
    )]
    pub fn coefficients(&self, format: crate::format::Format) -> &[f32] {
        let (cell, levels) = match format.k_bits() {
            8 => (&self.quant[0], 255.0f32),
            4 => (&self.quant[1], 15.0),
            2 => (&self.quant[2], 3.0),
            _ => return self.wide(),
        };
        cell.get_or_init(|| Aligned::pairs(self.q, |x| [levels * x.max(0.0), x])).get()
    }
}

/// Floats whose first lies on a 64-byte boundary (a cache line), so a kernel's 16-float loads
/// from its start never straddle two lines (that cost Llama-3-8B's selection 14%).
#[derive(Debug)]
struct Aligned {
    floats: Vec<f32>,
    start: usize,
}

impl Aligned {
    /// `pair(x)` for each `x` of `q`, in order.
    fn pairs(q: &[f32], pair: impl Fn(f32) -> [f32; 2]) -> Aligned {
        let mut floats: Vec<f32> = Vec::with_capacity(2 * q.len() + 15);
        let start = floats.as_ptr().align_offset(64).min(15);
        floats.resize(start, 0.0);
        for &x in q {
            floats.extend_from_slice(&pair(x));
        }
        Aligned { floats, start }
    }

    fn get(&self) -> &[f32] {
        &self.floats[self.start..]
    }
}

/// Writes into `out` (`q_heads` floats) an upper bound of `q_qh · k` over every key stored in
/// `page` (unscaled: multiply by the softmax scale for a score bound), after checking its header.
pub fn page_score_bounds(shape: AttnShape, q: &[f32], page: PageView<'_>, out: &mut [f32]) -> Result<(), KernelError> {
    shape.validate()?;
    check_query(shape, q)?;
    if out.len() != shape.q_heads {
        return Err(KernelError::BufferLength {
            what: "out (one per query head)",
            got: out.len(),
            need: shape.q_heads,
        });
    }
    let (_, regions) = HeaderCheck::new(shape.page_shape()).check(page.format, page.bytes)?;
    bounds(shape, &BoundQuery::new(q), &[page], regions.page_bytes, out);
    Ok(())
}

fn check_query(shape: AttnShape, q: &[f32]) -> Result<(), KernelError> {
    if q.len() != shape.q_heads * shape.head_dim {
        return Err(KernelError::QueryLength { got: q.len(), q_heads: shape.q_heads, head_dim: shape.head_dim });
    }
    Ok(())
}

/// [`page_score_bounds`] on checked pages of one format (header and length; `page_bytes` that
/// format's page size), at most [`BATCH`] of them, `query` built from a query of the shape's length
/// and `out` of `q_heads` floats per page, with the best kernel of this CPU.
pub(crate) fn bounds(shape: AttnShape, query: &BoundQuery, pages: &[PageView<'_>], page_bytes: usize, out: &mut [f32]) {
    assert!(!pages.is_empty() && pages.len() <= BATCH && out.len() == pages.len() * shape.q_heads);
    let format = pages[0].format;
    assert!(pages.iter().all(|page| page.format == format && page.bytes.len() >= page_bytes));
    #[cfg(target_arch = "x86_64")]
    if Isa::detect().is_avx512() {
        let coefficients = query.coefficients(format);
        assert!(coefficients.len() == 2 * shape.q_heads * shape.head_dim);
        debug_assert_eq!(page_bytes, shape.page_shape().page_bytes(format));
        let mut bytes: [&[u8]; BATCH] = [&[]; BATCH];
        for (b, page) in bytes.iter_mut().zip(pages) {
            *b = page.bytes;
        }
        // SAFETY: `Isa::detect` only returns available kernels, so avx512f/bw/vl, avx2, fma and
        // f16c are present; the lengths and formats were just asserted and the shape was
        // validated.
        unsafe { super::avx512_select::bounds(shape, coefficients, format, &bytes[..pages.len()], out) };
        return;
    }
    let _ = page_bytes;
    for (page, out) in pages.iter().zip(out.chunks_exact_mut(shape.q_heads)) {
        bounds_scalar(shape, query, *page, out);
    }
}

/// The scalar bound, straight from the definition: `Σ_d min(q_d, 0)·lo_d + max(q_d, 0)·hi_d` with
/// the bounds of [`crate::format::bounds`].
pub(crate) fn bounds_scalar(shape: AttnShape, query: &BoundQuery, page: PageView<'_>, out: &mut [f32]) {
    let reader = PageReader::new(shape.page_shape(), page.format, page.bytes);
    let (dim, group) = (shape.head_dim, shape.group());
    let wide = query.wide();
    out.fill(0.0);
    for kv in 0..shape.kv_heads {
        for d in 0..dim {
            let (lo, hi) = reader.key_bounds(kv, d);
            for (qh, u) in out.iter_mut().enumerate().skip(kv * group).take(group) {
                let (neg, pos) = (wide[2 * (qh * dim + d)], wide[2 * (qh * dim + d) + 1]);
                *u += neg * lo + pos * hi;
            }
        }
    }
}

/// The pages to attend over for query `q` (softmax scale `scale`, as [`DecodeAttention::new`]
/// takes) under a budget of `budget` pages: indices into `pages`, ascending. Always includes the
/// first page and the last [`RECENT_PAGES`] pages (so at least `min(pages, 3)` pages, whatever the
/// budget); all pages when `budget ≥ pages.len()`. Every page's header is checked, as
/// [`DecodeAttention::page`] would.
pub fn select_pages(
    shape: AttnShape,
    q: &[f32],
    scale: f32,
    pages: &[PageView<'_>],
    budget: usize,
) -> Result<Vec<usize>, KernelError> {
    shape.validate()?;
    check_query(shape, q)?;
    let headers = HeaderCheck::new(shape.page_shape());
    let mut sizes = Vec::with_capacity(pages.len());
    for page in pages {
        sizes.push(headers.check(page.format, page.bytes)?.1.page_bytes);
    }
    let n = pages.len();
    if budget >= n {
        return Ok((0..n).collect());
    }
    let heads = shape.q_heads;
    let query = BoundQuery::new(q);
    let mut bound = vec![0.0f32; n * heads];
    // The lines `bounds` reads of the page `SELECT_AHEAD` ahead are prefetched into L2: a page's
    // bounds take a few dozen lines, so reading them one page ahead left most of DRAM's latency
    // exposed.
    #[cfg(target_arch = "x86_64")]
    let prefetch = |p: usize| {
        if let Some(page) = pages.get(p) {
            super::avx512_select::prefetch_pairs(shape, page.format, page.bytes);
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let prefetch = |_: usize| {};
    (0..SELECT_AHEAD).for_each(prefetch);
    // Batches of up to `BATCH` consecutive pages of one format.
    let mut p = 0;
    while p < n {
        let format = pages[p].format;
        let run = pages[p..n.min(p + BATCH)].iter().take_while(|page| page.format == format).count();
        (p + SELECT_AHEAD..p + SELECT_AHEAD + run).for_each(prefetch);
        bounds(shape, &query, &pages[p..p + run], sizes[p], &mut bound[p * heads..(p + run) * heads]);
        p += run;
    }
    let ranks = rank_pages(&bound, heads, scale);
    let rank = |p: usize| ranks[p];
    let always = |p: usize| p < SINK_PAGES || p + RECENT_PAGES >= n;
    let mut chosen: Vec<usize> = (0..n).filter(|&p| always(p)).collect();
    let mut others: Vec<(f32, usize)> = (0..n).filter(|&p| !always(p)).map(|p| (rank(p), p)).collect();
    // Best rank first; equal ranks by position, earlier first. Only the first `room` matter.
    let order = |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let room = budget.saturating_sub(chosen.len()).min(others.len());
    if room > 0 && room < others.len() {
        others.select_nth_unstable_by(room - 1, order);
    }
    chosen.extend(others[..room].iter().map(|&(_, p)| p));
    chosen.sort_unstable();
    Ok(chosen)
}

/// Each page's rank from its bounds (`bound[p × heads + qh]`): per head, the largest finite bound
/// `best` and `ln Σ_p exp(scale·(U − best))` over finite bounds; a page's rank is its largest
/// log-share, `max_qh (scale·U − scale·best − ln total)`, which orders pages as the largest share
/// does; a NaN or `+∞` bound ranks `+∞`. With the best kernel of this CPU.
pub(crate) fn rank_pages(bound: &[f32], heads: usize, scale: f32) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if Isa::detect().is_avx512() {
        assert!(bound.len().is_multiple_of(heads));
        // SAFETY: `Isa::detect` only returns available kernels; the length was just asserted.
        return unsafe { super::avx512_select::rank_pages(bound, heads, scale) };
    }
    rank_pages_scalar(bound, heads, scale)
}

/// [`rank_pages`], the scalar definition.
pub(crate) fn rank_pages_scalar(bound: &[f32], heads: usize, scale: f32) -> Vec<f32> {
    let mut best = vec![f32::NEG_INFINITY; heads];
    for row in bound.chunks_exact(heads) {
        for (b, u) in best.iter_mut().zip(row) {
            if u.is_finite() && *u > *b {
                *b = *u;
            }
        }
    }
    let mut total = vec![0.0f32; heads];
    for row in bound.chunks_exact(heads) {
        for ((t, u), b) in total.iter_mut().zip(row).zip(&best) {
            if u.is_finite() {
                *t += exp_nonpositive(scale * (u - b));
            }
        }
    }
    let offset: Vec<f32> = best.iter().zip(&total).map(|(b, t)| scale * b + t.ln()).collect();
    bound
        .chunks_exact(heads)
        .map(|row| {
            row.iter().zip(&offset).fold(f32::NEG_INFINITY, |r, (u, o)| {
                if u.is_nan() || *u == f32::INFINITY { f32::INFINITY } else { r.max(scale * u - o) }
            })
        })
        .collect()
}

/// `exp(x)` for `x ≤ 0` (NaN-free), about 1e-7 relative error, no branches or library calls so the
/// loops over pages and heads stay cheap: the scheme of `exp.rs` with `2^n` built in the exponent
/// bits; arguments below −87 give `exp(−87)`, as good as 0 for a sum that includes a 1.
fn exp_nonpositive(x: f32) -> f32 {
    use super::exp::{LN2_HI, LN2_LO, LOG2E, P};
    let x = x.max(-87.0);
    // Round to nearest by the 1.5·2^23 trick (|x·log2 e| < 2^22).
    let n = (x * LOG2E + 12_582_912.0) - 12_582_912.0;
    let r = x - n * LN2_HI - n * LN2_LO;
    let y = P.iter().fold(0.0f32, |y, c| y * r + c);
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Decode attention (see [`super::decode_attention`]) over the pages `selected` (indices into
/// `pages`, e.g. from [`select_pages`], each at most once) only: `out` gets `q_heads × head_dim`
/// floats, `mass` one slot per page of `pages`, 0 for the pages not selected (the selected pages'
/// mass sums to 1).
pub fn decode_attention_selected(
    shape: AttnShape,
    q: &[f32],
    scale: f32,
    pages: &[PageView<'_>],
    selected: &[usize],
    out: &mut [f32],
    mass: &mut [f32],
) -> Result<(), KernelError> {
    if mass.len() != pages.len() {
        return Err(KernelError::MassLength { got: mass.len(), need: pages.len(), per: "page" });
    }
    if let Some(&p) = selected.iter().find(|&&p| p >= pages.len()) {
        return Err(KernelError::BufferLength { what: "pages (selected index + 1)", got: pages.len(), need: p + 1 });
    }
    let mut attention = DecodeAttention::new(shape, q, scale)?;
    attention.reserve_pages(selected.len());
    for (i, &p) in selected.iter().enumerate() {
        match selected.get(i + 1) {
            Some(&next) => attention.page_prefetching(pages[p], pages[next].bytes)?,
            None => attention.page(pages[p])?,
        }
    }
    let mut chosen_mass = vec![0.0; selected.len()];
    attention.finish(out, &mut chosen_mass)?;
    mass.fill(0.0);
    for (&p, m) in selected.iter().zip(chosen_mass) {
        mass[p] += m;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::Isa;
    use crate::format::Format;

    #[test]
    fn every_kernel_ranks_pages_like_the_scalar_definition() {
        for heads in [1usize, 9, 16, 17, 40] {
            let pages = 37;
            let mut bound: Vec<f32> = (0..pages * heads).map(|i| ((i * 7919 % 1009) as f32 - 500.0) / 13.0).collect();
            bound[5 * heads] = f32::NAN;
            bound[7 * heads + heads - 1] = f32::INFINITY;
            bound[9 * heads] = f32::NEG_INFINITY;
            let want = rank_pages_scalar(&bound, heads, 0.3);
            let got = rank_pages(&bound, heads, 0.3);
            assert_eq!((want[5], want[7]), (f32::INFINITY, f32::INFINITY));
            for (p, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(a == b || (a - b).abs() <= 1e-4 * b.abs().max(1.0), "{heads} heads, page {p}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn branch_free_exp_is_close_to_exp_over_the_rank_range() {
        for i in 0..=10_000 {
            let x = -90.0 * i as f32 / 10_000.0;
            let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
            let tolerance = if x >= -87.0 { 1e-6 * want } else { 1.7e-38 };
            assert!((got - want).abs() <= tolerance, "exp({x}) = {got}, not {want}");
        }
    }

    #[test]
    fn every_kernel_bounds_pages_like_the_scalar_definition() {
        use crate::format::header::init_page;
        use crate::format::quant::quantize_with;
        use crate::format::rows::write_rows;
        // Group sizes that fill the 16-head reduction exactly, leave it partial, and split a group
        // across two reductions.
        for (q_heads, kv_heads, head_dim) in [(12, 3, 48), (40, 5, 32), (18, 6, 16)] {
            let shape = AttnShape { q_heads, kv_heads, head_dim, block_tokens: 16 };
            let layout = shape.page_shape();
            let row = kv_heads * head_dim;
            let q: Vec<f32> = (0..q_heads * head_dim)
                .map(|i| if i % 11 == 0 { 0.0 } else { ((i * 31 % 200) as f32 - 100.0) / 50.0 })
                .collect();
            // Per format, BATCH pages of different keys, so a batch that mixed up its pages (or
            // read one page's pairs for another) would give some page a bound not its own.
            let mut pages: Vec<(Format, Vec<Vec<u8>>)> = vec![(Format::F16, vec![]), (Format::Bf16, vec![])];
            pages.extend(Format::QUANTIZED.iter().map(|&format| (format, vec![])));
            for seed in 0..BATCH {
                let k: Vec<f32> =
                    (0..16 * row).map(|i| (((i + 131 * seed) * 7919 % 1000) as f32 - 500.0) / 97.0).collect();
                let mut f16_page = vec![0u8; layout.page_bytes(Format::F16)];
                init_page(layout, Format::F16, &mut f16_page).unwrap();
                write_rows(layout, Format::F16, &mut f16_page, 0, &k, &k).unwrap();
                for (format, list) in pages.iter_mut() {
                    let mut page = vec![0u8; layout.page_bytes(*format)];
                    if format.is_quantized() {
                        quantize_with(Isa::Scalar, layout, Format::F16, &f16_page, 16, *format, &mut page).unwrap();
                    } else {
                        init_page(layout, *format, &mut page).unwrap();
                        write_rows(layout, *format, &mut page, 0, &k, &k).unwrap();
                    }
                    list.push(page);
                }
            }
            let query = BoundQuery::new(&q);
            for (format, list) in &pages {
                let views: Vec<PageView<'_>> =
                    list.iter().map(|bytes| PageView { bytes, format: *format, tokens: 16 }).collect();
                let mut want = vec![0.0; BATCH * q_heads];
                for (view, want) in views.iter().zip(want.chunks_exact_mut(q_heads)) {
                    bounds_scalar(shape, &query, *view, want);
                }
                for batch in 1..=BATCH {
                    let mut got = vec![0.0; batch * q_heads];
                    bounds(shape, &query, &views[BATCH - batch..], layout.page_bytes(*format), &mut got);
                    for (i, (a, b)) in got.iter().zip(&want[(BATCH - batch) * q_heads..]).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                            "{shape:?} {format}, batch of {batch}, page {}, head {}: {a} vs {b}",
                            BATCH - batch + i / q_heads,
                            i % q_heads
                        );
                    }
                }
            }
        }
    }
}
