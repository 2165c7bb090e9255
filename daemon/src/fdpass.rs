//! Handing memfds to clients over `kvmm-fd.sock` (`SOCK_SEQPACKET`, SCM_RIGHTS).
//!
//! `Attach` issues a one-time token bound to the attaching connection's uid and pid. The client
//! presents it here; the daemon checks this socket's own `SO_PEERCRED` against the binding, marks the
//! token used, and replies with the arena, session-table and client-region memfds. A token is
//! refused when it does not match (PERMISSION_DENIED), was already used or has expired
//! (FAILED_PRECONDITION), or comes from another process (PERMISSION_DENIED; the token is burned,
//! since it has leaked). Records live as long as their session, so a replay is told apart from a
//! guess.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicUsize, Ordering};

use kvmm_shm::ShmErrorKind;
use kvmm_shm::fdpass::{FdReply, PeerCred, SeqpacketConn, SeqpacketListener};
use rustix::event::{PollFd, PollFlags, Timespec, poll};

use crate::daemon::Daemon;
use crate::error::{Error, Result};
use crate::server::status;

/// Length of a token in bytes.
pub const TOKEN_BYTES: usize = 32;

/// How long the daemon waits for a connected client to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(500);

#[derive(Debug)]
struct TokenRecord {
    token: [u8; TOKEN_BYTES],
    uid: u32,
    pid: i32,
    expires: Instant,
    used: bool,
}

/// Tokens issued by `Attach`, one per live session.
#[derive(Debug, Default)]
pub struct TokenStore {
    records: HashMap<u64, TokenRecord>,
}

impl TokenStore {
    /// Issues a fresh random token for `session`, bound to `uid` and `pid`.
    pub fn issue(&mut self, session: u64, uid: u32, pid: i32, ttl: Duration) -> Result<[u8; TOKEN_BYTES]> {
        let mut token = [0u8; TOKEN_BYTES];
        let mut filled = 0;
        while filled < TOKEN_BYTES {
            filled += rustix::rand::getrandom(&mut token[filled..], rustix::rand::GetRandomFlags::empty())
                .map_err(|e| Error::io("cannot read random bytes for an fd token", e.into()))?;
        }
        self.records.insert(session, TokenRecord { token, uid, pid, expires: Instant::now() + ttl, used: false });
        Ok(token)
    }

    /// Checks and consumes the token of `session` presented by `peer`.
    pub fn redeem(&mut self, session: u64, token: &[u8; TOKEN_BYTES], peer: PeerCred, now: Instant) -> Result<()> {
        let rec = self.records.get_mut(&session).ok_or(Error::UnknownSession(session))?;
        if !constant_time_eq(&rec.token, token) {
            return Err(Error::PermissionDenied(format!(
                "the fd token does not match session {session}; present the token that Attach returned"
            )));
        }
        if rec.used {
            return Err(Error::FailedPrecondition(format!(
                "the fd token of session {session} was already used; memfds are handed out once per Attach"
            )));
        }
        if now > rec.expires {
            rec.used = true;
            return Err(Error::FailedPrecondition(format!(
                "the fd token of session {session} has expired; fetch the memfds right after Attach, or attach again"
            )));
        }
        if peer.pid == 0 || rec.pid == 0 {
            rec.used = true;
            return Err(Error::PermissionDenied(format!(
                "the process presenting the fd token of session {session} cannot be identified (pid 0: it runs \
                 in another pid namespace), so the token is refused and revoked; run the client in kvmmd's pid \
                 namespace"
            )));
        }
        if (peer.uid, peer.pid) != (rec.uid, rec.pid) {
            rec.used = true;
            return Err(Error::PermissionDenied(format!(
                "the fd token of session {session} was issued to pid {} (uid {}) but pid {} (uid {}) presented it; \
                 only the attaching process may fetch the memfds, and this token is now revoked",
                rec.pid, rec.uid, peer.pid, peer.uid
            )));
        }
        rec.used = true;
        Ok(())
    }

    /// Forgets the token of a destroyed session.
    pub fn remove(&mut self, session: u64) {
        self.records.remove(&session);
    }
}

fn constant_time_eq(a: &[u8; TOKEN_BYTES], b: &[u8; TOKEN_BYTES]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Most fd requests handled at once; more are refused with UNAVAILABLE so a flood of idle
/// connections cannot pile up threads.
const MAX_CONCURRENT_REQUESTS: usize = 64;

/// How often the accept loop looks at the shutdown flag.
const POLL_INTERVAL_MS: i32 = 100;

/// Serves the fd socket on the calling thread until the daemon shuts down. Each request is answered
/// on its own short-lived thread, since a client may take up to [`REQUEST_TIMEOUT`] to send it.
pub fn serve(daemon: Arc<Daemon>, listener: SeqpacketListener) -> Result<()> {
    listener.set_nonblocking(true)?;
    let active = Arc::new(AtomicUsize::new(0));
    while !daemon.is_shutting_down() {
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        let timeout = Timespec { tv_sec: 0, tv_nsec: i64::from(POLL_INTERVAL_MS) * 1_000_000 };
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(Error::io("polling the fd socket", e.into())),
        }
        let conn = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.errno() == Some(rustix::io::Errno::AGAIN) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "fd socket accept failed");
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONCURRENT_REQUESTS {
            active.fetch_sub(1, Ordering::AcqRel);
            let busy = Error::Busy("too many fd requests are in progress; retry in a moment".to_owned());
            refuse(&conn, &busy);
            continue;
        }
        let (daemon, active) = (daemon.clone(), active.clone());
        let spawned = std::thread::Builder::new().name("kvmm-fd-request".to_owned()).spawn(move || {
            handle(&daemon, &conn);
            active.fetch_sub(1, Ordering::AcqRel);
        });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a thread for an fd request");
        }
    }
    Ok(())
}

/// Answers one fd request; every failure is a refusal frame with a gRPC code and a sentence.
fn handle(daemon: &Daemon, conn: &SeqpacketConn) {
    let grant = (|| -> Result<_> {
        let peer = conn.peer_cred()?;
        conn.set_timeouts(REQUEST_TIMEOUT)?;
        let request = conn.recv_request().map_err(|e| match e.kind() {
            ShmErrorKind::Malformed => Error::InvalidArgument(e.to_string()),
            _ => Error::Shm(e),
        })?;
        daemon.grant_fds(peer, &request)
    })();
    let sent = match grant {
        Ok(g) => {
            let frame = FdReply::Granted {
                arena_bytes: g.arena.len(),
                table_bytes: g.table.len(),
                client_region_bytes: g.region.len(),
            };
            conn.send_reply(&frame, &[g.arena.as_fd(), g.table.as_fd(), g.region.as_fd()])
        }
        Err(e) => {
            refuse(conn, &e);
            Ok(())
        }
    };
    if let Err(e) = sent {
        tracing::debug!(error = %e, "could not answer an fd request");
    }
}

fn refuse(conn: &SeqpacketConn, e: &Error) {
    // Any local process can trigger this, so it stays out of the default log level and is limited.
    crate::limited!(debug, error = %e, "refused an fd request");
    if let Err(send) = conn.send_reply(&FdReply::refused(status::refusal(e.kind()) as u32, e.to_string()), &[]) {
        tracing::debug!(error = %send, "could not send a refusal");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(uid: u32, pid: i32) -> PeerCred {
        PeerCred { uid, pid, gid: uid }
    }

    #[test]
    fn a_token_is_honoured_once_for_its_process() {
        let mut store = TokenStore::default();
        let t = store.issue(1, 1000, 42, Duration::from_secs(10)).unwrap();
        let now = Instant::now();
        store.redeem(1, &t, peer(1000, 42), now).unwrap();
        let replay = store.redeem(1, &t, peer(1000, 42), now).unwrap_err();
        assert_eq!(replay.kind(), crate::error::ErrorKind::FailedPrecondition);
        assert!(replay.to_string().contains("already used"));
    }

    #[test]
    fn a_token_from_another_process_is_refused_and_revoked() {
        let mut store = TokenStore::default();
        let t = store.issue(1, 1000, 42, Duration::from_secs(10)).unwrap();
        let err = store.redeem(1, &t, peer(1000, 43), Instant::now()).unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("pid 43"));
        assert!(store.redeem(1, &t, peer(1000, 42), Instant::now()).is_err(), "a leaked token is burned");
    }

    #[test]
    fn an_unidentifiable_process_never_matches() {
        let mut store = TokenStore::default();
        let t = store.issue(1, 0, 0, Duration::from_secs(10)).unwrap();
        let err = store.redeem(1, &t, peer(0, 0), Instant::now()).unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("pid namespace"));
    }

    #[test]
    fn an_expired_token_is_refused() {
        let mut store = TokenStore::default();
        let t = store.issue(1, 0, 1, Duration::from_millis(100)).unwrap();
        let err = store.redeem(1, &t, peer(0, 1), Instant::now() + Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("expired"), "{err}");
    }

    #[test]
    fn a_wrong_token_does_not_burn_the_right_one() {
        let mut store = TokenStore::default();
        let t = store.issue(1, 0, 1, Duration::from_secs(10)).unwrap();
        let mut guess = t;
        guess[0] ^= 1;
        assert_eq!(
            store.redeem(1, &guess, peer(0, 1), Instant::now()).unwrap_err().kind(),
            crate::error::ErrorKind::PermissionDenied
        );
        store.redeem(1, &t, peer(0, 1), Instant::now()).unwrap();
        assert_eq!(
            store.redeem(9, &t, peer(0, 1), Instant::now()).unwrap_err().kind(),
            crate::error::ErrorKind::NotFound
        );
    }
}
