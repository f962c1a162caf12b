//! The validated cluster: nodes, their interfaces, and typed links.
//!
//! A [`Topology`] is only made by [`Topology::new`], which refuses what a plan
//! could not use (repeated ids, link ends that name nothing, bad addresses,
//! nodes without memory or cores, links from a node to itself), so placement
//! can index it without checks. It also keeps, for each ordered pair of
//! nodes, the link that carries their traffic, chosen once here.

use super::address::Host;
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::file::{ClusterSpec, InterfaceSpec, LinkEnd, LinkSpec, NodeSpec};
use crate::suggest::did_you_mean;

/// Most nodes one cluster may list: placement tries every subset of nodes,
/// as exo does, and 2^16 subsets is the most that stays instant. Larger
/// clusters are a scheduler's job (Slurm places the ranks of `srun`).
pub const MAX_NODES: usize = 16;

/// What kind of hardware an interface is. The order is the priority for
/// carrying traffic: a faster, dedicated link first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InterfaceKind {
    /// An RDMA-capable device (InfiniBand, RoCE); with an address it also
    /// carries sockets (IPoIB).
    Rdma,
    /// A Thunderbolt bridge between two machines.
    Thunderbolt,
    /// Wired Ethernet.
    Ethernet,
    /// Wireless.
    Wifi,
}

/// How a link carries data.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum LinkKind {
    /// TCP between the two interfaces' addresses.
    #[default]
    Socket,
    /// RDMA verbs between two RDMA devices; carries no TCP.
    Rdma,
}

/// A validated network interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Interface {
    /// Name, unique within its node.
    pub name: String,
    /// Its IP address or DNS name; `None` only for an RDMA device without one.
    pub address: Option<Host>,
    /// What hardware it is.
    pub kind: InterfaceKind,
}

/// A validated node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Node {
    /// Unique id.
    pub id: String,
    /// Name by which launchers reach it (`host`, default the id).
    pub host: String,
    /// Bytes the run may use, more than 0.
    pub memory: u64,
    /// Cores the run may use, more than 0.
    pub cores: u32,
    /// GPUs.
    pub gpus: u32,
    /// Its interfaces.
    pub interfaces: Vec<Interface>,
}

/// One end of a validated link, as indices into the topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    /// Index of the node in [`Topology::nodes`].
    pub node: usize,
    /// Index of the interface in that node's `interfaces`.
    pub interface: usize,
}

/// A validated link, usable in both directions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Link {
    /// Its two ends, on different nodes.
    pub ends: [Endpoint; 2],
    /// Socket or RDMA.
    pub kind: LinkKind,
    /// Gbit/s, if known.
    pub bandwidth_gbps: Option<f64>,
}

/// A cluster file's content that does not hold together, with the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{key}`: {message}")]
pub struct TopologyError {
    /// Dotted key such as `links[2].to`.
    pub key: String,
    /// What is wrong and what was expected.
    pub message: String,
}

/// The nodes of a cluster and the links between them, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    nodes: Vec<Node>,
    links: Vec<Link>,
    /// `routes[kind][i][j]`: the link that carries traffic of that kind from
    /// node `i` to node `j`, if any.
    routes: [Vec<Vec<Option<usize>>>; 2],
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> TopologyError {
    TopologyError {
        key: key.into(),
        message: message.into(),
    }
}

impl Topology {
    /// Validates a parsed cluster file.
    pub fn new(spec: &ClusterSpec) -> Result<Self, TopologyError> {
        if spec.nodes.is_empty() {
            return Err(invalid("nodes", "a cluster needs at least one node"));
        }
        if spec.nodes.len() > MAX_NODES {
            return Err(invalid(
                "nodes",
                format!(
                    "{} nodes; a cluster file lists at most {MAX_NODES} (placement tries every subset)",
                    spec.nodes.len()
                ),
            ));
        }
        let mut ids = BTreeMap::new();
        let mut nodes = Vec::with_capacity(spec.nodes.len());
        for (index, node) in spec.nodes.iter().enumerate() {
            if let Some(first) = ids.insert(node.id.as_str(), index) {
                return Err(invalid(
                    format!("nodes[{index}].id"),
                    format!("duplicate node id `{}` (also nodes[{first}])", node.id),
                ));
            }
            nodes.push(check_node(index, node)?);
        }
        let mut links = Vec::with_capacity(spec.links.len());
        let mut seen = BTreeMap::new();
        for (index, link) in spec.links.iter().enumerate() {
            let checked = check_link(index, link, &nodes)?;
            let mut ends = checked.ends.map(|e| (e.node, e.interface));
            ends.sort_unstable();
            if let Some(first) = seen.insert((ends, checked.kind), index) {
                return Err(invalid(
                    format!("links[{index}]"),
                    format!("the same link as links[{first}]"),
                ));
            }
            links.push(checked);
        }
        let routes =
            [LinkKind::Socket, LinkKind::Rdma].map(|kind| route_table(&nodes, &links, kind));
        Ok(Self {
            nodes,
            links,
            routes,
        })
    }

    /// The nodes, in file order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The links, in file order.
    pub fn links(&self) -> &[Link] {
        &self.links
    }

    /// The link of `kind` that carries traffic between nodes `from` and `to`.
    ///
    /// Here and below, nodes are indices into [`Topology::nodes`]; an index
    /// past the end panics.
    pub fn route(&self, kind: LinkKind, from: usize, to: usize) -> Option<&Link> {
        self.routes[kind as usize][from][to].map(|index| &self.links[index])
    }

    /// The address of `to` that `from` reaches it at: `to`'s end of their best
    /// socket link.
    pub fn address_of(&self, to: usize, from: usize) -> Option<&Host> {
        let link = self.route(LinkKind::Socket, from, to)?;
        let end = link.ends.iter().find(|end| end.node == to)?;
        self.nodes[to].interfaces[end.interface].address.as_ref()
    }

    /// The RDMA device on `from` that reaches `to`.
    pub fn rdma_device(&self, from: usize, to: usize) -> Option<&str> {
        let link = self.route(LinkKind::Rdma, from, to)?;
        let end = link.ends.iter().find(|end| end.node == from)?;
        Some(&self.nodes[from].interfaces[end.interface].name)
    }

    /// How many other nodes `node` has a link of any kind to: a leaf has few.
    pub fn degree(&self, node: usize) -> usize {
        (0..self.nodes.len())
            .filter(|&other| {
                other != node
                    && (self.routes[0][node][other].is_some()
                        || self.routes[1][node][other].is_some())
            })
            .count()
    }
}

/// For every ordered pair of nodes, the best link of `kind` between them: the
/// better interface kind (judged by the slower of the two ends, since a
/// Thunderbolt port into an Ethernet adapter runs at Ethernet speed), then the
/// higher bandwidth, then the earlier link in the file.
fn route_table(nodes: &[Node], links: &[Link], kind: LinkKind) -> Vec<Vec<Option<usize>>> {
    let n = nodes.len();
    let mut table = vec![vec![None; n]; n];
    let rank = |index: usize| {
        let link = &links[index];
        let slower = link
            .ends
            .iter()
            .map(|e| nodes[e.node].interfaces[e.interface].kind)
            .max();
        let bandwidth = std::cmp::Reverse(link.bandwidth_gbps.map(f64::to_bits).unwrap_or(0));
        (slower, bandwidth, index)
    };
    for (index, link) in links.iter().enumerate().filter(|(_, l)| l.kind == kind) {
        let [a, b] = link.ends.map(|e| e.node);
        for (from, to) in [(a, b), (b, a)] {
            let slot = &mut table[from][to];
            if slot.is_none_or(|best| rank(index) < rank(best)) {
                *slot = Some(index);
            }
        }
    }
    table
}

fn is_plain_name(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 64
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn check_node(index: usize, spec: &NodeSpec) -> Result<Node, TopologyError> {
    let key = |field: &str| format!("nodes[{index}].{field}");
    if !is_plain_name(&spec.id) {
        return Err(invalid(
            key("id"),
            format!(
                "invalid node id `{}`: expected 1 to 64 letters, digits, `-` or `_`",
                spec.id
            ),
        ));
    }
    let host = spec.host.clone().unwrap_or_else(|| spec.id.clone());
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !host_ok {
        return Err(invalid(
            key("host"),
            format!(
                "invalid host `{host}` for node `{}`: expected a host name or an IPv4 address, \
                 as mpirun's --host reads it",
                spec.id
            ),
        ));
    }
    if spec.memory == 0 {
        return Err(invalid(
            key("memory"),
            format!(
                "node `{}` has no memory; expected more than 0 bytes",
                spec.id
            ),
        ));
    }
    if spec.cores == 0 {
        return Err(invalid(
            key("cores"),
            format!("node `{}` has no cores; expected at least 1", spec.id),
        ));
    }
    let mut names = BTreeSet::new();
    let mut interfaces = Vec::with_capacity(spec.interfaces.len());
    for (i, interface) in spec.interfaces.iter().enumerate() {
        let key = format!("nodes[{index}].interfaces[{i}]");
        if !names.insert(interface.name.as_str()) {
            return Err(invalid(
                format!("{key}.name"),
                format!(
                    "duplicate interface `{}` on node `{}`",
                    interface.name, spec.id
                ),
            ));
        }
        interfaces.push(check_interface(&key, &spec.id, interface)?);
    }
    Ok(Node {
        id: spec.id.clone(),
        host,
        memory: spec.memory,
        cores: spec.cores,
        gpus: spec.gpus,
        interfaces,
    })
}

fn check_interface(
    key: &str,
    node: &str,
    spec: &InterfaceSpec,
) -> Result<Interface, TopologyError> {
    let name_ok = !spec.name.is_empty()
        && spec.name.len() <= 64
        && spec.name.chars().all(|c| c.is_ascii_graphic() && c != '"');
    if !name_ok {
        return Err(invalid(
            format!("{key}.name"),
            format!(
                "invalid interface name `{}` on node `{node}`: expected 1 to 64 printable \
                 characters without spaces",
                spec.name
            ),
        ));
    }
    let address = match &spec.address {
        None if spec.kind == InterfaceKind::Rdma => None,
        None => {
            return Err(invalid(
                key,
                format!(
                    "interface `{node}.{}` has no `address`; every kind but rdma needs one",
                    spec.name
                ),
            ));
        }
        Some(text) => Some(check_address(&format!("{key}.address"), text)?),
    };
    Ok(Interface {
        name: spec.name.clone(),
        address,
        kind: spec.kind,
    })
}

/// An interface's address: an IP address another node can reach, or a DNS
/// name (resolved by the rank that connects, when it connects).
fn check_address(key: &str, text: &str) -> Result<Host, TopologyError> {
    let host: Host = text.parse().map_err(|message| invalid(key, message))?;
    if let Host::Ip(address) = &host
        && (address.is_unspecified() || address.is_multicast())
    {
        return Err(invalid(
            key,
            format!(
                "`{text}` is not an address another node can reach; expected a unicast address"
            ),
        ));
    }
    Ok(host)
}

fn resolve_end(key: &str, end: &LinkEnd, nodes: &[Node]) -> Result<Endpoint, TopologyError> {
    let Some(node) = nodes.iter().position(|n| n.id == end.node) else {
        let ids = nodes.iter().map(|n| n.id.as_str());
        return Err(invalid(
            key,
            format!(
                "`{end}`: no node `{}`{}; nodes: {}",
                end.node,
                did_you_mean(&end.node, ids.clone()),
                ids.collect::<Vec<_>>().join(", ")
            ),
        ));
    };
    let names = || nodes[node].interfaces.iter().map(|i| i.name.as_str());
    let Some(interface) = names().position(|name| name == end.interface) else {
        let listed = names().collect::<Vec<_>>().join(", ");
        return Err(invalid(
            key,
            format!(
                "`{end}`: node `{}` has no interface `{}`{}; its interfaces: {}",
                end.node,
                end.interface,
                did_you_mean(&end.interface, names()),
                if listed.is_empty() { "none" } else { &listed }
            ),
        ));
    };
    Ok(Endpoint { node, interface })
}

fn check_link(index: usize, spec: &LinkSpec, nodes: &[Node]) -> Result<Link, TopologyError> {
    let key = |field: &str| format!("links[{index}].{field}");
    let from = resolve_end(&key("from"), &spec.from, nodes)?;
    let to = resolve_end(&key("to"), &spec.to, nodes)?;
    if from.node == to.node {
        return Err(invalid(
            key("to"),
            format!(
                "`{}` and `{}` are both on node `{}`; a link joins two different nodes",
                spec.from, spec.to, spec.from.node
            ),
        ));
    }
    if let Some(bandwidth) = spec.bandwidth_gbps
        && !(bandwidth.is_finite() && bandwidth > 0.0)
    {
        return Err(invalid(
            key("bandwidth_gbps"),
            format!("{bandwidth} is not a bandwidth; expected Gbit/s, more than 0"),
        ));
    }
    let interface = |end: Endpoint| &nodes[end.node].interfaces[end.interface];
    let ends = [(&spec.from, from), (&spec.to, to)];
    match spec.kind {
        LinkKind::Rdma => {
            for (name, end) in ends {
                if interface(end).kind != InterfaceKind::Rdma {
                    return Err(invalid(
                        key("kind"),
                        format!(
                            "an rdma link needs interfaces of kind rdma at both ends; `{name}` is {}",
                            kind_name(interface(end).kind)
                        ),
                    ));
                }
            }
        }
        LinkKind::Socket => {
            let [a, b] = ends.map(|(name, end)| (name, interface(end).address.clone()));
            for (name, address) in [&a, &b] {
                if address.is_none() {
                    return Err(invalid(
                        key("kind"),
                        format!("a socket link needs addresses at both ends; `{name}` has none"),
                    ));
                }
            }
            // A name's family is known only once it resolves.
            let family = |address: Option<&Host>| match address {
                Some(Host::Ip(ip)) => Some(ip.is_ipv4()),
                _ => None,
            };
            let (fa, fb) = (family(a.1.as_ref()), family(b.1.as_ref()));
            if fa.is_some() && fb.is_some() && fa != fb {
                return Err(invalid(
                    key("to"),
                    format!(
                        "`{}` and `{}` are of different IP families; a socket link joins two \
                         IPv4 or two IPv6 addresses",
                        spec.from, spec.to
                    ),
                ));
            }
        }
    }
    Ok(Link {
        ends: [from, to],
        kind: spec.kind,
        bandwidth_gbps: spec.bandwidth_gbps,
    })
}

/// The name a kind has in the file.
pub(crate) fn kind_name(kind: InterfaceKind) -> &'static str {
    match kind {
        InterfaceKind::Rdma => "rdma",
        InterfaceKind::Thunderbolt => "thunderbolt",
        InterfaceKind::Ethernet => "ethernet",
        InterfaceKind::Wifi => "wifi",
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::file::{ClusterError, parse};

    const TWO: &str = r#"
[[nodes]]
id = "alpha"
memory = "8 GiB"
cores = 4
interfaces = [
  { name = "en0", address = "10.0.0.1", kind = "ethernet" },
  { name = "ib0", kind = "rdma" },
]

[[nodes]]
id = "beta"
memory = "8 GiB"
cores = 4
interfaces = [
  { name = "en0", address = "10.0.0.2", kind = "ethernet" },
  { name = "ib0", kind = "rdma" },
]

[[links]]
from = "alpha.en0"
to = "beta.en0"
"#;

    /// The key and message of the error `TWO` gives with `from` replaced by `to`.
    fn error_with(from: &str, to: &str) -> (String, String) {
        let text = TWO.replacen(from, to, 1);
        assert_ne!(text, TWO, "`{from}` is not in the file");
        match parse(&text, Path::new("two.toml")) {
            Err(ClusterError::Invalid { key, message, .. }) => (key, message),
            other => panic!("expected an invalid key, got {other:?}"),
        }
    }

    #[test]
    fn the_example_is_valid_and_links_are_both_ways() {
        let topology = parse(TWO, Path::new("two.toml")).unwrap();
        assert_eq!(topology.nodes()[1].host, "beta");
        assert_eq!(topology.address_of(1, 0).unwrap().to_string(), "10.0.0.2");
        assert_eq!(topology.address_of(0, 1).unwrap().to_string(), "10.0.0.1");
        assert_eq!(topology.degree(0), 1);
    }

    #[test]
    fn duplicate_ids_and_interfaces_are_named() {
        let (key, message) = error_with("id = \"beta\"", "id = \"alpha\"");
        assert_eq!(key, "nodes[1].id");
        assert_eq!(message, "duplicate node id `alpha` (also nodes[0])");
        let (key, message) = error_with("name = \"ib0\"", "name = \"en0\"");
        assert_eq!(key, "nodes[0].interfaces[1].name");
        assert_eq!(message, "duplicate interface `en0` on node `alpha`");
    }

    #[test]
    fn dangling_link_ends_name_what_exists() {
        let (key, message) = error_with("to = \"beta.en0\"", "to = \"betta.en0\"");
        assert_eq!(key, "links[0].to");
        assert_eq!(
            message,
            "`betta.en0`: no node `betta` (did you mean `beta`?); nodes: alpha, beta"
        );
        let (key, message) = error_with("from = \"alpha.en0\"", "from = \"alpha.en1\"");
        assert_eq!(key, "links[0].from");
        assert!(message.contains("node `alpha` has no interface `en1` (did you mean `en0`?)"));
        assert!(message.ends_with("its interfaces: en0, ib0"), "{message}");
    }

    #[test]
    fn bad_addresses_and_empty_nodes_are_refused() {
        let (key, message) = error_with("10.0.0.2", "10.0.0.300");
        assert_eq!(key, "nodes[1].interfaces[0].address");
        assert!(
            message
                .starts_with("`10.0.0.300` is neither an IP address nor a DNS name; expected IPv4"),
            "{message}"
        );
        // A name is an address too: the rank that connects resolves it.
        let text = TWO.replacen("10.0.0.2", "node-2.cohort", 1);
        let topology = parse(&text, Path::new("two.toml")).unwrap();
        assert_eq!(
            topology.address_of(1, 0).unwrap().to_string(),
            "node-2.cohort"
        );
        let (_, message) = error_with("10.0.0.2", "0.0.0.0");
        assert!(
            message.contains("not an address another node can reach"),
            "{message}"
        );
        let (key, message) = error_with("memory = \"8 GiB\"", "memory = 0");
        assert_eq!(key, "nodes[0].memory");
        assert!(message.contains("node `alpha` has no memory"), "{message}");
        let (key, _) = error_with("cores = 4", "cores = 0");
        assert_eq!(key, "nodes[0].cores");
        let (key, message) = error_with("id = \"beta\"", "id = \"be.ta\"");
        assert_eq!(key, "nodes[1].id");
        assert!(message.contains("invalid node id `be.ta`"), "{message}");
        let (key, message) = error_with(
            "{ name = \"en0\", address = \"10.0.0.1\", kind",
            "{ name = \"en0\", kind",
        );
        assert_eq!(key, "nodes[0].interfaces[0]");
        assert!(message.contains("has no `address`"), "{message}");
    }

    #[test]
    fn links_must_join_two_nodes_of_the_right_kind() {
        let (key, message) = error_with("to = \"beta.en0\"", "to = \"alpha.ib0\"");
        assert_eq!(key, "links[0].to");
        assert!(message.contains("are both on node `alpha`"), "{message}");
        let (key, message) = error_with("to = \"beta.en0\"", "to = \"beta.en0\"\nkind = \"rdma\"");
        assert_eq!(key, "links[0].kind");
        assert!(message.contains("`alpha.en0` is ethernet"), "{message}");
        let (key, message) = error_with("to = \"beta.en0\"", "to = \"beta.ib0\"");
        assert_eq!(key, "links[0].kind");
        assert!(message.contains("`beta.ib0` has none"), "{message}");
        let (key, message) =
            error_with("to = \"beta.en0\"", "to = \"beta.en0\"\nbandwidth_gbps = 0");
        assert_eq!(key, "links[0].bandwidth_gbps");
        assert!(message.contains("expected Gbit/s"), "{message}");
        let twice = format!("{TWO}\n[[links]]\nfrom = \"beta.en0\"\nto = \"alpha.en0\"\n");
        match parse(&twice, Path::new("two.toml")) {
            Err(ClusterError::Invalid { key, message, .. }) => {
                assert_eq!(
                    (key.as_str(), message.as_str()),
                    ("links[1]", "the same link as links[0]")
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_rdma_link_gives_each_side_its_device() {
        let text =
            format!("{TWO}\n[[links]]\nfrom = \"alpha.ib0\"\nto = \"beta.ib0\"\nkind = \"rdma\"\n");
        let topology = parse(&text, Path::new("two.toml")).unwrap();
        assert_eq!(topology.rdma_device(0, 1), Some("ib0"));
        assert_eq!(topology.rdma_device(1, 0), Some("ib0"));
    }

    #[test]
    fn errors_carry_the_file_name() {
        let text = TWO.replacen("cores = 4", "cores = 0", 1);
        let error = parse(&text, Path::new("clusters/two.toml")).unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("clusters/two.toml: `nodes[0].cores`: node `alpha` has no cores"),
            "{error}"
        );
    }
}
