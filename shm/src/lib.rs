//! kvmm's shared-memory ABI: memfds and seals, mappings, the session table and client region, the
//! pin/migrate protocol, and fd passing over `SOCK_SEQPACKET`.
//!
//! All of kvmm's `unsafe` for shared memory lives in this crate: `mmap`/`munmap` and raw byte copies
//! ([`mapping`]), atomic views over shared memory ([`table`], [`region`]), one `getsockopt`
//! ([`fdpass`], for `SO_PEERCRED` and `SO_PEERPIDFD`; everything else there goes through rustix's
//! safe API), and
//! adopting the fds systemd passes ([`activation`]). Each file opens with a doc comment saying what
//! it owns and the invariants its `unsafe` relies on.
//!
//! | file | owns |
//! |---|---|
//! | [`error`] | [`ShmError`], [`ShmErrorKind`] |
//! | [`memfd`] | [`Memfd`], [`Seals`] |
//! | [`mapping`] | [`Mapping`], [`Access`]: the only ways bytes of shared memory are touched |
//! | [`geometry`] | [`Geometry`], [`GeometryError`]: a session's dimensions and their rules |
//! | [`state`] | [`PageFlags`]: the daemon-written state word |
//! | [`protocol`] | pin/migrate, model-checked with loom |
//! | [`layout`] | the session-table ABI: [`TableHeader`], [`DaemonEntry`], [`ClientEntry`] |
//! | [`table`] | [`SessionTable`], [`EntryWriter`] |
//! | [`region`] | [`ClientRegion`] |
//! | [`fdpass`] | `SOCK_SEQPACKET` + `SCM_RIGHTS`, request and reply frames |
//! | [`activation`] | sockets passed by systemd (`LISTEN_FDS`) adopted as owned fds |
//!
//! Builds with `--cfg loom` compile only [`state`] and [`protocol`] (over loom's atomics), for
//! `tests/loom_protocol.rs`.

#[cfg(not(loom))]
pub mod activation;
#[cfg(not(loom))]
pub mod error;
#[cfg(not(loom))]
pub mod fdpass;
#[cfg(not(loom))]
pub mod geometry;
#[cfg(not(loom))]
pub mod layout;
#[cfg(not(loom))]
pub mod mapping;
#[cfg(not(loom))]
pub mod memfd;
pub mod protocol;
#[cfg(not(loom))]
pub mod region;
pub mod state;
mod sync;
#[cfg(not(loom))]
pub mod table;

#[cfg(not(loom))]
pub use error::{ShmError, ShmErrorKind};
#[cfg(not(loom))]
pub use geometry::{DEFAULT_BLOCK_TOKENS, Geometry, GeometryError};
#[cfg(not(loom))]
pub use layout::{ClientEntry, DaemonEntry, PageLocation, TableHeader, TableStatus};
#[cfg(not(loom))]
pub use mapping::{Access, Mapping};
#[cfg(not(loom))]
pub use memfd::{Memfd, Seals};
pub use protocol::{MigrateSkip, MigrateTicket, PinOutcome};
#[cfg(not(loom))]
pub use region::ClientRegion;
pub use state::PageFlags;
#[cfg(not(loom))]
pub use table::{EntryWriter, SessionTable};
