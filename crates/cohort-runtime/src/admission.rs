//! Which TCP connections the gRPC server gets to see.
//!
//! tonic serves whatever its incoming stream yields, and waits for a client's
//! first bytes without a deadline. Left alone, connections that never send a
//! byte pile up until the process runs out of file descriptors, and then the
//! accept loop fails in a tight loop. This stream sits in front: at most
//! `max_connections` open at once and `max_per_address` from one IP address
//! (one more is closed at once), a connection that sends nothing within
//! `first_byte_within` is closed, one that has not registered a client within
//! `register_within` is closed too (whatever bytes it trickles), and so is a
//! registered connection once its client process is gone (it left, or the
//! server dropped it for not answering a task), so a process that never
//! answers cannot keep its slot; an accept error backs off instead of
//! spinning.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use atomic_waker::AtomicWaker;
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
    /// Connections open at once from one IP address, so one host cannot
    /// take every slot.
    pub max_per_address: usize,
    /// A connection must send its first byte within this.
    pub first_byte_within: Duration,
    /// A connection must have registered a client process within this.
    pub register_within: Duration,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_per_address: 64,
            first_byte_within: Duration::from_secs(10),
            register_within: Duration::from_secs(20),
        }
    }
}

/// How long the accept loop waits after an accept error (out of file
/// descriptors, say) before it tries again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// A connection that passed admission; it holds its slot (and its place
/// among its address's) until it closes.
pub struct Admitted {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    _address_slot: AddressSlot,
    registration: Arc<Registration>,
    /// When a connection without a client process is cut off.
    deadline: Pin<Box<tokio::time::Sleep>>,
}

/// Whether a client process is registered on a connection. Set by the
/// registration, cleared when the process is gone; a connection without one
/// past its deadline is closed.
#[derive(Debug, Default)]
pub struct Registration {
    registered: AtomicBool,
    /// The connection's reader, woken when its process is gone so it is cut
    /// off then, not at the peer's next byte.
    reader: AtomicWaker,
}

impl Registration {
    /// Marks the connection as a client process's; `false` if it is one
    /// already (one process per connection: more streams on it would be more
    /// processes in one slot).
    pub fn register(&self) -> bool {
        !self.registered.swap(true, Ordering::SeqCst)
    }

    /// The connection's process is gone: the connection is closed at once
    /// if its registration deadline has passed.
    pub fn release(&self) {
        self.registered.store(false, Ordering::SeqCst);
        self.reader.wake();
    }

    fn is_registered(&self) -> bool {
        self.registered.load(Ordering::SeqCst)
    }
}

/// What a request learns of its connection: the peer, and its registration.
#[derive(Debug, Clone)]
pub struct AdmittedInfo {
    pub tcp: TcpConnectInfo,
    pub registration: Arc<Registration>,
}

impl Connected for Admitted {
    type ConnectInfo = AdmittedInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        AdmittedInfo {
            tcp: self.stream.connect_info(),
            registration: Arc::clone(&self.registration),
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
        // cut off on time, not only when it next sends a byte; the waker
        // lets a release do the same.
        self.registration.reader.register(cx.waker());
        if !self.registration.is_registered() && self.deadline.as_mut().poll(cx).is_ready() {
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

/// Open connections per IP address.
#[derive(Default)]
struct AddressCounts(Mutex<HashMap<IpAddr, usize>>);

/// One connection's place among its address's; given back when dropped.
struct AddressSlot {
    counts: Arc<AddressCounts>,
    address: IpAddr,
}

impl AddressCounts {
    /// A place for one more connection from `address`, if it has fewer than
    /// `limit` open.
    fn take(self: &Arc<Self>, address: IpAddr, limit: usize) -> Option<AddressSlot> {
        let mut counts = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let open = counts.entry(address).or_default();
        if *open >= limit {
            return None;
        }
        *open += 1;
        Some(AddressSlot {
            counts: Arc::clone(self),
            address,
        })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut counts = self
            .counts
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(open) = counts.get_mut(&self.address) {
            *open -= 1;
            if *open == 0 {
                counts.remove(&self.address);
            }
        }
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
    let addresses = Arc::new(AddressCounts::default());
    tokio::spawn(async move {
        let mut refusals = Refusals::default();
        loop {
            // Stop at once when the server drops the stream, so the socket
            // closes with it.
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = admitted.closed() => break,
            };
            let (stream, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    refusals.note(&format!(
                        "cannot accept a connection ({error}); backing off"
                    ));
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let Some(address_slot) = addresses.take(peer.ip(), admission.max_per_address) else {
                refusals.note(&format!(
                    "connection closed: {} has the maximum of {} open connections from one \
                     address (server.max_connections_per_address)",
                    peer.ip(),
                    admission.max_per_address
                ));
                continue;
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
                        _address_slot: address_slot,
                        registration: Arc::default(),
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
