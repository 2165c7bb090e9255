//! Memory for direct I/O: [`AlignedBuf`], a zeroed block aligned to [`IO_ALIGN`], and
//! [`IoBuffers`], one such block cut into equal chunks that callers lease as [`IoBuffer`]s.
//!
//! O_DIRECT wants the buffer address, the length and the file offset aligned to the device's logical
//! block size; 4096 covers every block size Linux uses for it. The io_uring engine registers an
//! [`IoBuffers`] block once (fixed buffers: the kernel pins the pages at registration instead of on
//! every I/O), so staging pages in leased chunks makes their I/O cheaper.
//!
//! A block of [`HUGE_PAGE`] bytes or more is its own anonymous mapping, aligned to 2 MiB and
//! advised `MADV_HUGEPAGE`, so that where transparent huge pages are available (`enabled` set to
//! `always` or `madvise`) a 1 MiB request is one physically contiguous segment instead of 256
//! pages. On the development VM that made an O_DIRECT read of 64 MiB in 1 MiB requests 1.7× faster
//! (1.35 → 2.3 GB/s with pread, 1.4 → 2.4 with io_uring): the virtual disk pays per segment.
//! Without huge pages the block is an ordinary mapping and works as before.
//!
//! Invariants: a chunk is leased to at most one [`IoBuffer`] at a time (the free list holds each
//! index at most once, and a lease returns its index on drop), so the `&mut [u8]` an [`IoBuffer`]
//! hands out never aliases another lease; the block lives as long as any lease or engine holds the
//! `Arc`.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use rustix::mm::{Advice, MapFlags, ProtFlags};

use super::IoError;

/// Alignment of addresses, lengths and offsets of direct I/O.
pub const IO_ALIGN: usize = 4096;

/// Alignment and size of a transparent huge page on x86-64 and (4 KiB granule) aarch64: blocks of
/// at least this many bytes are mapped to take them.
pub const HUGE_PAGE: usize = 2 << 20;

/// A zeroed block of `len` bytes aligned to [`IO_ALIGN`] (`len` a positive multiple of it); from
/// [`HUGE_PAGE`] bytes up, a mapping of its own that may take huge pages (see the module docs).
pub struct AlignedBuf {
    /// Start of the block; valid for `len` bytes until drop.
    ptr: NonNull<u8>,
    /// Its length, a positive multiple of [`IO_ALIGN`].
    len: usize,
    /// Bytes of the block's own mapping (`len` rounded up to [`HUGE_PAGE`]), or 0 for a block
    /// from the allocator.
    mapped: usize,
}

// SAFETY: the block is uniquely owned heap memory; moving the owner between threads is like moving a
// `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed block of `len` bytes; `len` must be a positive multiple of [`IO_ALIGN`].
    pub fn zeroed(len: usize) -> Result<Self, IoError> {
        if len == 0 || !len.is_multiple_of(IO_ALIGN) {
            return Err(IoError::Unaligned { what: "buffer length", value: len as u64 });
        }
        if len >= HUGE_PAGE {
            return Self::mapped(len);
        }
        let layout = Layout::from_size_align(len, IO_ALIGN).map_err(|_| IoError::OutOfMemory { bytes: len })?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(IoError::OutOfMemory { bytes: len })?;
        Ok(AlignedBuf { ptr, len, mapped: 0 })
    }

    /// A block of its own mapping: `len` rounded up to [`HUGE_PAGE`], placed on a [`HUGE_PAGE`]
    /// boundary (a larger mapping, its slack unmapped) and advised `MADV_HUGEPAGE` before any page
    /// is touched. Anonymous memory reads as zeros.
    fn mapped(len: usize) -> Result<Self, IoError> {
        let oom = || IoError::OutOfMemory { bytes: len };
        let mapped = len.checked_next_multiple_of(HUGE_PAGE).ok_or_else(oom)?;
        let reserve = mapped.checked_add(HUGE_PAGE).ok_or_else(oom)?;
        // SAFETY: a fresh private anonymous mapping at an address the kernel picks.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                reserve,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|_| oom())?;
        let start = (base as usize).next_multiple_of(HUGE_PAGE);
        let (head, tail) = (start - base as usize, reserve - (start - base as usize) - mapped);
        // SAFETY: the head `base..start` and the tail after `start + mapped` lie inside the mapping
        // just made and nothing refers to them. A failed unmap only leaves slack mapped.
        unsafe {
            if head > 0 {
                let _ = rustix::mm::munmap(base, head);
            }
            if tail > 0 {
                let _ = rustix::mm::munmap((start + mapped) as *mut std::ffi::c_void, tail);
            }
        }
        // SAFETY: `start..start + mapped` is inside the mapping. Refused (no THP in this kernel) it
        // stays a mapping of small pages.
        let _ = unsafe { rustix::mm::madvise(start as *mut std::ffi::c_void, mapped, Advice::LinuxHugepage) };
        let ptr = NonNull::new(start as *mut u8).ok_or_else(oom)?;
        Ok(AlignedBuf { ptr, len, mapped })
    }

    /// The block's address, for registration with the kernel.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: blocks have a positive length.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid, initialized (zeroed) memory of `len` bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped > 0 {
            // SAFETY: `ptr..ptr + mapped` is the block's own mapping (made in `mapped`), and `&mut
            // self` at drop means no slice of it is alive.
            let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.mapped) };
            return;
        }
        // SAFETY: allocated in `zeroed` with exactly this layout (which was valid then).
        unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.len, IO_ALIGN)) };
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("mapped", &self.mapped)
            .finish()
    }
}

/// One aligned block cut into `count` chunks of `chunk` bytes, leased one at a time.
pub struct IoBuffers {
    /// The block; never accessed through `Deref` while chunks are leased (only through the raw
    /// pointer, chunk by chunk).
    block: AlignedBuf,
    /// Bytes per chunk, a positive multiple of [`IO_ALIGN`].
    chunk: usize,
    /// Indices of the chunks not leased, each at most once.
    free: Mutex<Vec<usize>>,
}

impl IoBuffers {
    /// `count` chunks of `chunk` bytes (a positive multiple of [`IO_ALIGN`]), all free.
    pub fn new(chunk: usize, count: usize) -> Result<Arc<Self>, IoError> {
        if chunk == 0 || !chunk.is_multiple_of(IO_ALIGN) {
            return Err(IoError::Unaligned { what: "chunk length", value: chunk as u64 });
        }
        let total = chunk.checked_mul(count.max(1)).ok_or(IoError::OutOfMemory { bytes: usize::MAX })?;
        let block = AlignedBuf::zeroed(total)?;
        Ok(Arc::new(IoBuffers { block, chunk, free: Mutex::new((0..count.max(1)).rev().collect()) }))
    }

    /// Bytes per chunk.
    pub fn chunk_len(&self) -> usize {
        self.chunk
    }

    /// Number of chunks.
    pub fn count(&self) -> usize {
        self.block.len() / self.chunk
    }

    /// The whole block's address range, for registration: `(start, len)`.
    pub fn region(&self) -> (*const u8, usize) {
        (self.block.as_ptr(), self.block.len())
    }

    /// Whether `buf` lies entirely inside the block (so a registered engine may use its fixed-buffer
    /// operations for it).
    pub fn contains(&self, buf: &[u8]) -> bool {
        let (start, len) = (self.block.as_ptr() as usize, self.block.len());
        let (b, n) = (buf.as_ptr() as usize, buf.len());
        b >= start && b.saturating_add(n) <= start + len
    }

    /// Leases a free chunk, or `None` when all are leased.
    pub fn lease(self: &Arc<Self>) -> Option<IoBuffer> {
        let index = self.free.lock().unwrap_or_else(PoisonError::into_inner).pop()?;
        Some(IoBuffer { pool: Arc::clone(self), index })
    }

    /// Chunks not leased now.
    pub fn available(&self) -> usize {
        self.free.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

impl fmt::Debug for IoBuffers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoBuffers")
            .field("chunk", &self.chunk)
            .field("count", &self.count())
            .field("available", &self.available())
            .finish()
    }
}

/// One leased chunk of an [`IoBuffers`] block; returned to the pool on drop.
pub struct IoBuffer {
    pool: Arc<IoBuffers>,
    /// The chunk, leased to this value alone.
    index: usize,
}

impl IoBuffer {
    fn ptr(&self) -> *mut u8 {
        self.pool.block.ptr.as_ptr().wrapping_add(self.index * self.pool.chunk)
    }
}

impl Deref for IoBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: chunk `index < count` lies inside the block, which the `Arc` keeps alive; the lease
        // is exclusive (module invariant), so no `&mut` to it exists elsewhere.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.pool.chunk) }
    }
}

impl DerefMut for IoBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, and `&mut self` makes this the only reference to the chunk.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.pool.chunk) }
    }
}

impl Drop for IoBuffer {
    fn drop(&mut self) {
        self.pool.free.lock().unwrap_or_else(PoisonError::into_inner).push(self.index);
    }
}

impl fmt::Debug for IoBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoBuffer").field("index", &self.index).field("len", &self.pool.chunk).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_aligned_disjoint_and_come_back_on_drop() {
        let pool = IoBuffers::new(2 * IO_ALIGN, 3).unwrap();
        let mut a = pool.lease().unwrap();
        let mut b = pool.lease().unwrap();
        let c = pool.lease().unwrap();
        assert!(pool.lease().is_none(), "three chunks, three leases");
        for buf in [&a, &b, &c] {
            assert_eq!(buf.as_ptr() as usize % IO_ALIGN, 0);
            assert_eq!(buf.len(), 2 * IO_ALIGN);
            assert!(pool.contains(buf));
        }
        a.fill(1);
        b.fill(2);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2) && c.iter().all(|&x| x == 0));
        drop(b);
        assert_eq!(pool.available(), 1);
        let again = pool.lease().unwrap();
        assert_eq!(again.len(), 2 * IO_ALIGN);
        assert!(!pool.contains(&[0u8; 4][..]));
    }

    #[test]
    fn unaligned_lengths_are_refused() {
        assert!(matches!(AlignedBuf::zeroed(100), Err(IoError::Unaligned { .. })));
        assert!(matches!(AlignedBuf::zeroed(0), Err(IoError::Unaligned { .. })));
        assert!(matches!(IoBuffers::new(4097, 2), Err(IoError::Unaligned { .. })));
    }

    /// The `VmFlags` line of the mapping that holds `addr`, from `/proc/self/smaps`.
    fn vm_flags_of(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().and_then(|r| r.split_once('-'));
            if let Some((Ok(a), Ok(b))) =
                range.map(|(a, b)| (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)))
            {
                inside = (a..b).contains(&addr);
            } else if inside && line.starts_with("VmFlags:") {
                return line.to_string();
            }
        }
        panic!("no mapping holds {addr:#x}")
    }

    #[test]
    fn large_blocks_are_zeroed_mappings_on_huge_page_boundaries_advised_for_huge_pages() {
        for len in [HUGE_PAGE, 3 * HUGE_PAGE + 5 * IO_ALIGN] {
            let mut buf = AlignedBuf::zeroed(len).unwrap();
            assert_eq!(buf.as_ptr() as usize % HUGE_PAGE, 0, "{len} bytes start on a huge page boundary");
            assert_eq!(buf.len(), len);
            assert!(buf.iter().all(|&x| x == 0));
            buf.fill(7);
            assert!(buf.iter().all(|&x| x == 7));
            let flags = vm_flags_of(buf.as_ptr() as usize);
            assert!(flags.split_whitespace().any(|f| f == "hg"), "MADV_HUGEPAGE is set: {flags}");
        }
        let small = AlignedBuf::zeroed(HUGE_PAGE - IO_ALIGN).unwrap();
        assert_eq!(small.as_ptr() as usize % IO_ALIGN, 0);
        assert!(small.iter().all(|&x| x == 0));
    }
}
