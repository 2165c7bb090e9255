//! Fd passing over real sockets: socketpairs and a listener in a temporary directory.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use super::*;
use crate::mapping::{Access, Mapping};
use crate::{Seals, ShmErrorKind};

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "kvmm-shm-fdpass-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("the temp dir is writable");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn memfds_sent_over_a_socketpair_arrive_and_map() -> Result<(), ShmError> {
    let (a, b) = SeqpacketConn::pair()?;
    let memfd = Memfd::create("kvmm-fdpass-test", 4096)?;
    Mapping::map(&memfd, Access::ReadWrite)?.write_at(100, b"hello from the daemon")?;
    memfd.seal(Seals::SHRINK | Seals::GROW)?;

    a.send(b"frame", &[memfd.as_fd(), memfd.as_fd()])?;
    let mut buf = [0u8; 64];
    let (len, fds) = b.recv(&mut buf)?;
    assert_eq!(&buf[..len], b"frame");
    assert_eq!(fds.len(), 2);
    for fd in fds {
        let flags = rustix::io::fcntl_getfd(&fd).map_err(|e| ShmError::os("fcntl", "test", e))?;
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        let received = Memfd::from_fd(fd)?;
        assert_eq!(received.len(), 4096);
        assert_eq!(received.seals()?, Seals::SHRINK | Seals::GROW);
        let mut got = [0u8; 21];
        Mapping::map(&received, Access::ReadOnly)?.read_at(100, &mut got)?;
        assert_eq!(&got, b"hello from the daemon");
    }
    Ok(())
}

#[test]
fn a_listener_in_a_directory_accepts_and_reports_peer_credentials() -> Result<(), ShmError> {
    let dir = TempDir::new();
    let path = dir.0.join("kvmm-fd.sock");
    let listener = SeqpacketListener::bind(&path)?;
    let client_path = path.clone();
    let client = std::thread::spawn(move || -> Result<PeerCred, ShmError> {
        let conn = SeqpacketConn::connect(&client_path)?;
        conn.set_timeouts(Duration::from_secs(10))?;
        conn.send_request(&FdRequest { session_id: 42, token: [7; 32] })?;
        let reply = conn.recv_reply()?;
        let ReceivedReply::Granted(memfds) = reply else {
            return Err(ShmError::malformed("fd reply", format!("not granted: {reply:?}")));
        };
        let mut buf = [0u8; 5];
        Mapping::map(&memfds.table, Access::ReadOnly)?.read_at(0, &mut buf)?;
        assert_eq!(&buf, b"table");
        assert_eq!(memfds.arena.len(), 8192);
        assert_eq!(memfds.client_region.len(), 100);
        conn.peer_cred()
    });

    let conn = listener.accept()?;
    conn.set_timeouts(Duration::from_secs(10))?;
    let cred = conn.peer_cred()?;
    assert_eq!(cred.pid, std::process::id() as i32);
    assert_eq!(cred.uid, rustix::process::getuid().as_raw());
    assert_eq!(cred.gid, rustix::process::getgid().as_raw());
    let request = conn.recv_request()?;
    assert_eq!(request.session_id, 42);
    assert_eq!(request.token, [7; 32]);

    let arena = Memfd::create("arena", 8192)?;
    let table = Memfd::create("table", 4096)?;
    Mapping::map(&table, Access::ReadWrite)?.write_at(0, b"table")?;
    let region = Memfd::create("region", 100)?;
    conn.send_reply(
        &FdReply::Granted { arena_bytes: 8192, table_bytes: 4096, client_region_bytes: 100 },
        &[arena.as_fd(), table.as_fd(), region.as_fd()],
    )?;
    let client_cred = client.join().expect("the client thread does not panic")?;
    assert_eq!(client_cred.pid, std::process::id() as i32);
    Ok(())
}

#[test]
fn binding_an_existing_path_fails_with_a_sentence() -> Result<(), ShmError> {
    let dir = TempDir::new();
    let path = dir.0.join("taken.sock");
    let _first = SeqpacketListener::bind(&path)?;
    let err = SeqpacketListener::bind(&path).err();
    assert_eq!(err.as_ref().and_then(ShmError::errno), Some(rustix::io::Errno::ADDRINUSE));
    assert!(err.is_some_and(|e| e.to_string().contains("taken.sock")));
    Ok(())
}

#[test]
fn a_refusal_arrives_as_code_and_message() -> Result<(), ShmError> {
    let (daemon, client) = SeqpacketConn::pair()?;
    daemon.send_reply(&FdReply::refused(7, "token was issued to another process"), &[])?;
    match client.recv_reply()? {
        ReceivedReply::Refused { code, message } => {
            assert_eq!(code, 7);
            assert_eq!(message, "token was issued to another process");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    Ok(())
}

#[test]
fn a_grant_with_the_wrong_fds_is_rejected_on_both_sides() -> Result<(), ShmError> {
    let (daemon, client) = SeqpacketConn::pair()?;
    let m = Memfd::create("m", 10)?;
    let granted = FdReply::Granted { arena_bytes: 10, table_bytes: 10, client_region_bytes: 10 };
    let err = daemon.send_reply(&granted, &[m.as_fd()]).err();
    assert!(matches!(err, Some(ShmError::Malformed { .. })), "{err:?}");

    // Bypass the check: a grant with one fd is refused by the receiver.
    daemon.send(&granted.encode()?, &[m.as_fd()])?;
    let err = client.recv_reply().err();
    assert!(err.as_ref().is_some_and(|e| e.to_string().contains("carries 1 fds")), "{err:?}");

    // Sizes that do not match the announcement are refused too.
    let wrong = FdReply::Granted { arena_bytes: 10, table_bytes: 11, client_region_bytes: 10 };
    daemon.send_reply(&wrong, &[m.as_fd(), m.as_fd(), m.as_fd()])?;
    let err = client.recv_reply().err();
    assert!(err.as_ref().is_some_and(|e| e.to_string().contains("session table memfd is 10 bytes")), "{err:?}");
    Ok(())
}

#[test]
fn oversized_payloads_and_fd_floods_are_truncation_errors() -> Result<(), ShmError> {
    let (a, b) = SeqpacketConn::pair()?;
    a.send(&[1u8; 100], &[])?;
    let mut small = [0u8; 10];
    let err = b.recv(&mut small).err();
    assert!(matches!(err, Some(ShmError::Truncated { what: "payload", .. })), "{err:?}");
    assert_eq!(err.map(|e| e.kind()), Some(ShmErrorKind::Malformed));

    let m = Memfd::create("m", 1)?;
    let nine = [m.as_fd(); 9];
    let err = a.send(b"x", &nine).err();
    assert!(err.as_ref().is_some_and(|e| e.to_string().contains("9 fds, more than the 8")), "{err:?}");

    // A peer that is not this crate sends 12 fds; the receiver keeps none and says so.
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(12))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let twelve = [m.as_fd(); 12];
    assert!(control.push(SendAncillaryMessage::ScmRights(&twelve)));
    rustix::net::sendmsg(&a, &[IoSlice::new(b"flood")], &mut control, SendFlags::empty())
        .map_err(|e| ShmError::os("sendmsg", "test", e))?;
    let mut buf = [0u8; 64];
    let err = b.recv(&mut buf).err();
    assert!(matches!(err, Some(ShmError::Truncated { what: "file descriptors", .. })), "{err:?}");
    Ok(())
}

#[test]
fn a_request_with_fds_or_garbage_is_malformed() -> Result<(), ShmError> {
    let (client, daemon) = SeqpacketConn::pair()?;
    let m = Memfd::create("m", 1)?;
    client.send(&FdRequest { session_id: 1, token: [0; 32] }.encode(), &[m.as_fd()])?;
    assert!(matches!(daemon.recv_request(), Err(ShmError::Malformed { .. })));
    client.send(b"GET / HTTP/1.1\r\n", &[])?;
    let err = daemon.recv_request().err();
    assert!(err.as_ref().is_some_and(|e| e.to_string().contains("exactly 48")), "{err:?}");
    Ok(())
}

#[test]
fn a_closed_peer_and_a_timeout_are_told_apart() -> Result<(), ShmError> {
    let (a, b) = SeqpacketConn::pair()?;
    b.set_timeouts(Duration::from_millis(20))?;
    let mut buf = [0u8; 8];
    let err = b.recv(&mut buf).err();
    assert_eq!(err.map(|e| e.kind()), Some(ShmErrorKind::TimedOut));
    drop(a);
    assert!(matches!(b.recv(&mut buf), Err(ShmError::PeerClosed)));
    Ok(())
}

#[test]
fn a_stream_socket_is_not_accepted_as_the_fd_socket() -> Result<(), ShmError> {
    let (a, _b) = rustix::net::socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None)
        .map_err(|e| ShmError::os("socketpair", "test", e))?;
    let err = SeqpacketListener::from_fd(a).err();
    assert!(err.as_ref().is_some_and(|e| e.to_string().contains("not SOCK_SEQPACKET")), "{err:?}");
    Ok(())
}

/// Whether `fd` polls readable right now.
fn readable(fd: BorrowedFd<'_>) -> bool {
    let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
    rustix::event::poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 })).expect("poll works") == 1
}

/// The pid a pidfd refers to, from `/proc/self/fdinfo`.
fn pidfd_pid(fd: &OwnedFd) -> i32 {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).expect("fdinfo is readable");
    let line = info.lines().find_map(|l| l.strip_prefix("Pid:")).expect("a pidfd's fdinfo has a Pid: line");
    line.trim().parse().expect("Pid: holds a number")
}

#[test]
fn the_peer_pidfd_names_the_connecting_process_and_polls_readable_once_it_exits() -> Result<(), ShmError> {
    // This process on both ends: a pidfd of ourselves, not readable while we run.
    let (a, _b) = SeqpacketConn::pair()?;
    match peer_pidfd(a.as_fd())? {
        PeerProcess::Pidfd(fd) => {
            assert_eq!(pidfd_pid(&fd), std::process::id() as i32);
            assert!(!readable(fd.as_fd()), "a live process's pidfd is not readable");
        }
        PeerProcess::Unknown(errno) => {
            eprintln!("SKIPPED: this kernel has no SO_PEERPIDFD ({errno})");
            return Ok(());
        }
        PeerProcess::Exited => panic!("this process has not exited"),
    }

    // A child connects and exits at once; we reap it and then accept its connection.
    let dir = TempDir::new();
    let path = dir.0.join("kvmm-fd.sock");
    let listener = SeqpacketListener::bind(&path)?;
    let addr = unix_addr(&path)?;
    let socket = seqpacket_socket()?;
    // SAFETY: the child runs only `connect` (a system call through rustix, no allocation or lock;
    // the address was built before the fork) and `_exit`, both async-signal-safe.
    let child = unsafe { libc::fork() };
    if child == 0 {
        let rc = i32::from(rustix::net::connect(&socket, &addr).is_err());
        // SAFETY: `_exit` ends the child without running the parent's atexit handlers or destructors.
        unsafe { libc::_exit(rc) };
    }
    assert!(child > 0, "fork failed: {}", std::io::Error::last_os_error());
    let mut status = 0;
    // SAFETY: `status` is valid for writes; `child` is our own child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child connected");
    drop(socket);
    let conn = listener.accept()?;
    assert_eq!(conn.peer_cred()?.pid, child);
    match peer_pidfd(conn.as_fd())? {
        PeerProcess::Pidfd(fd) => {
            assert_eq!(pidfd_pid(&fd), -1, "an exited process's pidfd has no pid any more");
            assert!(readable(fd.as_fd()), "an exited process's pidfd is readable");
        }
        PeerProcess::Exited => {}
        PeerProcess::Unknown(errno) => panic!("SO_PEERPIDFD worked on a socketpair but not here: {errno}"),
    }
    Ok(())
}
