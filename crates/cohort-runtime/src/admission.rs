//! Which TCP connections the gRPC server gets to see.
//!
//! tonic serves whatever its incoming stream yields, and waits for a client's
//! first bytes without a deadline. Left alone, connections that never send a
//! byte pile up until the process runs out of file descriptors, and then the
//! accept loop fails in a tight loop. This stream sits in front: at most
//! `max_connections` open at once (one more is closed at once), a connection
//! that sends nothing within `first_byte_within` is closed, one that has not
//! registered a client within `register_within` is closed too (whatever bytes
//! it trickles), and an accept error backs off instead of spinning.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// A connection must have registered a client process within this.
    pub register_within: Duration,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            max_connections: 256,
            first_byte_within: Duration::from_secs(10),
            register_within: Duration::from_secs(20),
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
    registered: Arc<AtomicBool>,
    /// When an unregistered connection is cut off.
    deadline: Pin<Box<tokio::time::Sleep>>,
}

/// What a request learns of its connection: the peer, and a flag the
/// registration sets so the connection may stay.
#[derive(Debug, Clone)]
pub struct AdmittedInfo {
    pub tcp: TcpConnectInfo,
    pub registered: Arc<AtomicBool>,
}

impl Connected for Admitted {
    type ConnectInfo = AdmittedInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        AdmittedInfo {
            tcp: self.stream.connect_info(),
            registered: Arc::clone(&self.registered),
        }
    }
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // Polling the deadline arms its timer, so a silent peer is woken and
        // cut off on time, not only when it next sends a byte.
        if !self.registered.load(Ordering::Relaxed) && self.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no client registered on this connection in time",
            )));
        }
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

/// How often one kind of refusal is logged: once per window, with a count.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// Refusals of one kind, logged at most once every ten seconds with a count,
/// so a flood of refused connections (or registrations) cannot flood
/// `run.log`.
#[derive(Default)]
pub(crate) struct Refusals {
    last: Option<std::time::Instant>,
    unlogged: u64,
}

impl Refusals {
    fn note(&mut self, what: &str) {
        if let Some(times) = self.due() {
            tracing::warn!(times, "{what}");
        }
    }

    /// Counts one refusal; `Some(refusals since the last line)` when this
    /// one is to be logged.
    pub(crate) fn due(&mut self) -> Option<u64> {
        self.unlogged += 1;
        if self.in_window() {
            return None;
        }
        let times = std::mem::take(&mut self.unlogged);
        self.last = Some(std::time::Instant::now());
        Some(times)
    }

    fn in_window(&self) -> bool {
        self.last
            .is_some_and(|last| last.elapsed() < REFUSAL_LOG_EVERY)
    }
}

/// [`Refusals`] per peer address and kind of refusal, for refusals that come
/// after a connection is admitted (a wrong token, say). Keyed by IP address,
/// not port: a peer that reconnects gets a new port each time.
#[derive(Default)]
pub(crate) struct RefusalsByPeer {
    peers: HashMap<(IpAddr, &'static str), Refusals>,
    /// Shared by the peers that find the table full, so that many addresses
    /// (an IPv6 prefix, all of 127.0.0.0/8) cannot grow it or the log
    /// without bound either.
    overflow: Refusals,
}

/// (Peer address, kind) pairs tracked at once: at most this many refusal
/// lines, and one more, per window.
const MAX_TRACKED_PEERS: usize = 256;

impl RefusalsByPeer {
    /// Counts one refusal of `kind` from `peer`; `Some(refusals of this kind
    /// from this peer since its last line)` when this one is to be logged.
    pub(crate) fn due(&mut self, peer: Option<IpAddr>, kind: &'static str) -> Option<u64> {
        let Some(peer) = peer else {
            return self.overflow.due();
        };
        if self.peers.len() >= MAX_TRACKED_PEERS && !self.peers.contains_key(&(peer, kind)) {
            // A peer whose window has passed would be logged at its next
            // refusal anyway; forgetting it loses only its count.
            self.peers.retain(|_, refusals| refusals.in_window());
        }
        if self.peers.len() >= MAX_TRACKED_PEERS && !self.peers.contains_key(&(peer, kind)) {
            return self.overflow.due();
        }
        self.peers.entry((peer, kind)).or_default().due()
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
        let mut refusals = Refusals::default();
        loop {
            // Stop at once when the server drops the stream, so the socket
            // closes with it.
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = admitted.closed() => break,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    refusals.note(&format!(
                        "cannot accept a connection ({error}); backing off"
                    ));
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                refusals.note(&format!(
                    "connection closed: the server has its maximum of {} open connections",
                    admission.max_connections
                ));
                continue;
            };
            let admitted = admitted.clone();
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                let spoke =
                    tokio::time::timeout(admission.first_byte_within, stream.peek(&mut first))
                        .await;
                if let Ok(Ok(1..)) = spoke {
                    let connection = Admitted {
                        stream,
                        _slot: slot,
                        registered: Arc::new(AtomicBool::new(false)),
                        deadline: Box::pin(tokio::time::sleep(admission.register_within)),
                    };
                    let _ = admitted.send(Ok(connection)).await;
                } else {
                    tracing::debug!(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_logged_once_per_window_per_peer_and_kind() {
        let mut refusals = RefusalsByPeer::default();
        let peer = |last: u8| Some(IpAddr::from([10, 0, 0, last]));
        assert_eq!(refusals.due(peer(1), "token"), Some(1));
        assert_eq!(refusals.due(peer(1), "token"), None);
        assert_eq!(refusals.due(peer(1), "name"), Some(1));
        assert_eq!(refusals.due(peer(2), "token"), Some(1));
        // The table full of peers still in their window: newcomers share one.
        for last in 3..=255 {
            refusals.due(peer(last), "token");
        }
        assert_eq!(refusals.peers.len(), MAX_TRACKED_PEERS);
        assert_eq!(
            refusals.due(Some(IpAddr::from([10, 0, 1, 1])), "token"),
            Some(1)
        );
        assert_eq!(
            refusals.due(Some(IpAddr::from([10, 0, 1, 2])), "token"),
            None
        );
        assert_eq!(refusals.due(None, "token"), None);
        assert_eq!(refusals.peers.len(), MAX_TRACKED_PEERS);
    }
}
