//! [`probe`]: picks the I/O engine at start-up. `auto` tries io_uring with registered buffers, then
//! io_uring without them (when only the registration is refused, e.g. over `RLIMIT_MEMLOCK`), then
//! pread/pwrite; every step down is logged with its reason and reported in [`Probed::fallback`].
//! A forced engine that cannot run is an error, not a silent fallback.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use super::{IoBuffers, IoEngine, IoError, SyncEngine, UringEngine};

/// The engine the configuration asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EngineChoice {
    /// io_uring when it works here, else pread/pwrite.
    #[default]
    Auto,
    /// io_uring or fail.
    IoUring,
    /// pread/pwrite.
    Sync,
}

impl FromStr for EngineChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(EngineChoice::Auto),
            "io_uring" => Ok(EngineChoice::IoUring),
            "pread" => Ok(EngineChoice::Sync),
            other => Err(format!("unknown I/O engine {other:?}; use \"auto\", \"io_uring\" or \"pread\"")),
        }
    }
}

impl fmt::Display for EngineChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineChoice::Auto => "auto",
            EngineChoice::IoUring => "io_uring",
            EngineChoice::Sync => "pread",
        })
    }
}

/// The engine picked, and why it is not the first choice (if it is not).
#[derive(Debug)]
pub struct Probed {
    /// The engine to use.
    pub engine: Arc<dyn IoEngine>,
    /// The reasons for each step down from io_uring with registered buffers, joined; `None` when
    /// the first choice worked or pread/pwrite was asked for.
    pub fallback: Option<String>,
}

/// Picks the engine for `choice`: io_uring rings get `depth` entries and `buffers` registered.
pub fn probe(choice: EngineChoice, depth: u32, buffers: Option<Arc<IoBuffers>>) -> Result<Probed, IoError> {
    if choice == EngineChoice::Sync {
        return Ok(Probed { engine: Arc::new(SyncEngine::new()), fallback: None });
    }
    let mut reasons = Vec::new();
    let registered = buffers.is_some();
    match UringEngine::new(depth, buffers) {
        Ok(engine) => return Ok(Probed { engine: Arc::new(engine), fallback: None }),
        Err(IoError::Unavailable { reason, .. }) => reasons.push(reason),
        Err(other) => return Err(other),
    }
    if registered && reasons.iter().any(|r| r.starts_with("registering")) {
        match UringEngine::new(depth, None) {
            Ok(engine) => {
                let fallback = format!("{}; using io_uring without registered buffers", reasons.join("; "));
                tracing::warn!(reason = %fallback, "io_uring fell back");
                return Ok(Probed { engine: Arc::new(engine), fallback: Some(fallback) });
            }
            Err(IoError::Unavailable { reason, .. }) => reasons.push(reason),
            Err(other) => return Err(other),
        }
    }
    let reason = reasons.join("; ");
    if choice == EngineChoice::IoUring {
        return Err(IoError::Unavailable { engine: super::EngineKind::IoUring, reason });
    }
    let fallback = format!("{reason}; using pread/pwrite");
    tracing::warn!(reason = %fallback, "io_uring unavailable");
    Ok(Probed { engine: Arc::new(SyncEngine::new()), fallback: Some(fallback) })
}
