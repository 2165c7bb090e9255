//! [`KvmmKvCache`]: the [`KvCache`] seam over a `kvmm_client::Session`, so the KV cache of a
//! running model lives in kvmmd's shared pages and attention is kvmm's fused page kernel.
//!
//! One session per sequence: `layers` layers of `kv_heads` KV heads and `heads` query heads, pages
//! of `block_tokens` tokens in the session's element type (f16 by default). `append` writes one
//! token's rows into the tail page in shared memory; `attention` reads every page of the layer in
//! place, in whatever format the daemon has left it in (f16, or q8/q4/q2 after recompression),
//! faulting pages the daemon moved below the device back in transparently.
//!
//! kvmm pages hold heads of 16 to 256 channels in steps of 16 (`kvmm_shm::Geometry`). A model whose
//! `head_dim` is not a multiple of 16 (stories260K: 8) gets a session of `padded` channels, the next
//! multiple of 16, and every row and query is zero-padded into it:
//!
//! ```text
//!   key, value, query of one head:  [ x0 x1 .. x(d-1) | 0 .. 0 ]      d = head_dim, padded to p
//!   q · k  over p channels = q · k over d (the zeros add nothing)
//!   out    over p channels = [ out over d | 0 .. 0 ]  (zero values average to zero; dropped)
//! ```
//!
//! The softmax scale is the model's, `1 / sqrt(head_dim)`, set on the session explicitly (the
//! session's default would be `1 / sqrt(padded)`). So a padded session computes the same attention
//! as the unpadded formula of [`crate::kv_cache`], up to the f16 rounding of the stored rows and the
//! order of the kernel's operations. When no padding is needed, rows and queries go to the session
//! as they are.
//!
//! Invariants: the padding channels of the scratch rows are zero and stay zero (only the first
//! `head_dim` channels of each head are ever written); the cache allocates nothing per token.

use std::path::Path;

use kvmm_client::{AttachOptions, Client, ElementType, Geometry, ModelShape, Priority, Session, SessionStats};

use crate::config::ModelConfig;
use crate::error::InferError;
use crate::kv_cache::{KvCache, check_append, check_attention, check_layer};

/// Channels per head a kvmm page stores: heads are padded up to a multiple of this.
pub const CHANNEL_STEP: usize = 16;

/// The widest head a kvmm page stores.
pub const MAX_HEAD_DIM: usize = 256;

/// How to attach the session behind a [`KvmmKvCache`].
#[derive(Clone, Debug)]
pub struct KvmmCacheOptions {
    /// Tokens per page: a power of two in `8..=256` (kvmm's default is 32).
    pub block_tokens: u32,
    /// The element type pages are written in (f16, or bf16).
    pub element_type: ElementType,
    /// Free text shown in the daemon's session list (e.g. the model file's name).
    pub model_id: String,
    /// Scheduling class: the daemon demotes background and batch sessions' pages first.
    pub priority: Priority,
    /// How long the session outlives this process's connection, for another process to take it
    /// over with [`KvmmKvCache::resume`] (zero: not at all).
    pub linger: std::time::Duration,
}

impl Default for KvmmCacheOptions {
    fn default() -> Self {
        KvmmCacheOptions {
            block_tokens: 32,
            element_type: ElementType::F16,
            model_id: String::new(),
            priority: Priority::Foreground,
            linger: std::time::Duration::ZERO,
        }
    }
}

/// A [`KvCache`] whose keys and values live in a kvmm session.
///
/// Dropping it detaches the session (the daemon wipes its pages).
#[derive(Debug)]
pub struct KvmmKvCache {
    session: Session,
    /// The model's channels per head.
    head_dim: usize,
    /// The session's channels per head: `head_dim` rounded up to [`CHANNEL_STEP`].
    padded: usize,
    q_heads: usize,
    kv_heads: usize,
    /// Tokens each layer can hold (the session's `max_tokens`).
    max_tokens: usize,
    /// Padded key and value rows (`kv_heads × padded`), reused for every append; their padding
    /// channels are always zero. Empty when `padded == head_dim`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Padded query and attention output (`q_heads × padded`), reused for every attention call;
    /// the query's padding channels are always zero. Empty when `padded == head_dim`.
    q: Vec<f32>,
    out: Vec<f32>,
}

impl KvmmKvCache {
    /// Connects to kvmmd's session socket at `socket` and attaches a session for `config`, holding
    /// up to `max_tokens` tokens per layer (at most `config.seq_len`).
    pub fn connect(
        socket: &Path,
        config: &ModelConfig,
        max_tokens: usize,
        options: KvmmCacheOptions,
    ) -> Result<Self, InferError> {
        let client = Client::connect(socket)
            .map_err(|e| InferError::CacheSetup { what: "connect to kvmmd".to_owned(), source: Box::new(e) })?;
        Self::attach(&client, config, max_tokens, options)
    }

    /// Attaches a session for `config` through `client`, holding up to `max_tokens` tokens per
    /// layer (at most `config.seq_len`). The session keeps the client's connection alive.
    pub fn attach(
        client: &Client,
        config: &ModelConfig,
        max_tokens: usize,
        options: KvmmCacheOptions,
    ) -> Result<Self, InferError> {
        config.validate()?;
        if max_tokens == 0 || max_tokens > config.seq_len {
            return Err(InferError::InvalidArgument(format!(
                "a KV cache for this model holds 1..={} tokens (seq_len), not {max_tokens}",
                config.seq_len
            )));
        }
        let (shape, padded) = model_shape(config)?;
        let geometry = Geometry {
            layers: shape.layers,
            kv_heads: shape.kv_heads,
            q_heads: shape.q_heads,
            head_dim: shape.head_dim,
            block_tokens: options.block_tokens,
            element_type: options.element_type,
            max_tokens: narrow("max_tokens", max_tokens)?,
        };
        if let Err(e) = geometry.validate() {
            return Err(InferError::InvalidArgument(format!("this model's KV cache does not fit a kvmm session: {e}")));
        }
        let attach = AttachOptions {
            model_id: options.model_id,
            priority: options.priority,
            linger: options.linger,
            ..AttachOptions::default()
        };
        let session = client
            .attach_with(geometry, attach)
            .map_err(|e| InferError::CacheSetup { what: "attach a session".to_owned(), source: Box::new(e) })?;
        Ok(Self::over(session, config, padded, max_tokens))
    }

    /// Takes over session `session_id`, which another process of this uid attached for the same
    /// model with a linger and then left (it exited, crashed or lost its connection): the cache
    /// holds the tokens that process appended, and the next position to run is
    /// [`KvCache::tokens`]. A session of another model's shape is refused and left as it was.
    pub fn resume(client: &Client, config: &ModelConfig, session_id: u64) -> Result<Self, InferError> {
        config.validate()?;
        let (shape, padded) = model_shape(config)?;
        Self::resume_shaped(client, config, shape, padded, session_id)
            .map_err(|e| InferError::CacheSetup { what: format!("resume session {session_id}"), source: Box::new(e) })
    }

    /// Takes over the newest session of this uid that another process attached for `config`'s
    /// model with `model_id` (see [`KvmmCacheOptions::model_id`]) and left, as
    /// [`KvmmKvCache::resume`] does; `None` when kvmmd holds none. Sessions of another shape are
    /// passed over, and so is one that another process resumes (or kvmmd wipes) first.
    pub fn resume_newest(client: &Client, config: &ModelConfig, model_id: &str) -> Result<Option<Self>, InferError> {
        config.validate()?;
        let (shape, padded) = model_shape(config)?;
        let setup = |what: String| move |e: kvmm_client::Error| InferError::CacheSetup { what, source: Box::new(e) };
        let orphans = client.orphans(Some(model_id)).map_err(setup("list the sessions left to resume".to_owned()))?;
        for orphan in orphans.iter().filter(|o| o.fits(&shape)) {
            match Self::resume_shaped(client, config, shape, padded, orphan.session_id) {
                Ok(cache) => return Ok(Some(cache)),
                // Resumed by another process, or wiped, since it was listed.
                Err(e) if matches!(e.code(), tonic::Code::FailedPrecondition | tonic::Code::NotFound) => continue,
                Err(e) => return Err(setup(format!("resume session {}", orphan.session_id))(e)),
            }
        }
        Ok(None)
    }

    fn resume_shaped(
        client: &Client,
        config: &ModelConfig,
        shape: ModelShape,
        padded: usize,
        session_id: u64,
    ) -> Result<Self, kvmm_client::Error> {
        // The daemon checks the shape before it hands the session over, so a session of another
        // model stays where it was, for the process that can use it.
        let session = client.resume(session_id, Some(shape))?;
        let max_tokens = (session.geometry().max_tokens as usize).min(config.seq_len);
        Ok(Self::over(session, config, padded, max_tokens))
    }

    /// The cache over an attached (or resumed) session of `config`'s shape.
    fn over(mut session: Session, config: &ModelConfig, padded: usize, max_tokens: usize) -> Self {
        session.set_scale(1.0 / (config.head_dim as f32).sqrt());
        let pad = |heads: usize| if padded == config.head_dim { Vec::new() } else { vec![0.0; heads * padded] };
        KvmmKvCache {
            session,
            head_dim: config.head_dim,
            padded,
            q_heads: config.heads,
            kv_heads: config.kv_heads,
            max_tokens,
            k: pad(config.kv_heads),
            v: pad(config.kv_heads),
            q: pad(config.heads),
            out: pad(config.heads),
        }
    }

    /// The session behind the cache (its id, geometry, last read formats, prefetch hints).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The session, mutably (page budgets, wipe).
    pub fn session_mut(&mut self) -> &mut Session {
        &mut self.session
    }

    /// The model's channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Channels per head of the session's pages (`head_dim` rounded up to a multiple of 16).
    pub fn padded_head_dim(&self) -> usize {
        self.padded
    }

    /// The daemon's statistics of the session: pages per tier, faults, promotions.
    pub fn stats(&self) -> Result<SessionStats, InferError> {
        self.session.stats().map_err(|e| InferError::CacheSetup {
            what: "report the session's statistics".to_owned(),
            source: Box::new(e),
        })
    }

    /// `layer` checked against the session's layers, as the session's `u32`.
    fn check_layer(&self, layer: usize) -> Result<u32, InferError> {
        let layers = self.session.geometry().layers;
        check_layer(layer, layers as usize)?;
        Ok(layer as u32)
    }

    fn failed(layer: usize) -> impl FnOnce(kvmm_client::Error) -> InferError {
        move |e| InferError::Cache { layer, source: Box::new(e) }
    }
}

/// `v` as a session's `u32` field `what`.
fn narrow(what: &str, v: usize) -> Result<u32, InferError> {
    u32::try_from(v).map_err(|_| InferError::InvalidArgument(format!("{what} {v} does not fit a kvmm session")))
}

/// The session shape `config`'s KV cache takes (heads padded to [`CHANNEL_STEP`]), and its padded
/// channels per head.
fn model_shape(config: &ModelConfig) -> Result<(ModelShape, usize), InferError> {
    let padded = padded_head_dim(config.head_dim)?;
    let shape = ModelShape {
        layers: narrow("layers", config.layers)?,
        kv_heads: narrow("kv_heads", config.kv_heads)?,
        q_heads: narrow("heads", config.heads)?,
        head_dim: narrow("head_dim", padded)?,
    };
    Ok((shape, padded))
}

/// `head_dim` rounded up to a multiple of [`CHANNEL_STEP`], or why kvmm cannot hold such heads.
pub fn padded_head_dim(head_dim: usize) -> Result<usize, InferError> {
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(InferError::InvalidArgument(format!(
            "heads of {head_dim} channels do not fit kvmm's pages, which hold 1..={MAX_HEAD_DIM} channels per head"
        )));
    }
    Ok(head_dim.next_multiple_of(CHANNEL_STEP))
}

/// Copies heads of `from` (`d` channels each) into the first `d` channels of the heads of `to`
/// (`p` channels each), leaving the rest of each head of `to` as it is.
fn spread(from: &[f32], d: usize, to: &mut [f32], p: usize) {
    for (src, dst) in from.chunks_exact(d).zip(to.chunks_exact_mut(p)) {
        dst[..d].copy_from_slice(src);
    }
}

impl KvCache for KvmmKvCache {
    fn tokens(&self, layer: usize) -> usize {
        u32::try_from(layer).map_or(0, |l| self.session.tokens(l) as usize)
    }

    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), InferError> {
        let l = self.check_layer(layer)?;
        check_append(layer, self.tokens(layer), self.max_tokens, self.kv_heads * self.head_dim, k, v)?;
        if self.padded == self.head_dim {
            return self.session.append(l, k, v).map_err(Self::failed(layer));
        }
        spread(k, self.head_dim, &mut self.k, self.padded);
        spread(v, self.head_dim, &mut self.v, self.padded);
        self.session.append(l, &self.k, &self.v).map_err(Self::failed(layer))
    }

    fn attention(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<(), InferError> {
        let l = self.check_layer(layer)?;
        check_attention(layer, self.tokens(layer), self.q_heads * self.head_dim, q, out)?;
        if self.padded == self.head_dim {
            return self.session.attention(l, q, out).map_err(Self::failed(layer));
        }
        spread(q, self.head_dim, &mut self.q, self.padded);
        self.session.attention(l, &self.q, &mut self.out).map_err(Self::failed(layer))?;
        for (src, dst) in self.out.chunks_exact(self.padded).zip(out.chunks_exact_mut(self.head_dim)) {
            dst.copy_from_slice(&src[..self.head_dim]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_padded_to_the_next_multiple_of_16() {
        let padded: Vec<usize> = [2, 8, 16, 24, 64, 250, 256].iter().map(|&d| padded_head_dim(d).unwrap()).collect();
        assert_eq!(padded, [16, 16, 16, 32, 64, 256, 256]);
        assert!(padded_head_dim(258).unwrap_err().to_string().contains("1..=256 channels"));
        assert!(padded_head_dim(0).is_err());
    }

    #[test]
    fn spreading_fills_the_head_prefixes_and_leaves_the_padding() {
        let mut to = [9.0; 8];
        spread(&[1.0, 2.0, 3.0, 4.0], 2, &mut to, 4);
        assert_eq!(to, [1.0, 2.0, 9.0, 9.0, 3.0, 4.0, 9.0, 9.0]);
    }
}
