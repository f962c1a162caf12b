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
        secret: RingSecret::from_bytes([7; 32]),
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

/// Connects to `port` until it listens.
fn connect_until_listening(port: u16) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => return stream,
            Err(e) if Instant::now() >= deadline => panic!("port {port}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// A process that knows the instance and says rank 0, but not the
/// secret, connects to rank 1 first: it is refused (no acceptance, nothing
/// of the run), and the honest rank 0 still joins and gathers.
#[test]
fn a_fake_rank_without_the_secret_is_refused_and_the_ring_still_forms() {
    let ports = free_ports(2);
    let one = {
        let settings = settings(2, &ports, 1);
        std::thread::spawn(move || {
            let mut ring = RingCollective::connect(settings).map_err(|e| e.to_string())?;
            ring.all_gather(vec![1; 10], 100).map_err(|e| e.to_string())
        })
    };
    let mut fake = connect_until_listening(ports[1]);
    fake.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
    fake.write_all(&hello_bytes("test", 0, &[3; NONCE_BYTES]))
        .unwrap();
    let mut answer = [0u8; 12 + 4 + NONCE_BYTES + PROOF_BYTES];
    fake.read_exact(&mut answer).unwrap();
    // A guess at the proof, and an update it would like aggregated.
    fake.write_all(&[0x55; PROOF_BYTES]).unwrap();
    let _ = write_frame(&mut fake, 0, 0, &[66; 10]);
    let mut got = Vec::new();
    let _ = fake.read_to_end(&mut got);
    assert!(got.is_empty(), "the fake rank was sent {got:?}");

    let zero = {
        let settings = settings(2, &ports, 0);
        std::thread::spawn(move || {
            let mut ring = RingCollective::connect(settings).map_err(|e| e.to_string())?;
            ring.all_gather(vec![0; 10], 100).map_err(|e| e.to_string())
        })
    };
    for handle in [zero, one] {
        let blocks = handle.join().unwrap().unwrap();
        assert_eq!(blocks, vec![vec![0; 10], vec![1; 10]]);
    }
}

/// Ranks whose host files hold different secrets do not form a ring:
/// each refuses the other, naming its address and the authentication.
#[test]
fn ranks_with_different_secrets_fail_naming_authentication() {
    let ports = free_ports(2);
    let started = Instant::now();
    let handles: Vec<_> = (0..2u32)
        .map(|rank| {
            let mut settings = settings(2, &ports, rank);
            if rank == 1 {
                settings.secret = RingSecret::from_bytes([8; 32]);
            }
            std::thread::spawn(move || RingCollective::connect(settings).map(|_| ()))
        })
        .collect();
    for (rank, handle) in handles.into_iter().enumerate() {
        let message = handle.join().unwrap().unwrap_err().to_string();
        let other = ports[1 - rank];
        assert!(message.contains("authentication failed"), "{message}");
        assert!(message.contains(&format!("127.0.0.1:{other}")), "{message}");
    }
    assert!(started.elapsed() < Duration::from_secs(8));
}

/// An idle connection to a rank's port holds its accepting side for the
/// hello deadline only, not the whole connect window.
#[test]
fn an_idle_connection_does_not_stop_the_ring_forming() {
    let ports = free_ports(2);
    let spawn = |rank: u32| {
        let mut settings = settings(2, &ports, rank);
        settings.connect_timeout = Duration::from_secs(30);
        std::thread::spawn(move || {
            let mut ring = RingCollective::connect(settings).unwrap();
            ring.all_gather(vec![rank as u8; 4], 100).unwrap()
        })
    };
    let one = spawn(1);
    let _idle = connect_until_listening(ports[1]);
    let started = Instant::now();
    let zero = spawn(0);
    for handle in [zero, one] {
        assert_eq!(handle.join().unwrap(), vec![vec![0; 4], vec![1; 4]]);
    }
    let took = started.elapsed();
    assert!(took < HELLO_TIMEOUT + Duration::from_secs(4), "{took:?}");
}

/// A neighbour that sends its frame a byte every 200 ms, each byte well
/// within the 1 s I/O timeout, is cut off when the step's 1 s is up.
#[test]
fn a_trickling_neighbour_is_cut_at_the_step_deadline() {
    let ports = free_ports(2);
    let trickler = {
        let settings = settings(2, &ports, 1);
        std::thread::spawn(move || RingCollective::connect(settings).unwrap())
    };
    let mut zero_settings = settings(2, &ports, 0);
    zero_settings.io_timeout = Duration::from_secs(1);
    let mut zero = RingCollective::connect(zero_settings).unwrap();
    let one = trickler.join().unwrap();
    let (_, to_zero) = one.links.as_ref().unwrap();
    let mut to_zero = to_zero.try_clone().unwrap();
    let trickle = std::thread::spawn(move || {
        let mut frame = Vec::new();
        write_frame(&mut frame, 0, 1, &[1; 10]).unwrap();
        for byte in frame {
            if to_zero.write_all(&[byte]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let started = Instant::now();
    let result = zero.all_gather(vec![0; 10], 100);
    let took = started.elapsed();
    let message = result.unwrap_err().to_string();
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(message.contains("its left neighbour rank 1"), "{message}");
    assert!(message.contains("I/O timeout"), "{message}");
    drop(zero);
    drop(one);
    trickle.join().unwrap();
}
