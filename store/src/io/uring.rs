//! [`UringEngine`]: io_uring on a thread of its own.
//!
//! Callers hand a batch to the ring thread and block until it answers. The thread pushes as many
//! requests as the submission queue holds, enters the kernel once for all of them (submit and wait
//! for at least one completion), collects completions and refills until the batch is done, then
//! answers; one ring serves every caller, several batches at once (a batch handed over while
//! others are in flight joins them at once: the caller writes an eventfd whose read the ring keeps
//! in flight, which wakes the thread; each batch is answered when its own last request completes).
//! Requests whose buffer lies inside the registered [`IoBuffers`] block use the fixed-buffer
//! opcodes (no page pinning per I/O).
//!
//! Safety rests on the engine contract (`io/mod.rs`): [`IoEngine::submit`] holds the borrows of the
//! batch's buffers until the ring thread has reaped every completion of that batch, so the kernel
//! never touches a buffer after the caller gets it back. If the ring thread could no longer answer
//! (it died with requests in flight), `submit` aborts the process rather than return buffers the
//! kernel may still write.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use io_uring::{IoUring, opcode, types};

use super::{EngineKind, IoBuffers, IoEngine, IoError, IoRequest};

/// The largest transfer one submission carries; longer requests complete short and `run_all`
/// resumes them.
const MAX_TRANSFER: usize = 1 << 30;

/// One request, with its buffer as a raw pointer valid until the batch is answered.
#[derive(Clone, Copy)]
struct Op {
    read: bool,
    ptr: *mut u8,
    len: u32,
    offset: u64,
}

/// A batch in flight to the ring thread.
struct Job {
    fd: RawFd,
    ops: Vec<Op>,
    reply: mpsc::SyncSender<Vec<io::Result<usize>>>,
}

// SAFETY: the pointers in `ops` are only dereferenced by the kernel while the submitting thread
// blocks in `submit`, holding the borrows they came from (module doc).
unsafe impl Send for Job {}

/// io_uring on its own thread; see the module doc.
#[derive(Debug)]
pub struct UringEngine {
    /// Batches for the ring thread; dropped first on drop, which ends the thread.
    jobs: Option<mpsc::Sender<Job>>,
    /// Written after each batch is handed over: the ring keeps a read of it in flight, so a
    /// thread waiting in the kernel for other batches' completions wakes up to take the new one.
    wake: Arc<OwnedFd>,
    /// The ring thread, joined on drop.
    thread: Option<JoinHandle<()>>,
    /// The registered block, kept alive as long as the ring may use it.
    registered: Option<Arc<IoBuffers>>,
    /// Submission queue entries.
    depth: u32,
}

impl UringEngine {
    /// A ring of `depth` entries with `buffers` registered as its fixed buffer 0 (if given); checks
    /// the ring with a no-op before returning. Fails with [`IoError::Unavailable`] and the reason
    /// (io_uring disabled, not supported, or the registration refused).
    pub fn new(depth: u32, buffers: Option<Arc<IoBuffers>>) -> Result<Self, IoError> {
        let unavailable =
            |what: &str, e: io::Error| IoError::Unavailable { engine: EngineKind::IoUring, reason: explain(what, &e) };
        let mut ring = IoUring::new(depth.max(1)).map_err(|e| unavailable("creating a ring", e))?;
        if let Some(block) = &buffers {
            let (start, len) = block.region();
            let iov = libc::iovec { iov_base: start as *mut libc::c_void, iov_len: len };
            // SAFETY: the block stays allocated while the ring exists: this engine holds its `Arc`
            // and drops it only after the ring thread (which owns the ring) has exited.
            unsafe { ring.submitter().register_buffers(&[iov]) }
                .map_err(|e| unavailable(&format!("registering {} MiB of I/O buffers", len >> 20), e))?;
        }
        // SAFETY: a no-op carries no buffer.
        unsafe { ring.submission().push(&opcode::Nop::new().build().user_data(u64::MAX)) }
            .map_err(|_| unavailable("queueing a no-op", io::Error::from_raw_os_error(libc::EBUSY)))?;
        ring.submit_and_wait(1).map_err(|e| unavailable("submitting a no-op", e))?;
        let nop = ring.completion().next().map(|c| c.result());
        if nop != Some(0) {
            let e = io::Error::from_raw_os_error(nop.map_or(libc::EIO, |r| -r));
            return Err(unavailable("completing a no-op", e));
        }
        let fixed = buffers.as_ref().map(|b| {
            let (start, len) = b.region();
            (start as usize, len)
        });
        let wake = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
            .map_err(|e| unavailable("creating an eventfd", e.into()))?;
        let wake = Arc::new(wake);
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread_wake = Arc::clone(&wake);
        let thread = std::thread::Builder::new()
            .name("kvmm-io-uring".into())
            .spawn(move || serve(ring, queue, fixed, &thread_wake))
            .map_err(|e| unavailable("starting the ring thread", e))?;
        Ok(UringEngine { jobs: Some(jobs), wake, thread: Some(thread), registered: buffers, depth })
    }

    /// Whether a block is registered as fixed buffers.
    pub fn has_registered_buffers(&self) -> bool {
        self.registered.is_some()
    }

    /// Submission queue entries.
    pub fn depth(&self) -> u32 {
        self.depth
    }
}

/// A sentence for a refused io_uring step, naming the usual cause of each errno.
fn explain(what: &str, e: &io::Error) -> String {
    let cause = match e.raw_os_error() {
        Some(libc::EPERM) => " (io_uring is disabled by kernel.io_uring_disabled or a seccomp filter)",
        Some(libc::ENOSYS) => " (this kernel has no io_uring)",
        Some(libc::ENOMEM) => " (locked memory would exceed RLIMIT_MEMLOCK: raise LimitMEMLOCK=)",
        _ => "",
    };
    format!("{what} failed: {e}{cause}")
}

impl IoEngine for UringEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::IoUring
    }

    fn submit(&self, fd: BorrowedFd<'_>, requests: &mut [IoRequest<'_>]) -> Vec<io::Result<usize>> {
        if requests.is_empty() {
            return Vec::new();
        }
        let ops = requests
            .iter_mut()
            .map(|request| match request {
                IoRequest::Read { offset, buf } => {
                    Op { read: true, ptr: buf.as_mut_ptr(), len: buf.len().min(MAX_TRANSFER) as u32, offset: *offset }
                }
                IoRequest::Write { offset, buf } => Op {
                    read: false,
                    ptr: buf.as_ptr().cast_mut(),
                    len: buf.len().min(MAX_TRANSFER) as u32,
                    offset: *offset,
                },
            })
            .collect();
        let (reply, answer) = mpsc::sync_channel(1);
        let job = Job { fd: fd.as_raw_fd(), ops, reply };
        let Some(jobs) = &self.jobs else { return stopped(requests.len()) };
        if jobs.send(job).is_err() {
            // The thread is gone and never saw this batch: nothing is in flight.
            return stopped(requests.len());
        }
        // Cannot fail while the counter is far from its maximum; the thread also takes the batch
        // at its next completion without it.
        let _ = rustix::io::write(self.wake.as_fd(), &1u64.to_ne_bytes());
        match answer.recv() {
            Ok(results) => results,
            Err(_) => {
                // The thread took the batch and died: the kernel may still write into the callers'
                // buffers, so no caller may get them back.
                eprintln!("kvmm: the io_uring thread died with I/O in flight; aborting to keep memory safe");
                std::process::abort()
            }
        }
    }
}

/// Results for a batch the ring thread cannot take.
fn stopped(n: usize) -> Vec<io::Result<usize>> {
    (0..n).map(|_| Err(io::Error::other("the io_uring thread has stopped"))).collect()
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A batch the ring thread has taken and not yet answered.
struct Active {
    job: Job,
    results: Vec<Option<io::Result<usize>>>,
    /// Ops pushed to the submission queue so far (in order).
    next: usize,
    /// Ops pushed and not yet completed.
    in_flight: usize,
}

impl Active {
    fn done(&self) -> bool {
        self.next == self.job.ops.len() && self.in_flight == 0
    }
}

/// How many bits of a completion's user data name the op inside its batch (the rest name the
/// batch's slot among those in flight).
const OP_BITS: u32 = 32;
/// The user data of the read of the wake eventfd.
const WAKE: u64 = u64::MAX;

/// Queues a read of the eventfd `wake` into `counter`; whether the queue took it.
fn arm_wake(ring: &mut IoUring, wake: RawFd, counter: &mut [u8; 8]) -> bool {
    let entry = opcode::Read::new(types::Fd(wake), counter.as_mut_ptr(), 8).build().user_data(WAKE);
    // SAFETY: `counter` lives in `serve`, which does not free it while this read is in flight.
    unsafe { ring.submission().push(&entry) }.is_ok()
}

/// The ring thread: runs every batch it is handed, several at once (a batch handed over while
/// others are in flight joins them at once, woken by the eventfd `wake`, so one caller's I/O never
/// waits for another's to finish), and answers each as soon as its last op completes; stops when
/// every sender is gone and nothing is in flight.
fn serve(mut ring: IoUring, jobs: mpsc::Receiver<Job>, fixed: Option<(usize, usize)>, wake: &OwnedFd) {
    // On the heap, so it can be leaked if the ring breaks with the read in flight (below).
    let mut counter = Box::new([0u8; 8]);
    let mut armed = false;
    let mut active: Vec<Option<Active>> = Vec::new();
    let mut open = true;
    let mut failures = 0u32;
    loop {
        let idle = active.iter().all(Option::is_none);
        if idle {
            // Nothing in flight but the wake-up read: wait for work (or the end).
            match jobs.recv() {
                Ok(job) => take(&mut active, job),
                Err(_) => break,
            }
        }
        while open {
            match jobs.try_recv() {
                Ok(job) => take(&mut active, job),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => open = false,
            }
        }
        if !armed {
            armed = arm_wake(&mut ring, wake.as_raw_fd(), &mut counter);
        }
        {
            // Every batch in turn (by slot), as many ops as the queue holds.
            let mut queue = ring.submission();
            'push: for (slot, a) in active.iter_mut().enumerate() {
                let Some(a) = a else { continue };
                while a.next < a.job.ops.len() {
                    if queue.is_full() {
                        break 'push;
                    }
                    let data = ((slot as u64) << OP_BITS) | a.next as u64;
                    let entry = entry(a.job.fd, a.job.ops[a.next], fixed).user_data(data);
                    // SAFETY: the buffer of this op stays valid until its batch is answered (module
                    // doc), which happens only after its completion is reaped below.
                    if unsafe { queue.push(&entry) }.is_err() {
                        break 'push;
                    }
                    a.next += 1;
                    a.in_flight += 1;
                }
            }
        }
        match ring.submit_and_wait(1) {
            Ok(_) => failures = 0,
            Err(e) => {
                // EINTR, EAGAIN and EBUSY are transient: unconsumed entries stay queued and are
                // submitted by the next call. Anything else repeating means the ring itself is broken
                // while the kernel may hold buffers, so the process cannot go on safely.
                failures += 1;
                let transient = matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY));
                if !transient && failures > 1000 {
                    eprintln!("kvmm: io_uring_enter keeps failing ({e}) with I/O in flight; aborting");
                    std::process::abort();
                }
            }
        }
        for cqe in ring.completion() {
            if cqe.user_data() == WAKE {
                armed = false;
                continue;
            }
            let (slot, op) = ((cqe.user_data() >> OP_BITS) as usize, (cqe.user_data() & ((1 << OP_BITS) - 1)) as usize);
            let Some(Some(a)) = active.get_mut(slot) else { continue };
            let Some(result) = a.results.get_mut(op) else { continue };
            let r = cqe.result();
            *result = Some(if r < 0 { Err(io::Error::from_raw_os_error(-r)) } else { Ok(r as usize) });
            a.in_flight -= 1;
        }
        for entry in active.iter_mut() {
            if entry.as_ref().is_some_and(Active::done)
                && let Some(a) = entry.take()
            {
                let results = a
                    .results
                    .into_iter()
                    .map(|r| r.unwrap_or_else(|| Err(io::Error::other("no completion"))))
                    .collect();
                // The caller waits for this answer; if it is gone, nobody holds the buffers any more.
                let _ = a.job.reply.send(results);
            }
        }
    }
    if !armed {
        return;
    }
    // The wake-up read may still be queued or in flight into `counter`: complete it before
    // `counter` goes. Should the ring no longer complete it, the 8 bytes are leaked instead.
    let _ = rustix::io::write(wake, &1u64.to_ne_bytes());
    for _ in 0..1000 {
        let _ = ring.submit_and_wait(1);
        if ring.completion().any(|cqe| cqe.user_data() == WAKE) {
            return;
        }
    }
    std::mem::forget(counter);
}

/// Puts `job` in the first free slot of `active`.
fn take(active: &mut Vec<Option<Active>>, job: Job) {
    let n = job.ops.len();
    let a = Active { job, results: (0..n).map(|_| None).collect(), next: 0, in_flight: 0 };
    match active.iter_mut().find(|e| e.is_none()) {
        Some(free) => *free = Some(a),
        None => active.push(Some(a)),
    }
}

/// The submission entry of one op: the fixed-buffer opcode when its buffer lies in the registered
/// block.
fn entry(fd: RawFd, op: Op, fixed: Option<(usize, usize)>) -> io_uring::squeue::Entry {
    let fd = types::Fd(fd);
    let in_block = fixed.is_some_and(|(start, len)| {
        let p = op.ptr as usize;
        p >= start && p + op.len as usize <= start + len
    });
    match (op.read, in_block) {
        (true, true) => opcode::ReadFixed::new(fd, op.ptr, op.len, 0).offset(op.offset).build(),
        (true, false) => opcode::Read::new(fd, op.ptr, op.len).offset(op.offset).build(),
        (false, true) => opcode::WriteFixed::new(fd, op.ptr, op.len, 0).offset(op.offset).build(),
        (false, false) => opcode::Write::new(fd, op.ptr, op.len).offset(op.offset).build(),
    }
}
