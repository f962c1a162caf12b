//! Which TCP connections the gRPC server gets to see.
//!
//! tonic serves whatever its incoming stream yields, and waits for a client's
//! first bytes without a deadline. Left alone, connections that never send a
//! byte pile up until the process runs out of file descriptors, and then the
//! accept loop fails in a tight loop. This stream sits in front: at most
//! `max_connections` open at once (one more is closed at once), a connection
//! that sends nothing within `first_byte_within` is closed, and an accept
//! error backs off instead of spinning.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// The limits on incoming connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Connections open at once, registered clients and others together.
    pub max_connections: usize,
    /// A connection must send its first byte within this.
    pub first_byte_within: Duration,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            max_connections: 256,
            first_byte_within: Duration::from_secs(10),
        }
    }
}

/// How long the accept loop waits after an accept error (out of file
/// descriptors, say) before it tries again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// A connection that passed admission; it holds its slot until it closes.
pub struct Admitted {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
}

impl Connected for Admitted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The admitted connections of `listener`, for `serve_with_incoming`. Must be
/// called inside a tokio runtime; the accept loop ends when the stream is
/// dropped.
pub fn incoming(
    listener: TcpListener,
    admission: Admission,
) -> impl Stream<Item = io::Result<Admitted>> {
    let (admitted, stream) = mpsc::channel(64);
    let slots = Arc::new(Semaphore::new(admission.max_connections));
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(error) => {
                    tracing::warn!(%error, "cannot accept a connection; retrying shortly");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            if admitted.is_closed() {
                break;
            }
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                tracing::warn!(
                    peer = ?stream.peer_addr().ok(),
                    limit = admission.max_connections,
                    "connection closed: the server has its maximum of open connections"
                );
                continue;
            };
            let admitted = admitted.clone();
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                let spoke =
                    tokio::time::timeout(admission.first_byte_within, stream.peek(&mut first))
                        .await;
                if let Ok(Ok(1..)) = spoke {
                    let _ = admitted
                        .send(Ok(Admitted {
                            stream,
                            _slot: slot,
                        }))
                        .await;
                } else {
                    tracing::info!(
                        peer = ?stream.peer_addr().ok(),
                        "connection closed: nothing sent within {:?}",
                        admission.first_byte_within
                    );
                }
            });
        }
    });
    ReceiverStream::new(stream)
}
