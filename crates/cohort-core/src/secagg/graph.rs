//! Who shares secrets with whom: a seeded random `k`-regular graph.
//!
//! SecAgg+ (Bell et al., §4) uses a random Harary graph: the clients in a
//! random order on a ring, each joined to the `(k-1)/2` nearest on either
//! side. It is `(k-1)`-regular and connected (it contains the ring), and a
//! random relabelling keeps the server from choosing who neighbours whom.
//! Flower builds the same graph from a shuffled list; here the shuffle is
//! seeded so a round can be replayed. With `k` at least the number of
//! clients the graph is complete, which is SecAgg.

use std::collections::BTreeMap;

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;

use super::ClientId;

/// The neighbourhoods of one round; each list is sorted and holds the client
/// itself (it keeps one share of its own secrets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Graph {
    neighbours: BTreeMap<ClientId, Vec<ClientId>>,
}

/// Why no graph could be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    #[error("client id {0} appears twice; expected distinct ids")]
    DuplicateClient(ClientId),
    #[error(
        "{clients} clients with {shares} shares each; expected at least 2 clients, and an odd number of shares unless it covers every client"
    )]
    Shape { clients: usize, shares: usize },
}

impl Graph {
    /// The graph over `clients` in which every neighbourhood (self included)
    /// has `shares` members, shuffled by `seed`.
    pub fn new(clients: &[ClientId], shares: usize, seed: u64) -> Result<Graph, GraphError> {
        let n = clients.len();
        let mut order = clients.to_vec();
        order.sort_unstable();
        if let Some(pair) = order.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(GraphError::DuplicateClient(pair[0]));
        }
        if n < 2 || shares < 2 || shares > n || (shares < n && shares.is_multiple_of(2)) {
            return Err(GraphError::Shape { clients: n, shares });
        }
        if shares == n {
            let neighbours = order.iter().map(|&id| (id, order.clone())).collect();
            return Ok(Graph { neighbours });
        }
        order.shuffle(&mut ChaCha20Rng::seed_from_u64(seed));
        let half = (shares - 1) / 2;
        let neighbours = (0..n)
            .map(|at| {
                // 2·half < n, so these offsets are distinct positions.
                let mut around: Vec<ClientId> = (0..=2 * half)
                    .map(|step| order[(at + n + step - half) % n])
                    .collect();
                around.sort_unstable();
                (order[at], around)
            })
            .collect();
        Ok(Graph { neighbours })
    }

    /// The neighbourhood of `client`, itself included, sorted; `None` for a
    /// client not in the round.
    pub fn neighbours(&self, client: ClientId) -> Option<&[ClientId]> {
        self.neighbours.get(&client).map(Vec::as_slice)
    }

    /// Whether `a` and `b` share secrets (a client is its own neighbour).
    pub fn linked(&self, a: ClientId, b: ClientId) -> bool {
        self.neighbours(a)
            .is_some_and(|n| n.binary_search(&b).is_ok())
    }

    /// Every client of the round, sorted.
    pub fn clients(&self) -> impl Iterator<Item = ClientId> + '_ {
        self.neighbours.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn connected(graph: &Graph) -> bool {
        let Some(start) = graph.clients().next() else {
            return true;
        };
        let mut seen = BTreeSet::from([start]);
        let mut stack = vec![start];
        while let Some(at) = stack.pop() {
            for &next in graph.neighbours(at).unwrap() {
                if seen.insert(next) {
                    stack.push(next);
                }
            }
        }
        seen.len() == graph.clients().count()
    }

    #[test]
    fn refuses_bad_shapes() {
        assert_eq!(
            Graph::new(&[1, 2, 2], 3, 0),
            Err(GraphError::DuplicateClient(2))
        );
        assert!(Graph::new(&[1, 2, 3, 4, 5], 4, 0).is_err());
        assert!(Graph::new(&[1], 1, 0).is_err());
        assert!(Graph::new(&[1, 2, 3], 4, 0).is_err());
        let complete = Graph::new(&[3, 1, 2, 4], 4, 0).unwrap();
        assert_eq!(complete.neighbours(2), Some(&[1, 2, 3, 4][..]));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn seeded_regular_symmetric_connected(
            n in 3usize..120,
            k_pick in 1usize..60,
            seed in any::<u64>(),
        ) {
            let ids: Vec<ClientId> = (0..n as u64).map(|i| i * 7 + 100).collect();
            let k = (2 * k_pick + 1).min(n);
            let k = if k < n && k.is_multiple_of(2) { k - 1 } else { k };
            let graph = Graph::new(&ids, k, seed).unwrap();
            prop_assert_eq!(&graph, &Graph::new(&ids, k, seed).unwrap());
            for &id in &ids {
                let around = graph.neighbours(id).unwrap();
                prop_assert_eq!(around.len(), k);
                prop_assert!(around.contains(&id));
                for &other in around {
                    prop_assert!(graph.linked(other, id));
                }
            }
            prop_assert!(connected(&graph));
        }
    }

    #[test]
    fn different_seeds_differ() {
        let ids: Vec<ClientId> = (0..50).collect();
        let a = Graph::new(&ids, 5, 1).unwrap();
        let b = Graph::new(&ids, 5, 2).unwrap();
        assert_ne!(a, b);
    }
}
