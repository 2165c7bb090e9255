//! kvmmd: the daemon that owns the KV-cache memory of every local inference process.
//!
//! Layout: [`config`] (file, flags, defaults), [`runtime_dir`] (socket directory and its lock),
//! [`server`] (gRPC services, peer identity, error-to-code mapping, shutdown), [`fdpass`] (memfds
//! over SCM_RIGHTS), [`pool`] (arenas, frames, accounting), [`session`] (registry, page tables),
//! [`migrate`] (the page-move primitive, compaction, tiering), [`policy`] (sensors and modes),
//! [`metrics`] (the Prometheus families), [`ratelog`] (rate limits of log lines clients can
//! trigger), [`malloc`] (the cap on glibc's malloc arenas), [`systemd`] (notifications, the watchdog's heartbeats), and [`daemon`] (the shared state and the operations the servers call). See
//! ARCHITECTURE.md.
//!
//! Its documentation describes internals and links to private items: read it with
//! `cargo doc --document-private-items`.

#![allow(rustdoc::private_intra_doc_links)]

pub mod config;
pub mod daemon;
pub mod error;
pub mod failpoint;
pub mod fdpass;
pub mod malloc;
pub mod metrics;
pub mod migrate;
pub mod policy;
pub mod pool;
pub mod prefault;
pub mod ratelog;
pub mod runtime_dir;
pub mod server;
pub mod session;
pub mod systemd;
