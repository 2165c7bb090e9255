//! Decode attention over a whole context, one thread, against a plain streaming read of the same bytes,
//! for every page format.
//!
//! Shapes: SmolLM2 (9 query heads, 3 KV heads, head_dim 64) and Llama-3-8B (32/8/128), block_tokens
//! 32, contexts of 4096 and 32768 tokens stored as full pages in one contiguous private buffer per
//! format: f16 pages written row by row, and the same rows quantized to q8, q4, q2 and k8v4.
//! Criterion times every available kernel on f16, the AVX2 and every AVX-512 kernel on each quantized
//! format (`avx2`, what an AVX2-only machine runs, and the integer `avx512vnni` beside its fallback
//! `avx512`; or the best kernel elsewhere), and the streaming sum (throughput in bytes of pages
//! read); then, in benchmark mode, a summary table gives for each shape, context, format and kernel
//! the attention bandwidth, the streaming bandwidth of a buffer of the same size, their ratio
//! (target ≥ 0.6 for the best f16 kernel at 32k), tokens per second, and tokens per second relative
//! to the best f16 kernel of the same case measured in the same run (targets: q8 ≥ 1.6×, q4 ≥
//! 2.5×), from the best of several runs of each. Pages are fed with the next page as a prefetch hint
//! (`DecodeAttention::page_prefetching`), as a client that has pinned a whole layer can. Rows
//! `f16/25%`, `q8/25%`, `q4/25%`: page selection (`select_pages`) at a budget of a quarter of the
//! pages plus attention over the chosen pages, counted over the whole context (target: f16/25% ≥
//! 2.5× full f16).
//!
//! `cargo bench -p kvmm-kernels --bench decode_attention` (with `KVMM_BENCH_SUMMARY_ONLY=1`, only the
//! table; `KVMM_BENCH_CONTEXTS=131072` for other contexts; `KVMM_BENCH_PROFILE_ATTEND=smollm2/ctx4096/q4`
//! to run one case's attention alone for a profiler, `KVMM_BENCH_PROFILE_SELECT=llama3-8b/ctx32768/f16`
//! its page selection alone; both print the best call).
//!
//! `KVMM_BENCH_FROM_DRAM=1`: the summary table with every format's pages read from DRAM, as in a
//! decode step, which attends layer after layer, so that a layer's K/V has left the caches by the
//! time its next call comes. Each format's pages are copied until the copies hold at least
//! [`FROM_DRAM_BYTES`] (three times this machine's 32 MiB last-level cache), and each call reads
//! the next copy; a figure is the best time of a whole round of calls over the copies, divided by
//! their number. Without it, a context smaller than the last-level cache (every SmolLM2 case,
//! Llama-3-8B at 4k) is read from the cache, over and over.

mod support;

use support::best_seconds;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvmm_kernels::{AttnShape, DecodeAttention, Format, Isa, PageView, init_page, quantize, select_pages, write_rows};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const BLOCK_TOKENS: usize = 32;

/// Under `KVMM_BENCH_FROM_DRAM`, the bytes each format's copies hold at least.
const FROM_DRAM_BYTES: usize = 96 << 20;
const CONTEXTS: [usize; 2] = [4096, 32768];

/// The contexts to run: [`CONTEXTS`], or the comma-separated token counts of `KVMM_BENCH_CONTEXTS`
/// (multiples of `BLOCK_TOKENS`), e.g. `131072` to see a context whose f16 pages only DRAM can hold.
fn contexts() -> Vec<usize> {
    match std::env::var("KVMM_BENCH_CONTEXTS") {
        Ok(list) => list
            .split(',')
            .map(|c| {
                let tokens: usize = c.trim().parse().expect("KVMM_BENCH_CONTEXTS: token counts such as 4096,131072");
                assert!(
                    tokens > 0 && tokens.is_multiple_of(BLOCK_TOKENS),
                    "contexts are whole pages of {BLOCK_TOKENS}"
                );
                tokens
            })
            .collect(),
        Err(_) => CONTEXTS.to_vec(),
    }
}

struct Model {
    name: &'static str,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

const MODELS: [Model; 2] = [
    Model { name: "smollm2", q_heads: 9, kv_heads: 3, head_dim: 64 },
    Model { name: "llama3-8b", q_heads: 32, kv_heads: 8, head_dim: 128 },
];

/// One context stored in one format: full pages, contiguous.
struct Stored {
    format: Format,
    page_bytes: usize,
    pages: Vec<u8>,
}

/// One benchmark case: a context stored in every format, and a query.
struct Case {
    label: String,
    shape: AttnShape,
    context: usize,
    stored: Vec<Stored>,
    q: Vec<f32>,
    scale: f32,
}

/// The formats benchmarked, f16 (the baseline) first.
const FORMATS: [Format; 5] = [Format::F16, Format::Q8, Format::K8V4, Format::Q4, Format::Q2];

impl Case {
    fn new(model: &Model, context: usize) -> Case {
        let shape = AttnShape {
            q_heads: model.q_heads,
            kv_heads: model.kv_heads,
            head_dim: model.head_dim,
            block_tokens: BLOCK_TOKENS,
        };
        let layout = shape.page_shape();
        let mut rng = StdRng::seed_from_u64(context as u64);
        let row = BLOCK_TOKENS * shape.kv_heads * shape.head_dim;
        let f16_bytes = layout.page_bytes(Format::F16);
        let mut f16_pages = vec![0u8; f16_bytes * context / BLOCK_TOKENS];
        for page in f16_pages.chunks_exact_mut(f16_bytes) {
            let k: Vec<f32> = (0..row).map(|_| rng.random_range(-1.0..1.0)).collect();
            let v: Vec<f32> = (0..row).map(|_| rng.random_range(-1.0..1.0)).collect();
            init_page(layout, Format::F16, page).expect("valid shape");
            write_rows(layout, Format::F16, page, 0, &k, &v).expect("rows fit");
        }
        let mut stored = Vec::new();
        for format in FORMATS {
            if format == Format::F16 {
                continue;
            }
            let page_bytes = layout.page_bytes(format);
            let mut pages = vec![0u8; page_bytes * context / BLOCK_TOKENS];
            for (src, dst) in f16_pages.chunks_exact(f16_bytes).zip(pages.chunks_exact_mut(page_bytes)) {
                quantize(layout, Format::F16, src, BLOCK_TOKENS, format, dst).expect("quantizable");
            }
            stored.push(Stored { format, page_bytes, pages });
        }
        stored.insert(0, Stored { format: Format::F16, page_bytes: f16_bytes, pages: f16_pages });
        let q = (0..shape.q_heads * shape.head_dim).map(|_| rng.random_range(-1.0..1.0)).collect();
        Case {
            label: format!("{}/ctx{}", model.name, context),
            shape,
            context,
            stored,
            q,
            scale: 1.0 / (model.head_dim as f32).sqrt(),
        }
    }

    fn pages(&self) -> usize {
        self.context / BLOCK_TOKENS
    }
}

impl Stored {
    fn bytes(&self) -> usize {
        self.pages.len()
    }

    /// One attention call over every page, pages fed in order, each with the next as a prefetch hint.
    fn attend(&self, case: &Case, attention: &mut DecodeAttention, out: &mut [f32], mass: &mut [f32]) {
        attention.reset(&case.q, case.scale).expect("query fits the shape");
        for (i, bytes) in self.pages.chunks_exact(self.page_bytes).enumerate() {
            let page = black_box(PageView { bytes, format: self.format, tokens: BLOCK_TOKENS });
            let next = &self.pages[((i + 1) * self.page_bytes).min(self.pages.len())..];
            if next.is_empty() {
                attention.page(page).expect("page fits the shape");
            } else {
                attention.page_prefetching(page, next).expect("page fits the shape");
            }
        }
        attention.write_output(out, mass).expect("buffers fit");
        black_box((out, mass));
    }

    /// Page selection under a budget of a quarter of the pages, then attention over the chosen
    /// pages (next chosen page as prefetch hint): the whole cost of a sparse call.
    fn attend_quarter(&self, case: &Case, attention: &mut DecodeAttention, out: &mut [f32], views: &[PageView<'_>]) {
        let chosen = select_pages(case.shape, &case.q, case.scale, views, views.len() / 4).expect("valid pages");
        attention.reset(&case.q, case.scale).expect("query fits the shape");
        for (i, &p) in chosen.iter().enumerate() {
            match chosen.get(i + 1) {
                Some(&next) => attention.page_prefetching(views[p], views[next].bytes),
                None => attention.page(views[p]),
            }
            .expect("page fits the shape");
        }
        let mut mass = vec![0.0; chosen.len()];
        attention.write_output(out, &mut mass).expect("buffers fit");
        black_box(out);
    }

    /// Under `KVMM_BENCH_FROM_DRAM` (`from_dram`), copies of these pages that hold at least
    /// [`FROM_DRAM_BYTES`] together, each its own allocation; otherwise none.
    fn replicas(&self, from_dram: bool) -> Vec<Stored> {
        let n = if from_dram { FROM_DRAM_BYTES.div_ceil(self.bytes()).max(1) } else { 0 };
        (0..n).map(|_| Stored { format: self.format, page_bytes: self.page_bytes, pages: self.pages.clone() }).collect()
    }

    /// The pages one round of calls reads, a call each: the `copies` from [`Stored::replicas`], or
    /// these pages alone when there are none.
    fn round<'a>(&'a self, copies: &'a [Stored]) -> Vec<&'a Stored> {
        if copies.is_empty() { vec![self] } else { copies.iter().collect() }
    }

    fn views(&self) -> Vec<PageView<'_>> {
        self.pages
            .chunks_exact(self.page_bytes)
            .map(|bytes| PageView { bytes, format: self.format, tokens: BLOCK_TOKENS })
            .collect()
    }

    /// The kernels benchmarked on this format: every one for f16; for the others the best, and
    /// beside it every other x86-64 SIMD kernel: AVX2 (what an AVX2-only machine runs) and the
    /// other AVX-512 kernel (the FMA kernel is the fallback of the VNNI one).
    fn isas(&self) -> Vec<Isa> {
        if self.format == Format::F16 {
            return Isa::available();
        }
        let best = Isa::detect();
        let mut isas: Vec<Isa> =
            Isa::available().into_iter().filter(|isa| (*isa == Isa::Avx2 || isa.is_avx512()) && *isa != best).collect();
        isas.push(best);
        isas
    }
}

/// Sum of every 64-bit word of `bytes`: the streaming-read baseline. Word reads of all the memory,
/// summed so nothing can be skipped; the loop vectorizes to full-width loads.
fn stream_sum(bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: avx512f was detected on this CPU just above.
        return unsafe { stream_sum_avx512(bytes) };
    }
    stream_sum_portable(bytes)
}

#[inline(always)]
fn stream_sum_portable(bytes: &[u8]) -> u64 {
    bytes
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("chunks are 8 bytes")))
        .fold(0u64, u64::wrapping_add)
}

/// [`stream_sum_portable`] compiled for AVX-512 so the loop uses 64-byte loads.
///
/// # Safety
///
/// The CPU must support avx512f.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream_sum_avx512(bytes: &[u8]) -> u64 {
    stream_sum_portable(bytes)
}

fn main() {
    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    // The summary table runs under `cargo bench` only: not under `cargo test` (no `--bench`) nor when
    // profiling a single benchmark with `--profile-time`.
    let args: Vec<String> = std::env::args().collect();
    let benchmarking = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--profile-time");
    let summary_only = std::env::var_os("KVMM_BENCH_SUMMARY_ONLY").is_some();
    let from_dram = std::env::var_os("KVMM_BENCH_FROM_DRAM").is_some();
    let contexts = contexts();
    let cases: Vec<Case> = MODELS.iter().flat_map(|m| contexts.iter().map(move |&c| Case::new(m, c))).collect();
    // `KVMM_BENCH_PROFILE_SELECT=<case label>/<format>` (e.g. `llama3-8b/ctx32768/f16`): run only page
    // selection at a 25% budget on that case's pages in that format for a few seconds, for a
    // profiler, and print the best call.
    if let Ok(target) = std::env::var("KVMM_BENCH_PROFILE_SELECT") {
        let (label, format) = target.rsplit_once('/').expect("a case label and a format, such as smollm2/ctx32768/f16");
        let case = cases.iter().find(|c| c.label == label).expect("a case label such as smollm2/ctx32768");
        let stored = case.stored.iter().find(|s| s.format.name() == format).expect("a format such as q4");
        let views = stored.views();
        let (start, mut best) = (Instant::now(), f64::INFINITY);
        while start.elapsed() < Duration::from_secs(4) {
            best = best.min(best_seconds(1, || {
                black_box(select_pages(case.shape, &case.q, case.scale, &views, views.len() / 4).expect("valid pages"));
            }));
        }
        println!("{target}: selection best {:.1} µs per call", best * 1e6);
        return;
    }
    // `KVMM_BENCH_PROFILE_ATTEND=<case label>/<format>` (e.g. `smollm2/ctx4096/q4`): run only the best
    // kernel's attention over that case's pages in that format for a few seconds, for a profiler.
    if let Ok(target) = std::env::var("KVMM_BENCH_PROFILE_ATTEND") {
        let (label, format) = target.rsplit_once('/').expect("a case label and a format, such as smollm2/ctx4096/q4");
        let case = cases.iter().find(|c| c.label == label).expect("a case label such as smollm2/ctx4096");
        let stored = case.stored.iter().find(|s| s.format.name() == format).expect("a format such as q4");
        let mut attention = DecodeAttention::new(case.shape, &case.q, case.scale).expect("valid shape");
        let (mut out, mut mass) = (vec![0.0; case.shape.q_heads * case.shape.head_dim], vec![0.0; case.pages()]);
        let (start, mut best) = (Instant::now(), f64::INFINITY);
        while start.elapsed() < Duration::from_secs(4) {
            best = best.min(best_seconds(1, || stored.attend(case, &mut attention, &mut out, &mut mass)));
        }
        println!("{target}: best {:.1} µs per call, {:.2} Mtok/s", best * 1e6, case.context as f64 / best / 1e6);
        return;
    }

    for case in cases.iter().filter(|_| !summary_only) {
        let mut group = criterion.benchmark_group(format!("decode_attention/{}", case.label));
        let mut out = vec![0.0; case.shape.q_heads * case.shape.head_dim];
        let mut mass = vec![0.0; case.pages()];
        for stored in &case.stored {
            group.throughput(Throughput::Bytes(stored.bytes() as u64));
            for isa in stored.isas() {
                let mut attention = DecodeAttention::with_isa(isa, case.shape, &case.q, case.scale)
                    .expect("shape is valid and isa available");
                let name = if stored.format == Format::F16 {
                    isa.name().to_string()
                } else {
                    format!("{}/{isa}", stored.format)
                };
                group.bench_function(name, |b| b.iter(|| stored.attend(case, &mut attention, &mut out, &mut mass)));
            }
        }
        group.throughput(Throughput::Bytes(case.stored[0].bytes() as u64));
        group.bench_function("stream", |b| b.iter(|| stream_sum(black_box(&case.stored[0].pages))));
        group.finish();
    }
    if !summary_only {
        criterion.final_summary();
    }

    if !benchmarking {
        return;
    }
    println!();
    println!(
        "single thread, block_tokens {BLOCK_TOKENS}, pages contiguous, next page as prefetch hint; best of n \
         runs; GB = 1e9 bytes; × f16 = tokens/s over the best f16 kernel's, same case, same run"
    );
    if from_dram {
        println!(
            "pages from DRAM: each call reads the next of as many copies as hold {} MiB; a time is a round \
             over the copies divided by their number",
            FROM_DRAM_BYTES >> 20
        );
    }
    println!(
        "{:<20} {:>6} {:>8} {:>8} {:>15} {:>12} {:>7} {:>10} {:>7}",
        "case", "format", "KV MiB", "kernel", "attention GB/s", "stream GB/s", "ratio", "Mtok/s", "× f16"
    );
    for case in &cases {
        let mut out = vec![0.0; case.shape.q_heads * case.shape.head_dim];
        let mut mass = vec![0.0; case.pages()];
        let mut f16_best = f64::INFINITY;
        for stored in &case.stored {
            let bytes = stored.bytes() as f64;
            let copies = stored.replicas(from_dram);
            let round = stored.round(&copies);
            let per_call = round.len() as f64;
            for isa in stored.isas() {
                let mut attention = DecodeAttention::with_isa(isa, case.shape, &case.q, case.scale)
                    .expect("shape is valid and isa available");
                let runs = if isa == Isa::Scalar { 3 } else { 25 };
                let attend = best_seconds(runs, || {
                    for copy in &round {
                        copy.attend(case, &mut attention, &mut out, &mut mass);
                    }
                }) / per_call;
                // Measured right after, so both see the same cache and frequency state.
                let stream = best_seconds(25, || {
                    for copy in &round {
                        black_box(stream_sum(black_box(&copy.pages)));
                    }
                }) / per_call;
                if stored.format == Format::F16 {
                    f16_best = f16_best.min(attend);
                }
                println!(
                    "{:<20} {:>6} {:>8.1} {:>8} {:>15.2} {:>12.2} {:>7.3} {:>10.2} {:>7.2}",
                    case.label,
                    stored.format.name(),
                    bytes / (1 << 20) as f64,
                    isa.name(),
                    bytes / attend / 1e9,
                    bytes / stream / 1e9,
                    stream / attend,
                    case.context as f64 / attend / 1e6,
                    f16_best / attend,
                );
            }
        }
        // Sparse: select a quarter of the pages by their key bounds, attend over those. Bandwidth and
        // tokens/s are counted over the whole context, as the call answers for all of it.
        for stored in case.stored.iter().filter(|s| matches!(s.format, Format::F16 | Format::Q8 | Format::Q4)) {
            let isa = Isa::detect();
            let mut attention = DecodeAttention::with_isa(isa, case.shape, &case.q, case.scale)
                .expect("shape is valid and isa available");
            let copies = stored.replicas(from_dram);
            let round = stored.round(&copies);
            let views: Vec<Vec<PageView<'_>>> = round.iter().map(|copy| copy.views()).collect();
            let per_call = round.len() as f64;
            let attend = best_seconds(25, || {
                for (copy, views) in round.iter().zip(&views) {
                    copy.attend_quarter(case, &mut attention, &mut out, views);
                }
            }) / per_call;
            let select = best_seconds(25, || {
                for views in &views {
                    black_box(
                        select_pages(case.shape, &case.q, case.scale, views, views.len() / 4).expect("valid pages"),
                    );
                }
            }) / per_call;
            let bytes = stored.bytes() as f64;
            println!(
                "{:<20} {:>6} {:>8.1} {:>8} {:>15.2} {:>12} {:>7} {:>10.2} {:>7.2}",
                case.label,
                format!("{}/25%", stored.format.name()),
                bytes / (1 << 20) as f64,
                isa.name(),
                bytes / attend / 1e9,
                "-",
                "-",
                case.context as f64 / attend / 1e6,
                f16_best / attend,
            );
            println!("{:<20} {:>6} selection alone {:.1} µs of {:.1} µs", "", "", select * 1e6, attend * 1e6);
        }
    }
}
