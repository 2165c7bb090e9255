//! [`SyncEngine`]: pread/pwrite on the calling thread, one system call per request. The fallback
//! when io_uring is disabled or refused, and the plain second implementation of the seam.

use std::io;
use std::os::fd::BorrowedFd;

use super::{EngineKind, IoEngine, IoRequest};

/// Positioned reads and writes with `pread(2)`/`pwrite(2)`, in request order.
#[derive(Debug, Default)]
pub struct SyncEngine;

impl SyncEngine {
    /// The engine; it holds no resources.
    pub fn new() -> Self {
        SyncEngine
    }
}

impl IoEngine for SyncEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Sync
    }

    fn submit(&self, fd: BorrowedFd<'_>, requests: &mut [IoRequest<'_>]) -> Vec<io::Result<usize>> {
        requests
            .iter_mut()
            .map(|request| match request {
                IoRequest::Read { offset, buf } => rustix::io::pread(fd, &mut **buf, *offset),
                IoRequest::Write { offset, buf } => rustix::io::pwrite(fd, buf, *offset),
            })
            .map(|result| result.map_err(io::Error::from))
            .collect()
    }
}
