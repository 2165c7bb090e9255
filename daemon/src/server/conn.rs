//! Accepted Unix stream connections for the gRPC servers, with the peer's credentials and a close
//! notification.
//!
//! Each accepted socket is wrapped in a [`TrackedStream`] that tonic hands to hyper. Its
//! [`ConnInfo`] (connection id and `SO_PEERCRED`, read once at accept) is attached to every request
//! as an extension, so identity never comes from a request field. When hyper drops the stream (the
//! peer closed the connection or died), the stream's guard sends the connection id on a channel; the
//! daemon then destroys the sessions attached through that connection.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

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

/// An accepted connection: the socket, its peer, and the guard that reports its end.
#[derive(Debug)]
pub struct TrackedStream {
    inner: UnixStream,
    info: ConnInfo,
    _guard: CloseGuard,
}

impl Connected for TrackedStream {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info
    }
}

impl AsyncRead for TrackedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
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
        Some(TrackedStream { inner, info, _guard: CloseGuard { id, closed: self.closed.clone() } })
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
