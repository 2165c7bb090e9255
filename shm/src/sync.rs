//! The atomics the pin/migrate protocol is written against.
//!
//! Normal builds use `std::sync::atomic`; `--cfg loom` builds use loom's model-checked atomics, so
//! `shm/tests/loom_protocol.rs` runs the very source of [`crate::protocol`] under the model checker.
//! Only the protocol (and the state-word encoding it uses) is compiled in loom builds: the layout
//! types are views of real shared memory and always use the standard atomics.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
