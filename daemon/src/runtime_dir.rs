//! The runtime directory: where the sockets live, guarded by a lock file so that only one kvmmd
//! serves a directory at a time.
//!
//! The lock is an `flock` on `kvmmd.lock`, held for the life of the process and released by the
//! kernel however the process ends, so a crashed daemon never blocks its successor. The file holds
//! the owner's pid for the refusal message. A stale socket left by a crashed daemon is removed only
//! after the lock is taken, and only when kvmmd is about to bind that socket itself: sockets that
//! systemd passed in belong to their socket units and are neither removed nor re-moded.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{FlockOperation, flock};

use crate::error::{Error, Result};

/// File name of the session socket.
pub const SESSION_SOCKET: &str = "kvmm.sock";
/// File name of the fd-passing socket.
pub const FD_SOCKET: &str = "kvmm-fd.sock";
/// File name of the admin socket.
pub const ADMIN_SOCKET: &str = "kvmm-admin.sock";
/// File name of the lock.
pub const LOCK_FILE: &str = "kvmmd.lock";

/// A runtime directory this process holds the lock of. Dropping it removes the sockets this
/// process bound.
#[derive(Debug)]
pub struct RuntimeDir {
    dir: PathBuf,
    /// Held open for the flock; closing it releases the lock.
    _lock: File,
    /// Socket files this process bound (and so removes).
    bound: Vec<&'static str>,
}

impl RuntimeDir {
    /// Creates `dir` if needed and takes its lock.
    pub fn acquire(dir: &Path) -> Result<Self> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|e| Error::io(format!("cannot create the runtime directory {}", dir.display()), e))?;
        let lock_path = dir.join(LOCK_FILE);
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&lock_path)
            .map_err(|e| Error::io(format!("cannot open the lock file {}", lock_path.display()), e))?;
        if flock(&lock, FlockOperation::NonBlockingLockExclusive).is_err() {
            let mut pid = String::new();
            let _ = lock.read_to_string(&mut pid);
            let pid = pid.trim();
            let who = if pid.is_empty() { "another kvmmd".to_owned() } else { format!("another kvmmd (pid {pid})") };
            return Err(Error::FailedPrecondition(format!(
                "{who} is already serving {}; stop it first or start this one with --runtime-dir DIR",
                dir.display()
            )));
        }
        lock.set_len(0)
            .and_then(|()| lock.rewind())
            .and_then(|()| writeln!(lock, "{}", std::process::id()))
            .map_err(|e| Error::io(format!("cannot write the pid into {}", lock_path.display()), e))?;
        Ok(RuntimeDir { dir: dir.to_owned(), _lock: lock, bound: Vec::new() })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Path of a file in the directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Sets a socket file's mode.
    pub fn set_mode(&self, name: &str, mode: u32) -> Result<()> {
        let path = self.join(name);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| Error::io(format!("cannot set the mode of {}", path.display()), e))
    }

    /// Makes way for binding socket `name`: removes a stale file of that name (a crashed daemon's;
    /// the lock proves no live kvmmd serves it) and records that this process owns the socket, so
    /// dropping the directory removes it. Returns its path.
    pub fn claim_socket(&mut self, name: &'static str) -> PathBuf {
        let path = self.join(name);
        let _ = std::fs::remove_file(&path);
        if !self.bound.contains(&name) {
            self.bound.push(name);
        }
        path
    }
}

impl Drop for RuntimeDir {
    fn drop(&mut self) {
        for name in &self.bound {
            let _ = std::fs::remove_file(self.dir.join(name));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_pid() {
        let tmp = tempfile::tempdir().unwrap();
        let first = RuntimeDir::acquire(tmp.path()).unwrap();
        let err = RuntimeDir::acquire(tmp.path()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&std::process::id().to_string()), "{msg}");
        assert!(msg.contains("already serving"), "{msg}");
        drop(first);
        RuntimeDir::acquire(tmp.path()).unwrap();
    }

    #[test]
    fn only_claimed_sockets_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let mut dir = RuntimeDir::acquire(tmp.path()).unwrap();
        // A passed socket's file (systemd's) and a stale one kvmmd will bind over.
        std::fs::write(tmp.path().join(SESSION_SOCKET), b"").unwrap();
        std::fs::write(tmp.path().join(FD_SOCKET), b"stale").unwrap();
        let path = dir.claim_socket(FD_SOCKET);
        assert!(!path.exists(), "the stale file is gone before the bind");
        std::fs::write(&path, b"bound").unwrap();
        drop(dir);
        assert!(tmp.path().join(SESSION_SOCKET).exists(), "a socket kvmmd did not bind stays");
        assert!(!tmp.path().join(FD_SOCKET).exists(), "a socket kvmmd bound is removed");
    }
}
