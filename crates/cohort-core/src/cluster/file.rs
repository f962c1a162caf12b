//! The cluster file: its serde schema, and reading it with a size bound.
//!
//! The schema accepts only the keys it declares (`deny_unknown_fields`), so a
//! typo is an error with a did-you-mean, never a silently ignored key. What
//! serde cannot check (ids that repeat, link ends that name nothing,
//! addresses) is checked by [`Topology::new`], whose errors name the key; this
//! file adds the file name.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

use super::size;
use super::topology::{InterfaceKind, LinkKind, Topology};
use crate::suggest::did_you_mean;

/// A cluster file: the machines a run may use and how they are wired.
///
/// ```toml
/// [[nodes]]
/// id = "alpha"
/// memory = "64 GiB"
/// cores = 16
/// interfaces = [{ name = "en0", address = "10.0.0.1", kind = "ethernet" }]
///
/// [[links]]
/// from = "alpha.en0"
/// to = "beta.en0"
/// bandwidth_gbps = 10
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// The machines, at least one and at most [`super::MAX_NODES`]; the first
    /// one chosen for a run hosts rank 0. Required.
    pub nodes: Vec<NodeSpec>,
    /// Links between interfaces of two different nodes, each usable in both
    /// directions. Default: none (every node can only run alone).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkSpec>,
}

/// One machine of the cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Unique name of the node: letters, digits, `-` and `_` (no `.`, which
    /// separates node and interface in a link end). Required.
    pub id: String,
    /// Host name or IPv4 address by which ssh, mpirun and srun reach the node.
    /// Default: the `id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Memory the run may use on this node: bytes as an integer, or a string
    /// with a unit (`"64 GiB"`, `"512 MiB"`, `"1.5 TB"`). Required, more than 0.
    #[serde(deserialize_with = "size::deserialize")]
    pub memory: u64,
    /// CPU cores the run may use; ranks are split across nodes in proportion
    /// to them. Required, more than 0.
    pub cores: u32,
    /// GPUs of the node. Default: 0. Recorded for the plan; placement does not
    /// weigh them yet (cohort's workers train on the CPU by default).
    #[serde(default)]
    pub gpus: u32,
    /// The node's network interfaces. Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<InterfaceSpec>,
}

/// A network interface of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterfaceSpec {
    /// Name, unique within the node, such as `en0` or `mlx5_0`; no spaces.
    /// Required.
    pub name: String,
    /// IPv4 or IPv6 address of the interface, or a DNS name that resolves
    /// to it (a Kubernetes pod's `job-0.service`), resolved by the rank that
    /// connects, when it connects. Required for every kind but `rdma`: an RDMA
    /// device may have no IP, and then only `rdma` links can use it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// `ethernet`, `thunderbolt`, `wifi` or `rdma`. Required.
    pub kind: InterfaceKind,
}

/// A link between interfaces of two nodes, usable in both directions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// One end: `"node.interface"`, or `{ node = "...", interface = "..." }`.
    /// Required.
    pub from: LinkEnd,
    /// The other end, on another node; same forms as `from`. Required.
    pub to: LinkEnd,
    /// `socket` (TCP over the interfaces' addresses) or `rdma` (both ends must
    /// be interfaces of kind `rdma`). Default: `socket`.
    #[serde(default)]
    pub kind: LinkKind,
    /// Bandwidth in Gbit/s, more than 0; among links of the same interface
    /// kind, the faster one carries the traffic. Default: unknown (slowest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_gbps: Option<f64>,
}

/// One end of a link: a node and one of its interfaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkEnd {
    /// The node's `id`.
    pub node: String,
    /// The `name` of one of that node's interfaces.
    pub interface: String,
}

impl std::fmt::Display for LinkEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.node, self.interface)
    }
}

impl Serialize for LinkEnd {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // Node ids hold no `.`, so the string form always reads back.
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for LinkEnd {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Table {
            node: String,
            interface: String,
        }

        struct EndVisitor;

        impl<'de> de::Visitor<'de> for EndVisitor {
            type Value = LinkEnd;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("\"node.interface\" or { node = \"...\", interface = \"...\" }")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<LinkEnd, E> {
                match text.split_once('.') {
                    Some((node, interface)) => Ok(LinkEnd {
                        node: node.to_owned(),
                        interface: interface.to_owned(),
                    }),
                    None => Err(E::custom(format!(
                        "invalid link end `{text}`: expected \"node.interface\", such as \"alpha.en0\""
                    ))),
                }
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<LinkEnd, A::Error> {
                let table = Table::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(LinkEnd {
                    node: table.node,
                    interface: table.interface,
                })
            }
        }

        deserializer.deserialize_any(EndVisitor)
    }
}

/// A cluster file that cannot be used, with where the problem is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    /// The file could not be opened or read.
    #[error("{}: cannot read cluster file: {message}", file.display())]
    Read { file: PathBuf, message: String },
    /// The file is past [`MAX_CLUSTER_BYTES`].
    #[error("{}: is larger than {limit} bytes; a cluster file is a few kilobytes", file.display())]
    TooLarge { file: PathBuf, limit: u64 },
    /// Not TOML.
    #[error("{}: invalid TOML: {message}", file.display())]
    Syntax { file: PathBuf, message: String },
    /// A key is unknown, missing, of the wrong type or has a value that
    /// cannot be, such as a link to an interface no node has.
    #[error("{}: `{key}`: {message}", file.display())]
    Invalid {
        file: PathBuf,
        key: String,
        message: String,
    },
}

/// Largest cluster file read, as for the run config: a thousand times a real
/// one, so a wrong path to a huge file fails at once.
pub const MAX_CLUSTER_BYTES: u64 = 1 << 20;

/// Reads, parses and validates the cluster file at `path`.
pub fn load(path: &Path) -> Result<Topology, ClusterError> {
    use std::io::Read;
    let cannot = |e: std::io::Error| ClusterError::Read {
        file: path.to_path_buf(),
        message: e.to_string(),
    };
    let file = std::fs::File::open(path).map_err(cannot)?;
    let mut text = String::new();
    file.take(MAX_CLUSTER_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(cannot)?;
    if text.len() as u64 > MAX_CLUSTER_BYTES {
        return Err(ClusterError::TooLarge {
            file: path.to_path_buf(),
            limit: MAX_CLUSTER_BYTES,
        });
    }
    parse(&text, path)
}

/// Parses and validates cluster-file text that claims to come from `file`
/// (which only names it in errors): no I/O.
pub fn parse(text: &str, file: &Path) -> Result<Topology, ClusterError> {
    let table = text
        .parse::<toml::Table>()
        .map_err(|e| ClusterError::Syntax {
            file: file.to_path_buf(),
            message: e.to_string().trim_end().to_owned(),
        })?;
    let spec: ClusterSpec =
        serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|error| {
            let key = match error.path().to_string() {
                path if path == "." => "(top level)".to_owned(),
                path => path,
            };
            ClusterError::Invalid {
                file: file.to_path_buf(),
                key,
                message: readable(error.into_inner().to_string()),
            }
        })?;
    Topology::new(&spec).map_err(|e| ClusterError::Invalid {
        file: file.to_path_buf(),
        key: e.key,
        message: e.message,
    })
}

/// serde's messages for unknown keys and values, with a did-you-mean among the
/// names serde lists.
fn readable(message: String) -> String {
    let rewrite = |rest: &str, what: &str, valid: &str| -> Option<String> {
        let (given, expected) = rest.split_once('`')?;
        let names = listed_names(&expected[expected.find('`')?..]);
        let suggestion = did_you_mean(given, names.iter().copied());
        Some(format!(
            "unknown {what} `{given}`{suggestion}; {valid}: {}",
            names.join(", ")
        ))
    };
    if let Some(rest) = message.strip_prefix("missing field ") {
        return format!("missing key {rest}");
    }
    let rewritten = if let Some(rest) = message.strip_prefix("unknown field `") {
        rewrite(rest, "key", "valid keys")
    } else if let Some(rest) = message.strip_prefix("unknown variant `") {
        rewrite(rest, "value", "expected one of")
    } else {
        None
    };
    rewritten.unwrap_or(message)
}

/// The names of serde's "`a`, `b` or `c`" list, and nothing after it (the
/// TOML layer may add the key's path in backticks, which is not a choice).
fn listed_names(mut list: &str) -> Vec<&str> {
    let mut names = Vec::new();
    while let Some(after) = list.strip_prefix('`') {
        let Some((name, tail)) = after.split_once('`') else {
            break;
        };
        names.push(name);
        match tail
            .strip_prefix(", ")
            .or_else(|| tail.strip_prefix(" or "))
        {
            Some(next) => list = next,
            None => break,
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_value_lists_the_choices_and_no_path() {
        let (key, message) = error_of(&format!(
            "{NODE}interfaces = [{{ name = \"en0\", address = \"10.0.0.1\", kind = \"ethernt\" }}]\n"
        ));
        assert_eq!(key, "nodes[0].interfaces[0].kind");
        assert!(
            message
                == "unknown value `ethernt` (did you mean `ethernet`?); expected one of: rdma, \
                    thunderbolt, ethernet, wifi",
            "{message}"
        );
        assert!(
            !message.contains("nodes") && !message.contains("kind"),
            "{message}"
        );
        assert_eq!(
            listed_names("`a`, `b` or `c` for key `nodes.interfaces.kind`"),
            ["a", "b", "c"]
        );
    }

    fn error_of(text: &str) -> (String, String) {
        match parse(text, Path::new("c.toml")).unwrap_err() {
            ClusterError::Invalid { key, message, .. } => (key, message),
            other => panic!("expected an invalid key, got {other}"),
        }
    }

    const NODE: &str = "[[nodes]]\nid = \"a\"\nmemory = \"1 GiB\"\ncores = 2\n";

    #[test]
    fn unknown_keys_get_a_did_you_mean_and_the_valid_keys() {
        let (key, message) = error_of(&format!("{NODE}memroy = 3\n"));
        assert_eq!(key, "nodes[0].memroy");
        assert!(
            message.contains("unknown key `memroy` (did you mean `memory`?)"),
            "{message}"
        );
        assert!(
            message.contains("valid keys: id, host, memory"),
            "{message}"
        );
        let (key, message) = error_of(&format!("{NODE}\n[extra]\nx = 1\n"));
        assert_eq!(key, "extra");
        assert!(message.contains("valid keys: nodes, links"), "{message}");
    }

    #[test]
    fn unknown_kinds_and_missing_keys_are_named() {
        let text = format!(
            "{NODE}interfaces = [{{ name = \"e\", address = \"10.0.0.1\", kind = \"etherent\" }}]\n"
        );
        let (key, message) = error_of(&text);
        assert_eq!(key, "nodes[0].interfaces[0].kind");
        assert!(message.contains("(did you mean `ethernet`?)"), "{message}");
        let (key, message) = error_of("[[nodes]]\nid = \"a\"\ncores = 2\n");
        assert_eq!(key, "nodes[0]");
        assert!(message.contains("missing key `memory`"), "{message}");
    }

    #[test]
    fn memory_accepts_bytes_or_a_unit_and_names_a_bad_one() {
        let topology = parse(
            "[[nodes]]\nid = \"a\"\nmemory = 4096\ncores = 1\n",
            Path::new("c.toml"),
        )
        .unwrap();
        assert_eq!(topology.nodes()[0].memory, 4096);
        let (key, message) = error_of("[[nodes]]\nid = \"a\"\nmemory = \"64 GB2\"\ncores = 1\n");
        assert_eq!(key, "nodes[0].memory");
        assert!(message.contains("invalid size `64 GB2`"), "{message}");
        assert!(message.contains("\"64 GiB\""), "{message}");
    }

    #[test]
    fn link_ends_take_the_string_and_the_table_form() {
        let text = format!(
            "{NODE}interfaces = [{{ name = \"e\", address = \"10.0.0.1\", kind = \"ethernet\" }}]\n\
             [[nodes]]\nid = \"b\"\nmemory = 1\ncores = 1\n\
             interfaces = [{{ name = \"e.100\", address = \"10.0.0.2\", kind = \"ethernet\" }}]\n\
             [[links]]\nfrom = {{ node = \"a\", interface = \"e\" }}\nto = \"b.e.100\"\n"
        );
        let topology = parse(&text, Path::new("c.toml")).unwrap();
        assert_eq!(topology.links().len(), 1);
        let (key, message) = error_of(&text.replace("\"b.e.100\"", "\"b\""));
        assert_eq!(key, "links[0].to");
        assert!(message.contains("expected \"node.interface\""), "{message}");
    }

    #[test]
    fn syntax_and_size_problems_name_the_file() {
        let error = parse("nodes = [", Path::new("bad.toml")).unwrap_err();
        assert!(matches!(error, ClusterError::Syntax { .. }), "{error}");
        assert!(
            error.to_string().starts_with("bad.toml: invalid TOML"),
            "{error}"
        );
    }

    #[test]
    fn ships_cluster_files_that_load() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/clusters");
        let three = load(&root.join("three_nodes.toml")).unwrap();
        assert_eq!(three.nodes().len(), 3);
        let one = load(&root.join("one_machine.toml")).unwrap();
        assert_eq!(one.nodes().len(), 1);
        let missing = load(&root.join("no_such_file.toml")).unwrap_err();
        assert!(matches!(missing, ClusterError::Read { .. }), "{missing}");
    }

    #[test]
    fn a_file_past_the_bound_is_refused_before_parsing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("huge.toml");
        std::fs::write(&path, vec![b'#'; MAX_CLUSTER_BYTES as usize + 1]).unwrap();
        assert!(matches!(load(&path), Err(ClusterError::TooLarge { .. })));
    }
}
