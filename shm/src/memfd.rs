//! Anonymous shared-memory files (`memfd_create`) and their seals.
//!
//! Every piece of memory kvmm shares between the daemon and its clients is a [`Memfd`]: the arena of a
//! trust domain, a session table, a client region. A memfd is created sparse (`ftruncate` allocates
//! nothing; pages are allocated on first touch), always close-on-exec, and always with sealing allowed,
//! so that the daemon can fix its size (`F_SEAL_SHRINK | F_SEAL_GROW`: a client can never truncate it and
//! make the daemon's accesses fault with `SIGBUS`) and, for daemon-written memory, forbid new writable
//! mappings (`F_SEAL_FUTURE_WRITE`) before handing it out.
//!
//! Invariant: `len` is the file size observed at creation (or at [`Memfd::from_fd`]). Memfds that kvmm
//! shares are sealed against size changes, so it stays true for them; for an unsealed memfd it is only
//! as current as the last check.

use std::fmt;
use std::ops::BitOr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};

use crate::error::ShmError;

/// A memfd: an anonymous, sealable shared-memory file.
#[derive(Debug)]
pub struct Memfd {
    /// The open file; closed on drop. Mappings made from it stay valid after it is closed.
    fd: OwnedFd,
    /// File size in bytes (see the module invariant).
    len: u64,
}

impl Memfd {
    /// Creates a memfd of `len` bytes, close-on-exec and sealable. `name` shows up in
    /// `/proc/<pid>/fd` and `/proc/<pid>/maps` as `/memfd:<name>`; it has no other meaning.
    ///
    /// The file is sparse: no memory is allocated until pages are touched.
    pub fn create(name: &str, len: u64) -> Result<Memfd, ShmError> {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| ShmError::os("memfd_create", format!("memfd {name:?}"), e))?;
        rustix::fs::ftruncate(&fd, len)
            .map_err(|e| ShmError::os("ftruncate", format!("the new memfd {name:?} (to {len} bytes)"), e))?;
        Ok(Memfd { fd, len })
    }

    /// Adopts a memfd received from elsewhere (e.g. over the fd socket).
    ///
    /// Reads its size with `fstat` and checks that it supports seals (`F_GET_SEALS` fails on anything
    /// that is not a memfd or shmem file), so a wrong fd is caught here rather than at first use.
    pub fn from_fd(fd: OwnedFd) -> Result<Memfd, ShmError> {
        let stat = rustix::fs::fstat(&fd).map_err(|e| ShmError::os("fstat", "a received fd", e))?;
        match rustix::fs::fcntl_get_seals(&fd) {
            Ok(_) => {}
            Err(rustix::io::Errno::INVAL) => {
                return Err(ShmError::NotAMemfd { what: "a shared-memory file" });
            }
            Err(e) => return Err(ShmError::os("fcntl(F_GET_SEALS)", "a received fd", e)),
        }
        let len = u64::try_from(stat.st_size)
            .map_err(|_| ShmError::NotAMemfd { what: "a shared-memory file (its size is negative)" })?;
        Ok(Memfd { fd, len })
    }

    /// Adds `seals` (`F_ADD_SEALS`). Seals only ever accumulate; adding one already present is a
    /// no-op. Fails with `EPERM` once [`Seals::SEAL`] is set, and with `EBUSY` when adding
    /// [`Seals::WRITE`] while a writable shared mapping exists.
    pub fn seal(&self, seals: Seals) -> Result<(), ShmError> {
        rustix::fs::fcntl_add_seals(&self.fd, SealFlags::from_bits_retain(seals.0)).map_err(|e| {
            ShmError::os("fcntl(F_ADD_SEALS)", format!("a memfd of {} bytes (adding {seals:?})", self.len), e)
        })
    }

    /// The seals currently set (`F_GET_SEALS`).
    pub fn seals(&self) -> Result<Seals, ShmError> {
        rustix::fs::fcntl_get_seals(&self.fd)
            .map(|s| Seals(s.bits()))
            .map_err(|e| ShmError::os("fcntl(F_GET_SEALS)", self.describe(), e))
    }

    /// Checks that `required` seals are all set; `what` names the memfd in the error.
    pub fn require_seals(&self, what: &'static str, required: Seals) -> Result<(), ShmError> {
        let present = self.seals()?;
        let missing = Seals(required.0 & !present.0);
        if missing.is_empty() { Ok(()) } else { Err(ShmError::MissingSeals { what, missing, present }) }
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a memfd of zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Borrows the fd (to map it or send it).
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The file this memfd is, as `(device, inode)` (`fstat`): handles on one file give the same
    /// pair, and no other file shares it while this one lives (a mapping keeps it alive too).
    pub fn identity(&self) -> Result<(u64, u64), ShmError> {
        let stat = rustix::fs::fstat(&self.fd).map_err(|e| ShmError::os("fstat", self.describe(), e))?;
        #[allow(clippy::unnecessary_cast)] // `st_dev` and `st_ino` are not u64 on every target.
        Ok((stat.st_dev as u64, stat.st_ino as u64))
    }

    /// A second handle on the same file (`F_DUPFD_CLOEXEC`).
    pub fn try_clone(&self) -> Result<Memfd, ShmError> {
        let fd = self.fd.try_clone().map_err(|e| ShmError::Os {
            call: "fcntl(F_DUPFD_CLOEXEC)",
            what: self.describe(),
            source: e,
        })?;
        Ok(Memfd { fd, len: self.len })
    }

    /// Gives up ownership of the fd.
    pub fn into_owned_fd(self) -> OwnedFd {
        self.fd
    }

    /// Releases the memory behind `offset..offset + len` (`fallocate(PUNCH_HOLE | KEEP_SIZE)`): the
    /// range reads back as zeros and no longer counts against memory. The size does not change, so
    /// this works on memfds sealed against shrinking; the kernel refuses it (`EPERM`) on memfds
    /// sealed with [`Seals::WRITE`] or [`Seals::FUTURE_WRITE`].
    pub fn punch_hole(&self, offset: u64, len: u64) -> Result<(), ShmError> {
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > self.len) {
            return Err(ShmError::OutOfBounds { what: "punch_hole", offset, len, limit: self.len });
        }
        rustix::fs::fallocate(&self.fd, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len).map_err(
            |e| ShmError::os("fallocate(PUNCH_HOLE)", format!("{} (range {offset}+{len})", self.describe()), e),
        )
    }

    fn describe(&self) -> String {
        format!("a memfd of {} bytes", self.len)
    }
}

impl AsFd for Memfd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A set of memfd seals (`F_SEAL_*`), as a plain bit set.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Seals(u32);

impl Seals {
    /// No seals.
    pub const NONE: Seals = Seals(0);
    /// `F_SEAL_SEAL`: no further seals may be added.
    pub const SEAL: Seals = Seals(0x0001);
    /// `F_SEAL_SHRINK`: the file may not shrink.
    pub const SHRINK: Seals = Seals(0x0002);
    /// `F_SEAL_GROW`: the file may not grow.
    pub const GROW: Seals = Seals(0x0004);
    /// `F_SEAL_WRITE`: no writes at all, not even through existing mappings.
    pub const WRITE: Seals = Seals(0x0008);
    /// `F_SEAL_FUTURE_WRITE`: no new writable mappings and no `write(2)`; mappings that were writable
    /// before the seal keep working (the daemon's own mapping).
    pub const FUTURE_WRITE: Seals = Seals(0x0010);

    /// The raw `F_SEAL_*` bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Seals from raw `F_SEAL_*` bits (unknown bits are kept).
    pub const fn from_bits(bits: u32) -> Seals {
        Seals(bits)
    }

    /// `self` with the seals of `other` added.
    pub const fn union(self, other: Seals) -> Seals {
        Seals(self.0 | other.0)
    }

    /// True when every seal in `other` is also in `self`.
    pub const fn contains(self, other: Seals) -> bool {
        self.0 & other.0 == other.0
    }

    /// True when no seal is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl BitOr for Seals {
    type Output = Seals;

    fn bitor(self, rhs: Seals) -> Seals {
        Seals(self.0 | rhs.0)
    }
}

impl fmt::Debug for Seals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [(Seals, &str); 5] = [
            (Seals::SEAL, "SEAL"),
            (Seals::SHRINK, "SHRINK"),
            (Seals::GROW, "GROW"),
            (Seals::WRITE, "WRITE"),
            (Seals::FUTURE_WRITE, "FUTURE_WRITE"),
        ];
        let mut rest = self.0;
        let mut first = true;
        for (seal, name) in NAMES {
            if self.contains(seal) {
                if !first {
                    f.write_str(" | ")?;
                }
                f.write_str(name)?;
                first = false;
                rest &= !seal.0;
            }
        }
        if rest != 0 {
            if !first {
                f.write_str(" | ")?;
            }
            write!(f, "{rest:#x}")?;
            first = false;
        }
        if first {
            f.write_str("(none)")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_bits_match_the_kernel_constants() {
        assert_eq!(Seals::SEAL.bits(), SealFlags::SEAL.bits());
        assert_eq!(Seals::SHRINK.bits(), SealFlags::SHRINK.bits());
        assert_eq!(Seals::GROW.bits(), SealFlags::GROW.bits());
        assert_eq!(Seals::WRITE.bits(), SealFlags::WRITE.bits());
        assert_eq!(Seals::FUTURE_WRITE.bits(), SealFlags::FUTURE_WRITE.bits());
    }

    #[test]
    fn seals_combine_and_print_by_name() {
        let s = Seals::SHRINK | Seals::GROW;
        assert!(s.contains(Seals::SHRINK));
        assert!(!s.contains(Seals::SHRINK | Seals::SEAL));
        assert_eq!(format!("{s:?}"), "SHRINK | GROW");
        assert_eq!(format!("{:?}", Seals::NONE), "(none)");
        assert_eq!(format!("{:?}", Seals::from_bits(0x41)), "SEAL | 0x40");
    }

    #[test]
    fn created_memfd_is_sparse_sized_and_accepts_seals() -> Result<(), ShmError> {
        let m = Memfd::create("kvmm-test", 1 << 30)?;
        assert_eq!(m.len(), 1 << 30);
        let stat = rustix::fs::fstat(m.as_fd()).map_err(|e| ShmError::os("fstat", "test", e))?;
        assert_eq!(stat.st_size, 1 << 30);
        assert_eq!(stat.st_blocks, 0, "a fresh memfd allocates nothing");
        assert_eq!(m.seals()?, Seals::NONE);
        m.seal(Seals::SHRINK | Seals::GROW)?;
        assert_eq!(m.seals()?, Seals::SHRINK | Seals::GROW);
        Ok(())
    }

    #[test]
    fn from_fd_reads_the_size_and_rejects_non_memfds() -> Result<(), ShmError> {
        let m = Memfd::create("kvmm-test", 12345)?;
        let again = Memfd::from_fd(m.try_clone()?.into_owned_fd())?;
        assert_eq!(again.len(), 12345);

        let (pipe_r, _pipe_w) = rustix::pipe::pipe().map_err(|e| ShmError::os("pipe", "test", e))?;
        let err = Memfd::from_fd(pipe_r).err();
        assert!(matches!(err, Some(ShmError::NotAMemfd { .. })), "{err:?}");
        Ok(())
    }

    #[test]
    fn sealed_memfd_refuses_to_change_size() -> Result<(), ShmError> {
        let m = Memfd::create("kvmm-test", 8192)?;
        m.seal(Seals::SHRINK | Seals::GROW | Seals::SEAL)?;
        assert_eq!(rustix::fs::ftruncate(m.as_fd(), 4096), Err(rustix::io::Errno::PERM));
        assert_eq!(rustix::fs::ftruncate(m.as_fd(), 16384), Err(rustix::io::Errno::PERM));
        let err = m.seal(Seals::WRITE).err();
        assert_eq!(err.and_then(|e| e.errno()), Some(rustix::io::Errno::PERM));
        Ok(())
    }

    #[test]
    fn punch_hole_checks_bounds_and_keeps_the_size() -> Result<(), ShmError> {
        let m = Memfd::create("kvmm-test", 8192)?;
        m.seal(Seals::SHRINK | Seals::GROW)?;
        m.punch_hole(0, 4096)?;
        assert!(matches!(m.punch_hole(4096, 8192), Err(ShmError::OutOfBounds { .. })));
        let stat = rustix::fs::fstat(m.as_fd()).map_err(|e| ShmError::os("fstat", "test", e))?;
        assert_eq!(stat.st_size, 8192);
        Ok(())
    }
}
