//! `kvmm-infer`: a small llama-family inference engine that will keep its KV cache in kvmm.
//!
//! Today it runs llama2.c checkpoints (stories260K) in `f32` on the CPU, with an in-process KV
//! cache, and dumps real queries, keys and values as test fixtures for the kernels. Later it loads
//! GGUF models (SmolLM2), swaps the plain matrix loops for SIMD and quantized ones, and plugs a
//! kvmm-backed cache in behind [`KvCache`].
//!
//! # Layers
//!
//! - [`ModelConfig`] ([`config`]): the shape of a model, whatever file it came from.
//! - [`Model`] ([`model`]): configuration plus shape-checked [`Weights`]; [`model::llama2c`] loads
//!   llama2.c checkpoints.
//! - [`Tokenizer`] ([`tokenizer`]): llama2.c's BPE-by-scores vocabulary (`tok512.bin`).
//! - [`Matrix`] ([`matmul`]): the matrix–vector seam; [`Rope`] ([`rope`]): rotary embedding.
//! - [`KvCache`] ([`kv_cache`]): the cache seam, with [`LocalKvCache`] in process.
//! - [`Forward`] ([`forward`]): one token through the network; [`generate_greedy`] ([`generate`]).
//! - [`KvTrace`] ([`trace`]): queries, keys and values recorded over a sequence, written as a
//!   `.kvfx` fixture by [`fixture`].
//!
//! # The K/V dump tool
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
//! file's text (encoded with BOS) teacher-forced. The committed fixture
//! `infer/fixtures/stories260k_bos_256.kvfx` is the first command's output; the test
//! `kv_fixture_is_current` regenerates it and compares.

pub mod config;
mod cursor;
pub mod error;
pub mod fixture;
pub mod forward;
pub mod generate;
pub mod kv_cache;
pub mod matmul;
pub mod model;
pub mod rope;
pub mod tokenizer;
pub mod trace;

pub use config::ModelConfig;
pub use error::{InferError, InferErrorKind};
pub use forward::Forward;
pub use generate::{Generation, Stop, argmax, generate_greedy};
pub use kv_cache::{KvCache, LocalKvCache};
pub use matmul::Matrix;
pub use model::{Classifier, LayerWeights, Model, Weights};
pub use rope::Rope;
pub use tokenizer::Tokenizer;
pub use trace::{KvTrace, LayerTrace, RecordingKvCache, trace_greedy, trace_tokens};
