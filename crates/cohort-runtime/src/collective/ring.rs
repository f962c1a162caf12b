//! The `ring` backend: ranks in a TCP ring, each connected to its right
//! neighbour and accepting its left one, as the plan's host files say
//! (`cohort place --emit`). An all-gather takes `world_size − 1` steps; in
//! each, every rank passes one block to its right while it receives one from
//! its left, so every link carries the same load and no rank is a hub.
//!
//! Peers are other ranks of the same run, but what they send is still
//! checked. A connection is used only once both ends have proved that they
//! hold the plan's ring secret (32 random bytes `cohort place --emit` wrote
//! into every host file of the plan): in the hello, each side sends a fresh
//! random nonce and an HMAC-SHA256, keyed by the secret, over the instance,
//! both ranks, both nonces and the direction of the proof; proofs are
//! compared in constant time. So a process that knows only the plan's
//! instance and ranks can neither join the ring (and have its update
//! aggregated) nor be sent anyone's update: the connecting side sends nothing
//! of the run before the accepting side has proved itself, and the accepting
//! side reads nothing of the run from a peer that has not.
//!
//! What the secret does not protect: confidentiality and integrity in
//! transit. After the hello, updates cross in the clear, unsigned, so anyone
//! who can read or rewrite the traffic between two nodes sees every update
//! and could alter one; run the ring on a private network or through a VPN
//! (WireGuard, IPsec). Nor does it protect against a node that holds a host
//! file: anyone who can read one is a rank. See docs/SECURITY.md, "Cluster
//! ranks".
//!
//! Every frame's magic, sequence number, origin and size (bounded by the
//! caller) are checked before its bytes are read. Time is bounded at each
//! stage: each accepted connection has [`HELLO_TIMEOUT`] (or what is left of
//! the connect window) for its whole hello, so an idle or stray connection is
//! dropped and accepting goes on; each all-gather step has one deadline, the
//! I/O timeout, for its whole frame in each direction (every read and write
//! is given only the time left), so a peer that trickles a byte at a time is
//! cut off like a silent one. A dead peer or a cut link surfaces as an error
//! naming the rank and its address, never as a hang.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};

use cohort_core::cluster::{
    FRAME_HEADER_BYTES, FrameError, FrameExpectation, FrameHeader, HostPort, RingSecret,
};
use hmac::{Hmac, Mac};
use rand::TryRngCore;
use sha2::Sha256;
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;

use super::{Collective, CollectiveError};

/// Version 2: authenticated hellos (version 1 had none).
const HELLO: &[u8; 12] = b"cohort-ring2";
/// Instance names longer than this are refused in a hello.
const MAX_INSTANCE_BYTES: usize = 256;
const NONCE_BYTES: usize = 32;
const PROOF_BYTES: usize = 32;
/// The whole hello of one accepted connection, proofs included, must arrive
/// within this (or the rest of the connect window, when shorter); then the
/// connection is dropped and the next one accepted.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// The accepting side's last byte of the hello: the connecting side's proof
/// was good.
const ACCEPTED: u8 = 1;
/// Which side a proof is from, so that one side's proof is never the other's.
const FROM_ACCEPTOR: u8 = 1;
const FROM_CONNECTOR: u8 = 2;

/// Another rank as this one reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingPeer {
    pub rank: u32,
    /// An IP address, or a DNS name resolved at each connection attempt (a
    /// Kubernetes pod's name resolves only once the pod is up).
    pub address: HostPort,
    /// Its node, for error messages; may be empty.
    pub node: String,
}

impl std::fmt::Display for RingPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.node.is_empty() {
            write!(f, "rank {} (at {})", self.rank, self.address)
        } else {
            write!(f, "rank {} ({} at {})", self.rank, self.node, self.address)
        }
    }
}

/// Where this rank sits in the ring.
#[derive(Debug, Clone)]
pub struct RingSettings {
    /// The run instance; a hello from another instance is refused.
    pub instance: String,
    pub rank: u32,
    pub world_size: u32,
    pub listen: SocketAddr,
    pub left: RingPeer,
    pub right: RingPeer,
    /// The plan's ring secret, which both neighbours must prove they hold.
    pub secret: RingSecret,
    /// How long the ring may take to form (ranks start at different times).
    pub connect_timeout: Duration,
    /// How long one step may take to pass its block each way: longer than the
    /// slowest rank's training of a round, since ranks gather after training.
    pub io_timeout: Duration,
}

#[derive(Debug)]
pub struct RingCollective {
    settings: RingSettings,
    links: Option<(TcpStream, TcpStream)>,
    sequence: u64,
}

fn error(message: String) -> CollectiveError {
    CollectiveError { message }
}

impl RingCollective {
    /// Joins the ring: binds, then at once connects to the right neighbour
    /// (retrying until it listens) and accepts the left one, each with the
    /// authenticated hello. One rank needs no sockets.
    pub fn connect(settings: RingSettings) -> Result<Self, CollectiveError> {
        // The hello carries the instance; a name the peer would refuse is
        // refused here, before anything is sent.
        if settings.instance.len() > MAX_INSTANCE_BYTES {
            return Err(error(format!(
                "instance name of {} bytes; at most {MAX_INSTANCE_BYTES}",
                settings.instance.len()
            )));
        }
        if settings.rank >= settings.world_size {
            return Err(error(format!(
                "rank {} of a ring of {} ranks: ranks are 0 to world size − 1",
                settings.rank, settings.world_size
            )));
        }
        if settings.world_size <= 1 {
            return Ok(Self {
                settings,
                links: None,
                sequence: 0,
            });
        }
        let listener = TcpListener::bind(settings.listen).map_err(|e| {
            error(format!(
                "rank {}: cannot listen on {}: {e}",
                settings.rank, settings.listen
            ))
        })?;
        let deadline = Instant::now() + settings.connect_timeout;
        // Both at once: each rank's right neighbour answers its hello only
        // from its own accepting side, so connecting first everywhere would
        // wait around the ring for ever.
        let given_up = AtomicBool::new(false);
        let (right, left) = std::thread::scope(|scope| {
            let right = scope.spawn(|| {
                let right = connect_right(&settings, deadline);
                if right.is_err() {
                    given_up.store(true, Ordering::Relaxed);
                }
                right
            });
            let left = accept_left(&settings, &listener, deadline, &given_up);
            (right.join(), left)
        });
        let right =
            right.map_err(|_| error("the ring's connecting thread panicked".to_owned()))??;
        let left = left?;
        for stream in [&left, &right] {
            let _ = stream.set_nodelay(true);
            stream
                .set_read_timeout(Some(settings.io_timeout))
                .and_then(|()| stream.set_write_timeout(Some(settings.io_timeout)))
                .map_err(|e| error(format!("cannot set ring timeouts: {e}")))?;
        }
        tracing::info!(rank = settings.rank, left = %settings.left, right = %settings.right, "ring formed");
        Ok(Self {
            settings,
            links: Some((left, right)),
            sequence: 0,
        })
    }
}

/// Reads and writes on `stream` that together end by `deadline`: each is
/// given only the time left as its socket timeout, so a peer that trickles a
/// byte at a time is cut off at the deadline, as a silent one is.
struct Deadline<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl<'a> Deadline<'a> {
    fn new(stream: &'a TcpStream, deadline: Instant) -> Self {
        Self { stream, deadline }
    }

    fn left(&self) -> std::io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the deadline passed",
            ));
        }
        Ok(left)
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        let mut stream = self.stream;
        stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let mut stream = self.stream;
        stream.flush()
    }
}

fn nonce() -> Result<[u8; NONCE_BYTES], String> {
    let mut nonce = [0u8; NONCE_BYTES];
    rand::rngs::OsRng
        .try_fill_bytes(&mut nonce)
        .map_err(|e| format!("the operating system gave no random bytes for a nonce: {e}"))?;
    Ok(nonce)
}

/// What one side proves: that it holds `secret`, for this instance, these
/// two ranks, these two nonces and this direction.
fn proof(
    secret: &RingSecret,
    from: u8,
    instance: &str,
    connector: u32,
    acceptor: u32,
    connector_nonce: &[u8; NONCE_BYTES],
    acceptor_nonce: &[u8; NONCE_BYTES],
) -> [u8; PROOF_BYTES] {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
    mac.update(HELLO);
    mac.update(&[from]);
    // Bounded in connect(): fits a u16.
    mac.update(&(instance.len() as u16).to_le_bytes());
    mac.update(instance.as_bytes());
    mac.update(&connector.to_le_bytes());
    mac.update(&acceptor.to_le_bytes());
    mac.update(connector_nonce);
    mac.update(acceptor_nonce);
    mac.finalize().into_bytes().into()
}

fn proofs_match(got: &[u8; PROOF_BYTES], expected: &[u8; PROOF_BYTES]) -> bool {
    bool::from(got.ct_eq(expected))
}

/// The connecting side's first message: greeting, rank, instance, nonce.
fn hello_bytes(instance: &str, rank: u32, nonce: &[u8; NONCE_BYTES]) -> Vec<u8> {
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&rank.to_le_bytes());
    // Bounded in connect(): fits a u16.
    hello.extend_from_slice(&(instance.len() as u16).to_le_bytes());
    hello.extend_from_slice(instance.as_bytes());
    hello.extend_from_slice(nonce);
    hello
}

/// Why one attempt to reach the right neighbour failed.
enum Attempt {
    /// Not (yet) there, or not answering as a rank: tried again.
    Retry(String),
    /// It answered, but with a wrong proof: given up at once.
    Refused(String),
}

fn connect_right(settings: &RingSettings, deadline: Instant) -> Result<TcpStream, CollectiveError> {
    let right = &settings.right;
    loop {
        match try_right(settings, deadline) {
            Ok(stream) => return Ok(stream),
            Err(Attempt::Refused(reason)) => {
                return Err(error(format!("rank {}: {reason}", settings.rank)));
            }
            Err(Attempt::Retry(reason)) if Instant::now() >= deadline => {
                return Err(error(format!(
                    "rank {}: cannot reach its right neighbour {right} within {} s: {reason}",
                    settings.rank,
                    settings.connect_timeout.as_secs_f64()
                )));
            }
            Err(Attempt::Retry(_)) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// One connection to the right neighbour and its hello: this side sends
/// nothing of the run before the other has proved that it holds the secret.
fn try_right(settings: &RingSettings, deadline: Instant) -> Result<TcpStream, Attempt> {
    let right = &settings.right;
    let retry = |e: std::io::Error| Attempt::Retry(describe_hello_io(e));
    let stream = connect_any(&right.address).map_err(|e| Attempt::Retry(e.to_string()))?;
    let peer = stream
        .peer_addr()
        .map_or_else(|_| right.address.to_string(), |a| a.to_string());
    // A neighbour busy with strays answers late, but within the window.
    let mut io = Deadline::new(
        &stream,
        deadline.max(Instant::now() + Duration::from_secs(1)),
    );
    let mine = nonce().map_err(Attempt::Refused)?;
    io.write_all(&hello_bytes(&settings.instance, settings.rank, &mine))
        .map_err(retry)?;
    let mut answer = [0u8; 12 + 4 + NONCE_BYTES + PROOF_BYTES];
    io.read_exact(&mut answer).map_err(retry)?;
    if &answer[..12] != HELLO {
        return Err(Attempt::Retry(format!(
            "{peer} did not answer as a ring rank"
        )));
    }
    let rank = u32::from_le_bytes(answer[12..16].try_into().expect("4 bytes"));
    if rank != right.rank {
        return Err(Attempt::Retry(format!(
            "{peer} answered as rank {rank}, expected {}",
            right.rank
        )));
    }
    let theirs: [u8; NONCE_BYTES] = answer[16..16 + NONCE_BYTES].try_into().expect("32 bytes");
    let got: [u8; PROOF_BYTES] = answer[16 + NONCE_BYTES..].try_into().expect("32 bytes");
    let (me, instance, secret) = (settings.rank, &settings.instance, &settings.secret);
    let expected = proof(secret, FROM_ACCEPTOR, instance, me, rank, &mine, &theirs);
    if !proofs_match(&got, &expected) {
        return Err(Attempt::Refused(format!(
            "its right neighbour {right} answered from {peer}, but authentication failed: it              does not hold this plan's ring secret (the ranks' host files are of different              plans, or it is not a rank of this one); nothing was sent to it"
        )));
    }
    let own = proof(secret, FROM_CONNECTOR, instance, me, rank, &mine, &theirs);
    io.write_all(&own).map_err(retry)?;
    let mut accepted = [0u8; 1];
    io.read_exact(&mut accepted).map_err(retry)?;
    if accepted[0] != ACCEPTED {
        return Err(Attempt::Retry(format!("{peer} did not accept the hello")));
    }
    Ok(stream)
}

fn describe_hello_io(e: std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            "no complete hello in time".to_owned()
        }
        std::io::ErrorKind::UnexpectedEof => "closed the connection during the hello".to_owned(),
        _ => e.to_string(),
    }
}

/// The first of `address`'s resolved socket addresses that accepts a
/// connection; a name that does not resolve (yet) is an error like a refused
/// connection, so the caller retries it until its deadline.
fn connect_any(address: &HostPort) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!("{} resolves to no address", address.host),
    );
    for candidate in address.resolve()? {
        match TcpStream::connect_timeout(&candidate, Duration::from_secs(2)) {
            Ok(stream) => return Ok(stream),
            Err(error) => last = error,
        }
    }
    Err(last)
}

/// Accepts connections until one completes the hello as the left neighbour of
/// this instance; each has [`HELLO_TIMEOUT`] for it, and the others are
/// closed. When the connecting side has `given_up`, it goes on for one more
/// hello at most (within [`HELLO_TIMEOUT`]): the left neighbour, refused
/// with a wrong secret too, then learns so from this side's proof instead of
/// finding the port closed.
fn accept_left(
    settings: &RingSettings,
    listener: &TcpListener,
    deadline: Instant,
    given_up: &AtomicBool,
) -> Result<TcpStream, CollectiveError> {
    let left = &settings.left;
    listener
        .set_nonblocking(true)
        .map_err(|e| error(format!("cannot poll the ring listener: {e}")))?;
    let mut last_refusal = String::new();
    let mut grace: Option<Instant> = None;
    loop {
        let stopping = grace.is_some();
        match listener.accept() {
            Ok((stream, peer)) => {
                let _ = stream.set_nonblocking(false);
                let now = Instant::now();
                let by = (now + HELLO_TIMEOUT).min(deadline.max(now + Duration::from_millis(100)));
                match accept_hello(&stream, settings, by) {
                    Ok(()) => return Ok(stream),
                    Err(reason) => {
                        tracing::warn!(%peer, "not the ring's left neighbour ({reason}); closed");
                        last_refusal =
                            format!("; the last connection refused, from {peer}: {reason}");
                    }
                }
                if stopping {
                    grace = Some(now);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => return Err(error(format!("ring listener failed: {e}"))),
        }
        if grace.is_none() && given_up.load(Ordering::Relaxed) {
            grace = Some(Instant::now() + HELLO_TIMEOUT);
        }
        if grace.is_some_and(|end| Instant::now() >= end) {
            return Err(error(format!(
                "rank {}: stopped waiting for its left neighbour {left}{last_refusal}",
                settings.rank
            )));
        }
        if Instant::now() >= deadline {
            return Err(error(format!(
                "rank {}: its left neighbour {left} did not connect within {} s{last_refusal}",
                settings.rank,
                settings.connect_timeout.as_secs_f64()
            )));
        }
    }
}

/// The accepting side of the hello, all by `deadline`: the left neighbour's
/// greeting, rank, instance and nonce; this side's nonce and proof; the
/// neighbour's proof, checked before the connection is used.
fn accept_hello(
    stream: &TcpStream,
    settings: &RingSettings,
    deadline: Instant,
) -> Result<(), String> {
    let mut io = Deadline::new(stream, deadline);
    let mut head = [0u8; 18];
    io.read_exact(&mut head).map_err(describe_hello_io)?;
    if &head[..12] != HELLO {
        return Err("wrong greeting".to_owned());
    }
    let rank = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
    let length = u16::from_le_bytes(head[16..18].try_into().expect("2 bytes")) as usize;
    if rank != settings.left.rank {
        return Err(format!(
            "hello from rank {rank}, expected {}",
            settings.left.rank
        ));
    }
    if length > MAX_INSTANCE_BYTES {
        return Err(format!("instance name of {length} bytes"));
    }
    let mut name = vec![0u8; length];
    io.read_exact(&mut name).map_err(describe_hello_io)?;
    let instance = &settings.instance;
    if name != instance.as_bytes() {
        return Err(format!(
            "instance `{}`, this one is `{instance}`",
            String::from_utf8_lossy(&name)
        ));
    }
    let mut theirs = [0u8; NONCE_BYTES];
    io.read_exact(&mut theirs).map_err(describe_hello_io)?;
    let mine = nonce()?;
    let (me, secret) = (settings.rank, &settings.secret);
    let mut answer = HELLO.to_vec();
    answer.extend_from_slice(&me.to_le_bytes());
    answer.extend_from_slice(&mine);
    answer.extend_from_slice(&proof(
        secret,
        FROM_ACCEPTOR,
        instance,
        rank,
        me,
        &theirs,
        &mine,
    ));
    io.write_all(&answer).map_err(describe_hello_io)?;
    let mut got = [0u8; PROOF_BYTES];
    io.read_exact(&mut got).map_err(describe_hello_io)?;
    let expected = proof(secret, FROM_CONNECTOR, instance, rank, me, &theirs, &mine);
    if !proofs_match(&got, &expected) {
        return Err(
            "authentication failed: its proof does not match this plan's ring secret".to_owned(),
        );
    }
    io.write_all(&[ACCEPTED]).map_err(describe_hello_io)?;
    Ok(())
}

fn write_frame(
    stream: &mut impl Write,
    sequence: u64,
    origin: u32,
    bytes: &[u8],
) -> std::io::Result<()> {
    let header = FrameHeader {
        sequence,
        origin,
        length: bytes.len() as u64,
    };
    stream.write_all(&header.encode())?;
    stream.write_all(bytes)?;
    stream.flush()
}

/// Reads the frame of step `expected.sequence`, which must carry rank
/// `expected.origin`'s block of at most `expected.max_bytes`; the header is
/// checked (`cohort_core::cluster::FrameHeader::decode`) before any of it.
fn read_frame(stream: &mut impl Read, expected: &FrameExpectation) -> Result<Vec<u8>, String> {
    let mut head = [0u8; FRAME_HEADER_BYTES];
    stream.read_exact(&mut head).map_err(describe_io)?;
    let length = FrameHeader::decode(&head, expected)
        .map_err(|e| e.to_string())?
        .length;
    let mut bytes = Vec::with_capacity(length.min(1 << 20) as usize);
    stream
        .take(length)
        .read_to_end(&mut bytes)
        .map_err(describe_io)?;
    if bytes.len() as u64 != length {
        let got = bytes.len() as u64;
        return Err(FrameError::ShortBlock { got, length }.to_string());
    }
    Ok(bytes)
}

fn describe_io(e: std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            "did not finish the step within the ring's I/O timeout (dead, stuck, cut off or \
             too slow)"
                .to_owned()
        }
        std::io::ErrorKind::UnexpectedEof => "closed the connection".to_owned(),
        _ => e.to_string(),
    }
}

impl Collective for RingCollective {
    fn rank(&self) -> u32 {
        self.settings.rank
    }

    fn world_size(&self) -> u32 {
        self.settings.world_size
    }

    fn all_gather(
        &mut self,
        mine: Vec<u8>,
        max_bytes: u64,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let settings = &self.settings;
        if mine.len() as u64 > max_bytes {
            return Err(error(format!(
                "rank {}: its own contribution of {} bytes exceeds {max_bytes}",
                settings.rank,
                mine.len()
            )));
        }
        let n = settings.world_size as usize;
        let rank = settings.rank as usize;
        let mut blocks: Vec<Option<Vec<u8>>> = vec![None; n];
        blocks[rank] = Some(mine);
        let Some((left, right)) = self.links.as_ref() else {
            return Ok(blocks.into_iter().flatten().collect());
        };
        for step in 0..n - 1 {
            let outgoing_index = (rank + n - step) % n;
            let incoming_index = (rank + 2 * n - step - 1) % n;
            let sequence = self.sequence;
            self.sequence += 1;
            // One deadline for the whole step, each way: every read and write
            // gets only the time left, so a trickle is cut off like silence.
            let step_deadline = Instant::now() + settings.io_timeout;
            let outgoing = blocks[outgoing_index]
                .as_deref()
                .expect("held since the step before");
            // Send and receive at once: with both blocking, large blocks
            // would fill every socket buffer of the ring and stall it.
            let (sent, received) = std::thread::scope(|scope| {
                let sender = scope.spawn(|| {
                    let mut right = Deadline::new(right, step_deadline);
                    write_frame(&mut right, sequence, outgoing_index as u32, outgoing)
                });
                let expected = FrameExpectation {
                    sequence,
                    origin: incoming_index as u32,
                    world_size: settings.world_size,
                    max_bytes,
                };
                let mut left = Deadline::new(left, step_deadline);
                let received = read_frame(&mut left, &expected);
                (sender.join(), received)
            });
            // Both sides are reported: the neighbour that died is named even
            // when the other one noticed first and hung up on this rank.
            let receive_error = received
                .as_ref()
                .err()
                .map(|reason| format!("its left neighbour {} {reason}", settings.left));
            let send_error = match sent {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!(
                    "sending to {} failed: {}",
                    settings.right,
                    describe_io(e)
                )),
                Err(_) => Some("the ring's sending thread panicked".to_owned()),
            };
            let problems: Vec<String> = receive_error.into_iter().chain(send_error).collect();
            if !problems.is_empty() {
                return Err(error(format!(
                    "rank {}: {}",
                    settings.rank,
                    problems.join("; ")
                )));
            }
            let block = received.expect("checked above");
            blocks[incoming_index] = Some(block);
        }
        Ok(blocks.into_iter().flatten().collect())
    }
}

#[cfg(test)]
mod tests;
