//! Shared mappings of whole memfds, and the only ways this crate touches their bytes.
//!
//! A [`Mapping`] is `mmap(MAP_SHARED)` of an entire [`Memfd`], read-only or read-write, unmapped on
//! drop. The memory is shared with other processes (the daemon and its clients), which may change any
//! byte at any time. Rust's memory model says nothing about other processes, so this module keeps to
//! rules under which that is harmless:
//!
//! - **Safe byte access never creates references.** [`Mapping::read_at`], [`Mapping::write_at`],
//!   [`Mapping::copy_within`] and [`Mapping::zero`] copy through raw pointers (`ptr::copy`,
//!   `ptr::write_bytes`). No `&[u8]` to shared bytes exists during the copy, so the compiler never
//!   assumes the bytes are immutable or unaliased; the mapping's address escaped through `mmap`, so it
//!   cannot assume that nobody else reads or writes them either. A concurrent write by another process
//!   can at worst make the copy see a mix of old and new bytes, and every bit pattern is a valid `u8`.
//!   Whether the mix *means* anything is the business of the pin protocol ([`crate::protocol`]), which
//!   makes the bytes of a pinned page stable.
//! - **References to shared bytes are `unsafe` to obtain.** [`Mapping::bytes`] and
//!   [`Mapping::bytes_mut`] hand out slices (kernels want them) and make the caller promise that nobody
//!   writes (or, for `bytes_mut`, touches) the range while the slice lives; the pin protocol and the
//!   tail-page ownership rule are how callers keep that promise.
//! - **Atomics over shared memory are references to `Atomic*` types**, which are `UnsafeCell`s inside,
//!   so concurrent writes through them are allowed. They are only handed out for writable mappings:
//!   the standard library allows nothing but small *relaxed loads* on read-only memory, so views of a
//!   read-only mapping (the session table as a client sees it) are built by [`crate::layout`] types
//!   whose public methods only load, with `Relaxed` loads followed by an acquire fence where acquire
//!   ordering is needed.
//!
//! Invariant: `ptr..ptr + len` is a live `MAP_SHARED` mapping of the whole memfd, readable, and
//! writable exactly when `writable`, for the whole life of the `Mapping`. The memfds kvmm maps are
//! sealed against shrinking, so no access inside `len` can fault with `SIGBUS`.

use std::ffi::c_void;
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, compiler_fence};

use rustix::mm::{Advice, MapFlags, ProtFlags};

use crate::error::ShmError;
use crate::memfd::Memfd;

/// Whether a mapping may be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// `PROT_READ`.
    ReadOnly,
    /// `PROT_READ | PROT_WRITE`.
    ReadWrite,
}

/// A `MAP_SHARED` mapping of a whole memfd; unmapped on drop.
pub struct Mapping {
    /// Start of the mapping (page-aligned, as `mmap` returns it).
    ptr: NonNull<u8>,
    /// Length in bytes: the memfd's size when it was mapped.
    len: usize,
    /// Mapped with `PROT_WRITE`.
    writable: bool,
}

// SAFETY: a `Mapping` is an owned address range with no thread affinity; munmap from any thread is
// fine.
unsafe impl Send for Mapping {}
// SAFETY: every `&self` method either copies bytes through raw pointers (races with other threads
// are no worse than races with other processes, see the module doc), hands out atomics (which are
// `Sync`), or is `unsafe` and puts the aliasing obligation on its caller.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all of `memfd` with `MAP_SHARED`.
    ///
    /// A [`Access::ReadWrite`] mapping of a memfd sealed with `F_SEAL_WRITE` or
    /// `F_SEAL_FUTURE_WRITE` fails with `EPERM` ([`crate::ShmErrorKind::PermissionDenied`]).
    pub fn map(memfd: &Memfd, access: Access) -> Result<Mapping, ShmError> {
        if memfd.is_empty() {
            return Err(ShmError::Empty { what: "a memfd" });
        }
        let len =
            usize::try_from(memfd.len()).map_err(|_| ShmError::TooLarge { what: "a memfd", bytes: memfd.len() })?;
        let (prot, writable) = match access {
            Access::ReadOnly => (ProtFlags::READ, false),
            Access::ReadWrite => (ProtFlags::READ | ProtFlags::WRITE, true),
        };
        // SAFETY: a null hint lets the kernel pick a fresh range, so no existing mapping or Rust
        // object is replaced; `len` is the memfd's non-zero size.
        let addr = unsafe { rustix::mm::mmap(ptr::null_mut(), len, prot, MapFlags::SHARED, memfd.as_fd(), 0) }
            .map_err(|e| ShmError::os("mmap", format!("a memfd of {len} bytes ({access:?}, MAP_SHARED)"), e))?;
        let ptr = NonNull::new(addr.cast::<u8>())
            .ok_or(ShmError::TooLarge { what: "a mapping at address zero", bytes: memfd.len() })?;
        Ok(Mapping { ptr, len, writable })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty memfds cannot be mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True for a [`Access::ReadWrite`] mapping.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the mapping, for writing. Writing through it is only allowed on a writable mapping
    /// (debug builds assert this).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        debug_assert!(self.writable, "as_mut_ptr on a read-only mapping");
        self.ptr.as_ptr()
    }

    /// Checks that `offset..offset + len` lies inside the mapping.
    pub fn check_range(&self, what: &'static str, offset: usize, len: usize) -> Result<(), ShmError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(ShmError::OutOfBounds { what, offset: offset as u64, len: len as u64, limit: self.len as u64 }),
        }
    }

    fn check_writable(&self, what: &'static str) -> Result<(), ShmError> {
        if self.writable { Ok(()) } else { Err(ShmError::ReadOnly { what }) }
    }

    /// Faults in the pages under `offset..offset + len` ahead of use (`MADV_POPULATE_WRITE` for
    /// [`Access::ReadWrite`], `MADV_POPULATE_READ` for [`Access::ReadOnly`]), so later accesses do not
    /// take one page fault each. The range is widened outward to whole pages and clamped to the
    /// mapping. Populating for writing allocates memory in the memfd; populate only ranges in use,
    /// never a whole sparse arena.
    pub fn populate(&self, offset: usize, len: usize, access: Access) -> Result<(), ShmError> {
        self.check_range("populate", offset, len)?;
        if access == Access::ReadWrite {
            self.check_writable("populate for writing")?;
        }
        if len == 0 {
            return Ok(());
        }
        let page = rustix::param::page_size();
        let start = offset & !(page - 1);
        let mapped_end = self.len.next_multiple_of(page);
        let end = (offset + len).next_multiple_of(page).min(mapped_end);
        let advice = match access {
            Access::ReadOnly => Advice::LinuxPopulateRead,
            Access::ReadWrite => Advice::LinuxPopulateWrite,
        };
        // SAFETY: `start` is page-aligned and `start..end` lies inside this live mapping (the kernel
        // maps whole pages, so up to `mapped_end`); populating only faults pages in and changes no
        // contents.
        unsafe { rustix::mm::madvise(self.ptr.as_ptr().add(start).cast::<c_void>(), end - start, advice) }.map_err(
            |e| {
                ShmError::os(
                    "madvise(MADV_POPULATE)",
                    format!("bytes {start}..{end} of a {}-byte mapping ({access:?})", self.len),
                    e,
                )
            },
        )
    }

    /// Copies `buf.len()` bytes starting at `offset` into `buf`.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<(), ShmError> {
        self.check_range("read_at", offset, buf.len())?;
        // SAFETY: the source range is inside the live mapping (checked above) and readable; the
        // destination is a distinct Rust buffer of the same length. `ptr::copy` tolerates overlap in
        // case `buf` itself points into this mapping. Concurrent writers: see the module doc.
        unsafe { ptr::copy(self.ptr.as_ptr().add(offset), buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    /// Copies `bytes` into the mapping at `offset`.
    pub fn write_at(&self, offset: usize, bytes: &[u8]) -> Result<(), ShmError> {
        self.check_writable("write_at")?;
        self.check_range("write_at", offset, bytes.len())?;
        // SAFETY: the destination range is inside the live, writable mapping (checked above); no
        // reference to it exists in this crate's safe API; overlap with `bytes` is tolerated by
        // `ptr::copy`. Concurrent readers and writers: see the module doc.
        unsafe { ptr::copy(bytes.as_ptr(), self.ptr.as_ptr().add(offset), bytes.len()) };
        Ok(())
    }

    /// Copies `len` bytes from `src` to `dst` inside the mapping; the ranges may overlap.
    pub fn copy_within(&self, src: usize, dst: usize, len: usize) -> Result<(), ShmError> {
        self.check_writable("copy_within")?;
        self.check_range("copy_within (source)", src, len)?;
        self.check_range("copy_within (destination)", dst, len)?;
        // SAFETY: both ranges are inside the live, writable mapping (checked above); `ptr::copy` is a
        // memmove, so overlap is fine.
        unsafe { ptr::copy(self.ptr.as_ptr().add(src), self.ptr.as_ptr().add(dst), len) };
        Ok(())
    }

    /// Overwrites `offset..offset + len` with zeros. Used to wipe freed frames, so the stores must
    /// happen: they go to memory that escaped through `mmap` (and `black_box` plus a compiler fence
    /// make that explicit), so the compiler cannot drop them as dead. To order the wipe for other
    /// processes, publish it afterwards with a `Release` store (e.g. a "wiped" status).
    pub fn zero(&self, offset: usize, len: usize) -> Result<(), ShmError> {
        self.check_writable("zero")?;
        self.check_range("zero", offset, len)?;
        // SAFETY: the range is inside the live, writable mapping (checked above); zero is a valid
        // `u8`.
        unsafe { ptr::write_bytes(self.ptr.as_ptr().add(offset), 0, len) };
        compiler_fence(Ordering::SeqCst);
        std::hint::black_box(self.ptr);
        Ok(())
    }

    /// Borrows `offset..offset + len` as a slice.
    ///
    /// # Safety
    ///
    /// While the returned slice lives, nobody — no thread of this process, no other process — may
    /// write any byte of the range. For a page of the arena this is what holding a pin guarantees
    /// (the daemon never moves or frees a pinned page); for a tail page, what owning it does.
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> Result<&[u8], ShmError> {
        self.check_range("bytes", offset, len)?;
        // SAFETY: the range is inside the live, readable mapping (checked above) and lives as long
        // as `&self`; the caller guarantees the bytes do not change while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) })
    }

    /// Borrows `offset..offset + len` as a mutable slice; the mapping must be writable.
    ///
    /// # Safety
    ///
    /// While the returned slice lives, nobody else — no other slice or pointer in this process, no
    /// other process — may read or write any byte of the range. In kvmm this holds for a tail page
    /// between its hand-out by `Extend` and the publication of its token count, and for a frame the
    /// daemon owns exclusively (freshly allocated, or under a migration ticket).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: usize, len: usize) -> Result<&mut [u8], ShmError> {
        self.check_writable("bytes_mut")?;
        self.check_range("bytes_mut", offset, len)?;
        // SAFETY: the range is inside the live, writable mapping (checked above) and lives as long
        // as `&self`; the caller guarantees exclusive access while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) })
    }

    /// An atomic view of the 8 bytes at `offset` (a multiple of 8) of a writable mapping.
    ///
    /// Read-only mappings are refused ([`ShmError::ReadOnly`]): a store or read-modify-write through
    /// the view would be undefined behaviour there.
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64, ShmError> {
        self.check_writable("an atomic view")?;
        self.check_atomic("atomic_u64", offset, 8)?;
        // SAFETY: in bounds and aligned (checked; the mapping itself is page-aligned), writable, and
        // alive as long as `&self`. Every bit pattern is a valid `AtomicU64`, whose `UnsafeCell`
        // allows other threads and processes to write it concurrently.
        Ok(unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() })
    }

    /// An atomic view of the 4 bytes at `offset` (a multiple of 4) of a writable mapping; see
    /// [`Mapping::atomic_u64`].
    pub fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32, ShmError> {
        self.check_writable("an atomic view")?;
        self.check_atomic("atomic_u32", offset, 4)?;
        // SAFETY: as in `atomic_u64`, with 4-byte size and alignment.
        Ok(unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU32>() })
    }

    /// Checks bounds and alignment for a `size`-byte view at `offset`.
    pub(crate) fn check_atomic(&self, what: &'static str, offset: usize, size: usize) -> Result<(), ShmError> {
        self.check_range(what, offset, size)?;
        if !offset.is_multiple_of(size) {
            return Err(ShmError::Misaligned { what, offset: offset as u64, align: size as u64 });
        }
        Ok(())
    }

    /// A shared reference to a `T` at `offset`, for the layout types.
    ///
    /// # Safety
    ///
    /// `offset..offset + size_of::<T>() * count` must be in bounds and aligned for `T` (callers
    /// check with [`Mapping::check_range`] and their layout arithmetic), every bit pattern must be a
    /// valid `T`, and every byte of `T` that anyone may write while the reference lives must be
    /// inside an `UnsafeCell` (atomics). If the mapping is read-only, the caller must only ever load
    /// through the reference, with relaxed ordering.
    pub(crate) unsafe fn view_slice<T>(&self, offset: usize, count: usize) -> &[T] {
        debug_assert!(offset.checked_add(size_of::<T>() * count).is_some_and(|end| end <= self.len));
        debug_assert_eq!(offset % align_of::<T>(), 0);
        // SAFETY: the caller guarantees bounds, alignment, validity and the aliasing rules above;
        // the memory lives as long as `&self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset).cast::<T>(), count) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr + len` is the range `mmap` returned and nothing else unmapped it; every
        // reference handed out borrowed `self`, so none outlives this call.
        let result = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len) };
        debug_assert!(result.is_ok(), "munmap of an owned mapping failed: {result:?}");
    }
}

impl fmt::Debug for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapping")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("writable", &self.writable)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memfd::Seals;

    fn memfd(len: u64) -> Result<Memfd, ShmError> {
        Memfd::create("kvmm-mapping-test", len)
    }

    #[test]
    fn empty_memfd_cannot_be_mapped() -> Result<(), ShmError> {
        let err = Mapping::map(&memfd(0)?, Access::ReadOnly).err();
        assert!(matches!(err, Some(ShmError::Empty { .. })), "{err:?}");
        Ok(())
    }

    #[test]
    fn two_mappings_of_one_memfd_see_each_others_writes() -> Result<(), ShmError> {
        let m = memfd(10_000)?;
        let rw = Mapping::map(&m, Access::ReadWrite)?;
        let ro = Mapping::map(&m, Access::ReadOnly)?;
        rw.write_at(9_990, b"0123456789")?;
        let mut buf = [0u8; 10];
        ro.read_at(9_990, &mut buf)?;
        assert_eq!(&buf, b"0123456789");
        assert!(!ro.is_writable());
        Ok(())
    }

    #[test]
    fn accesses_past_the_end_are_refused() -> Result<(), ShmError> {
        let rw = Mapping::map(&memfd(4096)?, Access::ReadWrite)?;
        let mut buf = [0u8; 2];
        assert!(matches!(rw.read_at(4095, &mut buf), Err(ShmError::OutOfBounds { .. })));
        assert!(matches!(rw.write_at(usize::MAX, &buf), Err(ShmError::OutOfBounds { .. })));
        assert!(rw.copy_within(0, 4095, 2).is_err());
        assert!(rw.zero(4000, 97).is_err());
        assert!(rw.populate(4000, 97, Access::ReadWrite).is_err());
        // SAFETY: the call fails its bounds check before any slice exists.
        assert!(unsafe { rw.bytes(1, 4096) }.is_err());
        Ok(())
    }

    #[test]
    fn read_only_mapping_refuses_writes_and_atomic_views() -> Result<(), ShmError> {
        let ro = Mapping::map(&memfd(4096)?, Access::ReadOnly)?;
        assert!(matches!(ro.write_at(0, b"x"), Err(ShmError::ReadOnly { .. })));
        assert!(matches!(ro.zero(0, 1), Err(ShmError::ReadOnly { .. })));
        assert!(matches!(ro.atomic_u64(0), Err(ShmError::ReadOnly { .. })));
        assert!(matches!(ro.populate(0, 1, Access::ReadWrite), Err(ShmError::ReadOnly { .. })));
        ro.populate(0, 4096, Access::ReadOnly)?;
        // SAFETY: the call fails before any slice exists.
        assert!(unsafe { ro.bytes_mut(0, 1) }.is_err());
        Ok(())
    }

    #[test]
    fn copy_within_handles_overlap_and_zero_wipes() -> Result<(), ShmError> {
        let rw = Mapping::map(&memfd(64)?, Access::ReadWrite)?;
        rw.write_at(0, b"abcdefgh")?;
        rw.copy_within(0, 2, 8)?;
        let mut buf = [0u8; 10];
        rw.read_at(0, &mut buf)?;
        assert_eq!(&buf, b"ababcdefgh");
        rw.zero(1, 8)?;
        rw.read_at(0, &mut buf)?;
        assert_eq!(&buf, b"a\0\0\0\0\0\0\0\0h");
        Ok(())
    }

    #[test]
    fn atomic_views_check_alignment_and_share_the_bytes() -> Result<(), ShmError> {
        let rw = Mapping::map(&memfd(64)?, Access::ReadWrite)?;
        assert!(matches!(rw.atomic_u64(4), Err(ShmError::Misaligned { .. })));
        assert!(matches!(rw.atomic_u32(58), Err(ShmError::Misaligned { .. })));
        assert!(matches!(rw.atomic_u64(64), Err(ShmError::OutOfBounds { .. })));
        rw.atomic_u64(8)?.store(0x0102_0304_0506_0708, Ordering::Relaxed);
        rw.atomic_u32(60)?.fetch_add(7, Ordering::Relaxed);
        let mut buf = [0u8; 8];
        rw.read_at(8, &mut buf)?;
        assert_eq!(u64::from_ne_bytes(buf), 0x0102_0304_0506_0708);
        assert_eq!(rw.atomic_u32(60)?.load(Ordering::Relaxed), 7);
        Ok(())
    }

    #[test]
    fn populate_widens_to_pages_and_allocates_only_that_range() -> Result<(), ShmError> {
        let m = memfd(64 << 20)?;
        m.seal(Seals::SHRINK | Seals::GROW)?;
        let rw = Mapping::map(&m, Access::ReadWrite)?;
        rw.populate(5000, 10, Access::ReadWrite)?;
        rw.populate((64 << 20) - 1, 1, Access::ReadWrite)?;
        let stat = rustix::fs::fstat(m.as_fd()).map_err(|e| ShmError::os("fstat", "test", e))?;
        // Two pages touched (512-byte blocks): allocation follows the populated range only.
        let page_blocks = rustix::param::page_size() as u64 / 512;
        assert_eq!(stat.st_blocks as u64, 2 * page_blocks);
        Ok(())
    }

    #[test]
    fn writable_mapping_of_a_future_write_sealed_memfd_is_refused() -> Result<(), ShmError> {
        let m = memfd(4096)?;
        let before = Mapping::map(&m, Access::ReadWrite)?;
        m.seal(Seals::FUTURE_WRITE)?;
        let err = Mapping::map(&m, Access::ReadWrite).err();
        assert_eq!(err.as_ref().map(ShmError::kind), Some(crate::ShmErrorKind::PermissionDenied), "{err:?}");
        before.write_at(0, b"still writable")?;
        let ro = Mapping::map(&m, Access::ReadOnly)?;
        let mut buf = [0u8; 14];
        ro.read_at(0, &mut buf)?;
        assert_eq!(&buf, b"still writable");
        Ok(())
    }
}
