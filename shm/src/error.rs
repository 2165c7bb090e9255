//! The one error type of `kvmm-shm`.
//!
//! Every failure of this crate is a [`ShmError`]: a failed system call (which call, on what, and the
//! errno as the error's source), a range outside a mapping, a shared-memory layout that does not match
//! this ABI, or a malformed fd-passing frame. Messages are sentences that say what was expected and
//! what was found, so the person reading them knows which side to fix; they never repeat their source
//! (print the chain to see the errno). [`ShmError::kind`] gives a small, stable classification for
//! callers that map errors onto other codes (gRPC status, exit codes).

use std::io;

use rustix::io::Errno;

use crate::geometry::GeometryError;
use crate::memfd::Seals;

/// A small, stable classification of [`ShmError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ShmErrorKind {
    /// A system call failed for a reason other than a timeout or permissions.
    Io,
    /// A system call was refused for lack of permission (`EPERM`, `EACCES`), e.g. a writable
    /// mapping of a memfd sealed against writes.
    PermissionDenied,
    /// A socket operation ran past its timeout (`EAGAIN`/`EWOULDBLOCK` on a socket with a timeout).
    TimedOut,
    /// The peer closed the connection.
    PeerClosed,
    /// An argument is outside what the object allows: a range outside a mapping, a misaligned
    /// offset, a layer or block outside the table, an invalid geometry.
    InvalidArgument,
    /// A write was attempted through a read-only mapping or table.
    ReadOnly,
    /// Shared memory or an fd does not have the layout, size or seals this ABI version expects.
    Layout,
    /// A frame received over the fd-passing socket is malformed or truncated.
    Malformed,
}

/// Why an operation on shared memory or the fd-passing socket failed.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum ShmError {
    /// A system call failed.
    #[error("{call} failed on {what}")]
    Os {
        /// The system call, e.g. `"mmap"` or `"fcntl(F_ADD_SEALS)"`.
        call: &'static str,
        /// What it was called on, e.g. `"the session-table memfd (4096 bytes)"`.
        what: String,
        /// The errno.
        #[source]
        source: io::Error,
    },

    /// A byte range does not lie inside the object it addresses.
    #[error("{what}: the range starting at byte {offset} with length {len} does not fit in {limit} bytes")]
    OutOfBounds {
        /// What was being accessed, e.g. `"read_at"`.
        what: &'static str,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the object.
        limit: u64,
    },

    /// An atomic view was requested at an offset that is not a multiple of its size.
    #[error("{what}: byte offset {offset} is not a multiple of {align}, as an atomic view needs")]
    Misaligned {
        /// What was being accessed.
        what: &'static str,
        /// The offset given.
        offset: u64,
        /// The alignment required.
        align: u64,
    },

    /// A write was attempted through a read-only mapping.
    #[error(
        "{what} needs a writable mapping, but this one is read-only; only the daemon that created \
         the memory may write it"
    )]
    ReadOnly {
        /// What needed to write.
        what: &'static str,
    },

    /// An object of zero bytes was given where a mapping needs at least one.
    #[error("cannot map {what}: it is empty; create the memfd with a non-zero length")]
    Empty {
        /// What was empty.
        what: &'static str,
    },

    /// A size does not fit this process's address space.
    #[error("{what} of {bytes} bytes does not fit in this process's address space")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size in bytes.
        bytes: u64,
    },

    /// The fd is not a memfd (it does not support seals).
    #[error(
        "the fd given as {what} does not support seals, so it is not a memfd; the peer sent the \
         wrong file"
    )]
    NotAMemfd {
        /// What the fd was supposed to be.
        what: &'static str,
    },

    /// A memfd lacks seals that this side of the ABI relies on.
    #[error(
        "the {what} memfd lacks the seals {missing:?} (it has {present:?}); the daemon must seal it \
         before handing it out"
    )]
    MissingSeals {
        /// Which memfd.
        what: &'static str,
        /// Seals required but absent.
        missing: Seals,
        /// Seals present.
        present: Seals,
    },

    /// A field of a shared region does not hold what this ABI version expects.
    #[error(
        "the {region} has {field} = {found}, but this build expects {expected}; the fd is not a \
         {region}, or the daemon and this process speak different ABI versions"
    )]
    Layout {
        /// Which region, e.g. `"session table"`.
        region: &'static str,
        /// The field, e.g. `"magic"`.
        field: &'static str,
        /// What this build expects, rendered.
        expected: String,
        /// What was found, rendered.
        found: String,
    },

    /// A page address lies outside the table.
    #[error(
        "page (layer {layer}, block {block}) is outside the {region}, which has {layers} layers of \
         {blocks_per_layer} blocks"
    )]
    EntryOutOfRange {
        /// Which region.
        region: &'static str,
        /// Layer asked for.
        layer: u32,
        /// Block asked for.
        block: u32,
        /// Layers in the table.
        layers: u32,
        /// Blocks per layer in the table.
        blocks_per_layer: u32,
    },

    /// Two slices that must describe the same pages have different lengths.
    #[error("{what}: {left} entries on one side but {right} on the other; pass one layer of each")]
    LengthMismatch {
        /// The operation.
        what: &'static str,
        /// Length of the first slice.
        left: usize,
        /// Length of the second slice.
        right: usize,
    },

    /// The geometry is invalid; the inner error says which field and why.
    #[error(transparent)]
    Geometry(#[from] GeometryError),

    /// A frame read from or about to be written to the fd-passing socket is malformed.
    #[error("malformed {frame} frame: {reason}")]
    Malformed {
        /// Which frame, e.g. `"fd request"`.
        frame: &'static str,
        /// What is wrong with it, as a clause.
        reason: String,
    },

    /// A received message or its file descriptors did not fit the receive buffers.
    #[error(
        "a message on the fd socket was truncated ({what}); the peer sent more than the \
         {limit}-{unit} limit"
    )]
    Truncated {
        /// What was cut off: `"payload"` or `"file descriptors"`.
        what: &'static str,
        /// The limit that was exceeded.
        limit: usize,
        /// Unit of the limit.
        unit: &'static str,
    },

    /// An inherited socket is not a `SOCK_SEQPACKET` socket.
    #[error(
        "the socket given for fd passing is of type {found}, not SOCK_SEQPACKET; check the socket \
         unit (ListenSequentialPacket=)"
    )]
    WrongSocketType {
        /// The type found.
        found: String,
    },

    /// The service manager's socket-activation variables (`LISTEN_PID`, `LISTEN_FDS`) are malformed.
    #[error("socket activation: {0}; check the service's socket units")]
    Activation(String),

    /// The peer closed the connection before a message arrived.
    #[error("the peer closed the fd socket before sending a message")]
    PeerClosed,
}

impl ShmError {
    /// The small, stable classification of this error.
    pub fn kind(&self) -> ShmErrorKind {
        match self {
            ShmError::Os { source, .. } => match Errno::from_io_error(source) {
                Some(Errno::PERM) | Some(Errno::ACCESS) => ShmErrorKind::PermissionDenied,
                Some(Errno::AGAIN) | Some(Errno::TIMEDOUT) => ShmErrorKind::TimedOut,
                Some(Errno::PIPE) | Some(Errno::CONNRESET) => ShmErrorKind::PeerClosed,
                _ => ShmErrorKind::Io,
            },
            ShmError::OutOfBounds { .. }
            | ShmError::Misaligned { .. }
            | ShmError::Empty { .. }
            | ShmError::TooLarge { .. }
            | ShmError::EntryOutOfRange { .. }
            | ShmError::LengthMismatch { .. }
            | ShmError::WrongSocketType { .. }
            | ShmError::Geometry(_) => ShmErrorKind::InvalidArgument,
            ShmError::ReadOnly { .. } => ShmErrorKind::ReadOnly,
            ShmError::NotAMemfd { .. } | ShmError::MissingSeals { .. } | ShmError::Layout { .. } => {
                ShmErrorKind::Layout
            }
            ShmError::Malformed { .. } | ShmError::Truncated { .. } => ShmErrorKind::Malformed,
            ShmError::PeerClosed => ShmErrorKind::PeerClosed,
            ShmError::Activation(_) => ShmErrorKind::InvalidArgument,
        }
    }

    /// The errno of a failed system call, if this error is one.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            ShmError::Os { source, .. } => Errno::from_io_error(source),
            _ => None,
        }
    }

    /// Wraps an errno from `call` on `what`.
    pub(crate) fn os(call: &'static str, what: impl Into<String>, errno: Errno) -> ShmError {
        ShmError::Os { call, what: what.into(), source: io::Error::from(errno) }
    }

    /// A [`ShmError::Layout`] for `field` of `region`.
    pub(crate) fn layout(
        region: &'static str,
        field: &'static str,
        expected: impl ToString,
        found: impl ToString,
    ) -> ShmError {
        ShmError::Layout { region, field, expected: expected.to_string(), found: found.to_string() }
    }

    /// A [`ShmError::Malformed`] for `frame`.
    pub(crate) fn malformed(frame: &'static str, reason: impl Into<String>) -> ShmError {
        ShmError::Malformed { frame, reason: reason.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_classifies_into_kinds() {
        assert_eq!(ShmError::os("mmap", "a memfd", Errno::PERM).kind(), ShmErrorKind::PermissionDenied);
        assert_eq!(ShmError::os("recvmsg", "the fd socket", Errno::AGAIN).kind(), ShmErrorKind::TimedOut);
        assert_eq!(ShmError::os("ftruncate", "a memfd", Errno::NOMEM).kind(), ShmErrorKind::Io);
        assert_eq!(ShmError::os("mmap", "a memfd", Errno::PERM).errno(), Some(Errno::PERM));
    }

    #[test]
    fn os_error_message_names_call_and_target_but_not_the_errno() {
        let err = ShmError::os("ftruncate", "the arena memfd", Errno::PERM);
        assert_eq!(err.to_string(), "ftruncate failed on the arena memfd");
        let source = std::error::Error::source(&err).map(ToString::to_string);
        assert!(source.is_some_and(|s| s.contains("not permitted")));
    }
}
