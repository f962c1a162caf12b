//! The simulated clock's own cost per event: what an asynchronous server
//! does besides training, aggregating and evaluating, for federations of
//! 1,000 to 100,000 clients.
//!
//! `cargo bench -p cohort-core --bench clock -- [CONFIG]` replays the
//! asynchronous server's clock work (`cohort-runtime`'s
//! `round_loop/asynchronous.rs`, in its order) with the same core calls:
//! at every arrival the places in flight are refilled from the clients
//! online (`OnlineIndex::online_clients`, the selection's draw), each new
//! task is timed from its client's profile and checked against its online
//! spell, the clock wakes for a client coming online when places are free
//! (`OnlineIndex::next_online_client`), and `InFlight` names the next event.
//! Profiles and availability are read from CONFIG (default
//! `bench/async/fedbuff.toml`), so the figures are the experiment's.
//! `bench/clock_overhead.sh` sets them against a real run's time per event.

use std::time::Instant;

use cohort_core::clock::{InFlight, Next};
use cohort_core::devices::{
    Availability, AvailabilityConfig, OnlineIndex, ProfileConfig, Profiles,
};
use cohort_core::selection::ClientSelector;

/// LeNet-5's update on the wire, bytes (what the experiment moves).
const PAYLOAD_BYTES: u64 = 248_136;
/// Samples a client of the experiment trains on (60,000 over 1,000).
const SAMPLES: u64 = 60;
/// Arrivals replayed per configuration.
const EVENTS: u64 = 20_000;

struct Replay {
    total: u32,
    in_flight: usize,
    profiles: Profiles,
    availability: Availability,
    index: OnlineIndex,
    selector: ClientSelector,
    flights: InFlight<u32>,
    now: f64,
    next_task: u64,
    /// Scan as the server did before the one-pass scans (every client
    /// against the busy list, every client's next spell): the reference.
    naive: bool,
}

impl Replay {
    fn new(
        profile: &ProfileConfig,
        availability: &AvailabilityConfig,
        total: u32,
        in_flight: usize,
    ) -> Self {
        Self {
            total,
            in_flight,
            profiles: Profiles::draw(profile, total),
            availability: Availability::new(availability, total, None).expect("an on/off model"),
            index: OnlineIndex::default(),
            selector: ClientSelector::new(1),
            flights: InFlight::default(),
            now: 0.0,
            next_task: 0,
            naive: false,
        }
    }

    fn busy(&self) -> Vec<u32> {
        self.flights.iter().map(|(_, f)| f.item).collect()
    }

    fn refill(&mut self) {
        let free = self.in_flight.saturating_sub(self.flights.len());
        if free == 0 {
            return;
        }
        let busy = self.busy();
        let online = if self.naive {
            (1..=self.total)
                .filter(|c| {
                    !busy.contains(c) && self.availability.online_until(*c, self.now).is_some()
                })
                .collect()
        } else {
            self.index
                .online_clients(&mut self.availability, self.total, self.now, &busy)
        };
        for client in self.selector.select_from(&online, free.min(online.len())) {
            self.launch(client);
        }
    }

    fn launch(&mut self, client: u32) {
        let profile = self.profiles.of(client).expect("a profile per client");
        let timing = profile.before_upload(PAYLOAD_BYTES, SAMPLES, 1);
        let earliest = self.now + timing.total();
        let online_until = self
            .availability
            .online_until(client, self.now)
            .unwrap_or(self.now);
        let task = self.next_task;
        self.next_task += 1;
        let inserted = if online_until < earliest {
            self.flights.insert(task, online_until, true, client)
        } else {
            self.flights.insert(task, earliest, false, client)
        };
        inserted.expect("a fresh task number and a finite time");
    }

    /// Moves the clock to a client coming online; `true` when it did.
    fn wake(&mut self) -> bool {
        if self.flights.len() >= self.in_flight {
            return false;
        }
        let next_event = match self.flights.next() {
            Next::Ready(task) | Next::Unsettled(task) => {
                self.flights.get(task).map_or(f64::INFINITY, |f| f.at)
            }
            Next::Empty => f64::INFINITY,
        };
        let busy = self.busy();
        let next_online = if self.naive {
            (1..=self.total)
                .filter(|c| !busy.contains(c))
                .filter_map(|c| self.availability.next_online(c, self.now))
                .min_by(f64::total_cmp)
        } else {
            self.index
                .next_online_client(&mut self.availability, self.total, self.now, &busy)
        };
        match next_online {
            Some(at) if at > self.now && at < next_event => {
                self.now = at;
                true
            }
            _ => false,
        }
    }

    /// Runs to the next arrival.
    fn step(&mut self) {
        loop {
            self.refill();
            if self.wake() {
                continue;
            }
            match self.flights.next() {
                Next::Empty => panic!("no client online at {} s or ever after", self.now),
                Next::Unsettled(task) => {
                    // The update's bytes are known once trained: its upload.
                    let flight = self.flights.get(task).expect("named");
                    let profile = self.profiles.of(flight.item).expect("a profile");
                    let at = flight.at - profile.latency + profile.upload_seconds(PAYLOAD_BYTES);
                    self.flights.settle(task, at.max(flight.at)).expect("later");
                }
                Next::Ready(task) => {
                    let flight = self.flights.take(task).expect("named");
                    self.now = flight.at;
                    return;
                }
            }
        }
    }
}

/// Seconds per arrival, and the simulated time the arrivals took.
fn replay(
    profile: &ProfileConfig,
    availability: &AvailabilityConfig,
    total: u32,
    in_flight: usize,
    naive: bool,
) -> (f64, f64) {
    let mut replay = Replay::new(profile, availability, total, in_flight);
    replay.naive = naive;
    let events = if naive { EVENTS / 10 } else { EVENTS };
    let started = Instant::now();
    for _ in 0..events {
        replay.step();
    }
    (started.elapsed().as_secs_f64() / events as f64, replay.now)
}

fn section<T: serde::de::DeserializeOwned>(file: &toml::Table, key: &str) -> T {
    let value = file
        .get("clients")
        .and_then(|c| c.get(key))
        .cloned()
        .unwrap_or_else(|| panic!("the config has no [clients.{key}]"));
    value
        .try_into()
        .unwrap_or_else(|e| panic!("[clients.{key}]: {e}"))
}

fn main() {
    let path = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| {
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../bench/async/fedbuff.toml"
            )
            .to_owned()
        });
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let file: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    let profile: ProfileConfig = section(&file, "profile");
    let availability: AvailabilityConfig = section(&file, "availability");
    println!("simulated clock, {EVENTS} arrivals each, profiles and availability of {path}");
    println!(
        "{:>8} {:>10} {:>14} {:>20} {:>12}",
        "clients", "in flight", "us per event", "before (reference)", "simulated s"
    );
    for (total, in_flight) in [
        (1_000, 100),
        (10_000, 100),
        (10_000, 1_000),
        (100_000, 1_000),
    ] {
        let (per_event, simulated) = replay(&profile, &availability, total, in_flight, false);
        let (before, _) = replay(&profile, &availability, total, in_flight, true);
        println!(
            "{total:>8} {in_flight:>10} {:>14.2} {:>20.2} {simulated:>12.1}",
            per_event * 1e6,
            before * 1e6,
        );
    }
}
