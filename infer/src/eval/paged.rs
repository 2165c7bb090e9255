//! [`PagedKvCache`]: a [`KvCache`] whose layers live in kvmm pages, left the way the daemon's
//! demotion leaves them, and read by kvmm's fused kernel.
//!
//! Each layer is a sequence of pages of `block_tokens` tokens, all KV heads (the page formats of
//! `kvmm_kernels::format`). Rows are written into a 16-bit page of the session's element type
//! (`init_page`, `write_rows`), as `kvmm_client::Session::append` writes its tail page. Attention
//! is `DecodeAttention` over the layer's pages in place, in whatever format each is in, the calls
//! `Session::attention` makes; the per-page attention mass it reports is folded into each page's
//! importance with the client's EMA ([`IMPORTANCE_EMA`]), the number the daemon ranks pages by.
//!
//! **Demotion.** The daemon re-encodes a page when it demotes it, and never the sink page (block
//! 0) nor a page with a token in the layer's last [`RECENT_WINDOW_TOKENS`] (`keeps_precision` in
//! `daemon/src/migrate/tiering.rs`). This cache demotes as eagerly as that allows, as a daemon
//! under the tightest device budget would: full page `b ≥ 1` is demoted the moment the layer
//! holds `(b + 1) × block_tokens + window` tokens, re-encoded with `requantize` (the daemon's
//! call) in the format [`demotion_formats`] gives it. Lossy is one-way: a quantized page never
//! goes back up. (The daemon demotes only under pressure, victims by least importance across the
//! session, `pick_victims`; here the page demoted is always the newest candidate, not the least
//! attended one, which is the hardest case for adaptive precision's budget below.)
//!
//! ```text
//!   block  0      1      2     ...    b      b+1   ...          last (partial)
//!         [sink][ q4 ][ q4 ] ...  [ q4 ] [ f16 ] ... [ f16 ] [ f16 ...  ]
//!          f16   <-- demoted as they left -->  <------ recent window (128 tokens) ------>
//! ```
//!
//! **Adaptive precision by age** ([`Storage::ByAge`], `auto`: the daemon's default,
//! `[policy] adaptive_ranking = "age"`) decides at each demotion what the daemon's `LayerPlan`
//! decides: the window is [`AGE_WINDOW_TOKENS`], the layer's candidates (every full page outside
//! the sink page and that window, already quantized or not) are allocated with
//! `kvmm_kernels::precision::allocate_graded`: the newest one step up from the mode's format
//! (q4 → k8v4), as many as the candidates the usual [`RECENT_WINDOW_TOKENS`] would have kept at
//! the element format pay for, older ones at the mode's format. Every candidate takes its
//! allocation unless a quantized page would go up, so a page steps down as it ages (the daemon
//! re-encodes it in DRAM, `step_down_in_dram`). The cache never holds more bytes than uniform q4
//! with the usual window (a test checks every length of a 2,048-token layer). `graded-W` is the
//! same with a window of `W` tokens.
//!
//! **Adaptive precision by mass** ([`Storage::ByMass`], `mass`: `adaptive_ranking = "mass"`)
//! ranks the candidates (outside the usual window) by importance with
//! `kvmm_kernels::precision::allocate_by_mass` on the ladder around the mode's format,
//! [`HI_SHARE`] of them up, at uniform mode bytes over the candidates; the page leaving takes its
//! allocated format, and pages quantized earlier keep theirs (`target_format`). The allocation
//! counts those earlier pages at their allocated formats, not their actual ones, so a layer's
//! bytes match the budget only when every candidate is decided in one demotion; with one page per
//! demotion they drift (the bytes actually stored are reported, never assumed). The `step_down`
//! variant (`mass-down`, not the daemon's behaviour) also re-encodes earlier pages down to their
//! new allocation (never up), which keeps every layer within the budget. Sixteen-bit candidates
//! (only `mass-q8` keeps some: its pages up stay as written) are ranked again at every demotion,
//! as the daemon ranks pages still on the device.
//!
//! **Padding.** Page geometry needs `head_dim` a multiple of 16 in `16..=256`. Rows and queries are
//! zero-padded per head to the next multiple of 16 and the padded output channels dropped; the
//! softmax scale stays `1 / sqrt(head_dim)` of the model. Zero key channels add nothing to a score,
//! so this is exact for 16-bit pages; in quantized pages a zero key channel is a constant group
//! (stored exactly) while padded value zeros join their token's value group, widening its range
//! when the real channels do not straddle 0 (as in `quality`).

use kvmm_kernels::precision::{HI_SHARE, Ladder, allocate_by_mass, allocate_graded, uniform_bytes};
use kvmm_kernels::{AttnShape, DecodeAttention, Format, KernelError, PageShape, PageView, init_page, requantize};

use crate::config::ModelConfig;
use crate::error::InferError;
use crate::kv_cache::{KvCache, check_append, check_attention, check_layer};

/// Tokens at the end of a layer whose pages keep the client's precision: the daemon's
/// `RECENT_WINDOW_TOKENS` (`daemon/src/migrate/tiering.rs`), mirrored because this crate does not
/// depend on the daemon.
pub const RECENT_WINDOW_TOKENS: usize = 128;

/// Weight of the newest attention mass in a page's importance: the client's `IMPORTANCE_EMA`
/// (`client/src/session.rs`), mirrored because this crate does not depend on the client.
pub const IMPORTANCE_EMA: f32 = 0.1;

/// The recent window of the daemon's adaptive precision by age: `AGE_WINDOW_TOKENS`
/// (`daemon/src/migrate/tiering.rs`), mirrored because this crate does not depend on the daemon.
pub const AGE_WINDOW_TOKENS: usize = 32;

/// How a cache stores the pages that leave the recent window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Storage {
    /// Every such page in one format; a 16-bit format means nothing is ever quantized and every
    /// page is written in it (`f16` is the lossless reference).
    Uniform(Format),
    /// The daemon's adaptive precision by age around the compressed format `mode` (`[policy]
    /// adaptive_ranking = "age"`, its default; module documentation): the last `window` tokens
    /// stay at the element format, the newest pages past them one step up from `mode`
    /// (`age_step_up`: q4 → k8v4) and older ones at `mode`, each page stepping down as it ages. The
    /// pages one step up are paid for by the window's pages below [`RECENT_WINDOW_TOKENS`], so the
    /// cache holds no more bytes than uniform `mode` with the daemon's usual window. `auto` is the
    /// daemon's: around q4 with [`AGE_WINDOW_TOKENS`]; `graded-W` tries other windows.
    ByAge {
        /// The mode's format.
        mode: Format,
        /// Tokens at the end of a layer kept at the element format (at most
        /// [`RECENT_WINDOW_TOKENS`]).
        window: usize,
    },
    /// The daemon's adaptive precision by attention mass around the compressed format `mode`
    /// (`adaptive_ranking = "mass"`; module documentation); pages are written as f16.
    ByMass {
        /// The mode's format whose bytes the allocation spends.
        mode: Format,
        /// Not what the daemon does: at every demotion, pages quantized earlier also step down
        /// (`requantize`, never up) to the format the new allocation gives them, so the layer's
        /// bytes never exceed the budget (`mass-down`).
        step_down: bool,
    },
}

impl Storage {
    /// `auto`: the daemon's default adaptive precision (by age) under q4.
    pub const AUTO: Storage = Storage::ByAge { mode: Format::Q4, window: AGE_WINDOW_TOKENS };

    /// `mass`: the daemon's adaptive precision by attention mass under q4.
    pub const MASS: Storage = Storage::ByMass { mode: Format::Q4, step_down: false };

    /// `mass-down`: [`Storage::MASS`] with earlier pages stepping down to the new allocation.
    pub const MASS_DOWN: Storage = Storage::ByMass { mode: Format::Q4, step_down: true };

    /// Parses a name as [`Storage::name`] writes it: a format name (`f16`, `bf16`, `q8`, `k8v4`,
    /// `q4`, `q2`); `auto` (by age around q4) or `auto-FORMAT` around another compressed format;
    /// `graded-W` or `graded-W-FORMAT` for a window of `W ≤ 128` tokens; `mass`, `mass-FORMAT`,
    /// `mass-down` or `mass-down-FORMAT` by attention mass.
    pub fn from_name(name: &str) -> Option<Storage> {
        let name = name.trim();
        // `-FORMAT` at the end: a compressed format, q4 when absent.
        let mode = |rest: &str| match rest {
            "" => Some(Format::Q4),
            _ => rest.strip_prefix('-').and_then(Format::from_name).filter(|f| f.is_quantized()),
        };
        if let Some(rest) = name.strip_prefix("auto") {
            return Some(Storage::ByAge { mode: mode(rest)?, window: AGE_WINDOW_TOKENS });
        }
        if let Some(rest) = name.strip_prefix("graded-") {
            let (window, rest) = rest.split_at(rest.find('-').unwrap_or(rest.len()));
            let window = window.parse().ok().filter(|&w| w <= RECENT_WINDOW_TOKENS)?;
            return Some(Storage::ByAge { mode: mode(rest)?, window });
        }
        if let Some(rest) = name.strip_prefix("mass") {
            let (step_down, rest) = match rest.strip_prefix("-down") {
                Some(rest) => (true, rest),
                None => (false, rest),
            };
            return Some(Storage::ByMass { mode: mode(rest)?, step_down });
        }
        Format::from_name(name).map(Storage::Uniform)
    }

    /// The short name tables and tools use: `q4`, `auto`, `auto-q8`, `graded-64`, `mass-down`.
    pub fn name(&self) -> String {
        let mode = |mode: Format| if mode == Format::Q4 { String::new() } else { format!("-{mode}") };
        match *self {
            Storage::Uniform(format) => format.name().to_owned(),
            Storage::ByAge { mode: m, window: AGE_WINDOW_TOKENS } => format!("auto{}", mode(m)),
            Storage::ByAge { mode: m, window } => format!("graded-{window}{}", mode(m)),
            Storage::ByMass { mode: m, step_down } => {
                format!("mass{}{}", if step_down { "-down" } else { "" }, mode(m))
            }
        }
    }

    /// The 16-bit format rows are written in.
    pub fn element(&self) -> Format {
        match *self {
            Storage::Uniform(format) if !format.is_quantized() => format,
            _ => Format::F16,
        }
    }
}

impl std::fmt::Display for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// Bits per element of keys and values together (to order formats by precision).
fn bits(f: Format) -> u32 {
    f.k_bits() + f.v_bits()
}

/// What one demotion of a layer holding `tokens` tokens makes of its candidates: `candidates`
/// holds, oldest first, the current format and importance of every full page outside the sink
/// page and the window (already quantized or not; the page that just left is last); the result is
/// each one's format afterwards (its current one when unchanged). Pages are written as `element`.
/// Pure.
///
/// - Uniform storage: 16-bit candidates take its format; quantized ones keep theirs.
/// - By age: `allocate_graded` over the candidates (the daemon's `LayerPlan` by age), paid for
///   by the candidates the daemon's usual [`RECENT_WINDOW_TOKENS`] would keep at the element
///   format; every page takes its allocation unless that has more bits than a quantized page's
///   (the daemon's `target_format` stepping down, no floors).
/// - By mass: `allocate_by_mass` over every candidate on the ladder around the mode
///   (`Ladder::around`), [`HI_SHARE`] up, at uniform mode bytes over the candidates (the daemon's
///   `policy::precision::layer_formats`); a 16-bit candidate takes its allocated format and a
///   quantized one keeps its own (the daemon's `target_format`, no floors), or with `step_down`
///   takes the allocated one when that has fewer bits.
pub fn demotion_formats(
    storage: Storage,
    shape: PageShape,
    element: Format,
    tokens: usize,
    candidates: &[(Format, f64)],
) -> Vec<Format> {
    let step = |current: Format, to: Format, step_down: bool| match current.is_quantized() {
        false => to,
        true if step_down && bits(to) < bits(current) => to,
        true => current,
    };
    match storage {
        Storage::Uniform(format) => candidates
            .iter()
            .map(|&(current, _)| if current.is_quantized() || !format.is_quantized() { current } else { format })
            .collect(),
        Storage::ByAge { mode, .. } => {
            let allocated =
                allocate_graded(shape, element, mode, candidates.len(), saved_pages(shape, tokens, candidates.len()));
            candidates.iter().zip(allocated).map(|(&(current, _), to)| step(current, to, true)).collect()
        }
        Storage::ByMass { mode, step_down } => {
            let Some(ladder) = Ladder::around(mode, element) else {
                return candidates.iter().map(|&(current, _)| current).collect();
            };
            let mass: Vec<f64> = candidates.iter().map(|&(_, m)| m).collect();
            let allocated = allocate_by_mass(shape, &mass, ladder, HI_SHARE, uniform_bytes(shape, mode, mass.len()));
            candidates.iter().zip(allocated).map(|(&(current, _), to)| step(current, to, step_down)).collect()
        }
    }
}

/// Of `candidates` pages past a shorter window (pages `1..=candidates`) in a layer of `tokens`
/// tokens, how many the daemon's usual [`RECENT_WINDOW_TOKENS`] would keep at the element format:
/// the pages whose bytes pay for the step up, counted as the daemon's `LayerPlan` counts them.
fn saved_pages(shape: PageShape, tokens: usize, candidates: usize) -> usize {
    let b = shape.block_tokens;
    let outside = (1..=candidates).filter(|&p| (p + 1) * b + RECENT_WINDOW_TOKENS <= tokens).count();
    candidates - outside
}

impl Storage {
    /// Tokens at the end of a layer this storage keeps at the element format, `default` (the
    /// daemon's window) unless it sets its own.
    pub fn window(&self, default: usize) -> usize {
        match *self {
            Storage::ByAge { window, .. } => window,
            _ => default,
        }
    }
}

/// One page of a layer.
#[derive(Clone, Debug)]
struct Page {
    /// The format `bytes` are in.
    format: Format,
    /// The whole page, `page_bytes(format)` bytes, header first.
    bytes: Vec<u8>,
    /// Token slots filled (the last page of a layer may be partial).
    tokens: usize,
    /// The client's importance: EMA of the attention mass the kernel reported for this page, over
    /// every attention call since the page was started (0 before the first).
    importance: f32,
}

/// The pages of every layer, read by kvmm's fused kernel (module documentation).
#[derive(Debug)]
pub struct PagedKvCache {
    /// How pages leaving the window are stored.
    storage: Storage,
    /// The 16-bit format rows are written in.
    element: Format,
    /// The model's head geometry, unpadded.
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// The pages' attention geometry (head_dim padded to a multiple of 16).
    shape: AttnShape,
    /// `1 / sqrt(head_dim)` of the model.
    scale: f32,
    /// Tokens each layer can hold.
    max_tokens: usize,
    /// Tokens at the end of a layer kept at the element format.
    window: usize,
    /// Pages per layer, in token order.
    layers: Vec<Vec<Page>>,
    /// Per layer, candidates so far: pages `1..=demoted` have left the window (0: none).
    demoted: Vec<usize>,
    /// One padded key row and one padded value row (`kv_heads × padded`), padding kept zero.
    k_row: Vec<f32>,
    v_row: Vec<f32>,
    /// A padded query and output (`q_heads × padded`), padding kept zero.
    q_pad: Vec<f32>,
    out_pad: Vec<f32>,
    /// Per-page mass of the last attention call.
    mass: Vec<f32>,
    /// Candidates (format, importance) handed to [`demotion_formats`].
    candidates: Vec<(Format, f64)>,
    /// The kernel state, reused across calls (created by the first).
    attention: Option<DecodeAttention>,
}

fn kernel(what: impl Into<String>) -> impl FnOnce(KernelError) -> InferError {
    let what = what.into();
    move |source| InferError::Kernel { what, source }
}

impl PagedKvCache {
    /// An empty cache for `config` holding up to `max_tokens` tokens per layer (at most
    /// `seq_len`), in pages of `block_tokens` tokens, keeping the sink page and the last `window`
    /// tokens at the element format and storing the pages that leave them as `storage` says.
    pub fn new(
        config: &ModelConfig,
        max_tokens: usize,
        storage: Storage,
        block_tokens: usize,
        window: usize,
    ) -> Result<Self, InferError> {
        config.validate()?;
        if max_tokens == 0 || max_tokens > config.seq_len {
            return Err(InferError::InvalidArgument(format!(
                "a KV cache for this model holds 1..={} tokens (seq_len), not {max_tokens}",
                config.seq_len
            )));
        }
        let padded = config.head_dim.next_multiple_of(16);
        let shape = AttnShape { q_heads: config.heads, kv_heads: config.kv_heads, head_dim: padded, block_tokens };
        shape.validate().map_err(kernel(format!(
            "lay out {block_tokens}-token pages of this model's heads (head_dim {}, {padded} in pages)",
            config.head_dim
        )))?;
        let pages = max_tokens.div_ceil(block_tokens);
        Ok(Self {
            storage,
            element: storage.element(),
            q_heads: config.heads,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
            shape,
            scale: 1.0 / (config.head_dim as f32).sqrt(),
            max_tokens,
            window,
            layers: (0..config.layers).map(|_| Vec::with_capacity(pages)).collect(),
            demoted: vec![0; config.layers],
            k_row: vec![0.0; config.kv_heads * padded],
            v_row: vec![0.0; config.kv_heads * padded],
            q_pad: vec![0.0; config.heads * padded],
            out_pad: vec![0.0; config.heads * padded],
            mass: Vec::with_capacity(pages),
            candidates: Vec::with_capacity(pages),
            attention: None,
        })
    }

    /// How pages leaving the window are stored.
    pub fn storage(&self) -> Storage {
        self.storage
    }

    /// The pages' shape (head_dim padded).
    pub fn page_shape(&self) -> PageShape {
        self.shape.page_shape()
    }

    /// The format of every page of `layer`, in order (empty for a layer out of range).
    pub fn page_formats(&self, layer: usize) -> Vec<Format> {
        self.layers.get(layer).map_or_else(Vec::new, |pages| pages.iter().map(|p| p.format).collect())
    }

    /// The importance (attention-mass EMA) of every page of `layer`, in order.
    pub fn importance(&self, layer: usize) -> Vec<f32> {
        self.layers.get(layer).map_or_else(Vec::new, |pages| pages.iter().map(|p| p.importance).collect())
    }

    /// Bytes of every page of every layer (whole pages, the partial last ones included), and
    /// bytes of the pages outside the sink page and the window (the ones demotion re-encodes).
    pub fn bytes(&self) -> (u64, u64) {
        let (mut all, mut old) = (0u64, 0u64);
        for (pages, &demoted) in self.layers.iter().zip(&self.demoted) {
            for (b, page) in pages.iter().enumerate() {
                all += page.bytes.len() as u64;
                if (1..=demoted).contains(&b) {
                    old += page.bytes.len() as u64;
                }
            }
        }
        (all, old)
    }

    /// Pages in the cache, and pages outside the sink page and the window, over every layer.
    pub fn pages(&self) -> (usize, usize) {
        (self.layers.iter().map(Vec::len).sum(), self.demoted.iter().sum())
    }

    /// Demotes `layer` once for every page that has left the window since the last call: the
    /// page that left and, as [`demotion_formats`] says, the other candidates.
    fn demote(&mut self, layer: usize) -> Result<(), InferError> {
        let shape = self.shape.page_shape();
        let b = shape.block_tokens;
        let tokens = self.tokens(layer);
        // Block `p ≥ 1` leaves when (p + 1) × b + window ≤ tokens (the daemon's keeps_precision).
        while (self.demoted[layer] + 2) * b + self.window <= tokens {
            let p = self.demoted[layer] + 1;
            self.demoted[layer] = p;
            let pages = &mut self.layers[layer];
            self.candidates.clear();
            self.candidates.extend(pages[1..=p].iter().map(|page| (page.format, f64::from(page.importance))));
            let targets = demotion_formats(self.storage, shape, self.element, tokens, &self.candidates);
            for (c, (page, target)) in pages[1..=p].iter_mut().zip(targets).enumerate() {
                if target == page.format {
                    continue;
                }
                let mut bytes = vec![0u8; shape.page_bytes(target)];
                requantize(shape, self.element, page.format, &page.bytes, page.tokens, target, &mut bytes)
                    .map_err(kernel(format!("re-encode page {} of layer {layer} as {target}", c + 1)))?;
                page.bytes = bytes;
                page.format = target;
            }
        }
        Ok(())
    }
}

impl KvCache for PagedKvCache {
    fn tokens(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, |pages| pages.iter().map(|p| p.tokens).sum())
    }

    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), InferError> {
        check_layer(layer, self.layers.len())?;
        check_append(layer, self.tokens(layer), self.max_tokens, self.kv_heads * self.head_dim, k, v)?;
        let (d, padded) = (self.head_dim, self.shape.head_dim);
        for (dst, src) in self.k_row.chunks_exact_mut(padded).zip(k.chunks_exact(d)) {
            dst[..d].copy_from_slice(src);
        }
        for (dst, src) in self.v_row.chunks_exact_mut(padded).zip(v.chunks_exact(d)) {
            dst[..d].copy_from_slice(src);
        }
        let shape = self.shape.page_shape();
        let pages = &mut self.layers[layer];
        if pages.last().is_none_or(|p| p.tokens == shape.block_tokens) {
            let mut bytes = vec![0u8; shape.page_bytes(self.element)];
            init_page(shape, self.element, &mut bytes)
                .map_err(kernel(format!("start page {} of layer {layer}", pages.len())))?;
            pages.push(Page { format: self.element, bytes, tokens: 0, importance: 0.0 });
        }
        let p = pages.len() - 1;
        let page = &mut pages[p];
        // Rows round once to the element type, as the client's f32 rows do.
        kvmm_kernels::write_rows(shape, self.element, &mut page.bytes, page.tokens, &self.k_row, &self.v_row)
            .map_err(kernel(format!("write a row into page {p} of layer {layer}")))?;
        page.tokens += 1;
        self.demote(layer)
    }

    fn attention(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<(), InferError> {
        check_layer(layer, self.layers.len())?;
        let (d, padded) = (self.head_dim, self.shape.head_dim);
        check_attention(layer, self.tokens(layer), self.q_heads * d, q, out)?;
        let pages = &mut self.layers[layer];
        for (dst, src) in self.q_pad.chunks_exact_mut(padded).zip(q.chunks_exact(d)) {
            dst[..d].copy_from_slice(src);
        }
        let at = || format!("attend over layer {layer}");
        let run = match self.attention.as_mut() {
            Some(run) => {
                run.reset(&self.q_pad, self.scale).map_err(kernel(at()))?;
                run
            }
            None => {
                self.attention.insert(DecodeAttention::new(self.shape, &self.q_pad, self.scale).map_err(kernel(at()))?)
            }
        };
        run.reserve_pages(pages.len());
        for (i, page) in pages.iter().enumerate() {
            let view = PageView { bytes: &page.bytes, format: page.format, tokens: page.tokens };
            match pages.get(i + 1) {
                Some(next) => run.page_prefetching(view, &next.bytes),
                None => run.page(view),
            }
            .map_err(kernel(at()))?;
        }
        self.mass.resize(pages.len(), 0.0);
        run.write_output(&mut self.out_pad, &mut self.mass).map_err(kernel(at()))?;
        for (dst, src) in out.chunks_exact_mut(d).zip(self.out_pad.chunks_exact(padded)) {
            dst.copy_from_slice(&src[..d]);
        }
        for (page, &m) in pages.iter_mut().zip(&self.mass) {
            page.importance = (1.0 - IMPORTANCE_EMA) * page.importance + IMPORTANCE_EMA * m;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::kv_cache::LocalKvCache;

    fn config(head_dim: usize) -> ModelConfig {
        ModelConfig {
            dim: 4 * head_dim,
            hidden_dim: 8,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim,
            vocab_size: 16,
            seq_len: 512,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
        }
    }

    /// A deterministic stream of values in [-2, 2).
    fn stream(seed: u32) -> impl FnMut() -> f32 {
        let mut state = seed | 1;
        move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        }
    }

    #[test]
    fn names_parse_back_to_the_same_storage() {
        for name in [
            "f16",
            "bf16",
            "q8",
            "k8v4",
            "q4",
            "q2",
            "auto",
            "auto-q8",
            "graded-64",
            "graded-0-k8v4",
            "mass",
            "mass-k8v4",
            "mass-down",
            "mass-down-q2",
        ] {
            let storage = Storage::from_name(name).unwrap();
            assert_eq!(storage.name(), name);
        }
        assert_eq!(Storage::from_name("auto"), Some(Storage::ByAge { mode: Format::Q4, window: 32 }));
        assert_eq!(Storage::from_name("auto-q4"), Some(Storage::AUTO));
        assert_eq!(Storage::from_name("graded-32"), Some(Storage::AUTO));
        assert_eq!(Storage::from_name("mass-q4"), Some(Storage::MASS));
        assert_eq!(Storage::from_name("mass-down"), Some(Storage::MASS_DOWN));
        for bad in ["auto-f16", "autoq8", "q3", "mass-", "graded-", "graded-64-f16", "graded-x"] {
            assert_eq!(Storage::from_name(bad), None, "{bad}");
        }
        assert_eq!(Storage::from_name("graded-129"), None, "no wider than the daemon's window");
        let graded = Storage::ByAge { mode: Format::Q4, window: 64 };
        assert_eq!((graded.window(128), Storage::AUTO.window(128), Storage::MASS.window(128)), (64, 32, 128));
        assert_eq!(Storage::Uniform(Format::Bf16).element(), Format::Bf16);
        assert_eq!(Storage::AUTO.element(), Format::F16);
    }

    #[test]
    fn by_age_the_newest_pages_are_k8v4_and_older_ones_step_down_to_q4() {
        use Format::*;
        let shape = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };
        let graded = Storage::ByAge { mode: Q4, window: 64 };
        // A 64-token window in a long layer: its two pages below the usual 128 tokens pay for 11
        // k8v4 pages (SmolLM2's pages). 14 candidates: the oldest 2 were k8v4 and age out; one q4
        // page stays; the leaving one is f16.
        let mut c = vec![(K8V4, 0.0), (K8V4, 0.0), (Q4, 0.0)];
        c.extend(std::iter::repeat_n((K8V4, 0.0), 10));
        c.push((F16, 0.0));
        let tokens = 15 * 32 + 64;
        let got = demotion_formats(graded, shape, F16, tokens, &c);
        assert_eq!(&got[..3], [Q4, Q4, Q4]);
        assert!(got[3..].iter().all(|&f| f == K8V4), "{got:?}");
        // A short layer (130 tokens): both candidates are among the last 128 tokens, so the usual
        // window would keep both at f16, and both are k8v4.
        let got = demotion_formats(Storage::AUTO, shape, F16, 130, &[(F16, 0.0), (F16, 0.0)]);
        assert_eq!(got, [K8V4, K8V4]);
        // Longer layers: the three pages between the last 32 and the last 128 tokens pay.
        let saved = |tokens, candidates| saved_pages(shape, tokens, candidates);
        assert_eq!([saved(130, 2), saved(160, 3), saved(192, 4), saved(224, 5), saved(2000, 60)], [2, 3, 3, 3, 3]);
        // Never up: a q2 page among the newest stays q2; a q8 page past them steps down.
        let got = demotion_formats(graded, shape, F16, 160, &[(Q8, 0.0), (Q2, 0.0)]);
        assert_eq!(got, [K8V4, Q2]);
        // Around q8 the step up is the page as written.
        let around_q8 = Storage::ByAge { mode: Q8, window: 32 };
        let got = demotion_formats(around_q8, shape, F16, 400, &[(F16, 0.0); 10]);
        assert_eq!(got, [Q8, Q8, Q8, Q8, Q8, Q8, Q8, F16, F16, F16]);
    }

    /// The cache adaptive precision by age keeps holds no more bytes than uniform q4 with the
    /// daemon's usual window, at every length of a long layer.
    #[test]
    fn by_age_the_cache_never_holds_more_bytes_than_uniform_q4() {
        let cfg = ModelConfig { dim: 4 * 64, layers: 1, heads: 9, kv_heads: 3, seq_len: 2048, ..config(64) };
        for (storage, k8v4) in [(Storage::AUTO, 17), (Storage::ByAge { mode: Format::Q4, window: 64 }, 11)] {
            let mut next = stream(7);
            let mut q4 = PagedKvCache::new(&cfg, 2048, Storage::Uniform(Format::Q4), 32, RECENT_WINDOW_TOKENS).unwrap();
            let mut g = PagedKvCache::new(&cfg, 2048, storage, 32, storage.window(RECENT_WINDOW_TOKENS)).unwrap();
            for t in 0..2048 {
                let k: Vec<f32> = (0..3 * 64).map(|_| next()).collect();
                let v: Vec<f32> = (0..3 * 64).map(|_| next()).collect();
                q4.append(0, &k, &v).unwrap();
                g.append(0, &k, &v).unwrap();
                assert!(
                    g.bytes().0 <= q4.bytes().0,
                    "{storage} at {} tokens: {} > {}",
                    t + 1,
                    g.bytes().0,
                    q4.bytes().0
                );
            }
            let formats = g.page_formats(0);
            assert_eq!(formats.iter().filter(|&&f| f == Format::K8V4).count(), k8v4, "{storage}: {formats:?}");
        }
    }

    #[test]
    fn a_demotion_gives_the_leaving_page_its_share_of_the_daemons_allocation() {
        use Format::*;
        let shape = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };
        let formats = |storage: Storage, candidates: &[(Format, f64)]| {
            demotion_formats(storage, shape, F16, (candidates.len() + 5) * 32, candidates)
        };
        assert_eq!(formats(Storage::Uniform(Q4), &[(Q4, 1.0), (F16, 1.0)]), [Q4, Q4]);
        assert_eq!(formats(Storage::Uniform(F16), &[(F16, 1.0), (F16, 1.0)]), [F16, F16]);
        // Fewer than 10 candidates: 5% rounds to no page up, nothing pays, uniform q4.
        assert_eq!(formats(Storage::MASS, &[(Q4, 0.0), (Q4, 0.0), (F16, 9.0)]), [Q4, Q4, Q4]);
        // 20 candidates, the first 19 quantized as q4: the leaving page goes up when it has the
        // most mass, down when it has the least, and the older pages stay as they are ...
        let mut c: Vec<(Format, f64)> = (0..20).map(|p| (Q4, 1.0 + f64::from(p % 5))).collect();
        c[19] = (F16, 100.0);
        let got = formats(Storage::MASS, &c);
        assert_eq!((got[19], got.iter().filter(|&&f| f == Q4).count()), (Q8, 19));
        c[19].1 = 0.0;
        assert_eq!(formats(Storage::MASS, &c)[19], Q2);
        c[19].1 = 3.0;
        assert_eq!(formats(Storage::MASS, &c)[19], Q4);
        // ... unless they step down: the two oldest of the least mass pay for the leaving q8 page.
        c[19].1 = 100.0;
        let down = formats(Storage::MASS_DOWN, &c);
        assert_eq!((down[19], down[0], down[5]), (Q8, Q2, Q2));
        assert_eq!(down.iter().filter(|&&f| f == Q4).count(), 17);
        // Stepping down never raises: a q2 page allocated q4 stays q2; a q8 page allocated q4 drops.
        c[0] = (Q2, 50.0);
        c[1] = (Q8, 1.5);
        let down = formats(Storage::MASS_DOWN, &c);
        assert_eq!((down[0], down[1]), (Q2, Q4));
        // Around q8 the page up stays as written.
        let around_q8 = Storage::ByMass { mode: Q8, step_down: false };
        let c: Vec<(Format, f64)> = (0..20).map(|p| (F16, f64::from(p))).collect();
        let got = formats(around_q8, &c);
        assert_eq!((got[19], got[0], got[1], got[2]), (F16, Q4, Q4, Q8));
    }

    #[test]
    fn f16_pages_attend_like_the_local_cache_even_padded() {
        for head_dim in [8, 16, 24] {
            let cfg = config(head_dim);
            let mut local = LocalKvCache::new(&cfg, 300).unwrap();
            let mut paged = PagedKvCache::new(&cfg, 300, Storage::Uniform(Format::F16), 32, 128).unwrap();
            let mut next = stream(head_dim as u32);
            for t in 0..300 {
                let k: Vec<f32> = (0..cfg.kv_dim()).map(|_| next()).collect();
                let v: Vec<f32> = (0..cfg.kv_dim()).map(|_| next()).collect();
                let q: Vec<f32> = (0..cfg.q_dim()).map(|_| next()).collect();
                local.append(1, &k, &v).unwrap();
                paged.append(1, &k, &v).unwrap();
                let (mut a, mut b) = (vec![0.0; cfg.q_dim()], vec![0.0; cfg.q_dim()]);
                local.attention(1, &q, &mut a).unwrap();
                paged.attention(1, &q, &mut b).unwrap();
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() < 4e-3 * (1.0 + x.abs()), "head_dim {head_dim}, token {t}: {x} vs {y}");
                }
            }
            assert_eq!((paged.tokens(1), paged.tokens(0)), (300, 0));
            assert!(paged.page_formats(1).iter().all(|&f| f == Format::F16));
        }
    }

    #[test]
    fn pages_are_quantized_when_they_leave_the_window_and_the_sink_page_never_is() {
        let cfg = config(16);
        let mut cache = PagedKvCache::new(&cfg, 512, Storage::Uniform(Format::Q4), 32, 128).unwrap();
        let mut next = stream(7);
        let mut out = vec![0.0; cfg.q_dim()];
        for t in 1..=512 {
            let k: Vec<f32> = (0..cfg.kv_dim()).map(|_| next()).collect();
            let v: Vec<f32> = (0..cfg.kv_dim()).map(|_| next()).collect();
            cache.append(0, &k, &v).unwrap();
            cache.attention(0, &k.repeat(2), &mut out).unwrap();
            let formats = cache.page_formats(0);
            for (b, f) in formats.iter().enumerate() {
                let left = b >= 1 && (b + 1) * 32 + 128 <= t;
                assert_eq!(*f == Format::Q4, left, "{t} tokens: page {b} is {f}");
            }
        }
        assert_eq!(cache.pages(), (16, 11));
        let shape = cache.page_shape();
        let (all, old) = cache.bytes();
        assert_eq!(old, 11 * shape.page_bytes(Format::Q4) as u64);
        assert_eq!(all, old + 5 * shape.page_bytes(Format::F16) as u64);
        let mass: f32 = cache.importance(0).iter().sum();
        assert!((mass - 1.0).abs() < 1e-3, "the EMAs of a full history sum to about 1: {mass}");
    }

    #[test]
    fn wrong_lengths_layers_and_capacity_are_refused() {
        let cfg = config(8);
        let mut cache = PagedKvCache::new(&cfg, 2, Storage::AUTO, 32, 128).unwrap();
        assert!(cache.append(0, &[0.0; 3], &[0.0; 16]).is_err());
        assert!(cache.append(2, &[0.0; 16], &[0.0; 16]).is_err());
        assert!(cache.attention(0, &[0.0; 32], &mut [0.0; 32]).is_err(), "an empty layer");
        cache.append(0, &[0.0; 16], &[0.0; 16]).unwrap();
        cache.append(0, &[0.0; 16], &[0.0; 16]).unwrap();
        assert!(cache.append(0, &[0.0; 16], &[0.0; 16]).is_err(), "over capacity");
        assert!(cache.attention(0, &[0.0; 31], &mut [0.0; 32]).is_err());
        let err = PagedKvCache::new(&cfg, 2, Storage::AUTO, 12, 128).unwrap_err();
        assert!(err.to_string().contains("12-token pages"), "{err}");
    }
}
