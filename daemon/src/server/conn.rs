//! Accepted Unix stream connections for the gRPC servers, with the peer's credentials and a close
//! notification.
//!
//! Each accepted socket is wrapped in a [`TrackedStream`] that tonic hands to hyper. Its
//! [`ConnInfo`] (connection id and `SO_PEERCRED`, read once at accept) is attached to every request
//! as an extension, so identity never comes from a request field. When hyper drops the stream (the
//! peer closed the connection or died), the stream's guard sends the connection id on a channel; the
//! daemon then destroys the sessions attached through that connection.
//!
//! A connection lives as long as the process that opened it. A socket may outlive that process in a
//! child that inherited it (a fork without exec, an fd passed on), so each stream also watches the
//! opener's pidfd (`SO_PEERPIDFD`, taken at accept, so a reused pid is never mistaken for it): once
//! that process has exited, the stream reads as closed, hyper drops it, and the guard reports the
//! connection as above, whoever still holds the other end.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once};
use std::task::{Context, Poll};

use kvmm_shm::fdpass::{PeerProcess, peer_pidfd};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tonic::transport::server::Connected;

/// Identifies one accepted connection for the life of the daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// Who is on the other end of a connection, as the kernel reported it at accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    /// The connection.
    pub id: ConnId,
    /// Peer uid.
    pub uid: u32,
    /// Peer primary gid.
    pub gid: u32,
    /// Peer pid (0 if the kernel did not report one).
    pub pid: i32,
}

/// Sends the connection id when dropped.
#[derive(Debug)]
struct CloseGuard {
    id: ConnId,
    closed: mpsc::UnboundedSender<ConnId>,
}

impl Drop for CloseGuard {
    fn drop(&mut self) {
        // The receiver is gone only during shutdown, when every session is wiped anyway.
        let _ = self.closed.send(self.id);
    }
}

/// The process that opened a connection, as far as the stream knows.
#[derive(Debug)]
enum Opener {
    /// Running: its pidfd wakes the connection's task when it exits.
    Watched(AsyncFd<OwnedFd>),
    /// Exited: the stream reads as closed.
    Exited,
    /// No pidfd (a kernel before 6.5): only the socket's close ends the connection.
    Unwatched,
}

impl Opener {
    /// Starts watching the process at the other end of `stream`.
    fn of(stream: &UnixStream, id: ConnId) -> Opener {
        match peer_pidfd(stream.as_fd()) {
            // SAFETY: `fd` is an open pidfd that the `AsyncFd` takes ownership of, so it stays open
            // and names the same process until the `AsyncFd` drops it; `OwnedFd::as_raw_fd`
            // always returns that fd.
            Ok(PeerProcess::Pidfd(fd)) => match unsafe { AsyncFd::register(fd) } {
                Ok(fd) => Opener::Watched(fd),
                Err(e) => {
                    crate::limited!(warn, conn = id.0, error = %e, "cannot watch the pidfd of a connection's process; only its socket's close will end it");
                    Opener::Unwatched
                }
            },
            Ok(PeerProcess::Exited) => Opener::Exited,
            Ok(PeerProcess::Unknown(errno)) => {
                static ONCE: Once = Once::new();
                ONCE.call_once(|| {
                    tracing::info!(%errno, "this kernel gives no pidfd of a socket's peer (SO_PEERPIDFD, Linux 6.5); a client's connection ends only when its socket closes, not when its process exits while a child holds the socket");
                });
                Opener::Unwatched
            }
            Err(e) => {
                crate::limited!(warn, conn = id.0, error = %e, "cannot get the pidfd of a connection's process; only its socket's close will end it");
                Opener::Unwatched
            }
        }
    }
}

/// An accepted connection: the socket, its peer, the process that opened it, and the guard that
/// reports its end.
#[derive(Debug)]
pub struct TrackedStream {
    inner: UnixStream,
    info: ConnInfo,
    opener: Opener,
    _guard: CloseGuard,
}

impl TrackedStream {
    /// Whether the process that opened the connection has exited. While it runs, registers `cx`
    /// to be woken when it exits.
    fn opener_exited(&mut self, cx: &mut Context<'_>) -> bool {
        let Opener::Watched(pidfd) = &self.opener else {
            return matches!(self.opener, Opener::Exited);
        };
        match pidfd.poll_read_ready(cx) {
            Poll::Pending => false,
            Poll::Ready(Ok(_)) => {
                crate::limited!(
                    info,
                    conn = self.info.id.0,
                    pid = self.info.pid,
                    "the process that opened the connection exited; closing the connection"
                );
                self.opener = Opener::Exited;
                true
            }
            Poll::Ready(Err(e)) => {
                crate::limited!(warn, conn = self.info.id.0, error = %e, "watching a connection's process failed; only its socket's close will end it");
                self.opener = Opener::Unwatched;
                false
            }
        }
    }
}

impl Connected for TrackedStream {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info
    }
}

impl AsyncRead for TrackedStream {
    /// Reads as end of stream once the opener has exited, whatever the socket still holds.
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.opener_exited(cx) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TrackedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Accepts connections on a listener and wraps them; shared by the session and admin servers.
#[derive(Debug, Clone)]
pub struct Acceptor {
    next_id: Arc<AtomicU64>,
    closed: mpsc::UnboundedSender<ConnId>,
}

impl Acceptor {
    /// An acceptor that reports closed connections on `closed`.
    pub fn new(closed: mpsc::UnboundedSender<ConnId>) -> Self {
        Acceptor { next_id: Arc::new(AtomicU64::new(1)), closed }
    }

    /// A stream of tracked connections from `listener`. Connections whose credentials cannot be read
    /// are dropped (and logged): identity is required for every request.
    pub fn incoming(
        &self,
        listener: UnixListener,
    ) -> impl tokio_stream::Stream<Item = io::Result<TrackedStream>> + use<> {
        let this = self.clone();
        async_stream(listener, move |stream| this.wrap(stream))
    }

    fn wrap(&self, inner: UnixStream) -> Option<TrackedStream> {
        let cred = match inner.peer_cred() {
            Ok(c) => c,
            Err(e) => {
                crate::limited!(warn, error = %e, "dropping a connection whose peer credentials cannot be read");
                return None;
            }
        };
        let id = ConnId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let info = ConnInfo { id, uid: cred.uid(), gid: cred.gid(), pid: cred.pid().unwrap_or(0) };
        crate::limited!(debug, conn = id.0, uid = info.uid, pid = info.pid, "accepted");
        let opener = Opener::of(&inner, id);
        Some(TrackedStream { inner, info, opener, _guard: CloseGuard { id, closed: self.closed.clone() } })
    }
}

/// Turns a listener into a stream of wrapped connections, skipping those `wrap` rejects.
fn async_stream(
    listener: UnixListener,
    wrap: impl Fn(UnixStream) -> Option<TrackedStream> + Send + 'static,
) -> impl tokio_stream::Stream<Item = io::Result<TrackedStream>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let item = match listener.accept().await {
                Ok((stream, _)) => match wrap(stream) {
                    Some(s) => Ok(s),
                    None => continue,
                },
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    // Out of fds or similar: back off instead of spinning.
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            if tx.send(item).await.is_err() {
                break;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
