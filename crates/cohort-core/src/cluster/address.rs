//! Where a rank is reached: an IP address, or a DNS name resolved when the
//! rank connects.
//!
//! Names are what a Kubernetes Indexed Job gives its pods (a headless
//! Service makes `job-0.service` resolve to pod 0, whatever IP it got), and
//! what a cluster of machines known by name wants; IP addresses are what a
//! fixed cluster has. A plan carries either, as text (`10.0.0.2:52415`,
//! `cohort-1.cohort:52415`, `[fe80::1]:52415`), and only the rank that
//! connects turns a name into addresses, at that time, so a pod that starts
//! late or moves is found.

use std::fmt;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Longest DNS name (RFC 1035), dots included.
const MAX_NAME_BYTES: usize = 253;
/// Longest label of a DNS name.
const MAX_LABEL_BYTES: usize = 63;

/// An IP address or a DNS name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    Ip(IpAddr),
    /// A DNS name, lowercase.
    Name(String),
}

impl Host {
    pub fn is_ip(&self) -> bool {
        matches!(self, Host::Ip(_))
    }
}

impl From<IpAddr> for Host {
    fn from(ip: IpAddr) -> Self {
        Host::Ip(ip)
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Ip(ip) => write!(f, "{ip}"),
            Host::Name(name) => f.write_str(name),
        }
    }
}

impl FromStr for Host {
    type Err = String;

    /// An IP address if the text is one, else a DNS name: labels of letters,
    /// digits and inner hyphens, 1 to 63 bytes each, 253 in all, not all
    /// digits at the end (so a mistyped IPv4 address is not taken for a name).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Ok(ip) = text.parse::<IpAddr>() {
            return Ok(Host::Ip(ip));
        }
        let name = text.strip_suffix('.').unwrap_or(text);
        let label_ok = |label: &str| {
            (1..=MAX_LABEL_BYTES).contains(&label.len())
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        };
        let numeric_end = name
            .rsplit('.')
            .next()
            .is_some_and(|last| last.bytes().all(|b| b.is_ascii_digit()));
        if name.is_empty()
            || name.len() > MAX_NAME_BYTES
            || !name.split('.').all(label_ok)
            || numeric_end
        {
            return Err(format!(
                "`{text}` is neither an IP address nor a DNS name; expected IPv4 such as \
                 10.0.0.1, IPv6 such as fe80::1, or a name such as node-1.cluster.local"
            ));
        }
        Ok(Host::Name(name.to_ascii_lowercase()))
    }
}

/// A host and a port: where one rank reaches another.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPort {
    pub host: Host,
    pub port: u16,
}

impl HostPort {
    pub fn new(host: impl Into<Host>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
        }
    }

    /// The socket addresses it stands for now: itself for an IP address,
    /// what the system's resolver answers for a name.
    pub fn resolve(&self) -> std::io::Result<Vec<SocketAddr>> {
        match &self.host {
            Host::Ip(ip) => Ok(vec![SocketAddr::new(*ip, self.port)]),
            Host::Name(name) => Ok((name.as_str(), self.port).to_socket_addrs()?.collect()),
        }
    }
}

impl From<SocketAddr> for HostPort {
    fn from(address: SocketAddr) -> Self {
        Self::new(address.ip(), address.port())
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            host => write!(f, "{host}:{}", self.port),
        }
    }
}

impl FromStr for HostPort {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Ok(address) = text.parse::<SocketAddr>() {
            return Ok(address.into());
        }
        let Some((host, port)) = text.rsplit_once(':') else {
            return Err(format!("`{text}` is not HOST:PORT"));
        };
        let port = port
            .parse::<u16>()
            .map_err(|_| format!("`{text}`: `{port}` is not a port (0 to 65535)"))?;
        Ok(Self::new(host.parse::<Host>()?, port))
    }
}

impl Serialize for HostPort {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HostPort {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for Host {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ips_and_names_parse_and_print_back() {
        for text in [
            "10.0.0.2:52415",
            "[fe80::1]:9",
            "cohort-1.cohort:52415",
            "localhost:1",
            "a.b-c.d9:65535",
        ] {
            let parsed: HostPort = text.parse().unwrap();
            assert_eq!(parsed.to_string(), text);
        }
        let name: HostPort = "Node-1.Cluster.Local.:80".parse().unwrap();
        assert_eq!(name.host, Host::Name("node-1.cluster.local".to_owned()));
        assert!("10.0.0.2:1".parse::<HostPort>().unwrap().host.is_ip());
    }

    #[test]
    fn what_is_neither_an_ip_nor_a_name_is_refused() {
        for text in [
            "10.0.0.300:1",
            "10.0.0:1",
            "-node:1",
            "node-:1",
            "no_underscores:1",
            "two..dots:1",
            ":1",
            "node:70000",
            "node",
        ] {
            assert!(text.parse::<HostPort>().is_err(), "{text}");
        }
        let long = format!("{}:1", "a".repeat(64));
        assert!(long.parse::<HostPort>().is_err());
        let too_long = format!("{}a:1", "abcdefgh.".repeat(29));
        assert!(too_long.parse::<HostPort>().is_err());
    }

    #[test]
    fn names_resolve_when_asked_and_ips_are_themselves() {
        let ip: HostPort = "127.0.0.1:7".parse().unwrap();
        assert_eq!(ip.resolve().unwrap(), vec!["127.0.0.1:7".parse().unwrap()]);
        // `localhost` resolves on every system (the hosts file).
        let name: HostPort = "localhost:7".parse().unwrap();
        let addresses = name.resolve().unwrap();
        assert!(
            addresses
                .iter()
                .all(|a| a.ip().is_loopback() && a.port() == 7),
            "{addresses:?}"
        );
        assert!(!addresses.is_empty());
    }

    #[test]
    fn plans_carry_them_as_text() {
        let peer: HostPort = "cohort-2.cohort:52417".parse().unwrap();
        let json = serde_json::to_string(&peer).unwrap();
        assert_eq!(json, "\"cohort-2.cohort:52417\"");
        assert_eq!(serde_json::from_str::<HostPort>(&json).unwrap(), peer);
        let error = serde_json::from_str::<HostPort>("\"bad host:1\"").unwrap_err();
        assert!(
            error
                .to_string()
                .contains("neither an IP address nor a DNS name"),
            "{error}"
        );
    }
}
