//! Row writes (`write_rows`: K/V rows into a 16-bit page, keys transposed channel-major, key bounds
//! widened), one thread, in elements per second (an element is one K or V value): a whole page of
//! 32 tokens per call (prefill) and one token per call (decode), from f32 rows into f16 and bf16
//! pages and from f16 rows into an f16 page, for the SmolLM2 (3 × 64) and Llama-3-8B (8 × 128)
//! shapes. 64 pages cycled: a page filled before the next (in cache), and for one token a call also
//! the pages in turn, a token to each before the next token, as an engine's layers take a decode
//! step's token (each call finds its page's lines out of L1: a token's keys touch a cache line per
//! channel of the channel-major K region). Every writer this CPU runs (AVX-512, AVX2, scalar), and the
//! same write element by element (the rule the writers implement and how it was written before:
//! each element converted alone, put in place, then a second pass over the stored keys for the
//! bounds), each with its ratio to the scalar writer, all in one run.
//!
//! Then `truncate_rows` as a speculative decoder uses it: 3 of a full f16 page's 32 tokens taken
//! back (keys zeroed past the kept 29, key bounds recomputed over them), in µs a page, by each
//! kernel, with its ratio to the scalar one, beside `write_rows` of the 5 draft tokens that
//! preceded it by the same kernel, and the ratio of the two.
//!
//! `cargo bench -p kvmm-kernels --bench rows` (`KVMM_BENCH_RUNS=300` for the best of more runs)

mod support;

use support::best_seconds;

use std::hint::black_box;

use half::{bf16, f16};
use kvmm_kernels::{Format, Isa, PageShape, RowElement, init_page, truncate_rows_with, write_rows, write_rows_with};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const PAGES: usize = 64;
const BLOCK_TOKENS: usize = 32;

/// An element the element-by-element writer converts alone.
trait Element: RowElement {
    fn bits(self, format: Format) -> u16;
}

impl Element for f32 {
    fn bits(self, format: Format) -> u16 {
        if format == Format::Bf16 { bf16::from_f32(self).to_bits() } else { f16::from_f32(self).to_bits() }
    }
}

impl Element for f16 {
    fn bits(self, format: Format) -> u16 {
        if format == Format::Bf16 { bf16::from_f32(self.to_f32()).to_bits() } else { self.to_bits() }
    }
}

fn decode(format: Format, bits: u16) -> f32 {
    if format == Format::Bf16 { bf16::from_bits(bits).to_f32() } else { f16::from_bits(bits).to_f32() }
}

fn put(page: &mut [u8], at: usize, bits: u16) {
    page[at..at + 2].copy_from_slice(&bits.to_le_bytes());
}

fn get(page: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([page[at], page[at + 1]])
}

/// `write_rows` element by element: the baseline.
fn element_by_element<E: Element>(shape: PageShape, format: Format, page: &mut [u8], first: usize, k: &[E], v: &[E]) {
    let (heads, dim) = (shape.kv_heads, shape.head_dim);
    let count = k.len() / (heads * dim);
    for i in 0..count {
        for h in 0..heads {
            let row = (i * heads + h) * dim;
            for d in 0..dim {
                put(page, shape.k_byte(h, d, first + i), k[row + d].bits(format));
                put(page, shape.v_byte(h, first + i, d), v[row + d].bits(format));
            }
        }
    }
    for h in 0..heads {
        for d in 0..dim {
            let at = shape.bound_byte(h, d);
            let (mut lo, mut hi) = (get(page, at), get(page, at + 2));
            for t in first..first + count {
                let bits = get(page, shape.k_byte(h, d, t));
                let x = decode(format, bits);
                if x < decode(format, lo) || decode(format, lo).is_nan() {
                    lo = bits;
                }
                if x > decode(format, hi) || decode(format, hi).is_nan() {
                    hi = bits;
                }
            }
            put(page, at, lo);
            put(page, at + 2, hi);
        }
    }
}

/// Which writer a measurement runs.
#[derive(Clone, Copy)]
enum Writer {
    /// `write_rows_with` this kernel.
    Kernel(Isa),
    /// [`element_by_element`].
    ByElement,
}

/// The order in which a measurement's calls visit the pages.
#[derive(Clone, Copy, PartialEq)]
enum Order {
    /// Every call of a page before the next page (the page stays in L1).
    PageByPage,
    /// The calls' first slots in turn: the first call of every page, then the second, as an
    /// engine's layers append a decode step's token one after the other.
    InTurn,
}

/// G elements/s of writing `k`/`v` (one page's rows) into every page, `tokens` per call, in
/// `order`.
#[allow(clippy::too_many_arguments, reason = "a bench helper")]
fn measure<E: Element>(
    runs: usize,
    shape: PageShape,
    format: Format,
    pages: &mut [u8],
    k: &[E],
    v: &[E],
    tokens: usize,
    order: Order,
    writer: Writer,
) -> f64 {
    let bytes = shape.page_bytes(format);
    let row = shape.kv_heads * shape.head_dim;
    let call = |page: &mut [u8], first: usize| {
        let rows = first * row..(first + tokens) * row;
        match writer {
            Writer::Kernel(isa) => {
                write_rows_with(isa, shape, format, page, first, &k[rows.clone()], &v[rows]).expect("rows fit")
            }
            Writer::ByElement => element_by_element(shape, format, page, first, &k[rows.clone()], &v[rows]),
        }
        black_box(&page);
    };
    let seconds = best_seconds(runs, || match order {
        Order::PageByPage => {
            for page in pages.chunks_exact_mut(bytes) {
                for first in (0..BLOCK_TOKENS).step_by(tokens) {
                    call(page, first);
                }
            }
        }
        Order::InTurn => {
            for first in (0..BLOCK_TOKENS).step_by(tokens) {
                for page in pages.chunks_exact_mut(bytes) {
                    call(page, first);
                }
            }
        }
    });
    (PAGES * 2 * BLOCK_TOKENS * row) as f64 / seconds / 1e9
}

fn main() {
    // Only under `cargo bench` (not `cargo test`, which runs bench targets without `--bench`).
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let runs = std::env::var("KVMM_BENCH_RUNS").ok().and_then(|r| r.parse().ok()).unwrap_or(100);
    // The distinct writers: AVX-512 (with or without VNNI: the same writer), AVX2, scalar.
    let kernels: Vec<Isa> = Isa::available()
        .into_iter()
        .rev()
        .filter(|&isa| isa != Isa::Avx512 || !Isa::Avx512Vnni.is_available())
        .collect();
    println!("single thread, block_tokens {BLOCK_TOKENS}, {PAGES} pages cycled; G elements/s (1e9 per second)");
    println!(
        "{:<10} {:<12} {:<11} {:>10} {:>8} {:>10} {:>8} {:>10} {:>8}",
        "shape", "rows → page", "writer", "32 tokens", "÷ scalar", "1 token", "÷ scalar", "in turn", "÷ scalar"
    );
    for (name, kv_heads, head_dim) in [("smollm2", 3, 64), ("llama3-8b", 8, 128)] {
        let shape = PageShape { kv_heads, head_dim, block_tokens: BLOCK_TOKENS };
        let n = BLOCK_TOKENS * kv_heads * head_dim;
        let mut rng = StdRng::seed_from_u64(11);
        let k: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
        let (k16, v16): (Vec<f16>, Vec<f16>) =
            (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
        for (label, format, sixteen) in
            [("f32 → f16", Format::F16, false), ("f32 → bf16", Format::Bf16, false), ("f16 → f16", Format::F16, true)]
        {
            let bytes = shape.page_bytes(format);
            let mut pages = vec![0u8; PAGES * bytes];
            for page in pages.chunks_exact_mut(bytes) {
                init_page(shape, format, page).expect("valid shape");
            }
            // The writers alternate, so a change of the machine's speed hits all of them.
            let writers: Vec<Writer> =
                kernels.iter().map(|&isa| Writer::Kernel(isa)).chain([Writer::ByElement]).collect();
            let figures: Vec<[f64; 3]> = writers
                .iter()
                .map(|&writer| {
                    [(BLOCK_TOKENS, Order::PageByPage), (1, Order::PageByPage), (1, Order::InTurn)].map(
                        |(tokens, order)| {
                            if sixteen {
                                measure(runs, shape, format, &mut pages, &k16, &v16, tokens, order, writer)
                            } else {
                                measure(runs, shape, format, &mut pages, &k, &v, tokens, order, writer)
                            }
                        },
                    )
                })
                .collect();
            let scalar = figures[kernels.len() - 1];
            for (writer, [whole, single, in_turn]) in writers.iter().zip(&figures) {
                let who = match writer {
                    Writer::Kernel(isa) => isa.name(),
                    Writer::ByElement => "by element",
                };
                println!(
                    "{name:<10} {label:<12} {who:<11} {whole:>10.3} {:>7.2}× {single:>10.3} {:>7.2}× {in_turn:>10.3} {:>7.2}×",
                    whole / scalar[0],
                    single / scalar[1],
                    in_turn / scalar[2]
                );
            }
        }
    }
    truncation(runs, &kernels);
}

/// `truncate_rows` keeping 29 of 32 tokens against `write_rows` of 5 tokens, by each kernel, µs a
/// page, alternating.
fn truncation(runs: usize, kernels: &[Isa]) {
    const KEEP: usize = BLOCK_TOKENS - 3;
    const DRAFTS: usize = 5;
    println!();
    println!(
        "{:<10} {:<11} {:>22} {:>8} {:>20} {:>10}",
        "f16 page", "kernel", "truncate_rows 3 of 32", "÷ scalar", "write_rows 5 tokens", "truncate ÷"
    );
    for (name, kv_heads, head_dim) in [("smollm2", 3, 64), ("llama3-8b", 8, 128)] {
        let shape = PageShape { kv_heads, head_dim, block_tokens: BLOCK_TOKENS };
        let row = kv_heads * head_dim;
        let mut rng = StdRng::seed_from_u64(12);
        let k: Vec<f32> = (0..BLOCK_TOKENS * row).map(|_| rng.random_range(-3.0..3.0)).collect();
        let v: Vec<f32> = (0..BLOCK_TOKENS * row).map(|_| rng.random_range(-3.0..3.0)).collect();
        let bytes = shape.page_bytes(Format::F16);
        let mut pages = vec![0u8; PAGES * bytes];
        for page in pages.chunks_exact_mut(bytes) {
            init_page(shape, Format::F16, page).expect("valid shape");
            write_rows(shape, Format::F16, page, 0, &k, &v).expect("rows fit");
        }
        let drafts = (BLOCK_TOKENS - DRAFTS) * row..BLOCK_TOKENS * row;
        // Per kernel: (truncate, write) seconds, the best of 3 alternating rounds.
        let mut best = vec![[f64::INFINITY; 2]; kernels.len()];
        for _ in 0..3 {
            for (&isa, best) in kernels.iter().zip(&mut best) {
                best[0] = best[0].min(best_seconds(runs, || {
                    for page in pages.chunks_exact_mut(bytes) {
                        truncate_rows_with(isa, shape, Format::F16, page, KEEP).expect("a 16-bit page");
                        black_box(&page);
                    }
                }));
                best[1] = best[1].min(best_seconds(runs, || {
                    for page in pages.chunks_exact_mut(bytes) {
                        let first = BLOCK_TOKENS - DRAFTS;
                        write_rows_with(isa, shape, Format::F16, page, first, &k[drafts.clone()], &v[drafts.clone()])
                            .expect("rows fit");
                        black_box(&page);
                    }
                }));
            }
        }
        let scalar = best[kernels.len() - 1][0];
        for (isa, [truncate, write]) in kernels.iter().zip(&best) {
            let [t, w] = [truncate, write].map(|s| s / PAGES as f64 * 1e6);
            println!(
                "{name:<10} {:<11} {t:>19.2} µs {:>7.2}× {w:>17.2} µs {:>9.2}×",
                isa.name(),
                truncate / scalar,
                t / w
            );
        }
    }
}
