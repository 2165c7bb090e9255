//! kvmm's storage below the device tier: I/O engines, page sealing, the flash file and the DRAM pool.
//!
//! Like `shm`, this crate holds `unsafe` code (io_uring submissions, aligned and locked memory); every
//! block names the invariant it relies on. It never depends on tokio or tonic: engines run their own
//! threads and their calls block.
//!
//! - [`dram`]: the DRAM tier, a private pool of pages (sealed when configured).
//! - [`extent`]: the best-fit extent allocator behind arenas, the DRAM pool and flash slots.
//! - [`flash`]: the flash tier's preallocated O_DIRECT file: slots, sealed page records, coalesced I/O.
//! - [`io`]: the [`io::IoEngine`] seam (io_uring on its own thread, pread/pwrite, a fault-injecting
//!   wrapper), [`io::run_all`] that finishes batches on any engine, aligned buffers, and the start-up
//!   [`io::probe`].
//! - [`pace`]: [`pace::CpuShare`], how a long loop shares its CPU with the daemon's other threads.
//! - [`tier`]: the [`tier::Tier`] seam the DRAM pool and the flash file implement, and its errors.
//! - [`seal`]: AES-256-GCM sealing of pages that leave the device, with per-session keys in locked
//!   memory and per-slot nonces.
//!
//! Its documentation describes internals and links to private items: read it with
//! `cargo doc --document-private-items`.

#![allow(rustdoc::private_intra_doc_links)]

pub mod dram;
pub mod extent;
pub mod flash;
pub mod io;
pub mod pace;
pub mod seal;
pub mod tier;
