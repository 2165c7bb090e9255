//! Evaluation of kvmm's page formats on a model's own output: teacher-forced over a text, what
//! storing the KV cache the way the daemon's policy leaves it does to the next-token distribution.
//!
//! The text is encoded as a document ([`Tokenizer::encode_document`]: BOS when the model's
//! tokenizer adds one) and cut at the model's `seq_len` or [`EvalOptions::max_tokens`]. Every
//! storage runs as its own pass — its own [`Forward`] and [`PagedKvCache`] — over the same
//! tokens: token `t` is fed at position `t` and the logits predict token `t + 1`. The reference
//! pass stores every page as f16, which is what kvmm keeps losslessly; the others quantize each
//! page as it leaves the sink page and recent window ([`paged`] documents when and how, and how
//! `auto` chooses). Per step and pass, against the reference's logits of the same step:
//!
//! - **perplexity**: `exp(mean −log q(true next token))`;
//! - **KL(reference ‖ pass)**: over the whole vocabulary, log-softmax in `f64` ([`metrics`]),
//!   averaged over the steps (and its median, 99th percentile and maximum);
//! - **top-1 agreement**: whether the argmax equals the reference's, counted only at steps where
//!   the reference's two largest logits differ by at least [`EvalOptions::margin`] (a near tie is
//!   a coin toss, not a quality signal); the count of such steps is reported;
//! - **bits per element** actually stored at the end ([`report`]).
//!
//! The passes run in lockstep, one step of every pass at a time, so the reference's distribution
//! of a step is held only while that step is scored: memory is the caches (the reference's f16
//! pages: `2 × layers × kv_heads × head_dim × 2 B` per token, SmolLM2 ≈ 23 KB per token) plus two
//! vocabulary-sized buffers per pass. With more than one thread, each step's passes are split
//! among scoped threads (spawned per step: a few microseconds against tens of milliseconds of
//! forward pass); results do not depend on the thread count.
//!
//! Measured on SmolLM2-135M-Instruct over the whole shipped text (6,318 tokens, release build,
//! two shared cores): about 5 minutes per pass; the dev profile is about 5× slower.

pub mod metrics;
pub mod paged;
pub mod report;

use std::time::Instant;

use kvmm_kernels::Format;

use crate::error::InferError;
use crate::forward::Forward;
use crate::model::Model;
use crate::tokenizer::Tokenizer;

pub use metrics::Tally;
pub use paged::{IMPORTANCE_EMA, PagedKvCache, RECENT_WINDOW_TOKENS, Storage, demotion_formats};
pub use report::{EvalReport, PassReport};

/// What to evaluate and how.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalOptions {
    /// The storages to compare with the f16 reference, in report order. Default: q8, k8v4, q4,
    /// auto, q2.
    pub storages: Vec<Storage>,
    /// Use at most this many tokens of the text (default: all of it up to the model's `seq_len`).
    pub max_tokens: Option<usize>,
    /// Tokens per page: a power of two in `8..=256`. Default 32, the daemon's default.
    pub block_tokens: usize,
    /// Tokens at the end of a layer kept at full precision with the sink page. Default
    /// [`RECENT_WINDOW_TOKENS`], the daemon's.
    pub window_tokens: usize,
    /// The reference's top-2 logit margin from which a step counts for top-1 agreement.
    /// Default 0.5.
    pub margin: f32,
    /// Threads to run the passes on; 0 (the default): the available parallelism.
    pub threads: usize,
}

impl Default for EvalOptions {
    fn default() -> Self {
        EvalOptions {
            storages: vec![
                Storage::Uniform(Format::Q8),
                Storage::Uniform(Format::K8V4),
                Storage::Uniform(Format::Q4),
                Storage::AUTO,
                Storage::Uniform(Format::Q2),
            ],
            max_tokens: None,
            block_tokens: 32,
            window_tokens: RECENT_WINDOW_TOKENS,
            margin: 0.5,
            threads: 0,
        }
    }
}

/// Parses a comma-separated list of storage names (`q8,q4,auto`; see [`Storage::from_name`]).
pub fn parse_storages(list: &str) -> Result<Vec<Storage>, InferError> {
    list.split(',')
        .filter(|name| !name.trim().is_empty())
        .map(|name| {
            Storage::from_name(name).ok_or_else(|| {
                InferError::InvalidArgument(format!(
                    "\"{}\" is not a KV storage; use f16, bf16, q8, k8v4, q4, q2, auto (by age) or auto-FORMAT \
                     around another compressed format (auto-q8), graded-W with a window of W ≤ 128 tokens \
                     (graded-64), or mass, mass-down, mass-FORMAT (by attention mass)",
                    name.trim()
                ))
            })
        })
        .collect()
}

/// Evaluates `options.storages` against the f16 reference, teacher-forced over `text` encoded
/// with `tokenizer` (module documentation). This is what `kvmm-generate eval` runs.
///
/// Fails when the text encodes to fewer than 2 tokens, on options the pages cannot hold (a block
/// size outside the kernels' rules), or when a pass produces non-finite logits.
pub fn evaluate(
    model: &Model,
    tokenizer: &Tokenizer,
    text: &str,
    options: &EvalOptions,
) -> Result<EvalReport, InferError> {
    evaluate_with_progress(model, tokenizer, text, options, &mut |_, _| {})
}

/// [`evaluate`], calling `progress(steps done, steps in all)` after every step.
pub fn evaluate_with_progress(
    model: &Model,
    tokenizer: &Tokenizer,
    text: &str,
    options: &EvalOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<EvalReport, InferError> {
    let mut tokens = tokenizer.encode_document(text);
    let text_tokens = tokens.len();
    let cap = options.max_tokens.unwrap_or(usize::MAX).min(model.config().seq_len);
    tokens.truncate(cap);
    let bos = tokenizer.adds_bos();
    let mut report = evaluate_tokens(model, &tokens, bos, options, progress)?;
    report.text_tokens = text_tokens;
    Ok(report)
}

/// One storage's pass: its own forward state and cache, the distribution of its current step.
struct Pass {
    storage: Storage,
    forward: Forward,
    cache: PagedKvCache,
    /// Log-probabilities of the current step, `vocab_size`.
    log_probs: Vec<f64>,
    /// Probabilities of the current step (filled for the reference only).
    probs: Vec<f64>,
    /// The current step's argmax and top-2 margin.
    top1: u32,
    margin: f32,
    tally: Tally,
}

impl Pass {
    fn new(model: &Model, tokens: usize, storage: Storage, options: &EvalOptions) -> Result<Pass, InferError> {
        let vocab = model.config().vocab_size;
        Ok(Pass {
            storage,
            forward: Forward::new(model),
            cache: PagedKvCache::new(
                model.config(),
                tokens,
                storage,
                options.block_tokens,
                storage.window(options.window_tokens),
            )?,
            log_probs: vec![0.0; vocab],
            probs: Vec::new(),
            top1: 0,
            margin: 0.0,
            tally: Tally::with_capacity(tokens),
        })
    }

    /// Feeds `token` at `pos` and keeps the distribution of the next token.
    fn step(&mut self, model: &Model, token: u32, pos: usize, reference: bool) -> Result<(), InferError> {
        let logits = self.forward.step(model, &mut self.cache, token, pos)?;
        if !metrics::log_softmax(logits, &mut self.log_probs) {
            return Err(InferError::InvalidArgument(format!(
                "the model's logits at position {pos} are not finite with {} pages; the evaluation cannot score them",
                self.storage
            )));
        }
        (self.top1, self.margin) = metrics::top2(logits);
        if reference {
            self.probs.clear();
            self.probs.extend(self.log_probs.iter().map(|l| l.exp()));
        }
        Ok(())
    }

    fn report(&self, layers: usize) -> PassReport {
        let (all_bytes, old_bytes) = self.cache.bytes();
        let (pages, old_pages) = self.cache.pages();
        let elements = 2 * self.cache.page_shape().region_elements();
        let bits = |bytes: u64, pages: usize| 8.0 * bytes as f64 / (pages * elements) as f64;
        PassReport {
            storage: self.storage,
            perplexity: self.tally.perplexity(),
            mean_kl: self.tally.mean_kl(),
            median_kl: self.tally.kl_quantile(0.5),
            p99_kl: self.tally.kl_quantile(0.99),
            max_kl: self.tally.max_kl,
            top1_counted: self.tally.counted,
            top1_agree: self.tally.agree,
            bits_per_element: bits(all_bytes, pages),
            old_bits_per_element: (old_pages > 0).then(|| bits(old_bytes, old_pages)),
            page_formats: (0..layers).map(|l| self.cache.page_formats(l)).collect(),
        }
    }
}

/// Runs one step of every pass, `passes[0]` being the reference, on up to `threads` threads.
fn step_all(model: &Model, passes: &mut [Pass], token: u32, pos: usize, threads: usize) -> Result<(), InferError> {
    let run = |chunk: &mut [Pass], first: usize| -> Result<(), InferError> {
        for (i, pass) in chunk.iter_mut().enumerate() {
            pass.step(model, token, pos, first + i == 0)?;
        }
        Ok(())
    };
    if threads <= 1 {
        return run(passes, 0);
    }
    let per = passes.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let mut chunks = passes.chunks_mut(per);
        let mine = chunks.next();
        let handles: Vec<_> =
            chunks.enumerate().map(|(i, chunk)| scope.spawn(move || run(chunk, (i + 1) * per))).collect();
        let mut result = mine.map_or(Ok(()), |chunk| run(chunk, 0));
        for handle in handles {
            let theirs = handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            result = result.and(theirs);
        }
        result
    })
}

/// [`evaluate`] over `tokens` (already encoded and cut; `bos` says whether they start with BOS,
/// for the report).
pub fn evaluate_tokens(
    model: &Model,
    tokens: &[u32],
    bos: bool,
    options: &EvalOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<EvalReport, InferError> {
    let start = Instant::now();
    let c = model.config();
    if tokens.len() < 2 {
        return Err(InferError::InvalidArgument(format!(
            "the text encodes to {} token(s); the evaluation needs at least 2 (one to feed, one to predict)",
            tokens.len()
        )));
    }
    if tokens.len() > c.seq_len {
        return Err(InferError::InvalidArgument(format!(
            "{} tokens were given, more than the model's context of {} (seq_len); cut them first",
            tokens.len(),
            c.seq_len
        )));
    }
    if !(options.margin.is_finite() && options.margin >= 0.0) {
        return Err(InferError::InvalidArgument(format!(
            "a top-2 margin of {} was asked for; it must be a finite number ≥ 0",
            options.margin
        )));
    }
    let steps = tokens.len() - 1;
    let mut passes = Vec::with_capacity(options.storages.len() + 1);
    passes.push(Pass::new(model, steps, Storage::Uniform(Format::F16), options)?);
    for &storage in &options.storages {
        passes.push(Pass::new(model, steps, storage, options)?);
    }
    let threads = match options.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
    .clamp(1, passes.len());

    for (pos, pair) in tokens.windows(2).enumerate() {
        let (token, next) = (pair[0], pair[1] as usize);
        step_all(model, &mut passes, token, pos, threads)?;
        let (reference, others) = passes.split_at_mut(1);
        let reference = &mut reference[0];
        let counts = reference.margin >= options.margin;
        for pass in others.iter_mut() {
            let kl = metrics::kl_divergence(&reference.probs, &reference.log_probs, &pass.log_probs);
            pass.tally.add(-pass.log_probs[next], kl, counts.then_some(pass.top1 == reference.top1));
        }
        reference.tally.add(-reference.log_probs[next], 0.0, counts.then_some(true));
        progress(pos + 1, steps);
    }

    let page_shape = passes[0].cache.page_shape();
    Ok(EvalReport {
        text_tokens: tokens.len(),
        tokens: tokens.len(),
        bos,
        block_tokens: options.block_tokens,
        window_tokens: options.window_tokens,
        margin: options.margin,
        layers: c.layers,
        head_dim: c.head_dim,
        page_head_dim: page_shape.head_dim,
        reference: passes[0].report(c.layers),
        passes: passes[1..].iter().map(|p| p.report(c.layers)).collect(),
        seconds: start.elapsed().as_secs_f64(),
    })
}
