//! `kvmm-kv-quality`: score kvmm's compressed page formats on the real K/V of a `.kvfx` fixture
//! (method: `kvmm_infer::quality`).
//!
//! Prints, per format, a table per layer of the attention output's relative error (mean, p99, max)
//! and cosine (mean, min) with the old pages in that format and the last `--exact-tokens` tokens
//! f16; an overall table; the KIVI layout (q4) against per-token 4-bit keys; adaptive precision
//! (q8/q4/q2 by attention mass) against uniform q4 at equal bytes; page selection at a
//! `--budget` fraction of the context's pages over f16 and q8 pages against full attention; and
//! whether issue 3's thresholds hold (q8: mean ≤ 1%, p99 ≤ 4%, cosine ≥ 0.9999; q4: mean ≤ 7%,
//! p99 ≤ 30%, cosine ≥ 0.997).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use kvmm_infer::fixture;
use kvmm_infer::quality::report::{Style, comparison_table, layer_table, overall_table, percent, selection_table};
use kvmm_infer::quality::{ADAPTIVE_HISTORY, ADAPTIVE_Q8_SHARE, Evaluation, Quality, QualityOptions, Scheme};
use kvmm_kernels::Format;

/// Score kvmm's compressed KV page formats and page selection on a fixture's real K/V.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The `.kvfx` fixture (from `kvmm-dump-kv`).
    #[arg(long)]
    fixture: PathBuf,
    /// Formats of the old pages, comma-separated (f16 is the floor: f16 storage alone).
    #[arg(long, value_delimiter = ',', default_value = "f16,q8,q4,q2,k8v4")]
    formats: Vec<String>,
    /// Tokens at the end kept exact (f16): only pages ending before them are quantized.
    #[arg(long, default_value_t = 128)]
    exact_tokens: usize,
    /// Query positions scored, the last ones.
    #[arg(long, default_value_t = 128)]
    queries: usize,
    /// Tokens per page.
    #[arg(long, default_value_t = 32)]
    block_tokens: usize,
    /// Page budget of the selection tables, as a fraction of each query's context pages.
    #[arg(long, default_value_t = 0.25)]
    budget: f64,
    /// Formats of the old pages for the selection tables, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "f16,q8")]
    selection_formats: Vec<String>,
    /// Print Markdown tables instead of plain text.
    #[arg(long)]
    markdown: bool,
}

fn parse_format(name: &str) -> anyhow::Result<Format> {
    let names: Vec<&str> = Format::ALL.iter().map(|f| f.name()).collect();
    Format::ALL
        .into_iter()
        .find(|f| f.name() == name.trim())
        .with_context(|| format!("{name:?} is not a page format; use one of {}", names.join(", ")))
}

/// An acceptance threshold of issue 3 on a format's overall summary and its worst layer.
struct Threshold {
    format: Format,
    mean: f64,
    p99: f64,
    cosine: f64,
}

const THRESHOLDS: [Threshold; 2] = [
    Threshold { format: Format::Q8, mean: 0.01, p99: 0.04, cosine: 0.9999 },
    Threshold { format: Format::Q4, mean: 0.07, p99: 0.30, cosine: 0.997 },
];

/// Layers the per-layer floor keeps at q8.
const FLOOR_LAYERS: usize = 2;

fn verdict(holds: bool) -> &'static str {
    if holds { "holds" } else { "FAILS" }
}

fn acceptance(q: &Quality, t: &Threshold) -> Vec<String> {
    let worst = |f: fn(&kvmm_infer::quality::Summary) -> f64| q.layers.iter().map(f).fold(f64::NEG_INFINITY, f64::max);
    let worst_mean = worst(|s| s.mean_rel_error);
    let worst_p99 = worst(|s| s.p99_rel_error);
    let o = &q.overall;
    let name = t.format.name();
    vec![
        format!(
            "{name} mean rel err {} ≤ {}: {} (worst layer {})",
            percent(o.mean_rel_error),
            percent(t.mean),
            verdict(o.mean_rel_error <= t.mean),
            percent(worst_mean)
        ),
        format!(
            "{name} p99 rel err {} ≤ {}: {} (worst layer {})",
            percent(o.p99_rel_error),
            percent(t.p99),
            verdict(o.p99_rel_error <= t.p99),
            percent(worst_p99)
        ),
        format!(
            "{name} cosine ≥ {}: mean {:.6} {}, min {:.6} {}",
            t.cosine,
            o.mean_cosine,
            verdict(o.mean_cosine >= t.cosine),
            o.min_cosine,
            verdict(o.min_cosine >= t.cosine)
        ),
    ]
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let formats: Vec<Format> = args.formats.iter().map(|f| parse_format(f)).collect::<anyhow::Result<_>>()?;
    let selection: Vec<Format> =
        args.selection_formats.iter().map(|f| parse_format(f)).collect::<anyhow::Result<_>>()?;
    if !(args.budget > 0.0 && args.budget <= 1.0) {
        bail!("--budget is {}, but it is a fraction of the context's pages in (0, 1]", args.budget);
    }
    let style = if args.markdown { Style::Markdown } else { Style::Plain };

    let started = Instant::now();
    let trace = fixture::read(&args.fixture)?;
    let c = trace.config;
    let options =
        QualityOptions { block_tokens: args.block_tokens, exact_tokens: args.exact_tokens, queries: args.queries };
    let eval = Evaluation::new(&trace, options)?;
    let (pages, quantized) = eval.pages();
    let truth_seconds = started.elapsed().as_secs_f64();
    let padded = c.head_dim.next_multiple_of(16);
    println!("# KV page quality: {}\n", args.fixture.display());
    println!(
        "{} layers, {} positions, {} query / {} KV heads, head_dim {}{}; {}-token pages: {pages} per layer, the \
         first {quantized} stored in the format, the rest (last {} tokens) f16; the last {} positions scored against \
         an f64 reference over the original f32 K/V.\n",
        c.layers,
        trace.positions(),
        c.heads,
        c.kv_heads,
        c.head_dim,
        if padded == c.head_dim { String::new() } else { format!(" (zero-padded to {padded})") },
        args.block_tokens,
        trace.positions() - quantized * args.block_tokens,
        args.queries
    );

    let mut results: Vec<Quality> = Vec::new();
    let score = |scheme: Scheme, results: &mut Vec<Quality>| -> anyhow::Result<usize> {
        if let Some(i) = results.iter().position(|q| q.scheme == scheme) {
            return Ok(i);
        }
        results.push(eval.score(scheme)?);
        Ok(results.len() - 1)
    };
    let by_format: Vec<usize> =
        formats.iter().map(|&f| score(Scheme::Pages(f), &mut results)).collect::<anyhow::Result<_>>()?;
    let kivi = score(Scheme::Pages(Format::Q4), &mut results)?;
    let per_token = score(Scheme::PerTokenKeysQ4, &mut results)?;
    let adaptive = score(Scheme::Adaptive, &mut results)?;
    let mut selection_rows = Vec::new();
    let mut selected = Vec::new();
    for &format in &selection {
        selection_rows.push(score(Scheme::Pages(format), &mut results)?);
        let s = score(Scheme::Selected { format, fraction: args.budget }, &mut results)?;
        selection_rows.push(s);
        selected.push(s);
    }

    println!("## Overall, every layer and scored position\n");
    let overall: Vec<&Quality> = by_format.iter().map(|&i| &results[i]).collect();
    println!("{}", overall_table(&overall).render(style));
    for &i in &by_format {
        println!("## {} per layer\n", results[i].scheme.label());
        println!("{}", layer_table(&results[i]).render(style));
    }
    println!(
        "## KIVI layout vs per-token keys, 4 bits\n\nKIVI: q4 pages (keys per channel along the page's tokens); \
         per-token: keys per token in 32-channel groups, values as q4 (simulated in f32).\n"
    );
    println!("{}", comparison_table(&results[kivi], &results[per_token], ["KIVI", "per-token"]).render(style));
    println!(
        "## Adaptive precision vs uniform q4 at equal bytes\n\nAdaptive: per layer, the old pages ranked by the \
         attention mass the kernel reported over the {ADAPTIVE_HISTORY} positions before the scored ones; the top \
         {}% q8, the fewest lowest-mass pages q2 that bring the bytes back to uniform q4's, the rest q4. Old pages' \
         bits per element with metadata: uniform q4 {:.3}, adaptive {:.3}.\n",
        ADAPTIVE_Q8_SHARE * 100.0,
        results[kivi].old_bits_per_element,
        results[adaptive].old_bits_per_element
    );
    println!("{}", comparison_table(&results[kivi], &results[adaptive], ["q4", "adaptive"]).render(style));
    // Per-layer sensitivity: each layer's mean error with every old page at q2.
    let q2 = score(Scheme::Pages(Format::Q2), &mut results)?;
    let mut sensitive: Vec<usize> = (0..results[q2].layers.len()).collect();
    sensitive.sort_by(|&a, &b| results[q2].layers[b].mean_rel_error.total_cmp(&results[q2].layers[a].mean_rel_error));
    let floor = sensitive.iter().take(FLOOR_LAYERS).fold(0u64, |m, &l| m | 1 << l);
    let floored = score(Scheme::Floored { layers: floor }, &mut results)?;
    println!(
        "## A per-layer floor from measured sensitivity, at equal bytes\n\nThe {FLOOR_LAYERS} layers with the largest \
         mean error at q2 ({}) keep every old page at q8; the other layers run the adaptive allocation with the \
         bytes left, so all layers together spend uniform q4's. Bits per element: {:.3}.\n",
        results[floored].scheme.label(),
        results[floored].old_bits_per_element
    );
    println!("{}", comparison_table(&results[kivi], &results[floored], ["q4", "floored"]).render(style));
    println!("## Page selection at a {}% page budget vs full attention\n", args.budget * 100.0);
    let rows: Vec<&Quality> = selection_rows.iter().map(|&i| &results[i]).collect();
    println!("{}", selection_table(&rows).render(style));
    for &i in &selected {
        println!("### {} per layer\n", results[i].scheme.label());
        println!("{}", layer_table(&results[i]).render(style));
    }
    println!("## Acceptance (issue 3)\n");
    for t in &THRESHOLDS {
        let i = score(Scheme::Pages(t.format), &mut results)?;
        for line in acceptance(&results[i], t) {
            println!("- {line}");
        }
    }
    println!(
        "\n{} schemes scored in {:.1} s (reference {truth_seconds:.1} s).",
        results.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
