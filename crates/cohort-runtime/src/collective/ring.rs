//! The `ring` backend: ranks in a TCP ring, each connected to its right
//! neighbour and accepting its left one, as the plan's host files say
//! (`cohort place --emit`). An all-gather takes `world_size − 1` steps; in
//! each, every rank passes one block to its right while it receives one from
//! its left, so every link carries the same load and no rank is a hub.
//!
//! Peers are other ranks of the same run, but what they send is still
//! checked: a hello naming the instance and the expected rank before a
//! connection is used, and every frame's magic, sequence number, origin and
//! size (bounded by the caller) before its bytes are read. A dead peer or a
//! cut link surfaces as an error naming the rank and its address within the
//! I/O timeout, never as a hang.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};

use cohort_core::cluster::{
    FRAME_HEADER_BYTES, FrameError, FrameExpectation, FrameHeader, HostPort,
};
use std::time::{Duration, Instant};

use super::{Collective, CollectiveError};

const HELLO: &[u8; 12] = b"cohort-ring1";
/// Instance names longer than this are refused in a hello.
const MAX_INSTANCE_BYTES: usize = 256;

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
    /// How long the ring may take to form (ranks start at different times).
    pub connect_timeout: Duration,
    /// How long one step may wait for its neighbour: longer than the slowest
    /// rank's training of a round, since ranks gather after training.
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
    /// Joins the ring: binds, connects to the right neighbour (retrying until
    /// it listens), then accepts the left one. One rank needs no sockets.
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
        let right = connect_right(&settings, deadline)?;
        let left = accept_left(&settings, &listener, deadline)?;
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

fn connect_right(settings: &RingSettings, deadline: Instant) -> Result<TcpStream, CollectiveError> {
    let right = &settings.right;
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&settings.rank.to_le_bytes());
    // Bounded in connect(): fits a u16.
    hello.extend_from_slice(&(settings.instance.len() as u16).to_le_bytes());
    hello.extend_from_slice(settings.instance.as_bytes());
    loop {
        let attempt = connect_any(&right.address)
            .and_then(|mut stream| stream.write_all(&hello).map(|()| stream));
        match attempt {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() >= deadline => {
                return Err(error(format!(
                    "rank {}: cannot reach its right neighbour {right} within {} s: {e}",
                    settings.rank,
                    settings.connect_timeout.as_secs_f64()
                )));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
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

/// Accepts connections until one says hello as the left neighbour of this
/// instance; strays are closed.
fn accept_left(
    settings: &RingSettings,
    listener: &TcpListener,
    deadline: Instant,
) -> Result<TcpStream, CollectiveError> {
    let left = &settings.left;
    listener
        .set_nonblocking(true)
        .map_err(|e| error(format!("cannot poll the ring listener: {e}")))?;
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                let _ = stream.set_nonblocking(false);
                let remaining = deadline.saturating_duration_since(Instant::now());
                let _ = stream.set_read_timeout(Some(remaining.max(Duration::from_millis(100))));
                match read_hello(stream, &settings.instance) {
                    Ok((stream, rank)) if rank == left.rank => return Ok(stream),
                    Ok((_, rank)) => {
                        tracing::warn!(%peer, rank, "ring hello from rank {rank}, expected {}; closed", left.rank)
                    }
                    Err(reason) => tracing::warn!(%peer, "not a ring peer ({reason}); closed"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => return Err(error(format!("ring listener failed: {e}"))),
        }
        if Instant::now() >= deadline {
            return Err(error(format!(
                "rank {}: its left neighbour {left} did not connect within {} s",
                settings.rank,
                settings.connect_timeout.as_secs_f64()
            )));
        }
    }
}

fn read_hello(mut stream: TcpStream, instance: &str) -> Result<(TcpStream, u32), String> {
    let mut head = [0u8; 18];
    stream.read_exact(&mut head).map_err(|e| e.to_string())?;
    if &head[..12] != HELLO {
        return Err("wrong greeting".to_owned());
    }
    let rank = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
    let length = u16::from_le_bytes(head[16..18].try_into().expect("2 bytes")) as usize;
    if length > MAX_INSTANCE_BYTES {
        return Err(format!("instance name of {length} bytes"));
    }
    let mut name = vec![0u8; length];
    stream.read_exact(&mut name).map_err(|e| e.to_string())?;
    if name != instance.as_bytes() {
        return Err(format!(
            "instance `{}`, this one is `{instance}`",
            String::from_utf8_lossy(&name)
        ));
    }
    Ok((stream, rank))
}

fn write_frame(
    stream: &mut TcpStream,
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
fn read_frame(stream: &mut TcpStream, expected: &FrameExpectation) -> Result<Vec<u8>, String> {
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
            "sent nothing within the ring's I/O timeout (dead, stuck or cut off)".to_owned()
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
        let Some((left, right)) = self.links.as_mut() else {
            return Ok(blocks.into_iter().flatten().collect());
        };
        for step in 0..n - 1 {
            let outgoing_index = (rank + n - step) % n;
            let incoming_index = (rank + 2 * n - step - 1) % n;
            let sequence = self.sequence;
            self.sequence += 1;
            let outgoing = blocks[outgoing_index]
                .as_deref()
                .expect("held since the step before");
            // Send and receive at once: with both blocking, large blocks
            // would fill every socket buffer of the ring and stall it.
            let (sent, received) = std::thread::scope(|scope| {
                let sender =
                    scope.spawn(|| write_frame(right, sequence, outgoing_index as u32, outgoing));
                let expected = FrameExpectation {
                    sequence,
                    origin: incoming_index as u32,
                    world_size: settings.world_size,
                    max_bytes,
                };
                let received = read_frame(left, &expected);
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
mod tests {
    use super::*;

    fn free_ports(count: usize) -> Vec<u16> {
        let listeners: Vec<TcpListener> = (0..count)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        listeners
            .iter()
            .map(|l| l.local_addr().unwrap().port())
            .collect()
    }

    #[test]
    fn a_rank_outside_its_ring_is_an_error_not_a_panic() {
        let ports = free_ports(3);
        for (rank, world) in [(3, 3), (0, 0)] {
            let seat = RingSettings {
                rank,
                world_size: world,
                ..settings(3, &ports, 0)
            };
            match RingCollective::connect(seat) {
                Err(error) => assert!(
                    error
                        .to_string()
                        .contains(&format!("rank {rank} of a ring of {world}")),
                    "{error}"
                ),
                Ok(_) => panic!("rank {rank} of {world} was seated"),
            }
        }
    }

    fn settings(world: u32, ports: &[u16], rank: u32) -> RingSettings {
        let peer = |r: u32| RingPeer {
            rank: r,
            address: HostPort::from(SocketAddr::from(([127, 0, 0, 1], ports[r as usize]))),
            node: format!("node{r}"),
        };
        RingSettings {
            instance: "test".to_owned(),
            rank,
            world_size: world,
            listen: SocketAddr::from(([127, 0, 0, 1], ports[rank as usize])),
            left: peer((rank + world - 1) % world),
            right: peer((rank + 1) % world),
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(5),
        }
    }

    /// Every rank of rings of 1 to 5 gets every block, in rank order, over
    /// several gathers, with blocks large enough to fill socket buffers.
    #[test]
    fn all_gather_gives_every_rank_every_block_on_rings_of_one_to_five() {
        for world in 1..=5u32 {
            let ports = free_ports(world as usize);
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let settings = settings(world, &ports, rank);
                    std::thread::spawn(move || {
                        let mut ring = RingCollective::connect(settings).unwrap();
                        (0..3u8)
                            .map(|round| {
                                let size = 300_000 * (rank as usize + 1);
                                let mine = vec![round.wrapping_mul(7) ^ rank as u8; size];
                                ring.all_gather(mine, 2_000_000).unwrap()
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for handle in handles {
                let gathered = handle.join().unwrap();
                for (round, blocks) in gathered.iter().enumerate() {
                    assert_eq!(blocks.len(), world as usize);
                    for (origin, block) in blocks.iter().enumerate() {
                        assert_eq!(block.len(), 300_000 * (origin + 1));
                        assert!(block.iter().all(|&b| b == (round as u8 * 7) ^ origin as u8));
                    }
                }
            }
        }
    }

    #[test]
    fn a_dead_neighbour_is_named_within_the_timeout() {
        let ports = free_ports(3);
        let mut handles: Vec<_> = (0..3u32)
            .map(|rank| {
                let mut settings = settings(3, &ports, rank);
                settings.io_timeout = Duration::from_millis(500);
                std::thread::spawn(move || {
                    let mut ring = RingCollective::connect(settings).unwrap();
                    ring.all_gather(vec![1; 10], 100).unwrap();
                    if rank == 2 {
                        return None; // dies: drops its sockets
                    }
                    Some(ring.all_gather(vec![2; 10], 100).unwrap_err().to_string())
                })
            })
            .collect();
        let _ = handles.pop().unwrap().join();
        let errors: Vec<String> = handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        // Rank 0 receives from rank 2; rank 1 sends to rank 2 or waits on rank 0.
        assert!(
            errors[0].contains("rank 2 (node2 at 127.0.0.1:"),
            "{}",
            errors[0]
        );
        assert!(errors[0].starts_with("rank 0:"), "{}", errors[0]);
        assert!(errors[1].starts_with("rank 1:"), "{}", errors[1]);
    }

    #[test]
    fn an_overlong_instance_name_is_refused_before_anything_is_sent() {
        let ports = free_ports(2);
        let mut settings = settings(2, &ports, 0);
        settings.instance = "x".repeat(70_000);
        let message = RingCollective::connect(settings).unwrap_err().to_string();
        assert!(
            message.contains("instance name of 70000 bytes; at most 256"),
            "{message}"
        );
    }

    #[test]
    fn oversized_blocks_are_refused() {
        let ports = free_ports(2);
        let handles: Vec<_> = (0..2u32)
            .map(|rank| {
                let mut settings = settings(2, &ports, rank);
                settings.io_timeout = Duration::from_millis(500);
                std::thread::spawn(move || {
                    let mut ring = RingCollective::connect(settings).unwrap();
                    let size = if rank == 0 { 1000 } else { 10 };
                    ring.all_gather(vec![0; size], 100)
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let own = results[0].as_ref().unwrap_err();
        assert!(
            own.contains("its own contribution of 1000 bytes exceeds 100"),
            "{own}"
        );
    }
}
