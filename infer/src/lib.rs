//! `kvmm-infer`: a small llama-family inference engine that keeps its KV cache in kvmm.
//!
//! It runs two model families on the CPU, one token at a time, with its KV cache in a kvmm session
//! ([`KvmmKvCache`]) or in process ([`LocalKvCache`]), and dumps real queries, keys and values as
//! test fixtures for the kernels:
//!
//! - llama2.c checkpoints (stories260K), all `f32`, reproducing `run.c`'s greedy output exactly;
//! - llama-architecture GGUF files (SmolLM2-135M-Instruct), with `Q4_1`/`Q8_0` matrices kept
//!   quantized, a byte-level BPE tokenizer from the file's metadata, and its ChatML template.
//!
//! # Layers
//!
//! - [`ModelConfig`] ([`config`]): the shape of a model, whatever file it came from.
//! - [`Model`] ([`model`]): configuration plus shape-checked [`Weights`]; [`model::llama2c`] loads
//!   llama2.c checkpoints, [`model::gguf`] GGUF files (container format in [`gguf`]).
//! - [`Tokenizer`] ([`tokenizer`]): either llama2.c's BPE-by-scores vocabulary (`tok512.bin`) or a
//!   GGUF file's byte-level BPE, with stop tokens and chat template.
//! - [`Matrix`] ([`matmul`]): the matrix–vector seam, over `f32` or quantized blocks ([`quant`]);
//!   [`Rope`] ([`rope`]): rotary embedding.
//! - [`KvCache`] ([`kv_cache`]): the cache seam, with [`LocalKvCache`] in process and
//!   [`KvmmKvCache`] ([`kvmm_cache`]) in a kvmm session (heads zero-padded to kvmm's 16-channel
//!   step); [`kv_format`]: what `--kv-format` asks of the daemon.
//! - [`Forward`] ([`forward`]): one token through the network; [`generate_greedy`] ([`generate`]).
//! - [`KvTrace`] ([`trace`]): queries, keys and values recorded over a sequence, written as a
//!   `.kvfx` fixture by [`fixture`].
//! - [`quality`]: what kvmm's compressed page formats and page selection do to the attention
//!   output on a fixture's real K/V, against an `f64` reference over the original `f32` rows.
//! - [`eval`]: what they do to the model's own next-token distribution, teacher-forced over a
//!   text: perplexity, KL divergence and top-1 agreement against f16 pages, with the pages in a
//!   [`PagedKvCache`] left the way the daemon's demotion leaves them ([`evaluate`]).
//!
//! # Tools
//!
//! `kvmm-generate` runs a prompt greedily and reports tokens per second; `--chat` wraps the prompt
//! in the model's chat template (a GGUF chat model gets it by default, `--raw` feeds the prompt as
//! is). `--kv kvmm` keeps the KV cache in a session of the kvmmd at `--socket` (default
//! `kvmm_client::default_socket()`), `--kv local` (the default) in process; `--kv-format` says what
//! old pages become ([`kv_format`]):
//!
//! ```text
//! cargo run --release -p kvmm-infer --bin kvmm-generate -- --kv kvmm \
//!     --model ~/.cache/kvmm/models/SmolLM2-135M-Instruct.Q4_1.gguf --chat --prompt "What is the capital of France?"
//! ```
//!
//! `kvmm-dump-kv` runs a model over a token sequence and writes its post-RoPE queries, keys and
//! values per layer and position (format in [`fixture`]). From the repository root:
//!
//! ```text
//! cargo run --release -p kvmm-infer --bin kvmm-dump-kv -- \
//!     --model ../shared/models/stories260K/stories260K.bin \
//!     --tokenizer ../shared/models/stories260K/tok512.bin \
//!     --bos-steps 256 --out infer/fixtures/stories260k_bos_256.kvfx
//! ```
//!
//! `--bos-steps N` decodes greedily from BOS for `N` positions; `--text FILE` instead feeds the
//! file's text teacher-forced (encoded as a document: with BOS for llama2.c, as the GGUF says for
//! GGUF models — without for SmolLM2). A `.gguf` model brings its own tokenizer. The committed
//! fixture `infer/fixtures/stories260k_bos_256.kvfx` is the first command's output; the test
//! `kv_fixture_is_current` regenerates it and compares. SmolLM2's fixture over the evaluation text
//! in `infer/texts/` is too large to commit (≈ 215 MB); it is made with:
//!
//! ```text
//! cargo run --release -p kvmm-infer --bin kvmm-dump-kv -- \
//!     --model ~/.cache/kvmm/models/SmolLM2-135M-Instruct.Q4_1.gguf \
//!     --text infer/texts/us-constitution.txt --max-tokens 2048 \
//!     --out ~/.cache/kvmm/fixtures/smollm2_text_2048.kvfx
//! ```
//!
//! `kvmm-kv-quality` scores kvmm's page formats on a fixture's real K/V (see [`quality`]): per
//! format and layer, the relative error and cosine of the attention output with the old pages
//! quantized and the last 128 tokens exact, the KIVI layout against per-token keys at 4 bits, and
//! page selection at a 25% page budget:
//!
//! ```text
//! cargo run --release -p kvmm-infer --bin kvmm-kv-quality -- \
//!     --fixture ~/.cache/kvmm/fixtures/smollm2_text_2048.kvfx --markdown
//! ```

// `unsafe` lives in the per-ISA file `quant_avx512.rs` only, which allows it for itself.
#![deny(unsafe_code)]

pub mod config;
mod cursor;
pub mod error;
pub mod eval;
pub mod fixture;
pub mod forward;
pub mod generate;
pub mod gguf;
pub mod kv_cache;
pub mod kv_format;
pub mod kvmm_cache;
pub mod matmul;
pub mod model;
pub mod quality;
pub mod quant;
#[cfg(target_arch = "x86_64")]
mod quant_avx512;
pub mod rope;
pub mod tokenizer;
pub mod trace;

pub use config::ModelConfig;
pub use error::{InferError, InferErrorKind};
pub use eval::{EvalOptions, EvalReport, PagedKvCache, Storage, evaluate};
pub use forward::Forward;
pub use generate::{Generation, Stop, argmax, generate_greedy};
pub use kv_cache::{KvCache, LocalKvCache};
pub use kv_format::{KvFormat, Recompression};
pub use kvmm_cache::{KvmmCacheOptions, KvmmKvCache};
pub use matmul::{Matrix, WeightFormat};
pub use model::{Classifier, LayerWeights, Model, Weights};
pub use rope::Rope;
pub use tokenizer::{BpeTokenizer, ChatTemplate, Llama2cTokenizer, Tokenizer};
pub use trace::{KvTrace, LayerTrace, RecordingKvCache, trace_greedy, trace_tokens};
