//! `kvmm-dump-kv`: run a model over a token sequence and write its post-RoPE queries, keys and
//! values, per layer and position, as a `.kvfx` fixture (format: `kvmm_infer::fixture`).
//!
//! The sequence is either greedy decoding from BOS (`--bos-steps N`, N positions) or a text file
//! encoded with the tokenizer, BOS first, fed teacher-forced (`--text FILE`). The dump itself takes
//! a `Model` and tokens; only `load_model` knows checkpoint formats.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{ArgGroup, Parser};
use kvmm_infer::{Model, Tokenizer, fixture, model::llama2c, tokenizer::BOS, trace_greedy, trace_tokens};

/// Dump the attention inputs (q, k, v) of a model over a token sequence as a .kvfx fixture.
#[derive(Parser, Debug)]
#[command(version, group(ArgGroup::new("sequence").required(true).args(["bos_steps", "text"])))]
struct Args {
    /// The model checkpoint (llama2.c `.bin`).
    #[arg(long)]
    model: PathBuf,
    /// The tokenizer (llama2.c `tokenizer.bin`); required with --text.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Decode greedily from BOS for this many positions (stops early if the model emits BOS).
    #[arg(long)]
    bos_steps: Option<usize>,
    /// Feed this UTF-8 text file, encoded with BOS, teacher-forced.
    #[arg(long)]
    text: Option<PathBuf>,
    /// With --text, keep only the first this many tokens (default: fail if longer than seq_len).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Where to write the fixture.
    #[arg(long)]
    out: PathBuf,
}

fn load_model(path: &Path) -> anyhow::Result<Model> {
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        bail!("{} is a GGUF file; GGUF models are not supported yet, only llama2.c checkpoints", path.display());
    }
    Ok(llama2c::load(path)?)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let model = load_model(&args.model)?;
    let config = *model.config();
    let tokenizer = args.tokenizer.as_deref().map(|p| Tokenizer::load(p, config.vocab_size)).transpose()?;

    // The trace, and the tokens to show as text (everything after the leading BOS).
    let (trace, shown) = match (args.bos_steps, &args.text) {
        (Some(steps), _) => {
            let (trace, generation) = trace_greedy(&model, &[BOS], steps)?;
            eprintln!(
                "greedy from BOS: {} positions, {} tokens generated, stopped by {:?}",
                trace.positions(),
                generation.generated.len(),
                generation.stop
            );
            (trace, generation.generated)
        }
        (None, Some(text_path)) => {
            let Some(tokenizer) = &tokenizer else { bail!("--text needs --tokenizer to encode the text") };
            let text = std::fs::read_to_string(text_path)
                .with_context(|| format!("could not read {} as UTF-8 text", text_path.display()))?;
            let mut tokens = tokenizer.encode(&text, true, false);
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
            eprintln!("teacher-forced: {} tokens from {}", tokens.len(), text_path.display());
            (trace_tokens(&model, &tokens)?, tokens[1..].to_vec())
        }
        (None, None) => bail!("pass --bos-steps N or --text FILE"),
    };

    if let Some(tokenizer) = &tokenizer {
        let text = tokenizer.decode(BOS, &shown)?;
        eprintln!("text: {}", String::from_utf8_lossy(&text));
    }
    fixture::write(&args.out, &trace)?;
    let bytes = std::fs::metadata(&args.out).with_context(|| format!("could not stat {}", args.out.display()))?.len();
    eprintln!(
        "wrote {} ({bytes} bytes): {} layers × {} positions × (q {}×{} + k,v {}×{}) f32",
        args.out.display(),
        config.layers,
        trace.positions(),
        config.heads,
        config.head_dim,
        config.kv_heads,
        config.head_dim
    );
    Ok(())
}
