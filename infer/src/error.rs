//! The one error type of `kvmm-infer`: [`InferError`], with a small, stable [`InferErrorKind`].
//!
//! Every message is a sentence that names the file (or the call) and what is wrong with it, so a
//! person can fix the input without reading the code. A message never repeats its `source`: the
//! I/O error or the cache's own error is chained, and printers such as `anyhow` show both.

use std::path::PathBuf;

/// A small, stable classification of [`InferError`], for callers that map errors onto exit codes
/// or other status codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum InferErrorKind {
    /// A file could not be opened or read.
    Io,
    /// A model checkpoint (llama2.c or GGUF), tokenizer file or KV fixture is malformed or inconsistent.
    BadFile,
    /// A model configuration is outside what the engine supports.
    BadConfig,
    /// A call was given arguments that do not fit the model or the cache (token id, position,
    /// buffer length).
    InvalidArgument,
    /// A KV cache implementation failed on its own terms (out of memory, lost its daemon, ...), or
    /// could not be set up (kvmmd unreachable, a session refused).
    Cache,
}

/// Why an inference operation failed.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum InferError {
    /// Reading a file failed at the operating-system level.
    #[error("could not read {}", path.display())]
    Io {
        /// The file being read.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },

    /// Writing a file failed at the operating-system level.
    #[error("could not write {}", path.display())]
    Write {
        /// The file being written.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },

    /// A llama2.c checkpoint does not have the layout its header promises.
    #[error("{} is not a usable llama2.c checkpoint: {reason}", path.display())]
    Checkpoint {
        /// The checkpoint file.
        path: PathBuf,
        /// What is wrong, as the end of a sentence.
        reason: String,
    },

    /// A llama2.c tokenizer file is malformed or does not fit the model.
    #[error("{} is not a usable llama2.c tokenizer: {reason}", path.display())]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What is wrong, as the end of a sentence.
        reason: String,
    },

    /// A GGUF file is malformed, or holds a model or vocabulary this engine cannot run.
    #[error("{} is not a usable GGUF model: {reason}", path.display())]
    Gguf {
        /// The GGUF file.
        path: PathBuf,
        /// What is wrong, as the end of a sentence.
        reason: String,
    },

    /// A KV fixture is malformed.
    #[error("{origin} is not a valid KV fixture: {reason}")]
    Fixture {
        /// The fixture file, or "the buffer" when decoding from memory.
        origin: String,
        /// What is wrong, as the end of a sentence.
        reason: String,
    },

    /// The model configuration is outside what the engine supports.
    #[error("the model configuration is not supported: {reason}")]
    Config {
        /// What is wrong, as the end of a sentence.
        reason: String,
    },

    /// Weights given to [`crate::Model::new`] do not have the shapes the configuration needs.
    #[error("the model weights do not match the configuration: {reason}")]
    WeightShape {
        /// Which tensor and what shape it has versus needs.
        reason: String,
    },

    /// A call's arguments do not fit the model or the cache.
    #[error("{0}")]
    InvalidArgument(String),

    /// A page kernel refused a call (a geometry its pages cannot hold, a buffer of the wrong size).
    #[error("the page kernels refused to {what}")]
    Kernel {
        /// What was being done, as the end of the sentence "the page kernels refused to ...".
        what: String,
        /// The kernels' own error.
        source: kvmm_kernels::KernelError,
    },

    /// A KV cache implementation failed.
    #[error("the KV cache failed on layer {layer}")]
    Cache {
        /// The layer being appended to or attended over.
        layer: usize,
        /// The implementation's own error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A KV cache could not be set up or asked about itself (kvmmd unreachable, a session refused,
    /// statistics or a recompression refused).
    #[error("the KV cache could not {what}")]
    CacheSetup {
        /// What was being done, as the end of the sentence "the KV cache could not ...".
        what: String,
        /// The implementation's own error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl InferError {
    /// The stable classification of this error.
    pub fn kind(&self) -> InferErrorKind {
        match self {
            Self::Io { .. } | Self::Write { .. } => InferErrorKind::Io,
            Self::Checkpoint { .. } | Self::Tokenizer { .. } | Self::Gguf { .. } | Self::Fixture { .. } => {
                InferErrorKind::BadFile
            }
            Self::Config { .. } | Self::WeightShape { .. } => InferErrorKind::BadConfig,
            Self::InvalidArgument(_) | Self::Kernel { .. } => InferErrorKind::InvalidArgument,
            Self::Cache { .. } | Self::CacheSetup { .. } => InferErrorKind::Cache,
        }
    }
}
