//! Passing memfds between processes: `SOCK_SEQPACKET` Unix sockets with `SCM_RIGHTS`.
//!
//! After `Attach`, a client connects to `kvmm-fd.sock`, sends an [`FdRequest`] (session id and the
//! one-time token), and receives an [`FdReply`]: either "granted", carrying the arena, session-table
//! and client-region memfds as `SCM_RIGHTS`, or "refused", with a gRPC code and a sentence. The
//! frames are in [`frame`]; this file owns the sockets.
//!
//! `SOCK_SEQPACKET` keeps message boundaries (one frame per `recvmsg`) and is connection-oriented,
//! so `SO_PEERCRED` identifies the peer process; the daemon checks it against the process the token
//! was issued to. Every received fd is close-on-exec (`MSG_CMSG_CLOEXEC`) and owned (`OwnedFd`), so
//! nothing leaks: fds of a message that is rejected (truncated, wrong fd count) are closed before
//! the error returns. At most [`MAX_FDS`] fds travel with one message.
//!
//! [`peer_pidfd`] serves the daemon's stream sockets too: the pidfd of the process that connected,
//! so the daemon notices that process's exit while a child still holds the socket.

pub mod frame;

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType, sockopt,
};

pub use frame::{FdReply, FdRequest};

use crate::error::ShmError;
use crate::memfd::Memfd;

/// Most fds accepted with one message.
pub const MAX_FDS: usize = 8;

/// Backlog of a listening socket.
const BACKLOG: i32 = 128;

/// Credentials of the process at the other end of a connection (`SO_PEERCRED`), as of `connect`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerCred {
    /// Process id, in this process's pid namespace; 0 if the peer is not visible from it.
    pub pid: i32,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

/// The process at the other end of a Unix socket connection, as a pidfd ([`peer_pidfd`]).
#[derive(Debug)]
pub enum PeerProcess {
    /// A pidfd of the process that made the connection: it polls readable once that process has
    /// exited (all its threads, reaped or not), whoever else still holds the socket.
    Pidfd(OwnedFd),
    /// That process has exited already.
    Exited,
    /// The kernel cannot say (`SO_PEERPIDFD` needs Linux 6.5; the errno is kept for the log).
    Unknown(rustix::io::Errno),
}

/// The process that connected a Unix socket (`SO_PEERPIDFD`): the same process `SO_PEERCRED`
/// names, but as a pidfd, which stays bound to that process and is never confused with a later
/// one that reuses its pid. Works for stream and `SOCK_SEQPACKET` sockets alike. The pidfd is
/// close-on-exec.
pub fn peer_pidfd(socket: BorrowedFd<'_>) -> Result<PeerProcess, ShmError> {
    let mut pidfd: libc::c_int = -1;
    let len = match socket_option(socket, SO_PEERPIDFD, &mut pidfd) {
        Ok(len) => len,
        Err(e) => {
            let errno = rustix::io::Errno::from_io_error(&e).unwrap_or(rustix::io::Errno::IO);
            return match errno {
                // Kernels that reap the peer before the call answer so; newer ones hand out a
                // pidfd that is readable at once.
                rustix::io::Errno::SRCH => Ok(PeerProcess::Exited),
                // Before Linux 6.5 (ENOPROTOOPT); a socket without a peer process (EINVAL, ENODATA).
                rustix::io::Errno::NOPROTOOPT | rustix::io::Errno::INVAL | rustix::io::Errno::NODATA => {
                    Ok(PeerProcess::Unknown(errno))
                }
                e => Err(ShmError::os("getsockopt(SO_PEERPIDFD)", "a Unix socket", e)),
            };
        }
    };
    if pidfd < 0 {
        return Err(ShmError::malformed("SO_PEERPIDFD", format!("the kernel returned fd {pidfd}")));
    }
    // SAFETY: the kernel just installed `pidfd` in this process's fd table for us; nothing else
    // owns it, so the `OwnedFd` becomes its only owner and closes it once.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    if len != size_of::<libc::c_int>() {
        return Err(ShmError::malformed("SO_PEERPIDFD", format!("the kernel returned {len} bytes, not an int")));
    }
    Ok(PeerProcess::Pidfd(pidfd))
}

/// A value `getsockopt` may write: plain integers, valid whatever bytes the kernel leaves.
trait SocketOption {}
impl SocketOption for libc::c_int {}
impl SocketOption for libc::ucred {}

/// `getsockopt(SOL_SOCKET, option)` into `value`: the bytes the kernel wrote, or its errno.
fn socket_option<T: SocketOption>(
    socket: BorrowedFd<'_>,
    option: libc::c_int,
    value: &mut T,
) -> std::io::Result<usize> {
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `value` and `len` are valid for writes, `len` is the size of `value`, the kernel writes
    // at most `len` bytes there, and any bytes make a valid `T` (`SocketOption`); `socket` is a
    // live fd borrowed for the call.
    let rc = unsafe {
        libc::getsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, option, std::ptr::from_mut(value).cast(), &mut len)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(len as usize)
}

/// `SO_PEERPIDFD` (Linux 6.5) as `asm-generic/socket.h` numbers it, which x86-64 and aarch64 use
/// (sparc and mips number it otherwise); the libc crate does not export it for every target yet.
const SO_PEERPIDFD: libc::c_int = 77;

/// A listening `SOCK_SEQPACKET` Unix socket.
#[derive(Debug)]
pub struct SeqpacketListener {
    /// The listening socket; closed on drop (the socket file stays; the daemon removes it).
    fd: OwnedFd,
}

impl SeqpacketListener {
    /// Creates a socket, binds it to `path` and listens. Fails with `EADDRINUSE` if `path` exists:
    /// the daemon removes a stale socket file only after taking its lock. The file's mode follows
    /// the umask; the daemon sets it afterwards.
    pub fn bind(path: &Path) -> Result<SeqpacketListener, ShmError> {
        let fd = seqpacket_socket()?;
        let addr = unix_addr(path)?;
        rustix::net::bind(&fd, &addr).map_err(|e| ShmError::os("bind", format!("{}", path.display()), e))?;
        rustix::net::listen(&fd, BACKLOG).map_err(|e| ShmError::os("listen", format!("{}", path.display()), e))?;
        Ok(SeqpacketListener { fd })
    }

    /// Adopts an already listening socket (systemd socket activation), checking its type.
    pub fn from_fd(fd: OwnedFd) -> Result<SeqpacketListener, ShmError> {
        check_seqpacket(&fd)?;
        Ok(SeqpacketListener { fd })
    }

    /// Waits for and accepts one connection (blocking unless [`SeqpacketListener::set_nonblocking`]).
    pub fn accept(&self) -> Result<SeqpacketConn, ShmError> {
        let fd = rustix::net::accept_with(&self.fd, SocketFlags::CLOEXEC)
            .map_err(|e| ShmError::os("accept", "the fd-passing socket", e))?;
        Ok(SeqpacketConn { fd })
    }

    /// Makes [`SeqpacketListener::accept`] return `EAGAIN` instead of blocking (for use with an
    /// event loop).
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<(), ShmError> {
        rustix::io::ioctl_fionbio(&self.fd, nonblocking)
            .map_err(|e| ShmError::os("ioctl(FIONBIO)", "the fd-passing socket", e))
    }

    /// Borrows the socket (to poll it).
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsFd for SeqpacketListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Lets an async runtime register the listener (tokio's `AsyncFd` wants `AsRawFd`).
impl std::os::fd::AsRawFd for SeqpacketListener {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

/// A connected `SOCK_SEQPACKET` Unix socket: one message per send, one per receive.
#[derive(Debug)]
pub struct SeqpacketConn {
    /// The connected socket; closed on drop.
    fd: OwnedFd,
}

/// The memfds of a granted reply, each checked to be a memfd of the advertised size.
#[derive(Debug)]
pub struct GrantedMemfds {
    /// The trust domain's arena.
    pub arena: Memfd,
    /// The session table.
    pub table: Memfd,
    /// The client region.
    pub client_region: Memfd,
}

/// A reply as received by the client.
#[derive(Debug)]
pub enum ReceivedReply {
    /// The daemon sent the memfds.
    Granted(GrantedMemfds),
    /// The daemon refused.
    Refused {
        /// gRPC status code number.
        code: u32,
        /// The daemon's sentence.
        message: String,
    },
}

impl SeqpacketConn {
    /// Connects to the listener at `path`.
    pub fn connect(path: &Path) -> Result<SeqpacketConn, ShmError> {
        let fd = seqpacket_socket()?;
        let addr = unix_addr(path)?;
        rustix::net::connect(&fd, &addr).map_err(|e| ShmError::os("connect", format!("{}", path.display()), e))?;
        Ok(SeqpacketConn { fd })
    }

    /// A connected pair (`socketpair`), for in-process use and tests.
    pub fn pair() -> Result<(SeqpacketConn, SeqpacketConn), ShmError> {
        let (a, b) = rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
            .map_err(|e| ShmError::os("socketpair", "a SOCK_SEQPACKET pair", e))?;
        Ok((SeqpacketConn { fd: a }, SeqpacketConn { fd: b }))
    }

    /// Adopts a connected socket, checking its type.
    pub fn from_fd(fd: OwnedFd) -> Result<SeqpacketConn, ShmError> {
        check_seqpacket(&fd)?;
        Ok(SeqpacketConn { fd })
    }

    /// Gives up ownership of the socket.
    pub fn into_owned_fd(self) -> OwnedFd {
        self.fd
    }

    /// Borrows the socket.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The peer's pid, uid and gid (`SO_PEERCRED`, fixed when the connection was made).
    ///
    /// `pid` is 0 when the peer lives in a pid namespace this process cannot see; callers that
    /// match pids must treat 0 as "unknown", never as a match.
    pub fn peer_cred(&self) -> Result<PeerCred, ShmError> {
        // Read through libc rather than rustix: rustix's `UCred` holds a non-zero `Pid`, but the
        // kernel reports pid 0 for a peer outside this process's pid namespace.
        let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
        let len = socket_option(self.fd.as_fd(), libc::SO_PEERCRED, &mut cred).map_err(|source| ShmError::Os {
            call: "getsockopt(SO_PEERCRED)",
            what: "the fd-passing socket".to_owned(),
            source,
        })?;
        if len != size_of::<libc::ucred>() {
            return Err(ShmError::malformed(
                "SO_PEERCRED",
                format!("the kernel returned {len} bytes, not the {} of a struct ucred", size_of::<libc::ucred>()),
            ));
        }
        Ok(PeerCred { pid: cred.pid, uid: cred.uid, gid: cred.gid })
    }

    /// Bounds every later send and receive to `timeout` (`SO_SNDTIMEO`, `SO_RCVTIMEO`); past it
    /// they fail with [`crate::ShmErrorKind::TimedOut`]. `Duration::ZERO` removes the bound.
    pub fn set_timeouts(&self, timeout: Duration) -> Result<(), ShmError> {
        let value = (!timeout.is_zero()).then_some(timeout);
        for (id, call) in
            [(sockopt::Timeout::Recv, "setsockopt(SO_RCVTIMEO)"), (sockopt::Timeout::Send, "setsockopt(SO_SNDTIMEO)")]
        {
            sockopt::set_socket_timeout(&self.fd, id, value)
                .map_err(|e| ShmError::os(call, "the fd-passing socket", e))?;
        }
        Ok(())
    }

    /// Sends `bytes` as one message, with `fds` (at most [`MAX_FDS`]) as `SCM_RIGHTS`. The fds are
    /// duplicated into the receiver; the caller keeps its own.
    pub fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), ShmError> {
        if fds.len() > MAX_FDS {
            return Err(too_many_fds(fds.len()));
        }
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(too_many_fds(fds.len()));
        }
        let sent =
            rustix::net::sendmsg(&self.fd, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL).map_err(|e| {
                ShmError::os("sendmsg", format!("the fd-passing socket ({} bytes, {} fds)", bytes.len(), fds.len()), e)
            })?;
        if sent != bytes.len() {
            return Err(ShmError::malformed(
                "outgoing message",
                format!("only {sent} of its {} bytes were sent", bytes.len()),
            ));
        }
        Ok(())
    }

    /// Receives one message into `buf`, with up to [`MAX_FDS`] fds (close-on-exec). A message
    /// longer than `buf`, or with more fds, is an error ([`ShmError::Truncated`]) and its fds are
    /// closed. A closed connection is [`ShmError::PeerClosed`].
    pub fn recv(&self, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>), ShmError> {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let buf_len = buf.len();
        let msg = rustix::net::recvmsg(&self.fd, &mut [IoSliceMut::new(buf)], &mut control, RecvFlags::CMSG_CLOEXEC)
            .map_err(|e| ShmError::os("recvmsg", "the fd-passing socket", e))?;
        let mut fds = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if msg.flags.contains(ReturnFlags::CTRUNC) {
            return Err(ShmError::Truncated { what: "file descriptors", limit: MAX_FDS, unit: "fd" });
        }
        if msg.flags.contains(ReturnFlags::TRUNC) {
            return Err(ShmError::Truncated { what: "payload", limit: buf_len, unit: "byte" });
        }
        if msg.bytes == 0 && fds.is_empty() {
            return Err(ShmError::PeerClosed);
        }
        Ok((msg.bytes, fds))
    }

    /// Client: sends a request.
    pub fn send_request(&self, request: &FdRequest) -> Result<(), ShmError> {
        self.send(&request.encode(), &[])
    }

    /// Daemon: receives and parses a request; a request carrying fds is malformed.
    pub fn recv_request(&self) -> Result<FdRequest, ShmError> {
        let mut buf = [0u8; frame::REQUEST_BYTES];
        let (len, fds) = self.recv(&mut buf)?;
        if !fds.is_empty() {
            return Err(ShmError::malformed(
                "fd request",
                format!("it carries {} fds, but a request carries none", fds.len()),
            ));
        }
        FdRequest::decode(&buf[..len])
    }

    /// Daemon: sends a reply. A granted reply must come with exactly three fds (arena, session
    /// table, client region), a refusal with none.
    pub fn send_reply(&self, reply: &FdReply, fds: &[BorrowedFd<'_>]) -> Result<(), ShmError> {
        if fds.len() != reply.fd_count() {
            return Err(ShmError::malformed(
                "fd reply",
                format!("it would carry {} fds, but this kind of reply carries {}", fds.len(), reply.fd_count()),
            ));
        }
        self.send(&reply.encode()?, fds)
    }

    /// Client: receives a reply; for a grant, checks that exactly three memfds came with it and that
    /// each has the advertised size.
    pub fn recv_reply(&self) -> Result<ReceivedReply, ShmError> {
        let mut buf = [0u8; frame::MAX_FRAME_BYTES];
        let (len, fds) = self.recv(&mut buf)?;
        let reply = FdReply::decode(&buf[..len])?;
        if fds.len() != reply.fd_count() {
            return Err(ShmError::malformed(
                "fd reply",
                format!("it carries {} fds, but this kind of reply carries {}", fds.len(), reply.fd_count()),
            ));
        }
        match reply {
            FdReply::Refused { code, message } => Ok(ReceivedReply::Refused { code, message }),
            FdReply::Granted { arena_bytes, table_bytes, client_region_bytes } => {
                let mut fds = fds.into_iter();
                let mut next = |what: &'static str, bytes: u64| -> Result<Memfd, ShmError> {
                    let fd = fds
                        .next()
                        .ok_or_else(|| ShmError::malformed("fd reply", format!("the {what} fd is missing")))?;
                    let memfd = Memfd::from_fd(fd)?;
                    if memfd.len() != bytes {
                        return Err(ShmError::malformed(
                            "fd reply",
                            format!("the {what} memfd is {} bytes, but the reply announced {bytes}", memfd.len()),
                        ));
                    }
                    Ok(memfd)
                };
                Ok(ReceivedReply::Granted(GrantedMemfds {
                    arena: next("arena", arena_bytes)?,
                    table: next("session table", table_bytes)?,
                    client_region: next("client region", client_region_bytes)?,
                }))
            }
        }
    }
}

impl AsFd for SeqpacketConn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn too_many_fds(count: usize) -> ShmError {
    ShmError::malformed(
        "outgoing message",
        format!("it would carry {count} fds, more than the {MAX_FDS} a receiver accepts"),
    )
}

fn seqpacket_socket() -> Result<OwnedFd, ShmError> {
    rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .map_err(|e| ShmError::os("socket", "a new AF_UNIX SOCK_SEQPACKET socket", e))
}

fn unix_addr(path: &Path) -> Result<SocketAddrUnix, ShmError> {
    SocketAddrUnix::new(path)
        .map_err(|e| ShmError::os("sockaddr_un", format!("{} (a socket path is at most 107 bytes)", path.display()), e))
}

fn check_seqpacket(fd: &OwnedFd) -> Result<(), ShmError> {
    let found = sockopt::socket_type(fd).map_err(|e| ShmError::os("getsockopt(SO_TYPE)", "an inherited socket", e))?;
    if found != SocketType::SEQPACKET {
        return Err(ShmError::WrongSocketType { found: format!("{found:?}") });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
