//! Placement tests in exo's style: a small topology built in memory, a
//! request, and assertions on the plan. No I/O.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

const GIB: u64 = 1 << 30;

fn iface(name: &str, address: Option<&str>, kind: InterfaceKind) -> InterfaceSpec {
    InterfaceSpec {
        name: name.to_owned(),
        address: address.map(str::to_owned),
        kind,
    }
}

fn node(id: &str, memory_gib: u64, cores: u32, interfaces: Vec<InterfaceSpec>) -> NodeSpec {
    NodeSpec {
        id: id.to_owned(),
        host: None,
        memory: memory_gib * GIB,
        cores,
        gpus: 0,
        interfaces,
    }
}

fn link(from: &str, to: &str, kind: LinkKind, gbps: f64) -> LinkSpec {
    let end = |text: &str| {
        let (node, interface) = text.split_once('.').unwrap();
        LinkEnd {
            node: node.to_owned(),
            interface: interface.to_owned(),
        }
    };
    LinkSpec {
        from: end(from),
        to: end(to),
        kind,
        bandwidth_gbps: Some(gbps),
    }
}

/// alpha and beta see each other over Thunderbolt (and Ethernet) and share an
/// RDMA link; alpha and gamma only over Ethernet; beta and gamma only over
/// Wi-Fi. RDMA is a partial mesh.
fn three_nodes() -> Topology {
    use InterfaceKind::*;
    let spec = ClusterSpec {
        nodes: vec![
            node(
                "alpha",
                64,
                16,
                vec![
                    iface("en0", Some("10.0.0.1"), Ethernet),
                    iface("tb0", Some("169.254.0.1"), Thunderbolt),
                    iface("ib0", None, Rdma),
                ],
            ),
            node(
                "beta",
                32,
                8,
                vec![
                    iface("en0", Some("10.0.0.2"), Ethernet),
                    iface("tb0", Some("169.254.0.2"), Thunderbolt),
                    iface("wlan0", Some("192.168.1.2"), Wifi),
                    iface("ib0", None, Rdma),
                ],
            ),
            node(
                "gamma",
                16,
                8,
                vec![
                    iface("en0", Some("10.0.0.3"), Ethernet),
                    iface("wlan0", Some("192.168.1.3"), Wifi),
                ],
            ),
        ],
        links: vec![
            link("alpha.en0", "beta.en0", LinkKind::Socket, 10.0),
            link("alpha.tb0", "beta.tb0", LinkKind::Socket, 40.0),
            link("alpha.en0", "gamma.en0", LinkKind::Socket, 10.0),
            link("beta.wlan0", "gamma.wlan0", LinkKind::Socket, 0.5),
            link("alpha.ib0", "beta.ib0", LinkKind::Rdma, 100.0),
        ],
    };
    Topology::new(&spec).unwrap()
}

/// `n` nodes `n0..`, all joined over Ethernet, with the given cores.
fn mesh(cores: &[u32]) -> Topology {
    let nodes = cores
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let address = format!("10.1.0.{}", i + 1);
            node(
                &format!("n{i}"),
                64,
                c,
                vec![iface("en0", Some(&address), InterfaceKind::Ethernet)],
            )
        })
        .collect();
    let mut links = Vec::new();
    for a in 0..cores.len() {
        for b in a + 1..cores.len() {
            let (a, b) = (format!("n{a}.en0"), format!("n{b}.en0"));
            links.push(link(&a, &b, LinkKind::Socket, 10.0));
        }
    }
    Topology::new(&ClusterSpec { nodes, links }).unwrap()
}

/// A request with only a per-rank memory need, so sums are easy by hand.
fn request(instance: &str, clients: u32, per_rank_gib: u64) -> Request {
    let memory = MemoryNeed {
        per_rank: per_rank_gib * GIB,
        per_worker: 0,
        per_client: 0,
    };
    Request::new(instance, clients, memory)
}

fn addr(text: &str) -> HostPort {
    text.parse().unwrap()
}

fn nodes_of(plan: &Plan) -> Vec<&str> {
    plan.ranks.iter().map(|r| r.node.as_str()).collect()
}

#[test]
fn the_smallest_set_with_the_memory_wins() {
    let topology = three_nodes();
    // Every node holds one 10 GiB rank: alpha leaves the most free.
    let plan = place(&topology, &request("r", 10, 10)).unwrap();
    assert_eq!(nodes_of(&plan), ["alpha"]);
    // Three 20 GiB ranks fit on alpha alone (60 of 64 GiB).
    let mut three = request("r", 10, 20);
    three.ranks = RankCount::Exactly(3);
    assert_eq!(nodes_of(&place(&topology, &three).unwrap()), ["alpha"; 3]);
    // Three 30 GiB ranks need two nodes: by cores (16, 8) alpha takes two
    // (60 of 64 GiB) and beta one (30 of 32); gamma (16 GiB) holds none.
    let mut bigger = request("r", 10, 30);
    bigger.ranks = RankCount::Exactly(3);
    let plan = place(&topology, &bigger).unwrap();
    assert_eq!(nodes_of(&plan), ["alpha", "alpha", "beta"]);
    assert_eq!(plan.nodes[0].memory_needed, 60 * GIB);
}

#[test]
fn when_nothing_fits_the_error_says_how_much_is_needed_and_there() {
    let mut too_big = request("r", 10, 40);
    too_big.ranks = RankCount::Exactly(3);
    let error = place(&three_nodes(), &too_big).unwrap_err();
    assert!(
        matches!(error, PlacementError::NotEnoughMemory(_)),
        "{error}"
    );
    assert_eq!(
        error.to_string(),
        "not enough memory: the best set of nodes (alpha, beta, gamma) has 112.0 GiB and its 3 \
         rank(s) need 120.0 GiB; node `gamma` would need 40.0 GiB for 1 rank(s) and has 16.0 GiB \
         (a rank needs 40.0 GiB, plus 0 B a worker and 0 B a client)"
    );
}

#[test]
fn ranks_and_clients_split_by_capacity_with_largest_remainder() {
    // 7 ranks over cores 5, 3, 2: 3.5, 2.1, 1.4 → 4, 2, 1.
    let topology = mesh(&[5, 3, 2]);
    let mut seven = request("r", 70, 1);
    seven.ranks = RankCount::Exactly(7);
    seven.min_nodes = 3;
    let plan = place(&topology, &seven).unwrap();
    let ranks: Vec<u32> = plan.nodes.iter().map(|n| n.ranks).collect();
    assert_eq!(ranks, [4, 2, 1]);
    // n0's 5 cores over 4 ranks: 2, 1, 1, 1; n1's 3 over 2: 2, 1; n2: 2.
    let workers: Vec<u32> = plan.ranks.iter().map(|r| r.workers).collect();
    assert_eq!(workers, [2, 1, 1, 1, 2, 1, 2]);
    // 70 clients by workers (10 in all): 14, 7, 7, 7, 14, 7, 14.
    let sizes: Vec<u32> = plan.ranks.iter().map(|r| r.clients.len()).collect();
    assert_eq!(sizes, [14, 7, 7, 7, 14, 7, 14]);
    assert_eq!(
        plan.ranks[1].clients,
        ClientBlock {
            first: 15,
            last: 21
        }
    );
}

#[test]
fn client_blocks_are_stable_and_each_client_has_one_rank() {
    let topology = mesh(&[4, 4, 2]);
    let mut req = request("r", 25, 1);
    req.ranks = RankCount::Exactly(3);
    req.min_nodes = 3;
    let plan = place(&topology, &req).unwrap();
    // Nothing in the plan depends on the round: placing again is identical.
    assert_eq!(plan, place(&topology, &req).unwrap());
    assert_eq!(plan.rank_of_client(1), Some(0));
    assert_eq!(plan.rank_of_client(25), Some(2));
    assert_eq!(plan.rank_of_client(26), None);
}

fn spread(instance: &str, backend: Backend) -> Request {
    let mut req = request(instance, 30, 1);
    req.min_nodes = 3;
    req.backend = backend;
    req.available_backends = vec![Backend::Grpc, Backend::Ring, Backend::Mpi];
    req
}

#[test]
fn rank_0_binds_everywhere_and_others_reach_it_by_interface_priority() {
    let plan = place(&three_nodes(), &spread("r", Backend::Grpc)).unwrap();
    assert_eq!(nodes_of(&plan), ["alpha", "beta", "gamma"]);
    let port = plan.coordinator_port;
    let coordinators: Vec<String> = plan
        .ranks
        .iter()
        .map(|r| r.coordinator.to_string())
        .collect();
    assert_eq!(
        coordinators,
        [
            // rank 0 binds its coordinator on every interface
            format!("0.0.0.0:{port}"),
            // beta reaches alpha over Thunderbolt, preferred to Ethernet
            format!("169.254.0.1:{port}"),
            // gamma has only Ethernet to alpha
            format!("10.0.0.1:{port}"),
        ]
    );
    // Two ranks on one node meet over the loopback.
    let mut local = request("r", 10, 1);
    local.ranks = RankCount::Exactly(2);
    let plan = place(&three_nodes(), &local).unwrap();
    assert_eq!(plan.ranks[1].coordinator.host.to_string(), "127.0.0.1");
}

#[test]
fn among_links_of_one_kind_the_faster_carries_the_coordinator() {
    use InterfaceKind::Ethernet;
    let spec = ClusterSpec {
        nodes: vec![
            node(
                "a",
                8,
                2,
                vec![
                    iface("slow", Some("10.0.0.1"), Ethernet),
                    iface("fast", Some("10.9.0.1"), Ethernet),
                ],
            ),
            node(
                "b",
                8,
                2,
                vec![
                    iface("slow", Some("10.0.0.2"), Ethernet),
                    iface("fast", Some("10.9.0.2"), Ethernet),
                ],
            ),
        ],
        links: vec![
            link("a.slow", "b.slow", LinkKind::Socket, 1.0),
            link("a.fast", "b.fast", LinkKind::Socket, 25.0),
        ],
    };
    let mut req = request("r", 4, 1);
    req.min_nodes = 2;
    let plan = place(&Topology::new(&spec).unwrap(), &req).unwrap();
    assert_eq!(plan.ranks[1].coordinator.host.to_string(), "10.9.0.1");
}

/// The (left, right) neighbour ranks and addresses of every rank.
fn neighbours(plan: &Plan) -> Vec<((u32, HostPort), (u32, HostPort))> {
    plan.ranks
        .iter()
        .map(|r| {
            let ring = r.ring.as_ref().expect("a ring plan has neighbours");
            (
                (ring.left.rank, ring.left.address.clone()),
                (ring.right.rank, ring.right.address.clone()),
            )
        })
        .collect()
}

#[test]
fn a_3_node_ring_gives_each_rank_its_own_view_of_its_neighbours() {
    let plan = place(&three_nodes(), &spread("r", Backend::Ring)).unwrap();
    let p: Vec<u16> = plan.ranks.iter().map(|r| r.listen.port()).collect();
    let at = |ip: &str, rank: usize| (rank as u32, addr(&format!("{ip}:{}", p[rank])));
    assert_eq!(
        neighbours(&plan),
        [
            // alpha: gamma over Ethernet on the left, beta over Thunderbolt on the right
            (at("10.0.0.3", 2), at("169.254.0.2", 1)),
            // beta: alpha over Thunderbolt, gamma over Wi-Fi
            (at("169.254.0.1", 0), at("192.168.1.3", 2)),
            // gamma: beta over Wi-Fi, alpha over Ethernet
            (at("192.168.1.2", 1), at("10.0.0.1", 0)),
        ]
    );
    // One flat host list could not say this: beta is 169.254.0.2 to alpha
    // but 192.168.1.2 to gamma.
    let hosts = |rank: usize| plan.ranks[rank].ring.as_ref().unwrap().hosts.clone();
    assert_eq!(
        hosts(0),
        [
            Some(addr(&format!("0.0.0.0:{}", p[0]))),
            Some(at("169.254.0.2", 1).1),
            Some(at("10.0.0.3", 2).1),
        ]
    );
    assert_eq!(hosts(2)[1], Some(at("192.168.1.2", 1).1));
}

fn ring_on(nodes: usize) -> Plan {
    let mut req = request("ring", 100, 1);
    req.backend = Backend::Ring;
    req.min_nodes = nodes as u32;
    place(&mesh(&vec![4; nodes]), &req).unwrap()
}

#[test]
fn rings_of_4_and_5_nodes_link_each_rank_to_its_two_neighbours() {
    for size in [4, 5] {
        let plan = ring_on(size);
        assert_eq!(plan.world_size as usize, size);
        for (rank, r) in plan.ranks.iter().enumerate() {
            let ring = r.ring.as_ref().unwrap();
            let (left, right) = ((rank + size - 1) % size, (rank + 1) % size);
            assert_eq!(
                (ring.left.rank as usize, ring.right.rank as usize),
                (left, right)
            );
            // Node n_i is 10.1.0.(i+1), and rank i runs on node n_i.
            let ip = |i: usize| format!("10.1.0.{}", i + 1);
            assert_eq!(ring.right.address.host.to_string(), ip(right));
            assert_eq!(ring.left.address.host.to_string(), ip(left));
            assert_eq!(ring.right.address.port, plan.ranks[right].listen.port());
            for (other, host) in ring.hosts.iter().enumerate() {
                let expected = other == rank || other == left || other == right;
                assert_eq!(
                    host.is_some(),
                    expected,
                    "{size} nodes, rank {rank}, host {other}"
                );
            }
            assert_eq!(
                ring.hosts[rank].as_ref().unwrap().host.to_string(),
                "0.0.0.0"
            );
        }
    }
}

#[test]
fn ranks_that_share_a_node_are_ring_neighbours_over_the_loopback() {
    let mut req = request("r", 8, 1);
    req.backend = Backend::Ring;
    req.ranks = RankCount::Exactly(4);
    req.min_nodes = 2;
    let plan = place(&mesh(&[4, 4]), &req).unwrap();
    assert_eq!(nodes_of(&plan), ["n0", "n0", "n1", "n1"]);
    let ips: Vec<(String, String)> = neighbours(&plan)
        .iter()
        .map(|(l, r)| (l.1.host.to_string(), r.1.host.to_string()))
        .collect();
    let pair = |l: &str, r: &str| (l.to_owned(), r.to_owned());
    assert_eq!(
        ips,
        [
            pair("10.1.0.2", "127.0.0.1"),
            pair("127.0.0.1", "10.1.0.2"),
            pair("10.1.0.1", "127.0.0.1"),
            pair("127.0.0.1", "10.1.0.1"),
        ]
    );
}

#[test]
fn rdma_refuses_a_partial_mesh_and_names_the_pair() {
    let mut req = spread("r", Backend::Rdma);
    let error = place(&three_nodes(), &req).unwrap_err();
    assert_eq!(
        error,
        PlacementError::PartialRdmaMesh {
            a: "alpha".to_owned(),
            b: "gamma".to_owned(),
        }
    );
    assert!(error.to_string().contains("partial mesh"), "{error}");
    // On two nodes the RDMA link is a full mesh: the device matrix names it.
    req.min_nodes = 2;
    let plan = place(&three_nodes(), &req).unwrap();
    assert_eq!(nodes_of(&plan), ["alpha", "beta"]);
    let ib0 = Some("ib0".to_owned());
    assert_eq!(
        plan.rdma_devices,
        Some(vec![vec![None, ib0.clone()], vec![ib0, None]])
    );
}

#[test]
fn nodes_without_a_socket_link_are_named() {
    let mut spec_text = three_nodes_spec();
    spec_text.links.retain(|l| l.from.interface != "wlan0");
    let topology = Topology::new(&spec_text).unwrap();
    let error = place(&topology, &spread("r", Backend::Grpc)).unwrap_err();
    assert_eq!(
        error,
        PlacementError::NoLink {
            a: "beta".to_owned(),
            b: "gamma".to_owned(),
        }
    );
    // Two nodes that are linked are still placed.
    let mut two = spread("r", Backend::Grpc);
    two.min_nodes = 2;
    assert_eq!(
        nodes_of(&place(&topology, &two).unwrap()),
        ["alpha", "beta"]
    );
}

fn three_nodes_spec() -> ClusterSpec {
    // Rebuilt from the topology so that both tests share one description.
    let topology = three_nodes();
    let nodes = topology
        .nodes()
        .iter()
        .map(|n| NodeSpec {
            id: n.id.clone(),
            host: None,
            memory: n.memory,
            cores: n.cores,
            gpus: n.gpus,
            interfaces: n
                .interfaces
                .iter()
                .map(|i| InterfaceSpec {
                    name: i.name.clone(),
                    address: i.address.as_ref().map(|a| a.to_string()),
                    kind: i.kind,
                })
                .collect(),
        })
        .collect();
    let end = |e: &Endpoint| LinkEnd {
        node: topology.nodes()[e.node].id.clone(),
        interface: topology.nodes()[e.node].interfaces[e.interface]
            .name
            .clone(),
    };
    let links = topology
        .links()
        .iter()
        .map(|l| LinkSpec {
            from: end(&l.ends[0]),
            to: end(&l.ends[1]),
            kind: l.kind,
            bandwidth_gbps: l.bandwidth_gbps,
        })
        .collect();
    ClusterSpec { nodes, links }
}

#[test]
fn ties_go_to_more_free_memory_then_to_leaf_nodes() {
    use InterfaceKind::Ethernet;
    // a is a hub linked to b, c and d; b and c are also linked; d is a leaf.
    let with =
        |id: &str, gib: u64, ip: &str| node(id, gib, 4, vec![iface("e", Some(ip), Ethernet)]);
    let socket = |a: &str, b: &str| link(a, b, LinkKind::Socket, 10.0);
    let mut spec = ClusterSpec {
        nodes: vec![
            with("a", 8, "10.0.0.1"),
            with("b", 8, "10.0.0.2"),
            with("c", 8, "10.0.0.3"),
            with("d", 8, "10.0.0.4"),
        ],
        links: vec![
            socket("a.e", "b.e"),
            socket("a.e", "c.e"),
            socket("a.e", "d.e"),
            socket("b.e", "c.e"),
        ],
    };
    let mut req = request("r", 10, 1);
    req.min_nodes = 2;
    // Equal memory: {a, d} has 4 links, {a, b} and {a, c} have 5.
    let plan = place(&Topology::new(&spec).unwrap(), &req).unwrap();
    assert_eq!(nodes_of(&plan), ["a", "d"]);
    // More free memory comes before fewer links: with a and b grown, {a, b}
    // wins with its 5 links.
    spec.nodes[0].memory = 16 * GIB;
    spec.nodes[1].memory = 16 * GIB;
    let plan = place(&Topology::new(&spec).unwrap(), &req).unwrap();
    assert_eq!(nodes_of(&plan), ["a", "b"]);
}

#[test]
fn two_instances_get_deterministic_ports_that_do_not_collide() {
    let topology = three_nodes();
    let first = place(&topology, &spread("run-a", Backend::Ring)).unwrap();
    assert_eq!(
        first,
        place(&topology, &spread("run-a", Backend::Ring)).unwrap()
    );
    let mut second = spread("run-b", Backend::Ring);
    second.ports_in_use = first.ports();
    let second = place(&topology, &second).unwrap();
    assert_eq!(first.ports().len(), 3);
    assert!(first.ports().is_disjoint(&second.ports()));
    // Even the same instance id, placed twice on the same nodes, moves over.
    let mut again = spread("run-a", Backend::Ring);
    again.ports_in_use = first.ports();
    let again = place(&topology, &again).unwrap();
    assert!(first.ports().is_disjoint(&again.ports()));
    for plan in [&first, &second, &again] {
        let range = DEFAULT_BASE_PORT..DEFAULT_BASE_PORT + PORT_SPAN;
        assert!(plan.ports().iter().all(|p| range.contains(p)));
        assert_eq!(plan.coordinator_port, plan.ranks[0].listen.port());
    }
}

#[test]
fn a_full_port_range_is_an_error() {
    let mut req = spread("r", Backend::Ring);
    req.ports_in_use = (DEFAULT_BASE_PORT..DEFAULT_BASE_PORT + PORT_SPAN - 2).collect();
    let error = place(&three_nodes(), &req).unwrap_err();
    assert!(
        matches!(error, PlacementError::NoFreePorts { wanted: 3, .. }),
        "{error}"
    );
}

#[test]
fn host_files_of_two_instances_have_their_own_names_and_contents() {
    let topology = three_nodes();
    let a = place(&topology, &spread("run-a", Backend::Ring)).unwrap();
    let mut b = spread("run-b", Backend::Ring);
    b.ports_in_use = a.ports();
    let b = place(&topology, &b).unwrap();
    let secret = RingSecret::generate().unwrap();
    let (files_a, files_b) = (a.host_files(&secret), b.host_files(&secret));
    let names = |files: &[HostFile]| {
        files
            .iter()
            .map(|f| f.name.clone())
            .collect::<BTreeSet<_>>()
    };
    assert!(names(&files_a).is_disjoint(&names(&files_b)));
    assert!(names(&files_a).contains("hosts-run-a-2.json"));
    assert!(names(&files_b).contains("slurm-hosts-run-b"));
    for (plan, files) in [(&a, &files_a), (&b, &files_b)] {
        for rank in &plan.ranks {
            let name = host_file_name(&plan.instance, rank.rank);
            let file = files.iter().find(|f| f.name == name).unwrap();
            let read: RankFile = serde_json::from_str(&file.contents).unwrap();
            assert_eq!(read.instance, plan.instance);
            assert_eq!(read.world_size, 3);
            assert_eq!(&read.rank, rank);
        }
        let slurm = files.iter().find(|f| f.name.starts_with("slurm")).unwrap();
        assert_eq!(slurm.contents, "alpha\nbeta\ngamma\n");
    }
}

#[test]
fn host_files_that_cannot_seat_their_rank_are_refused_when_read() {
    let plan = place(&three_nodes(), &spread("r", Backend::Ring)).unwrap();
    let file = plan
        .host_files(&RingSecret::generate().unwrap())
        .into_iter()
        .find(|f| f.name == host_file_name("r", 1))
        .unwrap();
    let good = RankFile::parse(&file.contents).unwrap();
    let refused = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut json: serde_json::Value = serde_json::from_str(&file.contents).unwrap();
        edit(&mut json);
        match RankFile::parse(&json.to_string()) {
            Err(HostFileError::Invalid(message)) => message,
            other => panic!("accepted or misread: {other:?}"),
        }
    };
    let zero = refused(&|j| j["world_size"] = 0.into());
    assert!(zero.contains("world_size = 0"), "{zero}");
    let outside = refused(&|j| j["rank"]["rank"] = 3.into());
    assert_eq!(outside, "rank = 3, but world_size = 3: ranks are 0 to 2");
    let neighbour = refused(&|j| j["rank"]["ring"]["right"]["rank"] = 7.into());
    assert!(
        neighbour.contains("right neighbour is rank 7"),
        "{neighbour}"
    );
    let hosts = refused(&|j| {
        j["rank"]["ring"]["hosts"].as_array_mut().unwrap().pop();
    });
    assert!(hosts.contains("lists 2 hosts for 3 ranks"), "{hosts}");
    let block = refused(&|j| j["rank"]["clients"]["last"] = (good.num_clients + 1).into());
    assert!(block.contains("not a block of clients"), "{block}");
    let empty = refused(&|j| j["rank"]["clients"]["first"] = 0.into());
    assert!(empty.contains("not a block of clients"), "{empty}");
    assert!(matches!(
        RankFile::parse("{\"world_size\": 1}"),
        Err(HostFileError::Json(_))
    ));
}

/// Every host file of a plan carries the one secret it was written with; a
/// host file without one (an older cohort's) is refused when read, with what
/// to do, and a malformed one is not a host file.
#[test]
fn every_host_file_of_a_plan_carries_its_secret_and_one_without_is_refused() {
    let plan = place(&three_nodes(), &spread("r", Backend::Ring)).unwrap();
    let secret = RingSecret::generate().unwrap();
    let files = plan.host_files(&secret);
    let ranks: Vec<RankFile> = files
        .iter()
        .filter(|f| f.name.starts_with("hosts-"))
        .map(|f| RankFile::parse(&f.contents).unwrap())
        .collect();
    assert_eq!(ranks.len(), 3);
    for file in &ranks {
        assert_eq!(file.secret.as_ref(), Some(&secret));
    }
    let slurm = files.iter().find(|f| f.name.starts_with("slurm")).unwrap();
    assert!(!slurm.contents.contains(&secret.to_hex()));
    let other = plan.host_files(&RingSecret::generate().unwrap());
    assert_ne!(other[0].contents, files[0].contents);

    let mut json: serde_json::Value = serde_json::from_str(&files[1].contents).unwrap();
    assert_eq!(json["secret"], secret.to_hex().as_str());
    json.as_object_mut().unwrap().remove("secret");
    match RankFile::parse(&json.to_string()) {
        Err(HostFileError::Invalid(message)) => {
            assert!(message.contains("has no ring secret"), "{message}");
            assert!(message.contains("cohort place --emit"), "{message}");
        }
        other => panic!("a host file without a secret was read: {other:?}"),
    }
    json["secret"] = "abc".into();
    assert!(matches!(
        RankFile::parse(&json.to_string()),
        Err(HostFileError::Json(_))
    ));
}

#[test]
fn a_backend_this_build_lacks_fails_before_placement() {
    let mut req = request("r", 10, 1);
    req.backend = Backend::Mpi;
    let error = place(&three_nodes(), &req).unwrap_err();
    assert_eq!(
        error.to_string(),
        "backend `mpi` is not in this build; the backends this build has are grpc and ring; \
         rebuild with `--features mpi` (needs Open MPI: libopenmpi-dev, and libclang-dev for \
         bindgen)"
    );
}

#[test]
fn requests_that_no_cluster_can_meet_are_refused() {
    let topology = three_nodes();
    let mut req = request("r", 2, 1);
    req.ranks = RankCount::Exactly(3);
    assert_eq!(
        place(&topology, &req).unwrap_err(),
        PlacementError::TooFewClients {
            clients: 2,
            ranks: 3,
        }
    );
    for (instance, workers, min_nodes) in [("../x", None, 1), ("r", Some(0), 1), ("r", None, 4)] {
        let mut req = request(instance, 10, 1);
        req.workers_per_rank = workers;
        req.min_nodes = min_nodes;
        let error = place(&topology, &req).unwrap_err();
        assert!(matches!(error, PlacementError::Request(_)), "{error}");
    }
}

#[test]
fn launch_lines_in_plain_mpirun_and_srun_forms() {
    let mut req = request("exp-1", 30, 30);
    req.ranks = RankCount::Exactly(3);
    req.backend = Backend::Mpi;
    req.available_backends = vec![Backend::Mpi];
    let plan = place(&three_nodes(), &req).unwrap();
    let spec = LaunchSpec {
        program: "cohort".to_owned(),
        plan_dir: "/shared/plans/".to_owned(),
        config: "my run.toml".to_owned(),
        config_args: [
            "--set",
            "data.concentration=0.5",
            "--set",
            "general.run_name=a b",
        ]
        .map(str::to_owned)
        .to_vec(),
    };
    let launch = plan.launch(&spec);
    let config = "--config 'my run.toml' --set data.concentration=0.5 --set 'general.run_name=a b'";
    let run = format!("cohort run {config} --plan /shared/plans --instance exp-1");
    assert_eq!(
        launch.mpirun,
        format!("mpirun -n 3 --host alpha:2,beta:1 {run}")
    );
    assert_eq!(
        launch.srun,
        format!(
            "SLURM_HOSTFILE=/shared/plans/slurm-hosts-exp-1 srun --ntasks=3 \
             --distribution=arbitrary {run}"
        )
    );
    assert_eq!(launch.plain.len(), 3);
    assert_eq!(launch.plain[2].host, "beta");
    assert_eq!(
        launch.plain[2].command,
        format!("cohort worker {config} --plan /shared/plans --instance exp-1 --rank 2")
    );
}

#[test]
fn the_table_shows_every_rank_and_node() {
    let plan = place(&three_nodes(), &spread("r", Backend::Ring)).unwrap();
    let table = plan.table();
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("instance r: backend ring, 3 rank(s) on 3 node(s)"),
        "{table}"
    );
    assert!(lines[1].starts_with("rank  node   listen"), "{table}");
    assert!(lines[3].contains("169.254.0.1:"), "{table}");
    assert!(lines[4].contains("24-30"), "{table}");
    assert!(lines[5].starts_with("node alpha (alpha): 1 rank(s), needs 1.0 GiB of 64.0 GiB"));
    // JSON for `--json`.
    let json = serde_json::to_value(&plan).unwrap();
    assert_eq!(
        json["ranks"][1]["coordinator"],
        format!("169.254.0.1:{}", plan.coordinator_port)
    );
}

#[test]
fn the_memory_estimate_grows_with_model_workers_and_clients() {
    // LeNet-5: about 61,706 f32 parameters; 600 MNIST samples of 785 bytes.
    let need = MemoryNeed::estimate(61_706, 4, 600 * 785);
    assert_eq!(need.per_client, 471_000);
    assert!(need.per_rank > 4 * 61_706 * 4 && need.per_worker > 4 * 61_706 * 4);
    assert!(need.of_rank(4, 10) > need.of_rank(1, 10));
    assert!(need.of_rank(1, 20) > need.of_rank(1, 10));
    assert_eq!(MemoryNeed::estimate(u64::MAX, 4, 0).of_rank(2, 2), u64::MAX);
}

proptest! {
    #[test]
    fn blocks_partition_the_clients_and_every_rank_has_a_worker(
        cores in prop::collection::vec(1u32..32, 1..6),
        ranks in 1u32..12,
        extra_clients in 0u32..200,
        workers in prop::option::of(1u32..4),
    ) {
        let topology = mesh(&cores);
        let mut req = request("p", ranks + extra_clients, 0);
        req.ranks = RankCount::Exactly(ranks);
        req.min_nodes = (ranks as usize).min(cores.len()) as u32;
        req.workers_per_rank = workers;
        req.memory.per_client = 1 << 20;
        let plan = place(&topology, &req).unwrap();
        prop_assert_eq!(plan.ranks.len() as u32, ranks);
        let mut next = 1;
        for rank in &plan.ranks {
            prop_assert_eq!(rank.clients.first, next);
            prop_assert!(rank.clients.last >= rank.clients.first);
            next = rank.clients.last + 1;
            prop_assert!(rank.workers >= 1);
        }
        prop_assert_eq!(next, req.num_clients + 1);
        prop_assert_eq!(plan.ports().len() as u32, ranks);
    }
}
