//! [`FaultyEngine`]: wraps a real engine and injects failures at the I/O seam, for tests of
//! everything above it (errors surface cleanly, retries happen, accounting stays consistent).
//!
//! Armed [`Fault`]s match requests by direction and file range and fire a given number of times: an
//! errno (`EIO`, `ENOSPC`, ...) returned without touching the file, or a short transfer (the request
//! cut to a prefix and passed on). A latency, when set, delays every batch. Requests no fault
//! matches go to the wrapped engine unchanged, in one batch.

use std::io;
use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::{EngineKind, IoEngine, IoRequest};

/// What a fault does to a request it matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// Fail with this errno; the file is not touched.
    Errno(i32),
    /// Transfer only the first `bytes` bytes (less than the request's length, or nothing happens).
    Short(usize),
}

/// One armed fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// `Some(true)`: reads only; `Some(false)`: writes only; `None`: both.
    pub reads: Option<bool>,
    /// Only requests starting in this file range (all requests when `None`).
    pub at: Option<Range<u64>>,
    /// What happens.
    pub action: FaultAction,
    /// Requests it still fires on.
    pub times: u32,
}

impl Fault {
    /// The next `times` reads fail with `errno`.
    pub fn read_error(errno: i32, times: u32) -> Self {
        Fault { reads: Some(true), at: None, action: FaultAction::Errno(errno), times }
    }

    /// The next `times` writes fail with `errno`.
    pub fn write_error(errno: i32, times: u32) -> Self {
        Fault { reads: Some(false), at: None, action: FaultAction::Errno(errno), times }
    }

    /// The next `times` reads transfer only `bytes` bytes.
    pub fn short_read(bytes: usize, times: u32) -> Self {
        Fault { reads: Some(true), at: None, action: FaultAction::Short(bytes), times }
    }

    /// The next `times` writes transfer only `bytes` bytes.
    pub fn short_write(bytes: usize, times: u32) -> Self {
        Fault { reads: Some(false), at: None, action: FaultAction::Short(bytes), times }
    }

    /// Restricts the fault to requests starting in `range`.
    pub fn at(mut self, range: Range<u64>) -> Self {
        self.at = Some(range);
        self
    }

    fn matches(&self, request: &IoRequest<'_>) -> bool {
        let is_read = matches!(request, IoRequest::Read { .. });
        self.times > 0
            && self.reads.is_none_or(|r| r == is_read)
            && self.at.as_ref().is_none_or(|range| range.contains(&request.offset()))
    }
}

/// The armed faults and the latency.
#[derive(Debug, Default)]
struct Plan {
    faults: Vec<Fault>,
    latency: Duration,
    fired: u64,
}

/// An engine that injects armed faults into the requests it passes to `inner`.
#[derive(Debug)]
pub struct FaultyEngine {
    inner: Arc<dyn IoEngine>,
    plan: Mutex<Plan>,
}

impl FaultyEngine {
    /// Wraps `inner` with no fault armed.
    pub fn new(inner: Arc<dyn IoEngine>) -> Self {
        FaultyEngine { inner, plan: Mutex::new(Plan::default()) }
    }

    /// Arms a fault; faults are tried in the order armed, the first match fires.
    pub fn arm(&self, fault: Fault) {
        self.plan().faults.push(fault);
    }

    /// Removes every armed fault and the latency.
    pub fn clear(&self) {
        let mut plan = self.plan();
        plan.faults.clear();
        plan.latency = Duration::ZERO;
    }

    /// Delays every batch by `latency`.
    pub fn set_latency(&self, latency: Duration) {
        self.plan().latency = latency;
    }

    /// Faults fired so far.
    pub fn fired(&self) -> u64 {
        self.plan().fired
    }

    fn plan(&self) -> std::sync::MutexGuard<'_, Plan> {
        self.plan.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl IoEngine for FaultyEngine {
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }

    fn submit(&self, fd: BorrowedFd<'_>, requests: &mut [IoRequest<'_>]) -> Vec<io::Result<usize>> {
        let (actions, latency) = {
            let mut plan = self.plan();
            let mut fired = 0;
            let actions: Vec<Option<FaultAction>> = requests
                .iter()
                .map(|request| {
                    let fault = plan.faults.iter_mut().find(|f| f.matches(request))?;
                    fault.times -= 1;
                    fired += 1;
                    Some(fault.action.clone())
                })
                .collect();
            plan.fired += fired;
            plan.faults.retain(|f| f.times > 0);
            (actions, plan.latency)
        };
        if !latency.is_zero() {
            std::thread::sleep(latency);
        }
        let mut passed: Vec<IoRequest<'_>> = Vec::with_capacity(requests.len());
        let mut routes: Vec<Result<usize, i32>> = Vec::with_capacity(requests.len());
        for (request, action) in requests.iter_mut().zip(&actions) {
            let keep = match action {
                Some(FaultAction::Errno(errno)) => {
                    routes.push(Err(*errno));
                    continue;
                }
                Some(FaultAction::Short(bytes)) => (*bytes).min(request.len()),
                None => request.len(),
            };
            routes.push(Ok(passed.len()));
            passed.push(match request {
                IoRequest::Read { offset, buf } => IoRequest::Read { offset: *offset, buf: &mut buf[..keep] },
                IoRequest::Write { offset, buf } => IoRequest::Write { offset: *offset, buf: &buf[..keep] },
            });
        }
        let mut results: Vec<Option<io::Result<usize>>> =
            self.inner.submit(fd, &mut passed).into_iter().map(Some).collect();
        routes
            .into_iter()
            .map(|route| match route {
                Err(errno) => Err(io::Error::from_raw_os_error(errno)),
                Ok(i) => results[i].take().unwrap_or_else(|| Err(io::Error::other("missing result"))),
            })
            .collect()
    }
}
