//! kvmmctl's one error type and the one place that turns failures into exit codes.
//!
//! | exit | meaning |
//! |---|---|
//! | 0 | done |
//! | 2 | usage error (clap's, or `wipe --all` without `--yes` where nobody can confirm) |
//! | 3 | permission denied: `PERMISSION_DENIED`, or `EACCES` connecting to the socket |
//! | 4 | not found: `NOT_FOUND` (e.g. no such session), or no socket at the path tried |
//! | 5 | anything else: the daemon is not running (`UNAVAILABLE`), `UNIMPLEMENTED`, a refused policy, ... |

use std::path::{Path, PathBuf};

pub use kvmm_client::error::code_name;
use tonic::Code;

/// Exit status of a command that did what was asked.
pub const EXIT_OK: u8 = 0;
/// Exit status of a usage error (clap uses the same).
pub const EXIT_USAGE: u8 = 2;
/// Exit status when the daemon or the socket refused this user.
pub const EXIT_PERMISSION: u8 = 3;
/// Exit status when the thing named (a session, the socket) does not exist.
pub const EXIT_NOT_FOUND: u8 = 4;
/// Exit status of every other failure.
pub const EXIT_OTHER: u8 = 5;

/// Why a kvmmctl command failed. Displayed, it is the one sentence kvmmctl prints on stderr.
#[derive(thiserror::Error, Debug)]
pub enum Failure {
    /// Nothing exists at the socket path.
    #[error(
        "no admin socket at {}: is kvmmd running, and is this its runtime directory? Pass --socket PATH or set KVMM_ADMIN_SOCKET",
        .0.display()
    )]
    NoSocket(PathBuf),
    /// The socket exists but this user may not connect to it (mode 0660, owned by root and kvmmd's
    /// admin group).
    #[error(
        "permission denied connecting to {}: run as root, as the user kvmmd runs as, or as a member of kvmmd's admin group",
        .path.display()
    )]
    SocketPermission {
        /// The socket path.
        path: PathBuf,
    },
    /// The connection failed for another reason (nobody listening on a stale socket, ...).
    #[error("cannot connect to kvmmd at {} (UNAVAILABLE): {reason}; is kvmmd running?", .path.display())]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The innermost transport error.
        reason: String,
    },
    /// The daemon answered an RPC with an error status.
    #[error("{rpc} failed with {}: {}", code_name(.status.code()), message(.status))]
    Rpc {
        /// The RPC's name as in admin.proto.
        rpc: &'static str,
        /// The daemon's status.
        status: tonic::Status,
    },
    /// A request was refused here before anything was sent.
    #[error("{0}")]
    Usage(String),
    /// A local failure: reading a policy file, the terminal.
    #[error("{what}: {source}")]
    Local {
        /// What kvmmctl was doing.
        what: String,
        /// The failure.
        source: std::io::Error,
    },
}

impl Failure {
    /// The failure of `rpc` with `status`.
    pub fn rpc(rpc: &'static str) -> impl FnOnce(tonic::Status) -> Failure {
        move |status| Failure::Rpc { rpc, status }
    }

    /// The process exit status for this failure.
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::NoSocket(_) => EXIT_NOT_FOUND,
            Failure::SocketPermission { .. } => EXIT_PERMISSION,
            Failure::Connect { .. } | Failure::Local { .. } => EXIT_OTHER,
            Failure::Usage(_) => EXIT_USAGE,
            Failure::Rpc { status, .. } => match status.code() {
                Code::PermissionDenied | Code::Unauthenticated => EXIT_PERMISSION,
                Code::NotFound => EXIT_NOT_FOUND,
                _ => EXIT_OTHER,
            },
        }
    }

    /// Classifies a failure to connect to `path`: a missing socket, a refused one, or another.
    pub fn connect(path: &Path, error: &kvmm_client::Error) -> Failure {
        let io = match error {
            kvmm_client::Error::Connect { source, .. } => innermost_io(source.as_ref()),
            _ => None,
        };
        match io.map(std::io::Error::kind) {
            Some(std::io::ErrorKind::NotFound) => Failure::NoSocket(path.to_owned()),
            Some(std::io::ErrorKind::PermissionDenied) => Failure::SocketPermission { path: path.to_owned() },
            _ => Failure::Connect {
                path: path.to_owned(),
                reason: io.map_or_else(|| error.to_string(), std::string::ToString::to_string),
            },
        }
    }
}

/// The deepest `std::io::Error` in a chain of sources (tonic wraps the connector's error).
fn innermost_io<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a std::io::Error> {
    let mut found = None;
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            found = Some(io);
        }
        next = e.source();
    }
    found
}

/// The daemon's message, or a word for an empty one.
fn message(status: &tonic::Status) -> String {
    let m = status.message().trim().trim_end_matches('.');
    if m.is_empty() { "(no message)".to_owned() } else { m.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_distinct_exit_statuses() {
        let rpc = |code| Failure::Rpc { rpc: "Status", status: tonic::Status::new(code, "x") };
        assert_eq!(rpc(Code::PermissionDenied).exit_code(), EXIT_PERMISSION);
        assert_eq!(rpc(Code::NotFound).exit_code(), EXIT_NOT_FOUND);
        for other in [Code::Unavailable, Code::Unimplemented, Code::InvalidArgument, Code::Internal] {
            assert_eq!(rpc(other).exit_code(), EXIT_OTHER, "{other:?}");
        }
        assert_eq!(Failure::NoSocket(PathBuf::from("/x")).exit_code(), EXIT_NOT_FOUND);
        assert_eq!(Failure::SocketPermission { path: PathBuf::from("/x") }.exit_code(), EXIT_PERMISSION);
    }

    #[test]
    fn an_rpc_failure_reads_as_one_sentence_with_the_code_and_the_daemons_message() {
        let f = Failure::Rpc { rpc: "Session", status: tonic::Status::not_found("no session 999.") };
        assert_eq!(f.to_string(), "Session failed with NOT_FOUND: no session 999");
        let f = Failure::Rpc { rpc: "Metrics", status: tonic::Status::unimplemented("") };
        assert_eq!(f.to_string(), "Metrics failed with UNIMPLEMENTED: (no message)");
    }
}
