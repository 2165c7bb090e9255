//! The daemon's error type: one enum, a small stable [`ErrorKind`], and messages that are sentences a
//! person can act on. `server::status` is the one place that turns a kind into a gRPC code.

use kvmm_shm::{GeometryError, ShmError};
use kvmm_store::seal::SealErrorKind;
use kvmm_store::tier::TierError;

/// What kind of failure an [`Error`] is; stable across message changes, mapped to gRPC codes in one place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is malformed or out of range.
    InvalidArgument,
    /// The named object does not exist.
    NotFound,
    /// The caller's identity does not allow this.
    PermissionDenied,
    /// A budget would be exceeded.
    ResourceExhausted,
    /// The object is in the wrong state for the request.
    FailedPrecondition,
    /// The daemon is shutting down.
    Unavailable,
    /// Stored data failed authentication and is lost.
    DataLoss,
    /// A bug or an unexpected operating-system failure.
    Internal,
}

/// A failure of a daemon operation.
#[derive(thiserror::Error, Debug)]
pub enum Error {
    /// The geometry given at attach breaks a rule.
    #[error("invalid geometry: {0}")]
    Geometry(#[from] GeometryError),
    /// A request field is out of range; the message names the field and the allowed range.
    #[error("{0}")]
    InvalidArgument(String),
    /// No session with this id exists (for this caller).
    #[error("session {0} does not exist: it was detached, destroyed with its connection, or never attached")]
    UnknownSession(u64),
    /// The session is the caller's uid's but was attached through another connection: a handle
    /// kept across a reconnect (the old connection's sessions died with it; a restarted kvmmd may
    /// have reused the id).
    #[error(
        "session {0} was attached through another connection; a session is used through the connection that \
         attached it: after a reconnect, attach again"
    )]
    OtherConnection(u64),
    /// An operator wiped the session: its data is gone.
    #[error("session {0} was wiped by an administrator; its data is gone: attach a new session")]
    Wiped(u64),
    /// A process of the session's uid wiped it (its own `Wipe`): its data is gone.
    #[error("session {0} was wiped at its owner's request (Wipe); its data is gone: attach a new session")]
    WipedByOwner(u64),
    /// kvmmd revoked the session: one of its pages stayed pinned past the pin lease.
    #[error(
        "session {0} was revoked by kvmmd because one of its pages stayed pinned past the daemon's pin lease; its \
         data is gone: attach a new session"
    )]
    Revoked(u64),
    /// The session's connection closed and no process resumed it within its linger time.
    #[error(
        "session {0} was wiped because no process resumed it within its linger time after its connection closed; \
         its data is gone: attach a new session"
    )]
    Expired(u64),
    /// The session's connection closed; it waits for a `Resume` and serves nothing else until then.
    #[error(
        "session {0} lost the connection that attached it and is waiting to be resumed: call Resume on it from \
         this connection first, or Detach it to end it"
    )]
    Orphaned(u64),
    /// The caller is not the session's owner.
    #[error("session {session} belongs to uid {owner}; uid {caller} may not use it")]
    ForeignSession {
        /// The session asked for.
        session: u64,
        /// Its owner's uid.
        owner: u32,
        /// The caller's uid.
        caller: u32,
    },
    /// The caller may not use this endpoint.
    #[error("{0}")]
    PermissionDenied(String),
    /// A tier's budget cannot fit the request.
    #[error(
        "the {tier} tier cannot fit this request: {requested} bytes requested, {available} of its \
         {budget}-byte budget available; detach idle sessions or raise the {tier} budget"
    )]
    Exhausted {
        /// The tier whose budget is exhausted.
        tier: &'static str,
        /// Bytes the request needs.
        requested: u64,
        /// Bytes still free in the tier.
        available: u64,
        /// The tier's whole budget.
        budget: u64,
    },
    /// `Extend` would take a session past its quota and the session did not opt into eviction.
    #[error(
        "session {session} would hold {tokens} tokens per layer, over its quota of {quota}; {}",
        if *evict { "ask for fewer blocks" } else { "attach with eviction to drop its least-attended pages instead, or with a larger quota" }
    )]
    OverQuota {
        /// The session.
        session: u64,
        /// Tokens per layer the request would make it hold.
        tokens: u64,
        /// Its quota, in tokens per layer.
        quota: u64,
        /// Whether it opted into eviction.
        evict: bool,
    },
    /// A session that opted into eviction is at its quota and none of its pages may be dropped.
    #[error(
        "session {session} is at its quota of {quota} tokens per layer and has no page it may drop: the first \
         page, the pages of the last {window} tokens, pages not yet full and pages in use are kept; append to \
         every layer before extending, or attach with a larger quota"
    )]
    NothingToDrop {
        /// The session.
        session: u64,
        /// Its quota, in tokens per layer.
        quota: u64,
        /// The recent window kept, in tokens.
        window: u64,
    },
    /// The request does not fit the object's current state.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The daemon is momentarily overloaded; the request may be retried.
    #[error("{0}")]
    Busy(String),
    /// The daemon no longer admits work.
    #[error("kvmmd is shutting down and admits no new work; reconnect once it is back")]
    ShuttingDown,
    /// A page-format operation failed where the daemon's own inputs should have been valid.
    #[error("page format: {0}")]
    Kernel(#[from] kvmm_kernels::KernelError),
    /// A shared-memory operation failed.
    #[error("shared memory: {0}")]
    Shm(#[from] ShmError),
    /// A tier below the device failed: full, unauthenticated data, I/O, sealing.
    #[error(transparent)]
    Tier(#[from] kvmm_store::tier::TierError),
    /// An unexpected operating-system failure.
    #[error("{what}: {source}")]
    Io {
        /// What the daemon was doing.
        what: String,
        /// The underlying failure.
        source: std::io::Error,
    },
}

impl Error {
    /// The stable kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Geometry(_) | Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::UnknownSession(_) | Error::OtherConnection(_) => ErrorKind::NotFound,
            Error::ForeignSession { .. } | Error::PermissionDenied(_) => ErrorKind::PermissionDenied,
            Error::Exhausted { .. } | Error::OverQuota { .. } | Error::NothingToDrop { .. } => {
                ErrorKind::ResourceExhausted
            }
            Error::FailedPrecondition(_)
            | Error::Wiped(_)
            | Error::WipedByOwner(_)
            | Error::Revoked(_)
            | Error::Expired(_)
            | Error::Orphaned(_) => ErrorKind::FailedPrecondition,
            Error::ShuttingDown | Error::Busy(_) => ErrorKind::Unavailable,
            Error::Shm(_) | Error::Kernel(_) | Error::Io { .. } => ErrorKind::Internal,
            Error::Tier(e) => match e {
                TierError::Full { .. } => ErrorKind::ResourceExhausted,
                TierError::DataLoss { .. } => ErrorKind::DataLoss,
                TierError::Seal(s) if s.kind() == SealErrorKind::KeyMemory => ErrorKind::ResourceExhausted,
                _ => ErrorKind::Internal,
            },
        }
    }

    /// Wraps an I/O error with what the daemon was doing.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { what: what.into(), source }
    }
}

/// Result alias for daemon operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;
