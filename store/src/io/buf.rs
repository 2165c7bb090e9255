//! Memory for direct I/O: [`AlignedBuf`], a zeroed heap block aligned to [`IO_ALIGN`], and
//! [`IoBuffers`], one such block cut into equal chunks that callers lease as [`IoBuffer`]s.
//!
//! O_DIRECT wants the buffer address, the length and the file offset aligned to the device's logical
//! block size; 4096 covers every block size Linux uses for it. The io_uring engine registers an
//! [`IoBuffers`] block once (fixed buffers: the kernel pins the pages at registration instead of on
//! every I/O), so staging pages in leased chunks makes their I/O cheaper.
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

use super::IoError;

/// Alignment of addresses, lengths and offsets of direct I/O.
pub const IO_ALIGN: usize = 4096;

/// A zeroed heap block of `len` bytes aligned to [`IO_ALIGN`] (`len` a positive multiple of it).
pub struct AlignedBuf {
    /// Start of the block; valid for `len` bytes until drop.
    ptr: NonNull<u8>,
    /// Its length, a positive multiple of [`IO_ALIGN`].
    len: usize,
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
        let layout = Layout::from_size_align(len, IO_ALIGN).map_err(|_| IoError::OutOfMemory { bytes: len })?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(IoError::OutOfMemory { bytes: len })?;
        Ok(AlignedBuf { ptr, len })
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
        // SAFETY: allocated in `zeroed` with exactly this layout (which was valid then).
        unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.len, IO_ALIGN)) };
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf").field("ptr", &self.ptr).field("len", &self.len).finish()
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
}
