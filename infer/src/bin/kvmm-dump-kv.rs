//! `kvmm-dump-kv`: run a model over a token sequence and write its post-RoPE queries, keys and
//! values, per layer and position, as a `.kvfx` fixture (format: `kvmm_infer::fixture`).
//!
//! The model is a llama2.c checkpoint (with `--tokenizer` for text) or a GGUF file (its tokenizer
//! inside). The sequence is either greedy decoding from BOS (`--bos-steps N`, N positions, stopping
//! early at the vocabulary's stop tokens) or a text file encoded as a document (`--text FILE`: with
//! BOS first when the vocabulary's convention says so), fed teacher-forced. The dump itself takes a
//! `Model` and tokens; only `kvmm_infer::model::load` knows file formats.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{ArgGroup, Parser};
use kvmm_infer::{fixture, model, tokenizer::BOS, trace_greedy, trace_tokens};

/// Dump the attention inputs (q, k, v) of a model over a token sequence as a .kvfx fixture.
#[derive(Parser, Debug)]
#[command(version, group(ArgGroup::new("sequence").required(true).args(["bos_steps", "text"])))]
struct Args {
    /// The model: a llama2.c checkpoint (`.bin`) or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// The tokenizer of a llama2.c checkpoint (`tokenizer.bin`); required with --text. GGUF models
    /// carry their own.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Decode greedily from BOS for this many positions (stops early at a stop token).
    #[arg(long)]
    bos_steps: Option<usize>,
    /// Feed this UTF-8 text file, encoded as a document, teacher-forced.
    #[arg(long)]
    text: Option<PathBuf>,
    /// With --text, keep only the first this many tokens (default: fail if longer than seq_len).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Where to write the fixture.
    #[arg(long)]
    out: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (model, tokenizer) = model::load(&args.model, args.tokenizer.as_deref())?;
    let config = *model.config();
    let started = Instant::now();

    // The trace, the token before the ones to show as text, and those tokens.
    let (trace, prev, shown) = match (args.bos_steps, &args.text) {
        (Some(steps), _) => {
            let bos = tokenizer.as_ref().map_or(BOS, |t| t.bos());
            let stop = tokenizer.as_ref().map_or(vec![BOS], |t| t.stop_tokens().to_vec());
            let (trace, generation) = trace_greedy(&model, &[bos], steps, &stop)?;
            eprintln!(
                "greedy from BOS: {} positions, {} tokens generated, stopped by {:?}",
                trace.positions(),
                generation.generated.len(),
                generation.stop
            );
            (trace, bos, generation.generated)
        }
        (None, Some(text_path)) => {
            let Some(tokenizer) = &tokenizer else { bail!("--text needs --tokenizer to encode the text") };
            let text = std::fs::read_to_string(text_path)
                .with_context(|| format!("could not read {} as UTF-8 text", text_path.display()))?;
            let mut tokens = tokenizer.encode_document(&text);
            let encoded = tokens.len();
            let limit = args.max_tokens.unwrap_or(config.seq_len);
            if tokens.len() > limit {
                if args.max_tokens.is_none() {
                    bail!(
                        "{} encodes to {} tokens, more than the model's context of {}; pass --max-tokens to keep \
                         only the first ones",
                        text_path.display(),
                        tokens.len(),
                        config.seq_len
                    );
                }
                tokens.truncate(limit);
            }
            eprintln!(
                "teacher-forced: {} of {encoded} tokens from {} (BOS first: {})",
                tokens.len(),
                text_path.display(),
                tokenizer.adds_bos()
            );
            let trace = trace_tokens(&model, &tokens)?;
            let (prev, shown) = match tokenizer.adds_bos() {
                true => (tokens[0], tokens[1..].to_vec()),
                false => (BOS, tokens),
            };
            (trace, prev, shown)
        }
        (None, None) => bail!("pass --bos-steps N or --text FILE"),
    };
    let seconds = started.elapsed().as_secs_f64();

    if let Some(tokenizer) = &tokenizer {
        let text = tokenizer.decode(prev, &shown)?;
        eprintln!("text: {}", String::from_utf8_lossy(&text));
    }
    fixture::write(&args.out, &trace)?;
    let bytes = std::fs::metadata(&args.out).with_context(|| format!("could not stat {}", args.out.display()))?.len();
    eprintln!(
        "wrote {} ({bytes} bytes): {} layers × {} positions × (q {}×{} + k,v {}×{}) f32; the forward passes took \
         {seconds:.1} s ({:.1} tokens/s)",
        args.out.display(),
        config.layers,
        trace.positions(),
        config.heads,
        config.head_dim,
        config.kv_heads,
        config.head_dim,
        trace.positions() as f64 / seconds
    );
    Ok(())
}
