//! `kvmm-generate`: greedy generation from a prompt, printed as it is produced, with timings.
//!
//! A GGUF chat model's prompt is wrapped in its chat template (default system message included)
//! unless `--raw` is given; a llama2.c model's prompt is encoded with BOS, and no prompt means
//! "start from BOS". Generation stops at the vocabulary's stop tokens or after `--steps` positions.
//! The report on stderr separates the prompt (prefill, one token at a time like everything here)
//! from decoding, in tokens per second on one thread.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use kvmm_infer::{Forward, LocalKvCache, argmax, model};

/// Generate text greedily and report tokens per second.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The model: a llama2.c checkpoint (`.bin`, with --tokenizer) or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// The tokenizer of a llama2.c checkpoint.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The prompt (a user message for chat models).
    #[arg(long, default_value = "")]
    prompt: String,
    /// Feed the prompt as plain text, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Positions to run in total, prompt included.
    #[arg(long, default_value_t = 256)]
    steps: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let loading = Instant::now();
    let (model, tokenizer) = model::load(&args.model, args.tokenizer.as_deref())?;
    let Some(tokenizer) = tokenizer else { bail!("{} needs --tokenizer", args.model.display()) };
    let load_seconds = loading.elapsed().as_secs_f64();

    let prompt = match (args.raw, tokenizer.chat_prompt(&args.prompt)) {
        (false, Some(chat)) => chat,
        _ if args.prompt.is_empty() => vec![tokenizer.bos()],
        _ => tokenizer.encode(&args.prompt, tokenizer.adds_bos(), false),
    };
    let config = *model.config();
    let steps = args.steps.min(config.seq_len);
    if prompt.len() >= steps {
        bail!("the prompt is {} tokens, but --steps allows only {steps} positions", prompt.len());
    }
    let mut cache = LocalKvCache::new(&config, steps)?;
    let mut forward = Forward::new(&model);
    let stop = tokenizer.stop_tokens();

    let prefill = Instant::now();
    let mut next = 0;
    for (pos, &token) in prompt.iter().enumerate() {
        next = argmax(forward.step(&model, &mut cache, token, pos)?);
    }
    let prefill_seconds = prefill.elapsed().as_secs_f64();

    let decode = Instant::now();
    let mut generated = Vec::new();
    let mut printed = 0;
    let mut stdout = std::io::stdout().lock();
    let mut pos = prompt.len();
    while !stop.contains(&next) {
        generated.push(next);
        // Print whole UTF-8 sequences only: a code point may span tokens.
        let text = tokenizer.decode(prompt[prompt.len() - 1], &generated)?;
        let complete = match std::str::from_utf8(&text[printed..]) {
            Ok(_) => text.len(),
            Err(e) => printed + e.valid_up_to(),
        };
        stdout.write_all(&text[printed..complete]).context("could not write to stdout")?;
        stdout.flush().context("could not write to stdout")?;
        printed = complete;
        if pos >= steps {
            break;
        }
        next = argmax(forward.step(&model, &mut cache, next, pos)?);
        pos += 1;
    }
    let decode_seconds = decode.elapsed().as_secs_f64();
    writeln!(stdout).context("could not write to stdout")?;
    // Generated tokens that were fed back: all but the last one when the step budget ran out.
    let decoded = pos - prompt.len();
    eprintln!(
        "loaded in {load_seconds:.2} s; prompt: {} tokens in {prefill_seconds:.2} s ({:.1} tokens/s); generated: {} \
         tokens, {decoded} forward passes in {decode_seconds:.2} s ({:.1} tokens/s); stopped by {}",
        prompt.len(),
        prompt.len() as f64 / prefill_seconds,
        generated.len(),
        decoded as f64 / decode_seconds,
        if stop.contains(&next) { format!("stop token {next}") } else { format!("the {steps}-position limit") }
    );
    Ok(())
}
