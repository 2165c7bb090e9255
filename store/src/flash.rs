//! The flash tier's file: one preallocated file (sized to the flash budget, opened with O_DIRECT)
//! whose slots hold sealed pages, written and read in large coalesced I/Os through an
//! [`IoEngine`].
//!
//! A slot is an extent of whole 4 KiB blocks: a 64-byte record header, then the page's ciphertext,
//! then zeros to the block boundary. Pages written in one call get adjacent slots where the free
//! space allows, and adjacent slots travel in one request of up to [`RUN_BYTES`].
//!
//! ```text
//!  slot (a multiple of 4096 bytes)
//!  0        8     9        12       16          24          32       36       40         48        64
//!  +--------+-----+--------+--------+-----------+-----------+--------+--------+----------+---------+------------------+------+
//!  | magic  | ver | zero   | len    | counter   | session   | layer  | block  | zero     | tag     | ciphertext (len) | zero |
//!  | KVMMSLT1| 1  | 3 B    | u32    | u64       | u64       | u32    | u32    | 8 B      | 16 B    |                  | pad  |
//!  +--------+-----+--------+--------+-----------+-----------+--------+--------+----------+---------+------------------+------+
//! ```
//!
//! The header is never trusted: the caller's own index (a [`FlashSlot`] and the page's
//! [`PageId`]) says what a slot must hold, a header that disagrees (or whose reserved bytes are not
//! zero: they are not authenticated) is [`TierError::DataLoss`], and the GCM tag binds the
//! ciphertext to the page, the slot's nonce `(flash, first block, counter)` and the length. A slot's counter comes from [`SlotCounters`] keyed by its first block, so no nonce
//! repeats under any key while the file is open (keys never outlive the daemon).
//!
//! Accounting: `used` is the sum of the extents of the live slots; a failed write returns its
//! extents at once (their counters stay spent). Every call that changes the counters publishes
//! them as it ends, to a [`FlashStats`] that can be read without the file's lock, which a write or
//! a read holds for its whole I/O.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use rustix::fs::{FallocateFlags, Mode, OFlags};

use crate::extent::ExtentAllocator;
use crate::io::{AlignedBuf, EngineKind, IO_ALIGN, IoBuffers, IoEngine, IoError, IoRequest, run_all};
use crate::pace::CpuShare;
use crate::seal::{PageAad, SealError, SealNonce, SlotCounters, TAG_LEN, TIER_FLASH, open_into, seal_into};
use crate::tier::{PageId, PageRead, PageWrite, Tier, TierError, TierKind, TierStats};

/// Bytes of a slot before the ciphertext.
pub const RECORD_HEADER: usize = 64;
/// The most bytes one coalesced request carries.
pub const RUN_BYTES: usize = 1 << 20;
/// Runs sealed ahead of the writers (or batches read ahead of the openers), and the runs of a
/// read batch. With what the writers, readers and openers hold, a write stages at most 14 runs at
/// once (the queue, and each writer's batch of at most this many plus one) and a read 32 (the
/// queue's batches of at most this many runs, and each reader's and opener's batch); staging is a
/// leased chunk where one is free, else a buffer of its own.
const PIPELINE_RUNS: usize = 4;
/// The most threads that seal runs of one write.
const MAX_SEALERS: usize = 2;
/// Threads that write one call's sealed runs. Each writes a batch (what is sealed when it gets
/// there) and waits for all of it, so with one the disk idles between batches and sees only the
/// requests of one; with two, one batch is in flight while the next is gathered and submitted.
const WRITERS: usize = 2;
/// The most threads that read one call's runs, a batch at a time each: two with pread, whose batch
/// is one request at a time (the tier bench's read+open went from 0.82–0.92 of a plain pread of
/// the same bytes with one reader to 1.05–1.11 with two), one with io_uring, whose batch already
/// has its runs in flight together (0.85–0.92 with two against 1.03–1.11 with one).
const MAX_READERS: usize = 2;
/// Threads of a flash file's pool: the writers and a second sealer, or the readers and a second
/// opener. Every job of a call may block until the call's other jobs progress, so the pool must run
/// all of them at once.
const IO_WORKERS: usize = {
    let (writing, reading) = (MAX_SEALERS - 1 + WRITERS, MAX_READERS + 1);
    if writing > reading { writing } else { reading }
};
/// Magic of a slot record.
const MAGIC: [u8; 8] = *b"KVMMSLT1";
/// Version of the record layout.
const RECORD_VERSION: u8 = 1;
/// The largest file a slot id (`u32` block index) can address.
const MAX_CAPACITY: u64 = (u32::MAX as u64) * IO_ALIGN as u64;

/// Where and how a page was written: what the caller keeps to read it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashSlot {
    /// Byte offset in the file (a multiple of 4096).
    pub offset: u64,
    /// Bytes the slot takes (a multiple of 4096).
    pub extent: u64,
    /// The write counter its nonce used.
    pub counter: u64,
    /// Plaintext length.
    pub len: u32,
}

impl FlashSlot {
    fn id(&self) -> u32 {
        (self.offset / IO_ALIGN as u64) as u32
    }
}

/// The flash file; see the module doc.
#[derive(Debug)]
pub struct FlashFile {
    /// The file, O_DIRECT when `direct`.
    file: File,
    /// Where it lives.
    path: PathBuf,
    /// Whether O_DIRECT is in effect (false on filesystems that refuse it; the reason is logged).
    direct: bool,
    /// Carries the I/O.
    engine: Arc<dyn IoEngine>,
    /// Staging chunks (registered with the engine when it is io_uring), if given.
    buffers: Option<Arc<IoBuffers>>,
    /// Free space, in 4 KiB blocks.
    slots: ExtentAllocator,
    /// Write counters per first block.
    counters: SlotCounters,
    /// Counters for stats.
    stats: TierStats,
    /// [`Tier::stats`] as of the end of the last call that changed it.
    published: FlashStats,
    /// Long-lived threads for the writer, the reader and the second sealer or opener of a call
    /// (a thread spawned per call can wait milliseconds for a core; see [`IO_WORKERS`]).
    workers: rayon_core::ThreadPool,
}

impl FlashFile {
    /// Creates (or truncates) the file at `path`, preallocated to `capacity` bytes (rounded down to
    /// 4096), mode 0600, opened with O_DIRECT where the filesystem allows it.
    pub fn create(
        path: &Path,
        capacity: u64,
        engine: Arc<dyn IoEngine>,
        buffers: Option<Arc<IoBuffers>>,
    ) -> Result<FlashFile, TierError> {
        let capacity = capacity / IO_ALIGN as u64 * IO_ALIGN as u64;
        let fail = |what: String| TierError::Create { tier: TierKind::Flash, at: path.display().to_string(), what };
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(fail(format!("the flash budget must be between 4 KiB and {MAX_CAPACITY} bytes")));
        }
        let flags = OFlags::RDWR | OFlags::CREATE | OFlags::TRUNC | OFlags::CLOEXEC;
        let mode = Mode::from_raw_mode(0o600);
        let mut fallback = Vec::new();
        let (fd, direct): (OwnedFd, bool) = match rustix::fs::open(path, flags | OFlags::DIRECT, mode) {
            Ok(fd) => (fd, true),
            Err(rustix::io::Errno::INVAL) => {
                fallback.push("the filesystem refuses O_DIRECT, so pages go through the page cache".to_owned());
                (rustix::fs::open(path, flags, mode).map_err(|e| fail(e.to_string()))?, false)
            }
            Err(e) => return Err(fail(e.to_string())),
        };
        match rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, capacity) {
            Ok(()) => {}
            Err(rustix::io::Errno::NOSPC) => {
                return Err(fail(format!("{capacity} bytes do not fit on its filesystem; lower the flash budget")));
            }
            Err(rustix::io::Errno::OPNOTSUPP) => {
                fallback.push("the filesystem cannot preallocate, so the file is sparse".to_owned());
                rustix::fs::ftruncate(&fd, capacity).map_err(|e| fail(e.to_string()))?;
            }
            Err(e) => return Err(fail(e.to_string())),
        }
        if !fallback.is_empty() {
            tracing::warn!(path = %path.display(), reason = %fallback.join("; "), "flash file degraded");
        }
        let blocks = (capacity / IO_ALIGN as u64) as u32;
        let workers = rayon_core::ThreadPoolBuilder::new()
            .num_threads(IO_WORKERS)
            .thread_name(|i| format!("kvmm-flash-{i}"))
            .build()
            .map_err(|e| fail(format!("starting the flash I/O threads: {e}")))?;
        let stats = TierStats { budget: capacity, ..TierStats::default() };
        Ok(FlashFile {
            file: File::from(fd),
            path: path.to_owned(),
            direct,
            engine,
            buffers,
            slots: ExtentAllocator::with_align(capacity, IO_ALIGN as u64),
            counters: SlotCounters::new(TIER_FLASH, blocks),
            stats,
            published: FlashStats(Arc::new(Mutex::new(stats))),
            workers,
        })
    }

    /// A handle to this file's counters as of the end of its last call ([`Tier::stats`] then),
    /// readable while a call holds the file: a lock that waits for no I/O.
    pub fn stats_handle(&self) -> FlashStats {
        self.published.clone()
    }

    /// Publishes [`Tier::stats`] to the [`FlashStats`] handles.
    fn publish(&self) {
        *lock(&self.published.0) = self.stats();
    }

    /// Where the file lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether O_DIRECT is in effect.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Bytes a slot for a page of `len` bytes takes.
    pub fn extent_for(len: usize) -> u64 {
        ((RECORD_HEADER + len) as u64).div_ceil(IO_ALIGN as u64) * IO_ALIGN as u64
    }

    /// [`Tier::put`]: pages get adjacent slots where the free space allows and adjacent slots go out
    /// as one request. Each page's nonce is drawn first (the counters are this thread's alone);
    /// with several runs, this thread (and a second one when there are three cores or more, see
    /// [`sealer_threads`]) seals the runs while another thread writes what is sealed, each time in
    /// one submission of every run waiting.
    fn write(&mut self, pages: &[PageWrite<'_>]) -> Vec<Result<FlashSlot, TierError>> {
        let mut results: Vec<Option<Result<FlashSlot, TierError>>> = (0..pages.len()).map(|_| None).collect();
        let runs = self.allocate_runs(pages, &mut results);
        // Every page's slot and nonce, run by run. A page refused here (no key, spent slot) gets
        // its error now and zeros in its record.
        let mut plans: Vec<Vec<Planned>> = Vec::with_capacity(runs.len());
        let mut spare: Vec<(u64, u64)> = Vec::new();
        for run in &runs {
            let mut at = 0u64;
            let mut plan = Vec::with_capacity(run.pages.len());
            for p in run.pages.clone() {
                let extent = Self::extent_for(pages[p].bytes.len());
                let offset = run.offset + at;
                let nonce = match plan_nonce(&mut self.counters, &pages[p], offset) {
                    Ok(nonce) => Some(nonce),
                    Err(e) => {
                        // A spent slot stays allocated (retired); any other refusal frees it after the I/O.
                        if !matches!(e, TierError::Seal(SealError::SlotExhausted { .. })) {
                            spare.push((offset, extent));
                        }
                        results[p] = Some(Err(e));
                        None
                    }
                };
                plan.push(Planned { page: p, offset, extent, nonce });
                at += extent;
            }
            plans.push(plan);
        }
        let (engine, fd, buffers) = (self.engine.as_ref(), self.file.as_fd(), self.buffers.as_ref());
        // Seals run `k` into a staging buffer: the buffer (if one could be had) and each page's
        // result. The sealing thread yields its CPU between pages once its share is used up.
        let seal_run = |k: usize, cpu: &mut CpuShare| -> (Option<Staging>, Vec<PageResult>) {
            let mut staging = match staging(buffers, runs[k].bytes as usize) {
                Ok(s) => s,
                Err(e) => {
                    let failed = plans[k].iter().filter(|pl| pl.nonce.is_some());
                    return (None, failed.map(|pl| (pl.page, Err(TierError::Io(e.clone())))).collect());
                }
            };
            let mut out = Vec::with_capacity(plans[k].len());
            for pl in &plans[k] {
                cpu.between();
                let at = (pl.offset - runs[k].offset) as usize;
                let record = &mut staging[at..at + pl.extent as usize];
                let Some(nonce) = pl.nonce else {
                    record.fill(0);
                    continue;
                };
                let sealed = seal_record(nonce, &pages[pl.page], pl.offset, record);
                if sealed.is_err() {
                    record.fill(0);
                }
                out.push((pl.page, sealed));
            }
            (Some(staging), out)
        };
        let write = |batch: &[(usize, Staging)]| -> Vec<Result<(), IoError>> {
            let mut requests: Vec<IoRequest<'_>> = batch
                .iter()
                .map(|(k, staging)| IoRequest::Write {
                    offset: runs[*k].offset,
                    buf: &staging[..runs[*k].bytes as usize],
                })
                .collect();
            run_all(engine, fd, &mut requests)
        };
        let mut outcomes: Vec<Option<Result<(), IoError>>> = (0..runs.len()).map(|_| None).collect();
        let mut sealed_pages: Vec<PageResult> = Vec::with_capacity(pages.len());
        if runs.len() <= 1 {
            let mut staged = Vec::new();
            for k in 0..runs.len() {
                let (staging, out) = seal_run(k, &mut CpuShare::start());
                sealed_pages.extend(out);
                staged.extend(staging.map(|s| (k, s)));
            }
            for ((k, _), outcome) in staged.iter().zip(write(&staged)) {
                outcomes[*k] = Some(outcome);
            }
        } else {
            let sealers = sealer_threads();
            let written = Mutex::new(Vec::new());
            let helped = Mutex::new(Vec::new());
            let (written_ref, helped_ref) = (&written, &helped);
            let seal_every_nth = |first: usize, sealed: mpsc::SyncSender<(usize, Staging)>| {
                let (mut out, mut cpu) = (Vec::new(), CpuShare::start());
                for k in (first..runs.len()).step_by(sealers) {
                    let (staging, pages) = seal_run(k, &mut cpu);
                    out.extend(pages);
                    if let Some(staging) = staging
                        && sealed.send((k, staging)).is_err()
                    {
                        break;
                    }
                }
                out
            };
            let seal_every_nth = &seal_every_nth;
            let (sealed, queue) = mpsc::sync_channel::<(usize, Staging)>(PIPELINE_RUNS);
            let queue = &Mutex::new(queue);
            self.workers.in_place_scope(|scope| {
                for _ in 0..WRITERS {
                    scope.spawn(move |_| {
                        loop {
                            // The queue's lock is held while waiting for the first run, so the
                            // other writer waits for the next batch meanwhile.
                            let batch: Vec<(usize, Staging)> = {
                                let queue = lock(queue);
                                let Ok(first) = queue.recv() else { break };
                                std::iter::once(first).chain(queue.try_iter().take(PIPELINE_RUNS)).collect()
                            };
                            let outcome = write(&batch);
                            lock(written_ref).extend(batch.iter().map(|(k, _)| *k).zip(outcome));
                        }
                    });
                }
                for first in 1..sealers {
                    let sealed = sealed.clone();
                    scope.spawn(move |_| {
                        let out = seal_every_nth(first, sealed);
                        lock(helped_ref).extend(out);
                    });
                }
                sealed_pages.extend(seal_every_nth(0, sealed));
            });
            sealed_pages.extend(gathered(helped));
            for (k, outcome) in gathered(written) {
                outcomes[k] = Some(outcome);
            }
        }
        for (p, sealed) in sealed_pages {
            if sealed.is_err()
                && let Some(pl) = plans.iter().flatten().find(|pl| pl.page == p)
            {
                spare.push((pl.offset, pl.extent));
            }
            results[p] = Some(sealed);
        }
        for (run, outcome) in runs.iter().zip(outcomes) {
            let Some(outcome) = outcome else {
                // Never sealed (no staging buffer): its pages already carry the error.
                self.slots.free(run.offset, run.bytes);
                continue;
            };
            self.stats.write_requests += 1;
            for p in run.pages.clone() {
                let Some(Ok(slot)) = &results[p] else { continue };
                match &outcome {
                    Ok(()) => {
                        self.stats.bytes_in += u64::from(slot.len);
                        self.stats.pages_in += 1;
                        self.stats.pages += 1;
                    }
                    Err(e) => {
                        self.slots.free(slot.offset, slot.extent);
                        self.stats.io_failures += 1;
                        results[p] = Some(Err(TierError::Io(e.clone())));
                    }
                }
            }
        }
        for (offset, extent) in spare {
            self.slots.free(offset, extent);
        }
        results.into_iter().map(|r| r.expect("every page gets a result above")).collect()
    }

    /// Groups consecutive pages into runs of at most [`RUN_BYTES`] (a larger page alone) and gives
    /// each run one extent, or each page its own when the free space is fragmented; pages that find
    /// no room get [`TierError::Full`] in `results`.
    fn allocate_runs(
        &mut self,
        pages: &[PageWrite<'_>],
        results: &mut [Option<Result<FlashSlot, TierError>>],
    ) -> Vec<Run> {
        let mut runs = Vec::new();
        let mut first = 0;
        while first < pages.len() {
            let (mut end, mut bytes) = (first, 0u64);
            while end < pages.len() {
                let need = Self::extent_for(pages[end].bytes.len());
                if end > first && bytes + need > RUN_BYTES as u64 {
                    break;
                }
                bytes += need;
                end += 1;
            }
            if let Some(offset) = self.slots.alloc(bytes) {
                runs.push(Run { pages: first..end, offset, bytes });
            } else {
                for p in first..end {
                    let need = Self::extent_for(pages[p].bytes.len());
                    match self.slots.alloc(need) {
                        Some(offset) => runs.push(Run { pages: p..p + 1, offset, bytes: need }),
                        None => results[p] = Some(Err(self.full(need))),
                    }
                }
            }
            first = end;
        }
        runs
    }

    fn full(&self, need: u64) -> TierError {
        TierError::Full {
            tier: TierKind::Flash,
            need,
            free: self.slots.capacity() - self.slots.used(),
            budget: self.slots.capacity(),
        }
    }

    /// [`Tier::get`]: adjacent slots are read with one request. With several runs, reading and
    /// opening overlap: a second thread reads the first run alone, then the rest in batches, while
    /// this thread and a third authenticate and copy out the runs that have arrived.
    fn read(&mut self, reads: &mut [PageRead<'_, FlashSlot>]) -> Vec<Result<(), TierError>> {
        let mut results: Vec<Option<Result<(), TierError>>> = reads
            .iter()
            .map(|r| {
                (r.out.len() != r.slot.len as usize)
                    .then_some(Err(TierError::BufferLength { got: r.out.len(), len: r.slot.len }))
            })
            .collect();
        let mut order: Vec<usize> = (0..reads.len()).filter(|&i| results[i].is_none()).collect();
        order.sort_by_key(|&i| reads[i].slot.offset);
        let mut runs: Vec<ReadRun> = Vec::new();
        for i in order {
            let slot = reads[i].slot;
            match runs.last_mut() {
                Some(run) if run.offset + run.bytes == slot.offset && run.bytes + slot.extent <= RUN_BYTES as u64 => {
                    run.members.push(i);
                    run.bytes += slot.extent;
                }
                _ => runs.push(ReadRun { members: vec![i], offset: slot.offset, bytes: slot.extent }),
            }
        }
        let (engine, fd, buffers) = (self.engine.as_ref(), self.file.as_fd(), self.buffers.as_ref());
        // Reads a batch of runs; each comes back with its staging buffer, or the error.
        let read = |batch: &[usize]| -> Vec<(usize, Result<Staging, IoError>)> {
            let mut staged: Vec<(usize, Result<Staging, IoError>)> =
                batch.iter().map(|&k| (k, staging(buffers, runs[k].bytes as usize))).collect();
            let outcomes = {
                let mut requests: Vec<IoRequest<'_>> = staged
                    .iter_mut()
                    .filter_map(|(k, s)| {
                        let buf = s.as_mut().ok()?;
                        Some(IoRequest::Read { offset: runs[*k].offset, buf: &mut buf[..runs[*k].bytes as usize] })
                    })
                    .collect();
                run_all(engine, fd, &mut requests)
            };
            let mut outcomes = outcomes.into_iter();
            for (_, s) in staged.iter_mut() {
                if s.is_ok()
                    && let Some(Err(e)) = outcomes.next()
                {
                    *s = Err(e);
                }
            }
            staged
        };
        // Each run's reads, taken out of `reads` so that two threads can open different runs.
        let mut taken: Vec<Option<&mut PageRead<'_, FlashSlot>>> = reads.iter_mut().map(Some).collect();
        let jobs: Vec<Mutex<RunReads<'_, '_>>> = runs
            .iter()
            .map(|run| {
                let members = run.members.iter().filter_map(|&i| Some((i, taken[i].take()?))).collect();
                Mutex::new(members)
            })
            .collect();
        // Opens the pages of arrived runs; returns each page's result and the counters it moved.
        // The opening thread yields its CPU between pages once its share is used up.
        let open_batch = |batch: Vec<(usize, Result<Staging, IoError>)>, cpu: &mut CpuShare| -> Opened {
            let mut stats = TierStats::default();
            let mut out = Vec::new();
            for (k, staged) in batch {
                let run = &runs[k];
                let mut members = lock(&jobs[k]);
                stats.read_requests += 1;
                let staging = match staged {
                    Ok(s) => s,
                    Err(e) => {
                        stats.io_failures += members.len() as u64;
                        out.extend(members.iter().map(|(i, _)| (*i, Err(TierError::Io(e.clone())))));
                        continue;
                    }
                };
                for (i, read) in members.iter_mut() {
                    cpu.between();
                    let at = (read.slot.offset - run.offset) as usize;
                    let opened = open_record(read, &staging[at..at + read.slot.extent as usize]);
                    match opened {
                        Ok(()) => {
                            stats.pages_out += 1;
                            stats.bytes_out += u64::from(read.slot.len);
                        }
                        Err(_) => stats.auth_failures += 1,
                    }
                    out.push((*i, opened));
                }
            }
            (out, stats)
        };
        let mut opened: Vec<Opened> = Vec::new();
        if runs.len() <= 1 {
            let all: Vec<usize> = (0..runs.len()).collect();
            opened.push(open_batch(read(&all), &mut CpuShare::start()));
        } else {
            let (done, queue) = mpsc::sync_channel::<Vec<(usize, Result<Staging, IoError>)>>(PIPELINE_RUNS);
            let queue = Mutex::new(queue);
            let helped = Mutex::new(Vec::new());
            let helped_ref = &helped;
            // Two openers take arrived batches from one queue.
            let open_all = || {
                let (mut mine, mut cpu) = (Vec::new(), CpuShare::start());
                loop {
                    let batch = lock(&queue).recv();
                    let Ok(batch) = batch else { break };
                    mine.push(open_batch(batch, &mut cpu));
                }
                mine
            };
            let open_all = &open_all;
            // The runs not yet claimed by a reader.
            let unclaimed = &Mutex::new(0usize);
            self.workers.in_place_scope(|scope| {
                let runs_n = runs.len();
                let readers = if engine.kind() == EngineKind::Sync { MAX_READERS } else { 1 };
                for _ in 0..readers {
                    let done = done.clone();
                    scope.spawn(move |_| {
                        loop {
                            // The first run alone, so opening starts early; then batches of a few runs.
                            let batch: Vec<usize> = {
                                let mut next = lock(unclaimed);
                                let take = if *next == 0 { 1 } else { PIPELINE_RUNS.min(runs_n - *next) };
                                let batch = (*next..*next + take).collect();
                                *next += take;
                                batch
                            };
                            if batch.is_empty() || done.send(read(&batch)).is_err() {
                                break;
                            }
                        }
                    });
                }
                drop(done);
                scope.spawn(move |_| {
                    let out = open_all();
                    lock(helped_ref).extend(out);
                });
                opened.extend(open_all());
            });
            opened.extend(gathered(helped));
        }
        for (pages, stats) in opened {
            for (i, r) in pages {
                results[i] = Some(r);
            }
            let s = &mut self.stats;
            s.read_requests += stats.read_requests;
            s.io_failures += stats.io_failures;
            s.pages_out += stats.pages_out;
            s.bytes_out += stats.bytes_out;
            s.auth_failures += stats.auth_failures;
        }
        results.into_iter().map(|r| r.expect("every read gets a result above")).collect()
    }
}

impl Tier for FlashFile {
    type Slot = FlashSlot;

    fn kind(&self) -> TierKind {
        TierKind::Flash
    }

    fn stats(&self) -> TierStats {
        TierStats { used: self.slots.used(), ..self.stats }
    }

    fn put(&mut self, pages: &[PageWrite<'_>]) -> Vec<Result<FlashSlot, TierError>> {
        let written = self.write(pages);
        self.publish();
        written
    }

    fn get(&mut self, reads: &mut [PageRead<'_, FlashSlot>]) -> Vec<Result<(), TierError>> {
        let read = self.read(reads);
        self.publish();
        read
    }

    /// Its counter stays spent.
    fn free(&mut self, slot: FlashSlot) {
        self.slots.free(slot.offset, slot.extent);
        self.stats.pages = self.stats.pages.saturating_sub(1);
        self.publish();
    }

    /// Punches the slot's blocks out of the file, so the sealed bytes are gone from the device too
    /// (the file keeps its size).
    fn discard(&mut self, slot: FlashSlot) -> Result<(), TierError> {
        self.free(slot);
        rustix::fs::fallocate(
            &self.file,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            slot.offset,
            slot.extent,
        )
        .map_err(|e| {
            TierError::Io(IoError::Os {
                verb: "hole punch",
                offset: slot.offset,
                len: slot.extent as usize,
                source: e.into(),
            })
        })
    }
}

/// A [`FlashFile`]'s counters as its last finished call left them ([`FlashFile::stats_handle`]).
#[derive(Clone, Debug)]
pub struct FlashStats(Arc<Mutex<TierStats>>);

impl FlashStats {
    /// The counters. A write's slots count from the end of the write, so a caller that records
    /// the slots it was given before reading this sees them here.
    pub fn get(&self) -> TierStats {
        *lock(&self.0)
    }
}

/// Locks a mutex whose holders never leave it half-updated (a panic in the pool ends the call).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the pool's jobs of a call gathered, once the call's scope has ended.
fn gathered<T>(m: Mutex<Vec<T>>) -> Vec<T> {
    m.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Threads that seal one write's runs: one per core the writer leaves, at most [`MAX_SEALERS`].
/// On two cores a second sealer only takes CPU time from the writer and the kernel (measured with
/// `cargo bench -p kvmm-store --bench tiers`: io_uring seal+write fell from 0.80–0.91 of a plain
/// write with one sealer to 0.71–0.86 with two).
fn sealer_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    cores.saturating_sub(1).clamp(1, MAX_SEALERS)
}

/// A staging buffer of at least `len` bytes: a leased chunk when one is free and large enough.
fn staging(buffers: Option<&Arc<IoBuffers>>, len: usize) -> Result<Staging, IoError> {
    if let Some(buffers) = buffers
        && len <= buffers.chunk_len()
        && let Some(chunk) = buffers.lease()
    {
        return Ok(Staging::Leased(chunk));
    }
    AlignedBuf::zeroed(len.next_multiple_of(IO_ALIGN)).map(Staging::Owned)
}

/// The reads of one run (index into the caller's reads, and the read), handed to whichever thread
/// opens the run.
type RunReads<'r, 'a> = Vec<(usize, &'r mut PageRead<'a, FlashSlot>)>;

/// What opening a batch of runs gave: each read's result, and the counters it moved.
type Opened = (Vec<(usize, Result<(), TierError>)>, TierStats);

/// A page of a `write` call (its index) and what became of it.
type PageResult = (usize, Result<FlashSlot, TierError>);

/// One page of a `write` call: where its slot is and the nonce drawn for it (or why none could be).
#[derive(Debug)]
struct Planned {
    page: usize,
    offset: u64,
    extent: u64,
    /// `None`: refused at planning; the page's result already says why.
    nonce: Option<SealNonce>,
}

/// Draws the nonce for writing `page` at `offset`, after the checks that need no bytes.
fn plan_nonce(counters: &mut SlotCounters, page: &PageWrite<'_>, offset: u64) -> Result<SealNonce, TierError> {
    let p = page.page;
    if page.key.is_none() {
        return Err(TierError::NoKey { tier: TierKind::Flash, session: p.session, layer: p.layer, block: p.block });
    }
    u32::try_from(page.bytes.len()).map_err(|_| SealError::TooLong { len: page.bytes.len() })?;
    Ok(counters.next((offset / IO_ALIGN as u64) as u32)?)
}

/// Writes the record of `page` (header, ciphertext, zero padding) into `record`, the slot's bytes
/// at `offset`, sealed with `nonce`.
fn seal_record(nonce: SealNonce, page: &PageWrite<'_>, offset: u64, record: &mut [u8]) -> Result<FlashSlot, TierError> {
    let p = page.page;
    let key = page.key.ok_or(TierError::NoKey {
        tier: TierKind::Flash,
        session: p.session,
        layer: p.layer,
        block: p.block,
    })?;
    let len = u32::try_from(page.bytes.len()).map_err(|_| SealError::TooLong { len: page.bytes.len() })?;
    let slot = FlashSlot { offset, extent: record.len() as u64, counter: nonce.counter(), len };
    let aad = aad_of(page.page, &slot);
    let (header, body) = record.split_at_mut(RECORD_HEADER);
    let (cipher, pad) = body.split_at_mut(page.bytes.len());
    pad.fill(0);
    let tag = seal_into(key, nonce, &aad, page.bytes, cipher)?;
    Header { len, counter: slot.counter, page: page.page, tag }.encode(header);
    Ok(slot)
}

/// Consecutive pages of one `write` call sharing one extent and one request.
#[derive(Debug)]
struct Run {
    pages: std::ops::Range<usize>,
    offset: u64,
    bytes: u64,
}

/// Adjacent slots of one `read` call, read with one request.
#[derive(Debug)]
struct ReadRun {
    /// Indices of the reads, in slot order.
    members: Vec<usize>,
    offset: u64,
    bytes: u64,
}

/// A staging buffer: a leased (possibly registered) chunk or an owned block.
#[derive(Debug)]
enum Staging {
    Leased(crate::io::IoBuffer),
    Owned(AlignedBuf),
}

impl std::ops::Deref for Staging {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Staging::Leased(b) => b,
            Staging::Owned(b) => b,
        }
    }
}

impl std::ops::DerefMut for Staging {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Staging::Leased(b) => b,
            Staging::Owned(b) => b,
        }
    }
}

fn aad_of(page: PageId, slot: &FlashSlot) -> PageAad {
    PageAad {
        session: page.session,
        layer: page.layer,
        block: page.block,
        tier: TIER_FLASH,
        counter: slot.counter,
        len: slot.len,
    }
}

/// Checks `record` (a slot's bytes) against what the caller's index says it holds and opens it into
/// `read.out`.
fn open_record(read: &mut PageRead<'_, FlashSlot>, record: &[u8]) -> Result<(), TierError> {
    let page = read.page;
    let loss = |why| TierError::DataLoss {
        tier: TierKind::Flash,
        session: page.session,
        layer: page.layer,
        block: page.block,
        why,
    };
    let Some(key) = read.key else {
        read.out.fill(0);
        return Err(TierError::NoKey {
            tier: TierKind::Flash,
            session: page.session,
            layer: page.layer,
            block: page.block,
        });
    };
    let Some(header) = Header::decode(&record[..RECORD_HEADER]) else {
        read.out.fill(0);
        return Err(loss("the slot holds no record"));
    };
    if header.len != read.slot.len || header.counter != read.slot.counter || header.page != page {
        read.out.fill(0);
        return Err(loss("the slot's record names another page or write"));
    }
    let nonce = SealNonce::new(TIER_FLASH, read.slot.id(), read.slot.counter)?;
    let cipher = &record[RECORD_HEADER..RECORD_HEADER + read.slot.len as usize];
    open_into(key, nonce, &aad_of(page, &read.slot), cipher, read.out, header.tag).map_err(|e| match e {
        SealError::Tag { .. } => loss("the authentication tag does not match"),
        other => TierError::Seal(other),
    })
}

/// Decodes a slot's record header as the reader does and encodes it again: `None` where the reader
/// finds no record in `bytes`.
///
/// Only for the `flash_records` fuzz target, which checks that the header codec (private otherwise)
/// never panics and that every header the reader accepts is the one encoding of what it decoded.
#[doc(hidden)]
pub fn reencode_record_header(bytes: &[u8]) -> Option<[u8; RECORD_HEADER]> {
    let header = Header::decode(bytes)?;
    let mut out = [0u8; RECORD_HEADER];
    header.encode(&mut out);
    Some(out)
}

/// The record header (module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    len: u32,
    counter: u64,
    page: PageId,
    tag: [u8; TAG_LEN],
}

impl Header {
    fn encode(&self, out: &mut [u8]) {
        out[..RECORD_HEADER].fill(0);
        out[0..8].copy_from_slice(&MAGIC);
        out[8] = RECORD_VERSION;
        out[12..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..24].copy_from_slice(&self.counter.to_le_bytes());
        out[24..32].copy_from_slice(&self.page.session.to_le_bytes());
        out[32..36].copy_from_slice(&self.page.layer.to_le_bytes());
        out[36..40].copy_from_slice(&self.page.block.to_le_bytes());
        out[48..64].copy_from_slice(&self.tag);
    }

    /// The header in `bytes` (at least 64), or `None` when the magic or version is wrong or a
    /// reserved byte is not zero. The reserved bytes are not authenticated (the AAD holds only the
    /// page, counter and length), so accepting any value there would let a slot be changed without
    /// the read noticing; requiring zeros makes [`Header::encode`] the one encoding of a header.
    fn decode(bytes: &[u8]) -> Option<Header> {
        if bytes.len() < RECORD_HEADER
            || bytes[0..8] != MAGIC
            || bytes[8] != RECORD_VERSION
            || bytes[9..12] != [0; 3]
            || bytes[40..48] != [0; 8]
        {
            return None;
        }
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        Some(Header {
            len: u32_at(12),
            counter: u64_at(16),
            page: PageId { session: u64_at(24), layer: u32_at(32), block: u32_at(36) },
            tag: bytes[48..64].try_into().expect("16 bytes"),
        })
    }
}

#[cfg(test)]
mod tests;
