//! The I/O seam: [`IoEngine`] carries out a batch of positioned reads and writes on one file, and
//! [`run_all`] finishes a batch on top of any engine (short transfers resumed, interrupted ones
//! retried, no progress turned into an error).
//!
//! Two engines implement it: [`UringEngine`] (io_uring on its own thread: one submission per batch,
//! registered buffers) and [`SyncEngine`] (pread/pwrite on the calling thread), and
//! [`FaultyEngine`] wraps either to inject errors, short transfers and latency in tests. [`probe()`]
//! picks one at start-up and says why it fell back.
//!
//! Contract of [`IoEngine::submit`] (every engine MUST keep it; `run_all` and the tiers rely on it):
//! - it returns only when the kernel is done with every buffer of the batch, whatever happened;
//! - result `i` belongs to request `i`: `Ok(n)` with `n ≤ len` bytes transferred, from the start of
//!   the request (a short transfer is reported, not retried), or the OS error;
//! - requests of one batch may run concurrently and complete in any order, so a batch MUST NOT hold
//!   two requests touching the same file bytes when one of them writes.

mod buf;
mod faulty;
mod probe;
mod sync;
mod uring;

use std::fmt;
use std::io;
use std::os::fd::BorrowedFd;

pub use buf::{AlignedBuf, IO_ALIGN, IoBuffer, IoBuffers};
pub use faulty::{Fault, FaultyEngine};
pub use probe::{EngineChoice, Probed, probe};
pub use sync::SyncEngine;
pub use uring::UringEngine;

/// Which engine carries the I/O (shown in stats).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineKind {
    /// io_uring, submitted from the engine's own thread.
    IoUring,
    /// pread/pwrite on the calling thread.
    Sync,
}

impl EngineKind {
    /// The name used in config, logs and stats.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::IoUring => "io_uring",
            EngineKind::Sync => "pread",
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One positioned transfer between a buffer and the file.
#[derive(Debug)]
pub enum IoRequest<'a> {
    /// Fill `buf` from the file at `offset`.
    Read { offset: u64, buf: &'a mut [u8] },
    /// Write `buf` to the file at `offset`.
    Write { offset: u64, buf: &'a [u8] },
}

impl IoRequest<'_> {
    /// The file offset.
    pub fn offset(&self) -> u64 {
        match self {
            IoRequest::Read { offset, .. } | IoRequest::Write { offset, .. } => *offset,
        }
    }

    /// Bytes to transfer.
    pub fn len(&self) -> usize {
        match self {
            IoRequest::Read { buf, .. } => buf.len(),
            IoRequest::Write { buf, .. } => buf.len(),
        }
    }

    /// Whether there is nothing to transfer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// "read" or "write", for messages.
    pub fn verb(&self) -> &'static str {
        match self {
            IoRequest::Read { .. } => "read",
            IoRequest::Write { .. } => "write",
        }
    }

    /// The part of this request after its first `done` bytes (`done ≤ len`).
    fn rest(&mut self, done: usize) -> IoRequest<'_> {
        match self {
            IoRequest::Read { offset, buf } => IoRequest::Read { offset: *offset + done as u64, buf: &mut buf[done..] },
            IoRequest::Write { offset, buf } => IoRequest::Write { offset: *offset + done as u64, buf: &buf[done..] },
        }
    }
}

/// Carries out batches of positioned reads and writes; see the module doc for the contract.
pub trait IoEngine: Send + Sync + fmt::Debug {
    /// Which engine this is.
    fn kind(&self) -> EngineKind;

    /// Issues every request against `fd` and returns once all have completed: one result per
    /// request, in order.
    fn submit(&self, fd: BorrowedFd<'_>, requests: &mut [IoRequest<'_>]) -> Vec<io::Result<usize>>;
}

/// Errors of the I/O layer.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// The kernel refused or failed a transfer.
    #[error("the {verb} of {len} bytes at offset {offset} failed; check the device and the kernel log")]
    Os {
        verb: &'static str,
        offset: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    /// A transfer stopped making progress before its end.
    #[error(
        "the {verb} of {len} bytes at offset {offset} stopped after {done} bytes; the file may be shorter than its slots or the device full"
    )]
    Short { verb: &'static str, offset: u64, len: usize, done: usize },
    /// Direct I/O needs aligned addresses, lengths and offsets.
    #[error("the {what} {value} is not a multiple of {IO_ALIGN}, which direct I/O needs")]
    Unaligned { what: &'static str, value: u64 },
    /// An aligned buffer could not be allocated.
    #[error("could not allocate {bytes} bytes for I/O buffers; lower the buffer count or free memory")]
    OutOfMemory { bytes: usize },
    /// The requested engine cannot run here.
    #[error("the {engine} engine is unavailable: {reason}")]
    Unavailable { engine: EngineKind, reason: String },
}

impl Clone for IoError {
    /// A copy for each page of a failed coalesced request: the OS error is rebuilt from its errno (or
    /// its kind and message).
    fn clone(&self) -> Self {
        match self {
            IoError::Os { verb, offset, len, source } => IoError::Os {
                verb,
                offset: *offset,
                len: *len,
                source: match source.raw_os_error() {
                    Some(code) => io::Error::from_raw_os_error(code),
                    None => io::Error::new(source.kind(), source.to_string()),
                },
            },
            IoError::Short { verb, offset, len, done } => {
                IoError::Short { verb, offset: *offset, len: *len, done: *done }
            }
            IoError::Unaligned { what, value } => IoError::Unaligned { what, value: *value },
            IoError::OutOfMemory { bytes } => IoError::OutOfMemory { bytes: *bytes },
            IoError::Unavailable { engine, reason } => IoError::Unavailable { engine: *engine, reason: reason.clone() },
        }
    }
}

impl IoError {
    /// The OS error number behind this error, if any (`EIO`, `ENOSPC`, ...).
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            IoError::Os { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// Rounds of resubmission [`run_all`] allows for interrupted or short transfers before giving up.
const MAX_ROUNDS: usize = 8;

/// Carries out every request with `engine` to its end: short transfers are resumed from where they
/// stopped and interrupted ones (`EINTR`, `EAGAIN`) reissued, each round as one batch; a transfer
/// that makes no progress, or still is not done after a few rounds, becomes [`IoError::Short`], and
/// any other OS error is returned for its request alone. One result per request, in order.
pub fn run_all(engine: &dyn IoEngine, fd: BorrowedFd<'_>, requests: &mut [IoRequest<'_>]) -> Vec<Result<(), IoError>> {
    let mut done = vec![0usize; requests.len()];
    let mut outcome: Vec<Option<Result<(), IoError>>> =
        requests.iter().map(|r| r.is_empty().then_some(Ok(()))).collect();
    for round in 0..MAX_ROUNDS {
        let pending: Vec<usize> = (0..requests.len()).filter(|&i| outcome[i].is_none()).collect();
        if pending.is_empty() {
            break;
        }
        let results = {
            let mut batch: Vec<IoRequest<'_>> = Vec::with_capacity(pending.len());
            let mut rest = requests.iter_mut().enumerate();
            for &i in &pending {
                let (_, request) = rest.find(|(j, _)| *j == i).expect("pending indices are increasing and in range");
                batch.push(request.rest(done[i]));
            }
            engine.submit(fd, &mut batch)
        };
        let last = round + 1 == MAX_ROUNDS;
        for (&i, result) in pending.iter().zip(results) {
            let request = &requests[i];
            let short =
                |done| IoError::Short { verb: request.verb(), offset: request.offset(), len: request.len(), done };
            match result {
                Ok(0) => outcome[i] = Some(Err(short(done[i]))),
                Ok(n) => {
                    done[i] += n.min(request.len() - done[i]);
                    if done[i] == request.len() {
                        outcome[i] = Some(Ok(()));
                    } else if last {
                        outcome[i] = Some(Err(short(done[i])));
                    }
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) && !last => {}
                Err(source) => {
                    outcome[i] = Some(Err(IoError::Os {
                        verb: request.verb(),
                        offset: request.offset(),
                        len: request.len(),
                        source,
                    }))
                }
            }
        }
    }
    outcome
        .into_iter()
        .zip(requests.iter())
        .map(|(o, r)| o.unwrap_or(Err(IoError::Short { verb: r.verb(), offset: r.offset(), len: r.len(), done: 0 })))
        .collect()
}

#[cfg(test)]
mod tests;
