//! `kvmm-generate`: greedy generation from a prompt, printed as it is produced, with timings.
//!
//! `--chat` wraps the prompt in the model's chat template (a GGUF chat model's, default system
//! message included); without `--chat` or `--raw` a model that has a template gets it all the same,
//! and `--raw` feeds the prompt as plain text. `--chat` without `--prompt` reads the user message
//! from stdin. A llama2.c model's prompt is encoded with BOS, and no prompt means "start from BOS".
//! Generation stops at the vocabulary's stop tokens, after `--max-tokens` generated tokens, or at the
//! model's context.
//!
//! `--kv local` keeps the KV cache in process (`f32`, the baseline); `--kv kvmm` keeps it in a kvmm
//! session at `--socket` (attention is kvmm's page kernel over f16 pages). `--kv-format` says what
//! the session's old pages become (see `kvmm_infer::kv_format`): `f16` and `auto` leave it to the
//! daemon's demotion policy, `q8` and `q4` ask the daemon's admin API to recompress them.
//!
//! The report on stderr separates the prompt (prefill, one token at a time like everything here)
//! from decoding, in tokens per second on one thread, names the KV backend and, for kvmm, ends with
//! the session's pages per tier, faults and the formats the last attention read.
//!
//! `kvmm-generate eval --model PATH --text FILE` is the quality evaluation instead
//! (`kvmm_infer::eval`): teacher-forced over the text, per KV storage (`--formats`, default
//! `q8,k8v4,q4,auto,q2`), perplexity, KL divergence against f16 pages and top-1 agreement, as a
//! Markdown table on stdout (`--json` adds one JSON object per storage, `--census` every layer's
//! page formats), progress on stderr. For the shipped text:
//!
//! ```text
//! kvmm-generate eval --model ~/.cache/kvmm/models/SmolLM2-135M-Instruct.Q4_1.gguf \
//!     --text infer/texts/us-constitution.txt
//! ```

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use kvmm_client::proto::PolicyStatus;
use kvmm_infer::eval::{EvalOptions, evaluate_with_progress, parse_storages};
use kvmm_infer::kv_format::{self, Admin};
use kvmm_infer::{
    Forward, InferError, KvCache, KvFormat, KvmmCacheOptions, KvmmKvCache, LocalKvCache, Model, ModelConfig,
    Recompression, Tokenizer, argmax, model,
};

/// Generate text greedily and report tokens per second (or, with `eval`, measure what the KV
/// page formats do to a model's predictions).
#[derive(Parser, Debug)]
#[command(version, args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    generate: GenerateArgs,
    #[command(flatten)]
    kv: KvArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Perplexity, KL divergence against f16 pages and top-1 agreement of kvmm's KV storages,
    /// teacher-forced over a text.
    Eval(EvalArgs),
}

/// What `kvmm-generate eval` measures.
#[derive(Args, Debug)]
struct EvalArgs {
    /// The model: a llama2.c checkpoint (`.bin`, with --tokenizer) or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// The tokenizer of a llama2.c checkpoint.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The UTF-8 text to feed, encoded as a document (the repository ships
    /// infer/texts/us-constitution.txt).
    #[arg(long)]
    text: PathBuf,
    /// Storages to compare with the f16 reference: f16, bf16, q8, k8v4, q4, q2, auto (the daemon's
    /// default adaptive precision, by age, at q4's bytes: a 32-token window, then k8v4 pages aging
    /// into q4), auto-FORMAT (around another compressed format), graded-W (the same with a W-token
    /// window), mass (adaptive precision by attention mass), mass-down (earlier pages also step
    /// down to each new allocation), mass-FORMAT.
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
    /// Also print every layer's page formats per storage, one character per page (`F` f16, `B`
    /// bf16, `8` q8, `k` k8v4, `4` q4, `2` q2).
    #[arg(long)]
    census: bool,
}

/// What to run and how long.
#[derive(Args, Debug)]
struct GenerateArgs {
    /// The model: a llama2.c checkpoint (`.bin`, with --tokenizer) or a GGUF file.
    #[arg(long, required = true)]
    model: Option<PathBuf>,
    /// The tokenizer of a llama2.c checkpoint.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The prompt (the user message with --chat).
    #[arg(long, default_value = "")]
    prompt: String,
    /// Wrap the prompt in the model's chat template as a user message (read from stdin when
    /// --prompt is not given).
    #[arg(long, conflicts_with = "raw")]
    chat: bool,
    /// Feed the prompt as plain text, even to a model with a chat template.
    #[arg(long)]
    raw: bool,
    /// Tokens to generate at most (generation also ends at a stop token and at the model's context).
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
}

/// Where the KV cache lives.
#[derive(Args, Debug)]
struct KvArgs {
    /// The KV cache: in this process (`local`, f32) or in a kvmm session (`kvmm`).
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    kv: Backend,
    /// kvmmd's session socket (default: $KVMM_SOCKET, else /run/kvmm/kvmm.sock if it exists, else
    /// $XDG_RUNTIME_DIR/kvmm/kvmm.sock). The admin socket is kvmm-admin.sock beside it.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// The format old pages take with --kv kvmm: f16 (exact unless the daemon demotes lossily),
    /// q8 or q4 (recompressed through kvmmd's admin API: root or its admin_group), auto (the
    /// daemon's adaptive precision when it demotes).
    #[arg(long, default_value = "f16")]
    kv_format: KvFormat,
    /// Tokens per kvmm page (a power of two, 8 to 256).
    #[arg(long, default_value_t = 32)]
    block_tokens: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    Local,
    Kvmm,
}

/// The cache the run uses, and for kvmm what drives its page formats.
enum Cache {
    Local(LocalKvCache),
    Kvmm(Box<KvmmBackend>),
}

/// A kvmm session and, with `--kv-format q8|q4`, the recompression of its old pages.
struct KvmmBackend {
    cache: KvmmKvCache,
    recompression: Option<Recompression>,
}

impl Cache {
    fn open(kv: &KvArgs, config: &ModelConfig, positions: usize, model_id: String) -> anyhow::Result<Cache> {
        if kv.kv == Backend::Local {
            if kv.kv_format != KvFormat::F16 {
                bail!("--kv-format {} applies to --kv kvmm; the local cache keeps f32 rows", kv.kv_format.name());
            }
            return Ok(Cache::Local(LocalKvCache::new(config, positions)?));
        }
        let socket = kv.socket.clone().unwrap_or_else(kvmm_client::default_socket);
        let client = kvmm_client::Client::connect(&socket)
            .map_err(|e| InferError::CacheSetup { what: "connect to kvmmd".to_owned(), source: Box::new(e) })?;
        let options = KvmmCacheOptions { block_tokens: kv.block_tokens, model_id, ..KvmmCacheOptions::default() };
        let cache = KvmmKvCache::attach(&client, config, positions, options)?;
        let admin_socket = kv_format::admin_socket_beside(&socket);
        let recompression = match kv.kv_format.recompress_to() {
            Some(_) => {
                let (admin, policy) = Admin::connect(&client, &admin_socket)
                    .and_then(|mut admin| admin.policy().map(|policy| (admin, policy)))
                    .with_context(|| {
                        format!(
                            "--kv-format {} recompresses old pages through kvmmd's admin API; without access to it use \
                         --kv-format f16 or auto, which leave formats to the daemon's demotion policy",
                            kv.kv_format.name()
                        )
                    })?;
                eprintln!("{}", policy_line(&policy));
                eprintln!(
                    "kv: pages outside the sink page and the last {} tokens are recompressed to {} as they age",
                    kv_format::RECENT_WINDOW_TOKENS,
                    kv.kv_format.name()
                );
                Some(Recompression::new(admin, kv.kv_format)?)
            }
            None => {
                // Reading the policy is only a report: a user without admin access gets none.
                if let Ok(p) = Admin::connect(&client, &admin_socket).and_then(|mut a| a.policy()) {
                    eprintln!("{}", policy_line(&p));
                    if let Some(warning) =
                        kv_format::policy_mismatch(kv.kv_format, &p.demote_format, p.adaptive_precision)
                    {
                        eprintln!("kv: note: {warning}");
                    }
                }
                None
            }
        };
        Ok(Cache::Kvmm(Box::new(KvmmBackend { cache, recompression })))
    }

    fn as_kv_cache(&mut self) -> &mut dyn KvCache {
        match self {
            Cache::Local(c) => c,
            Cache::Kvmm(k) => &mut k.cache,
        }
    }

    /// Lets client-driven recompression catch up with the tokens written so far.
    fn after_step(&mut self) -> Result<(), InferError> {
        if let Cache::Kvmm(k) = self
            && let Some(r) = &mut k.recompression
        {
            r.catch_up(&k.cache)?;
        }
        Ok(())
    }

    /// The backend's line of the report.
    fn report(&self) -> Result<String, InferError> {
        let Cache::Kvmm(k) = self else {
            return Ok("kv: local (f32 rows in process)".to_owned());
        };
        let (cache, recompression) = (&k.cache, &k.recompression);
        let session = cache.session();
        let g = session.geometry();
        let s = cache.stats()?;
        let mut formats = std::collections::BTreeMap::<&str, usize>::new();
        for f in session.last_formats() {
            *formats.entry(f.map_or("dropped", |f| f.name())).or_default() += 1;
        }
        let formats: Vec<String> = formats.iter().map(|(f, n)| format!("{f} {n}")).collect();
        let mut line = format!(
            "kv: kvmm session {} ({} pages of {} tokens, head_dim {} as {}); pages: device {}, dram {}, flash {}; \
             pages faulted in {} (from dram {}, from flash {}); the last attention (layer {}) read {}",
            session.id(),
            kvmm_kernels::Format::from(g.element_type).name(),
            g.block_tokens,
            cache.head_dim(),
            g.head_dim,
            s.pages[0],
            s.pages[1],
            s.pages[2],
            s.faults,
            s.promoted_from_dram,
            s.promoted_from_flash,
            g.layers - 1,
            formats.join(", ")
        );
        if let Some(r) = recompression {
            let t = r.totals();
            line += &format!(
                "; recompressed {} pages in {} calls ({} → {} bytes, {} skipped)",
                t.compressed, t.calls, t.bytes_before, t.bytes_after, t.skipped
            );
        }
        Ok(line)
    }
}

/// What the daemon's policy does to pages that leave the device, in one line.
fn policy_line(p: &PolicyStatus) -> String {
    let how = match p.demote_format.as_str() {
        "none" => "exactly".to_owned(),
        f if p.adaptive_precision => match p.adaptive_ranking.as_str() {
            // An older kvmmd reports no ranking: it ranked by mass.
            "mass" | "" => format!("around {f}, per page by attention mass (adaptive precision)"),
            _ => format!("around {f}, the newest pages one step up (adaptive precision by age)"),
        },
        f => format!("as {f}"),
    };
    let floors =
        if p.layer_floors.is_empty() { String::new() } else { format!(", layer floors {}", p.layer_floors.join(" ")) };
    format!("kv: kvmmd demotes pages leaving the device {how}{floors} ({} mode)", p.mode)
}

fn prompt_tokens(args: &GenerateArgs, tokenizer: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    if args.chat {
        let mut message = args.prompt.clone();
        if message.is_empty() {
            std::io::stdin().read_to_string(&mut message).context("could not read the message from stdin")?;
        }
        return tokenizer.chat_prompt(message.trim_end()).with_context(|| {
            let model = args.model.as_deref().map(|m| m.display().to_string()).unwrap_or_default();
            format!("{model} has no chat template; drop --chat")
        });
    }
    Ok(match (args.raw, tokenizer.chat_prompt(&args.prompt)) {
        (false, Some(chat)) => chat,
        _ if args.prompt.is_empty() => vec![tokenizer.bos()],
        _ => tokenizer.encode(&args.prompt, tokenizer.adds_bos(), false),
    })
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Command::Eval(args)) = &cli.command {
        return eval(args);
    }
    let args = &cli.generate;
    let Some(model_path) = &args.model else { bail!("--model is required") };
    let loading = Instant::now();
    let (model, tokenizer) = model::load(model_path, args.tokenizer.as_deref())?;
    let Some(tokenizer) = tokenizer else { bail!("{} needs --tokenizer", model_path.display()) };
    let load_seconds = loading.elapsed().as_secs_f64();

    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let prompt = prompt_tokens(args, &tokenizer)?;
    let config = *model.config();
    if prompt.len() >= config.seq_len {
        bail!("the prompt is {} tokens, but the model's context is {} tokens", prompt.len(), config.seq_len);
    }
    // Positions run: the prompt, then every generated token but the last one.
    let positions = (prompt.len() + args.max_tokens.saturating_sub(1)).min(config.seq_len);
    let model_id = model_path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let mut cache = Cache::open(&cli.kv, &config, positions.max(1), model_id)?;
    generate(&model, &tokenizer, &prompt, args.max_tokens, positions, &mut cache, load_seconds)?;
    Ok(())
}

/// `kvmm-generate eval`: the quality table on stdout, progress on stderr.
fn eval(args: &EvalArgs) -> anyhow::Result<()> {
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
            print!("{}:\n{}", pass.storage, pass.page_map());
        }
    }
    Ok(())
}

fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    max_tokens: usize,
    positions: usize,
    cache: &mut Cache,
    load_seconds: f64,
) -> anyhow::Result<()> {
    let mut forward = Forward::new(model);
    let stop = tokenizer.stop_tokens();

    let prefill = Instant::now();
    let mut next = argmax(forward.prefill(model, cache.as_kv_cache(), prompt, 0)?);
    cache.after_step()?;
    let prefill_seconds = prefill.elapsed().as_secs_f64();

    let decode = Instant::now();
    let mut generated = Vec::new();
    let mut printed = 0;
    let mut stdout = std::io::stdout().lock();
    let mut pos = prompt.len();
    let stopped = loop {
        if stop.contains(&next) {
            break format!("stop token {next}");
        }
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
        if generated.len() >= max_tokens {
            break format!("--max-tokens {max_tokens}");
        }
        if pos >= positions {
            break format!("the model's context of {} tokens", model.config().seq_len);
        }
        next = argmax(forward.step(model, cache.as_kv_cache(), next, pos)?);
        cache.after_step()?;
        pos += 1;
    };
    let decode_seconds = decode.elapsed().as_secs_f64();
    writeln!(stdout).context("could not write to stdout")?;
    // Generated tokens that were fed back: all but the last one when a limit was reached.
    let decoded = pos - prompt.len();
    eprintln!(
        "loaded in {load_seconds:.2} s; prompt: {} tokens in {prefill_seconds:.2} s ({:.1} tokens/s); generated: {} \
         tokens, {decoded} forward passes in {decode_seconds:.2} s ({:.1} tokens/s); stopped by {stopped}",
        prompt.len(),
        prompt.len() as f64 / prefill_seconds,
        generated.len(),
        decoded as f64 / decode_seconds,
    );
    eprintln!("{}", cache.report()?);
    Ok(())
}
