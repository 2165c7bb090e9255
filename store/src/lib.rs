//! kvmm's storage below the device tier: I/O engines, page sealing, the flash file and the DRAM pool.
//!
//! Like `shm`, this crate holds `unsafe` code (io_uring submissions, aligned and locked memory); every
//! block names the invariant it relies on. It never depends on tokio or tonic: engines run their own
//! threads and their calls block.
