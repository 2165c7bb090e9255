//! [`LockedBox`]: one value in its own locked, non-dumpable, wiped-on-drop mapping.
//!
//! Session keys and the AES key schedules derived from them must never reach swap, a core dump or a
//! forked child, and must not linger in freed memory. A `LockedBox<T>` owns one anonymous private
//! mapping (the size of `T` rounded up to whole pages, at least one page) that is, from creation:
//!
//! - `mlock`ed: never written to swap. A refused `mlock` (`RLIMIT_MEMLOCK` too small) is an error,
//!   never a silent fallback to unlocked memory;
//! - `madvise(MADV_DONTDUMP)`ed: left out of core dumps;
//! - `madvise(MADV_WIPEONFORK)`ed: a child created by `fork` sees zeros there, not the key.
//!
//! The value is constructed in place ([`LockedBox::new_with`] hands the initializer a
//! `&mut MaybeUninit<T>` inside the mapping), so a secret written by the initializer touches no
//! unlocked memory on the way in. On drop the value is dropped in place, then every byte of the
//! mapping is overwritten with zeros by volatile writes the compiler cannot elide, then the mapping is
//! unlocked and unmapped.
//!
//! Invariants: `region.ptr..region.ptr + region.len` is a live, readable and writable, locked mapping
//! owned by exactly one `LockedRegion` until its drop; in a `LockedBox`, a valid `T` lives at
//! `region.ptr` from the end of `new_with` until `drop`.
//!
//! Costs: every box locks at least one page (4 KiB on x86-64) against `RLIMIT_MEMLOCK`.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};
use std::ptr::{self, NonNull};

use rustix::mm::{Advice, MapFlags, ProtFlags};
use zeroize::Zeroize;

use super::SealError;

/// The largest alignment a `LockedBox` supports: the smallest page size Linux uses. Mappings start
/// on a page boundary, so any `T` aligned to at most this fits at the start.
const MAX_ALIGN: usize = 4096;

/// A `T` in its own locked, non-dumpable mapping that is wiped when the box is dropped.
pub struct LockedBox<T> {
    /// The value, at the start of `region`; initialized from the end of `new_with` until `drop`.
    value: NonNull<T>,
    /// The mapping that holds `value`. Dropped (wiped, unlocked, unmapped) after `value` is dropped.
    region: LockedRegion,
    /// The box owns a `T` (for drop check and auto traits).
    _owns: PhantomData<T>,
}

// SAFETY: a `LockedBox<T>` owns its `T` exclusively, like `Box<T>`; moving the box to another thread
// moves the `T`, and the mapping has no thread affinity (munmap from any thread is fine).
unsafe impl<T: Send> Send for LockedBox<T> {}
// SAFETY: `&LockedBox<T>` only hands out `&T`, so sharing the box is sharing a `&T`.
unsafe impl<T: Sync> Sync for LockedBox<T> {}

impl<T> LockedBox<T> {
    /// Maps and locks memory for a `T`, then lets `init` construct the value in place.
    ///
    /// `init` receives the uninitialized slot inside the locked mapping and must return the
    /// reference that [`MaybeUninit::write`] gave it (that is how the box knows the slot is
    /// initialized). If `init` fails or panics, the mapping is wiped and unmapped and nothing is
    /// dropped; a value `init` wrote before failing is leaked, not dropped (its bytes are wiped).
    ///
    /// # Errors
    ///
    /// [`SealError::KeyMemory`] when the memory cannot be locked (`RLIMIT_MEMLOCK`),
    /// [`SealError::KeyMapping`] when it cannot be mapped or advised; whatever `init` returns.
    ///
    /// # Panics
    ///
    /// If `init` returns a reference to anything but the slot it was given.
    pub fn new_with<F>(init: F) -> Result<LockedBox<T>, SealError>
    where
        F: for<'a> FnOnce(&'a mut MaybeUninit<T>) -> Result<&'a mut T, SealError>,
    {
        const { assert!(align_of::<T>() <= MAX_ALIGN, "LockedBox supports alignments up to 4096 bytes") };
        let region = LockedRegion::map(size_of::<T>())?;
        let slot_ptr = region.ptr.cast::<MaybeUninit<T>>();
        // SAFETY: the region is a fresh, writable mapping of at least `size_of::<T>()` bytes (one
        // page at least, so also for a zero-sized `T`), page-aligned and so aligned for `T` (checked
        // above); nothing else refers to it. `MaybeUninit<T>` may hold any bytes.
        let slot = unsafe { &mut *slot_ptr.as_ptr() };
        let written: *const T = init(slot)?;
        assert!(
            ptr::eq(written, slot_ptr.as_ptr().cast::<T>()),
            "LockedBox::new_with: the initializer must return the reference MaybeUninit::write gave it"
        );
        Ok(LockedBox { value: slot_ptr.cast::<T>(), region, _owns: PhantomData })
    }

    /// A box holding `value`, moved in. Only for values that are not secret (the move may leave a
    /// copy on the stack); secrets are written in place with [`LockedBox::new_with`].
    ///
    /// # Errors
    ///
    /// As [`LockedBox::new_with`].
    pub fn new(value: T) -> Result<LockedBox<T>, SealError> {
        LockedBox::new_with(|slot| Ok(slot.write(value)))
    }

    /// Bytes of locked memory this box holds (whole pages), counted against `RLIMIT_MEMLOCK`.
    pub fn locked_bytes(&self) -> usize {
        self.region.len
    }

    /// Address of the mapping (for diagnostics and tests).
    pub fn as_ptr(&self) -> *const T {
        self.value.as_ptr()
    }
}

impl<T> Deref for LockedBox<T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: `value` points at a valid `T` for the life of the box (module invariant), and the
        // returned reference borrows the box.
        unsafe { self.value.as_ref() }
    }
}

impl<T> DerefMut for LockedBox<T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes the access exclusive.
        unsafe { self.value.as_mut() }
    }
}

impl<T> Drop for LockedBox<T> {
    fn drop(&mut self) {
        // SAFETY: `value` holds a valid `T` that nothing else owns, and it is never used again:
        // `region` (dropped right after this) only wipes and unmaps the bytes.
        unsafe { ptr::drop_in_place(self.value.as_ptr()) };
    }
}

impl<T> fmt::Debug for LockedBox<T> {
    /// Never prints the value: it is presumably secret.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LockedBox<{}>({} bytes locked, ..)", std::any::type_name::<T>(), self.region.len)
    }
}

/// An anonymous private mapping, locked and advised at creation, wiped and unmapped on drop.
struct LockedRegion {
    /// Start of the mapping (page-aligned).
    ptr: NonNull<u8>,
    /// Length in bytes: a non-zero multiple of the page size.
    len: usize,
}

impl LockedRegion {
    /// Maps at least `bytes` bytes (at least one page), locks them and marks them
    /// `MADV_DONTDUMP` and `MADV_WIPEONFORK`.
    fn map(bytes: usize) -> Result<LockedRegion, SealError> {
        let page = rustix::param::page_size();
        let len = bytes.max(1).checked_next_multiple_of(page).ok_or(SealError::KeyMapping {
            call: "mmap",
            bytes,
            source: std::io::Error::from(rustix::io::Errno::NOMEM),
        })?;
        // SAFETY: a null hint lets the kernel pick a fresh range, so no existing mapping or Rust
        // object is replaced; `len` is non-zero.
        let addr = unsafe {
            rustix::mm::mmap_anonymous(ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE)
        }
        .map_err(|e| SealError::KeyMapping { call: "mmap", bytes: len, source: e.into() })?;
        let ptr = NonNull::new(addr.cast::<u8>()).ok_or(SealError::KeyMapping {
            call: "mmap",
            bytes: len,
            source: std::io::Error::from(rustix::io::Errno::NOMEM),
        })?;
        // From here on, dropping `region` unmaps the range (and wipes the still-zero pages).
        let region = LockedRegion { ptr, len };
        for advice in [Advice::LinuxDontDump, Advice::LinuxWipeOnFork] {
            // SAFETY: `ptr..ptr + len` is the private anonymous mapping just created and owned by
            // `region`; these advices change dump and fork behaviour only, never the contents.
            unsafe { rustix::mm::madvise(region.ptr.as_ptr().cast::<c_void>(), len, advice) }
                .map_err(|e| SealError::KeyMapping { call: advice_name(advice), bytes: len, source: e.into() })?;
        }
        // SAFETY: as above; mlock faults the pages in and pins them, it changes no contents.
        unsafe { rustix::mm::mlock(region.ptr.as_ptr().cast::<c_void>(), len) }.map_err(|e| {
            let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock);
            SealError::KeyMemory { bytes: len, memlock_limit: limit.current, source: e.into() }
        })?;
        Ok(region)
    }
}

fn advice_name(advice: Advice) -> &'static str {
    match advice {
        Advice::LinuxDontDump => "madvise(MADV_DONTDUMP)",
        Advice::LinuxWipeOnFork => "madvise(MADV_WIPEONFORK)",
        _ => "madvise",
    }
}

impl Drop for LockedRegion {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr + len` is this region's live, writable mapping; no reference into it
        // outlives the owner being dropped. Viewing it as `MaybeUninit<u8>` makes no claim about the
        // bytes (the value that lived there may have left padding or moved-from bytes).
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<MaybeUninit<u8>>(), self.len) };
        // Volatile writes followed by a compiler fence: the wipe cannot be dropped as dead stores.
        bytes.zeroize();
        // SAFETY: the range is this region's mapping; unlocking changes no contents. munmap would
        // drop the lock as well; unlocking first keeps the accounting explicit.
        let unlocked = unsafe { rustix::mm::munlock(self.ptr.as_ptr().cast::<c_void>(), self.len) };
        debug_assert!(unlocked.is_ok(), "munlock of an owned locked mapping failed: {unlocked:?}");
        // SAFETY: `ptr..ptr + len` is the range `mmap` returned and nothing else unmapped it; the
        // value in it (if any) has been dropped and no reference to it remains.
        let unmapped = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len) };
        debug_assert!(unmapped.is_ok(), "munmap of an owned mapping failed: {unmapped:?}");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// The `VmFlags` line of the `/proc/self/smaps` entry whose address range contains `addr`.
    fn vm_flags_of(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps is readable");
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((start, end)) = first.split_once('-')
                && let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16))
            {
                inside = (start..end).contains(&addr);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.split_whitespace().map(str::to_owned).collect();
            }
        }
        panic!("no smaps entry with VmFlags contains {addr:#x}");
    }

    #[test]
    fn new_box_is_locked_dontdump_and_wipeonfork_in_smaps() -> Result<(), SealError> {
        let b = LockedBox::new([7u8; 100])?;
        let flags = vm_flags_of(b.as_ptr() as usize);
        assert!(flags.iter().any(|f| f == "lo"), "not locked: {flags:?}");
        assert!(flags.iter().any(|f| f == "dd"), "not excluded from core dumps: {flags:?}");
        assert!(flags.iter().any(|f| f == "wf"), "not wiped on fork: {flags:?}");
        assert_eq!(b.locked_bytes(), rustix::param::page_size());
        assert_eq!(b[99], 7);
        Ok(())
    }

    #[test]
    fn value_is_constructed_in_the_mapping_and_dropped_once() -> Result<(), SealError> {
        struct Counted(Arc<AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let drops = Arc::new(AtomicUsize::new(0));
        let mut seen = 0usize;
        let b = LockedBox::new_with(|slot| {
            seen = slot.as_ptr() as usize;
            Ok(slot.write(Counted(Arc::clone(&drops))))
        })?;
        assert_eq!(b.as_ptr() as usize, seen);
        assert_eq!(seen % rustix::param::page_size(), 0, "the value starts the mapping");
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(b);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        Ok(())
    }

    #[test]
    fn failing_initializer_unmaps_and_returns_its_error() {
        let err = LockedBox::<u64>::new_with(|_| Err(SealError::Random { source: std::io::Error::other("test") }));
        assert!(matches!(err, Err(SealError::Random { .. })), "{err:?}");
    }

    #[test]
    fn zero_sized_and_multi_page_values_get_whole_pages() -> Result<(), SealError> {
        let page = rustix::param::page_size();
        assert_eq!(LockedBox::new(())?.locked_bytes(), page);
        let big = LockedBox::new_with(|slot: &mut MaybeUninit<[u64; 1025]>| Ok(slot.write([1; 1025])))?;
        assert_eq!(big.locked_bytes(), 3 * page);
        assert_eq!(big.iter().sum::<u64>(), 1025);
        Ok(())
    }

    #[test]
    fn debug_output_does_not_show_the_value() -> Result<(), SealError> {
        let b = LockedBox::new(0x5EC2E7u32)?;
        let shown = format!("{b:?}");
        assert!(shown.contains("bytes locked"), "{shown}");
        assert!(!shown.contains(&0x5EC2E7u32.to_string()), "{shown}");
        Ok(())
    }

    #[test]
    fn lock_beyond_rlimit_memlock_names_the_limit() {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
        let Some(limit) = limit.and_then(|l| usize::try_from(l).ok()) else {
            eprintln!("RLIMIT_MEMLOCK is unlimited here; nothing to refuse");
            return;
        };
        // More than the whole limit, so the lock fails unless the process may ignore the limit.
        match LockedRegion::map(limit + rustix::param::page_size()) {
            Ok(_) => eprintln!("mlock above RLIMIT_MEMLOCK succeeded (CAP_IPC_LOCK?); nothing to check"),
            Err(err) => {
                assert!(matches!(err, SealError::KeyMemory { .. }), "{err:?}");
                let msg = err.to_string();
                eprintln!("{msg}");
                assert!(msg.contains("RLIMIT_MEMLOCK") && msg.contains("LimitMEMLOCK="), "{msg}");
                assert!(msg.contains(&(limit + rustix::param::page_size()).to_string()), "{msg}");
            }
        }
    }
}
