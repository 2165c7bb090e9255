//! `kvmm-kv-quality`: score kvmm's compressed page formats on the real K/V of a `.kvfx` fixture
//! (method: `kvmm_infer::quality`).
//!
//! Prints, per format, a table per layer of the attention output's relative error (mean, p99, max)
//! and cosine (mean, min) with the old pages in that format and the last `--exact-tokens` tokens
//! f16; an overall table; the KIVI layout (q4) against per-token 4-bit keys; adaptive precision
//! (q8/q4/q2 by attention mass) against uniform q4 at equal bytes; a per-layer floor beside both
//! (`--floor-format` on the layers whose p99 error at q2, measured before the scored positions,
//! exceeds `--floor-sensitivity` times the median layer's); page selection at a
//! `--budget` fraction of the context's pages over f16 and q8 pages against full attention; and
//! whether issue 3's thresholds hold (q8: mean ≤ 1%, p99 ≤ 4%, cosine ≥ 0.9999; q4: mean ≤ 7%,
//! p99 ≤ 30%, cosine ≥ 0.997).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use kvmm_infer::fixture;
use kvmm_infer::quality::report::{
    Style, budget_table, comparison_table, layer_table, overall_table, percent, selection_table,
};
use kvmm_infer::quality::{
    ADAPTIVE_HISTORY, ADAPTIVE_Q8_SHARE, Evaluation, Quality, QualityOptions, Scheme, layer_ranges,
};
use kvmm_infer::trace::KvTrace;
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
    /// Score the fixture cut after its first this many positions (default: all of them).
    #[arg(long)]
    positions: Option<usize>,
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
    /// The per-layer floor's format: floored layers never store an old page below it.
    #[arg(long, default_value = "k8v4")]
    floor_format: String,
    /// A layer is floored when its p99 error at q2, measured before the scored positions, exceeds
    /// this many times the median layer's.
    #[arg(long, default_value_t = 2.0)]
    floor_sensitivity: f64,
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

/// The layers a per-layer floor covers, and the sensitivity they were chosen by.
struct Floor {
    /// Bit `l` set: layer `l` is floored.
    layers: u64,
    /// Per layer, the p99 relative error with every old page at q2, before the scored positions.
    p99_at_q2: Vec<f64>,
    /// The median of `p99_at_q2`.
    median: f64,
}

/// The layers whose p99 error at q2 exceeds `times` the median layer's, measured on the trace cut
/// before its last `options.queries` positions (scored at the last `options.queries` positions
/// left), so that the choice never sees the positions the floor is scored on. `Ok(Err(why))` when
/// the trace is too short to cut.
fn floor_from_sensitivity(
    trace: &KvTrace,
    options: QualityOptions,
    times: f64,
) -> anyhow::Result<Result<Floor, String>> {
    let kept = trace.positions().saturating_sub(options.queries);
    if kept < options.queries {
        return Ok(Err(format!(
            "the trace has {} positions, too few to measure sensitivity on {} positions before the {} scored",
            trace.positions(),
            options.queries,
            options.queries
        )));
    }
    if trace.layers.len() > 64 {
        return Ok(Err(format!("the model has {} layers; a floor names at most 64", trace.layers.len())));
    }
    let calibration = trace.prefix(kept);
    let q2 = Evaluation::new(&calibration, options)?.score(Scheme::Pages(Format::Q2))?;
    let p99_at_q2: Vec<f64> = q2.layers.iter().map(|s| s.p99_rel_error).collect();
    let mut sorted = p99_at_q2.clone();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = if n % 2 == 1 { sorted[n / 2] } else { (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0 };
    let layers = (0..n).filter(|&l| p99_at_q2[l] > times * median).fold(0u64, |m, l| m | 1 << l);
    Ok(Ok(Floor { layers, p99_at_q2, median }))
}

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
    let floor_format = parse_format(&args.floor_format)?;
    if !Format::QUANTIZED.contains(&floor_format) {
        let names: Vec<&str> = Format::QUANTIZED.iter().map(|f| f.name()).collect();
        bail!("--floor-format is {floor_format}, but a floor is a quantized format: one of {}", names.join(", "));
    }
    if !(args.budget > 0.0 && args.budget <= 1.0) {
        bail!("--budget is {}, but it is a fraction of the context's pages in (0, 1]", args.budget);
    }
    let style = if args.markdown { Style::Markdown } else { Style::Plain };

    let started = Instant::now();
    let mut trace = fixture::read(&args.fixture)?;
    if let Some(positions) = args.positions {
        if positions == 0 || positions > trace.positions() {
            bail!("--positions is {positions}, but the fixture has 1..={} positions", trace.positions());
        }
        trace = trace.prefix(positions);
    }
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
    println!("## A per-layer floor from measured sensitivity, at equal bytes\n");
    match floor_from_sensitivity(&trace, options, args.floor_sensitivity)? {
        Err(why) => println!("Not measured: {why}.\n"),
        Ok(floor) => {
            let floored = score(Scheme::Floored { layers: floor.layers, format: floor_format }, &mut results)?;
            let mut largest: Vec<usize> = (0..floor.p99_at_q2.len()).collect();
            largest.sort_by(|&a, &b| floor.p99_at_q2[b].total_cmp(&floor.p99_at_q2[a]));
            let largest: Vec<String> =
                largest.iter().take(5).map(|&l| format!("layer {l} {}", percent(floor.p99_at_q2[l]))).collect();
            println!(
                "Sensitivity: each layer's p99 relative error with every old page at q2, measured before the scored \
                 positions (the trace cut there, its last {} positions scored): median {}; largest {}. Floored: the \
                 layers above {}× the median ({}); they never store an old page below {} (the top {}% by attention \
                 mass q8, the rest {}). The other layers share what is left of uniform q4's bytes equally, each \
                 giving up its lowest-mass q8 pages before it takes more q2 pages than adaptive has.\n",
                args.queries,
                percent(floor.median),
                largest.join(", "),
                args.floor_sensitivity,
                layer_ranges(floor.layers),
                floor_format.name(),
                ADAPTIVE_Q8_SHARE * 100.0,
                floor_format.name()
            );
            let rows = [&results[kivi], &results[adaptive], &results[floored]];
            println!("{}", budget_table(&rows).render(style));
            println!("### Floored vs adaptive per layer\n");
            println!(
                "{}",
                comparison_table(&results[adaptive], &results[floored], ["adaptive", "floored"]).render(style)
            );
        }
    }
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
