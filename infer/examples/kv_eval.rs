//! `kv_eval`: the quality table of kvmm's KV storages on a model's own predictions, teacher-forced
//! over a text (`kvmm_infer::eval`). The thin wrapper `kvmm-generate eval` is meant to be; until
//! then, from the repository root:
//!
//! ```text
//! cargo run --release -p kvmm-infer --example kv_eval -- \
//!     --model ~/.cache/kvmm/models/SmolLM2-135M-Instruct.Q4_1.gguf --text infer/texts/us-constitution.txt
//! ```
//!
//! Progress goes to stderr every 64 steps; the Markdown table to stdout, then with `--json` one
//! JSON object per storage and with `--census` every layer's page formats.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Parser;
use kvmm_infer::eval::{EvalOptions, evaluate_with_progress, parse_storages};
use kvmm_infer::model;
use kvmm_kernels::Format;

/// Perplexity, KL divergence and top-1 agreement of kvmm's KV page formats against f16 pages.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The model: a llama2.c checkpoint (`.bin`, with --tokenizer) or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// The tokenizer of a llama2.c checkpoint.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The UTF-8 text to feed, encoded as a document.
    #[arg(long)]
    text: PathBuf,
    /// Storages to compare with the f16 reference: f16, bf16, q8, k8v4, q4, q2, auto (adaptive
    /// precision at q4's bytes, as the daemon does it), auto-down (earlier pages also step down to
    /// each new allocation), auto-q8, ...
    #[arg(long, default_value = "q8,k8v4,q4,auto,q2")]
    formats: String,
    /// Use at most this many tokens of the text (default: all of it, up to the model's context).
    #[arg(long)]
    tokens: Option<usize>,
    /// The reference's top-2 logit margin from which a step counts for top-1 agreement.
    #[arg(long, default_value_t = 0.5)]
    margin: f32,
    /// Threads (0: all available).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Also print one JSON object per storage.
    #[arg(long)]
    json: bool,
    /// Also print every layer's pages, one character per page (`F` f16, `B` bf16, `8` q8, `k`
    /// k8v4, `4` q4, `2` q2), per storage.
    #[arg(long)]
    census: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (model, tokenizer) = model::load(&args.model, args.tokenizer.as_deref())?;
    let Some(tokenizer) = tokenizer else { bail!("{} needs --tokenizer", args.model.display()) };
    let text = std::fs::read_to_string(&args.text)
        .with_context(|| format!("could not read {} as UTF-8 text", args.text.display()))?;
    let options = EvalOptions {
        storages: parse_storages(&args.formats)?,
        max_tokens: args.tokens,
        margin: args.margin,
        threads: args.threads,
        ..EvalOptions::default()
    };
    let report = evaluate_with_progress(&model, &tokenizer, &text, &options, &mut |done, all| {
        if done % 64 == 0 || done == all {
            eprint!("\r{done}/{all} steps");
            let _ = std::io::stderr().flush();
        }
    })?;
    eprintln!();
    print!("{report}");
    if args.json {
        print!("{}", report.json_lines());
    }
    if args.census {
        for pass in std::iter::once(&report.reference).chain(&report.passes) {
            println!("{}:", pass.storage);
            for (layer, formats) in pass.page_formats.iter().enumerate() {
                let pages: String = formats
                    .iter()
                    .map(|f| match f {
                        Format::F16 => 'F',
                        Format::Bf16 => 'B',
                        Format::Q8 => '8',
                        Format::K8V4 => 'k',
                        Format::Q4 => '4',
                        Format::Q2 => '2',
                        _ => '?',
                    })
                    .collect();
                println!("  {layer:>3} {pages}");
            }
        }
    }
    Ok(())
}
