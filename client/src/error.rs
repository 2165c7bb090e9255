//! The client library's error type. Every error carries the gRPC code that best describes it, so a
//! caller can react the same way to a failure reported by the daemon and one found locally.

use kvmm_kernels::KernelError;
use kvmm_shm::ShmError;
use tonic::Code;

/// A failure of a client operation.
#[derive(thiserror::Error, Debug)]
pub enum Error {
    /// The daemon could not be reached.
    #[error(
        "cannot connect to kvmmd at {path}: {}; is kvmmd running, is this the right socket, and may this user use it?",
        root_cause(source.as_ref())
    )]
    Connect {
        /// The socket path.
        path: String,
        /// The transport failure.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The daemon refused or failed a request; its message says why.
    #[error("kvmmd: {}", .0.message())]
    Rpc(tonic::Status),
    /// The connection to the daemon broke (it stopped, restarted or crashed).
    #[error("the connection to kvmmd was lost ({0}); it stopped or restarted: reconnect and attach again")]
    Disconnected(String),
    /// The daemon refused to hand out the session's memfds.
    #[error("kvmmd refused the memfds: {message}")]
    FdRefused {
        /// gRPC code of the refusal.
        code: Code,
        /// The daemon's sentence.
        message: String,
    },
    /// A local argument check failed before anything was sent.
    #[error("{0}")]
    InvalidArgument(String),
    /// The session is not in a state that allows the call.
    #[error("{0}")]
    FailedPrecondition(String),
    /// Memory ran short in a way retrying now would not fix.
    #[error("{0}")]
    Exhausted(String),
    /// The daemon sent something this library does not accept.
    #[error("kvmmd sent an unexpected reply: {0}")]
    Protocol(String),
    /// A shared-memory operation failed.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// An attention kernel rejected its input.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A local I/O failure (runtime creation, the fd socket).
    #[error("{what}: {source}")]
    Io {
        /// What the library was doing.
        what: &'static str,
        /// The failure.
        source: std::io::Error,
    },
}

impl Error {
    /// The gRPC code that describes this error.
    pub fn code(&self) -> Code {
        match self {
            Error::Connect { source, .. } if io_kind(source.as_ref()) == Some(std::io::ErrorKind::PermissionDenied) => {
                Code::PermissionDenied
            }
            Error::Connect { .. } | Error::Disconnected(_) => Code::Unavailable,
            Error::Rpc(s) => s.code(),
            Error::FdRefused { code, .. } => *code,
            Error::InvalidArgument(_) | Error::Kernel(_) => Code::InvalidArgument,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::Exhausted(_) => Code::ResourceExhausted,
            Error::Protocol(_) | Error::Shm(_) | Error::Io { .. } => Code::Internal,
        }
    }
}

impl From<tonic::Status> for Error {
    /// A status the daemon sent stays as it is; one that tonic made up because the connection broke
    /// becomes [`Error::Disconnected`].
    fn from(s: tonic::Status) -> Self {
        let transport = std::error::Error::source(&s).is_some_and(|e| e.is::<tonic::transport::Error>());
        if transport || (s.code() == Code::Unknown && s.message().contains("transport error")) {
            Error::Disconnected(s.message().to_owned())
        } else {
            Error::Rpc(s)
        }
    }
}

/// Result alias for client operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The innermost error of a chain (a transport error's cause is the socket's `io::Error`).
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut e = e;
    while let Some(next) = e.source() {
        e = next;
    }
    e.to_string()
}

/// The kind of the `io::Error` in a chain, if there is one.
fn io_kind(e: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    let mut e = Some(e);
    while let Some(cur) = e {
        if let Some(io) = cur.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        e = cur.source();
    }
    None
}

/// The canonical upper-case name of a gRPC code, as the gRPC specification spells it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
