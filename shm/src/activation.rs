//! Sockets passed by systemd (socket activation, `sd_listen_fds(3)`).
//!
//! systemd (or `systemd-socket-activate`) starts a service with its listening sockets already open
//! as fds 3, 4, … and describes them in the environment:
//!
//! ```text
//!  LISTEN_PID=1234              the process they are meant for (a child that inherits them is not)
//!  LISTEN_FDS=3                 how many: fds 3, 4, 5
//!  LISTEN_FDNAMES=session:fd:admin   optional, one name per fd (FileDescriptorName=)
//! ```
//!
//! [`take_listen_fds`] is the one place those numbers become owned fds. It owns this file's single
//! `unsafe` (adopting a raw fd number) and relies on two checks made first: the variables are meant
//! for this process (`LISTEN_PID`), and each fd is open (`fcntl(F_GETFD)`). It is meant to be called
//! once, early in `main`, before anything else could have opened or closed fds 3 and up; a second
//! call finds nothing (it remembers that the fds were taken).

use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::io::FdFlags;

use crate::error::ShmError;

/// The first fd systemd passes (`SD_LISTEN_FDS_START`).
pub const LISTEN_FDS_START: RawFd = 3;

/// At most this many passed fds are accepted (kvmmd uses three).
const MAX_PASSED: u32 = 64;

/// Set once the passed fds have been adopted, so they are never adopted twice.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// One socket passed by the service manager.
#[derive(Debug)]
pub struct PassedFd {
    /// The fd, now owned (and close-on-exec).
    pub fd: OwnedFd,
    /// Its `FileDescriptorName=`, when `LISTEN_FDNAMES` names every fd.
    pub name: Option<String>,
}

/// What the environment says was passed, before any fd is touched: one entry per fd (its name, if
/// every fd has one), or `None` when nothing was passed to this process. Pure, for tests.
pub fn parse_listen_env(
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    listen_fdnames: Option<&str>,
    own_pid: u32,
) -> Result<Option<Vec<Option<String>>>, ShmError> {
    let (Some(pid), Some(count)) = (listen_pid, listen_fds) else { return Ok(None) };
    let bad = |what: String| ShmError::Activation(what);
    let pid: u32 = pid.trim().parse().map_err(|_| bad(format!("LISTEN_PID is not a process id: {pid:?}")))?;
    if pid != own_pid {
        // Meant for another process (we inherited the environment): not ours to take.
        return Ok(None);
    }
    let count: u32 =
        count.trim().parse().map_err(|_| bad(format!("LISTEN_FDS is not a count of file descriptors: {count:?}")))?;
    if count > MAX_PASSED {
        return Err(bad(format!("LISTEN_FDS is {count}; at most {MAX_PASSED} passed sockets are accepted")));
    }
    let names: Vec<Option<String>> = match listen_fdnames {
        Some(n) if n.split(':').count() == count as usize => n.split(':').map(|s| Some(s.to_owned())).collect(),
        // Absent, or a count that does not match (systemd-socket-activate passes a parent's fds
        // through but names only its own): every fd unnamed, identified by its address instead.
        _ => vec![None; count as usize],
    };
    Ok(Some(names))
}

/// Adopts the sockets systemd passed to this process, in order, and marks them close-on-exec.
/// Returns an empty list when none were passed (or they were already taken).
pub fn take_listen_fds() -> Result<Vec<PassedFd>, ShmError> {
    let env = |k: &str| std::env::var(k).ok();
    let Some(names) = parse_listen_env(
        env("LISTEN_PID").as_deref(),
        env("LISTEN_FDS").as_deref(),
        env("LISTEN_FDNAMES").as_deref(),
        std::process::id(),
    )?
    else {
        return Ok(Vec::new());
    };
    if TAKEN.swap(true, Ordering::SeqCst) {
        return Ok(Vec::new());
    }
    let count = names.len();
    let mut passed = Vec::with_capacity(count);
    for (i, name) in names.into_iter().enumerate() {
        let raw = LISTEN_FDS_START + i as RawFd;
        // SAFETY: borrowed only for the duration of the check; an fd number that is not open
        // fails F_GETFD with EBADF and is never adopted.
        let borrowed = unsafe { BorrowedFd::borrow_raw(raw) };
        let flags = rustix::io::fcntl_getfd(borrowed).map_err(|e| {
            ShmError::os("fcntl(F_GETFD)", format!("fd {raw}, which LISTEN_FDS={count} says was passed"), e)
        })?;
        rustix::io::fcntl_setfd(borrowed, flags | FdFlags::CLOEXEC)
            .map_err(|e| ShmError::os("fcntl(F_SETFD)", format!("passed fd {raw}"), e))?;
        // SAFETY: the fd is open (checked above), LISTEN_PID names this process, so the service
        // manager handed it to us, and TAKEN guarantees no other OwnedFd is ever made of it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        passed.push(PassedFd { fd, name });
    }
    Ok(passed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_taken_without_the_variables_or_when_they_name_another_process() {
        assert!(parse_listen_env(None, None, None, 7).unwrap().is_none());
        assert!(parse_listen_env(Some("7"), None, None, 7).unwrap().is_none());
        assert!(parse_listen_env(Some("8"), Some("3"), None, 7).unwrap().is_none());
    }

    #[test]
    fn names_apply_only_when_every_fd_has_one() {
        let names = parse_listen_env(Some("7"), Some("3"), Some("session:fd:admin"), 7).unwrap().unwrap();
        assert_eq!(names, vec![Some("session".into()), Some("fd".into()), Some("admin".into())]);
        let names = parse_listen_env(Some("7"), Some("3"), Some("session:admin"), 7).unwrap().unwrap();
        assert_eq!(names, vec![None, None, None]);
    }

    #[test]
    fn malformed_variables_are_errors_that_name_them() {
        let e = parse_listen_env(Some("x"), Some("3"), None, 7).unwrap_err().to_string();
        assert!(e.contains("LISTEN_PID"), "{e}");
        let e = parse_listen_env(Some("7"), Some("-1"), None, 7).unwrap_err().to_string();
        assert!(e.contains("LISTEN_FDS"), "{e}");
        let e = parse_listen_env(Some("7"), Some("1000"), None, 7).unwrap_err().to_string();
        assert!(e.contains("at most"), "{e}");
    }
}
