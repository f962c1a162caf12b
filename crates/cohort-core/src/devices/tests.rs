use std::path::Path;

use super::*;

fn config(compute: Distribution) -> ProfileConfig {
    ProfileConfig {
        compute: Some(compute),
        ..ProfileConfig::default()
    }
}

#[test]
fn a_task_takes_its_download_compute_and_upload_by_hand() {
    let profile = DeviceProfile {
        compute: 0.001,
        unit: ComputeUnit::Sample,
        task_overhead: 0.5,
        downlink_mbps: Some(8.0),
        uplink_mbps: Some(4.0),
        latency: 0.1,
    };
    // 1 MB at 8 Mbit/s is 1 s, plus 0.1 s latency.
    assert_eq!(profile.download_seconds(1_000_000), 1.1);
    // At 4 Mbit/s, 2 s.
    assert_eq!(profile.upload_seconds(1_000_000), 2.1);
    // 0.5 + 1000 samples · 2 epochs · 1 ms.
    assert_eq!(profile.compute_seconds(1000, 2), 2.5);
    let per_epoch = DeviceProfile {
        unit: ComputeUnit::Epoch,
        compute: 3.0,
        ..profile
    };
    // Plato's sleep per epoch: the partition's size does not count.
    assert_eq!(per_epoch.compute_seconds(1000, 2), 6.5);
    let before = profile.before_upload(1_000_000, 1000, 2);
    assert_eq!(before.total(), 1.1 + 2.5 + 0.1);
    let unbounded = DeviceProfile {
        downlink_mbps: None,
        ..profile
    };
    assert_eq!(unbounded.download_seconds(u64::MAX), 0.1);
    // An evaluation: 1 MB down (1.1 s), a third of one epoch over 1200
    // samples (1.2 s / 3, no overhead), 16 bytes up (0.1 s + 32 µs).
    let evaluation = profile.evaluation(1_000_000, 1200, 16);
    assert_eq!(evaluation.download, 1.1);
    assert!((evaluation.compute - 0.4).abs() < 1e-12, "{evaluation:?}");
    assert!(
        (evaluation.upload - 0.100_032).abs() < 1e-12,
        "{evaluation:?}"
    );
    // Per epoch: a third of the epoch's 3 s, whatever the samples.
    assert_eq!(per_epoch.evaluation(0, 5, 0).compute, 1.0);
}

#[test]
fn draws_depend_on_the_seed_and_the_client_alone() {
    let lognormal = config(Distribution::Lognormal {
        median: 0.01,
        sigma: 1.0,
    });
    let ten = Profiles::draw(&lognormal, 10);
    let twenty = Profiles::draw(&lognormal, 20);
    assert_eq!(ten.len(), 10);
    for client in 1..=10 {
        // More clients leave the first ten's figures as they were.
        assert_eq!(ten.of(client), twenty.of(client));
    }
    assert_ne!(ten.of(1).unwrap().compute, ten.of(2).unwrap().compute);
    let reseeded = Profiles::draw(
        &ProfileConfig {
            seed: 2,
            ..lognormal.clone()
        },
        10,
    );
    assert_ne!(ten.of(1), reseeded.of(1));
    assert!(ten.of(0).is_none() && ten.of(11).is_none());
    let fast_slow = Profiles::draw(
        &config(Distribution::TwoPoint {
            fast: 1.0,
            slow: 10.0,
            slow_fraction: 0.5,
        }),
        200,
    );
    let slow = (1..=200)
        .filter(|&c| fast_slow.of(c).unwrap().compute == 10.0)
        .count();
    assert!((70..=130).contains(&slow), "{slow}");
}

#[test]
fn a_csv_of_per_client_figures_is_read_and_the_rest_drawn() {
    let mut config = config(Distribution::Constant { value: 0.5 });
    config.uplink_mbps = Some(Distribution::Constant { value: 7.0 });
    let text = "client,compute,latency\n# the slow one\n2,0.25,0.5\n1, 0.125 ,0\n";
    let profiles = Profiles::from_csv(text, Path::new("devices.csv"), &config, 2).unwrap();
    let one = profiles.of(1).unwrap();
    assert_eq!(
        (one.compute, one.latency, one.uplink_mbps),
        (0.125, 0.0, Some(7.0))
    );
    assert_eq!(profiles.of(2).unwrap().compute, 0.25);
    assert_eq!(profiles.of(2).unwrap().latency, 0.5);
}

#[test]
fn a_bad_csv_is_refused_naming_file_line_and_column() {
    let config = config(Distribution::Constant { value: 0.5 });
    let cases = [
        ("", "devices.csv: line 1: the file is empty"),
        (
            "client,compte\n",
            "devices.csv: line 1, column 2 (compte): unknown column `compte` (did you mean \
             `compute`?)",
        ),
        (
            "client,latency\n1,0\n",
            "devices.csv: line 1: the header has no `compute` column",
        ),
        (
            "client,compute\n1,0.1\n2,fast\n",
            "devices.csv: line 3, column 2 (compute): `fast` is not a number",
        ),
        (
            "client,compute\n1,0.1\n2,-1\n",
            "devices.csv: line 3, column 2 (compute): -1 is outside [0, 86400]",
        ),
        (
            "client,compute\n1,0.1\n3,0.1\n",
            "devices.csv: line 3, column 1 (client): client 3 is not one of the run's clients \
             1..=2",
        ),
        (
            "client,compute\n1,0.1\n1,0.2\n",
            "devices.csv: line 3, column 1 (client): client 1 has a row already",
        ),
        (
            "client,compute\n1,0.1\n",
            "devices.csv: line 2: no row for client 2",
        ),
        (
            "client,compute\n1,0.1,3\n",
            "devices.csv: line 2: 3 fields, the header has 2",
        ),
        (
            "client,compute,compute\n",
            "devices.csv: line 1, column 3 (compute): column `compute` appears twice",
        ),
        (
            "client,compute\n1,NaN\n2,1\n",
            "devices.csv: line 2, column 2 (compute): NaN is outside",
        ),
    ];
    for (text, expected) in cases {
        let error = Profiles::from_csv(text, Path::new("devices.csv"), &config, 2)
            .unwrap_err()
            .to_string();
        assert!(error.starts_with(expected), "{text:?}: {error}");
    }
}

#[test]
fn config_problems_name_their_key() {
    let mut config = ProfileConfig {
        uplink_mbps: Some(Distribution::Constant { value: 5.0 }),
        ..ProfileConfig::default()
    };
    // Bandwidths without compute: no profile to put them in.
    assert_eq!(config.problems()[0].0, "uplink_mbps");
    config.compute = Some(Distribution::Constant { value: -1.0 });
    assert_eq!(config.problems()[0].0, "compute");
    config.compute = Some(Distribution::Constant { value: 1.0 });
    config.task_overhead = f64::INFINITY;
    assert_eq!(config.problems()[0].0, "task_overhead");
    config.task_overhead = 1.0;
    assert!(config.problems().is_empty());
}

fn trace(text: &str, clients: u32) -> Result<Availability, FileError> {
    let config = AvailabilityConfig {
        model: AvailabilityModel::Trace,
        trace_file: Some("trace.csv".into()),
        ..AvailabilityConfig::default()
    };
    Availability::new(&config, clients, Some((text, Path::new("trace.csv"))))
}

#[test]
fn a_trace_is_followed_exactly() {
    let text = "client,online_from,online_until\n1,10,20\n1,15,30\n1,40,50\n2,0,5\n";
    let mut availability = trace(text, 3).unwrap();
    // Overlapping spells of client 1 are one: [10, 30), then [40, 50).
    assert_eq!(availability.online_until(1, 9.999), None);
    assert_eq!(availability.online_until(1, 10.0), Some(30.0));
    assert_eq!(availability.online_until(1, 29.999), Some(30.0));
    assert_eq!(availability.online_until(1, 30.0), None);
    assert_eq!(availability.next_online(1, 30.0), Some(40.0));
    assert_eq!(availability.next_online(1, 45.0), Some(45.0));
    assert_eq!(availability.next_online(1, 50.0), None);
    assert_eq!(availability.online_until(2, 0.0), Some(5.0));
    // A client the trace does not name is never online.
    assert_eq!(availability.online_until(3, 0.0), None);
    assert_eq!(availability.next_online(3, 0.0), None);
}

#[test]
fn a_bad_trace_is_refused_naming_file_line_and_column() {
    let cases = [
        (
            "client,online_from,online_until\n1,20,10\n",
            "trace.csv: line 2, column 3 (online_until): online_until = 10 is not after \
             online_from = 20",
        ),
        (
            "client,online_from\n1,20\n",
            "trace.csv: line 1: the header has no `online_until` column",
        ),
        (
            "client,online_from,online_until\n0,1,2\n",
            "trace.csv: line 2, column 1 (client): client 0 is not one",
        ),
        (
            "client,online_from,online_until\n1,-1,2\n",
            "trace.csv: line 2, column 2 (online_from): -1 is outside",
        ),
    ];
    for (text, expected) in cases {
        let error = trace(text, 2).unwrap_err().to_string();
        assert!(error.starts_with(expected), "{text:?}: {error}");
    }
}

#[test]
fn on_off_spells_are_seeded_and_online_for_their_share() {
    let config = AvailabilityConfig {
        model: AvailabilityModel::OnOff,
        mean_online: 100.0,
        mean_offline: 300.0,
        ..AvailabilityConfig::default()
    };
    let mut a = Availability::new(&config, 50, None).unwrap();
    let mut b = Availability::new(&config, 50, None).unwrap();
    let mut online = 0;
    let mut asked = 0;
    for client in 1..=50 {
        for step in 0..400 {
            let time = f64::from(step) * 97.0;
            let here = a.online_until(client, time);
            // Asked in another order, the other model draws the same spells.
            assert_eq!(b.online_until(client, time), here);
            asked += 1;
            online += usize::from(here.is_some());
        }
    }
    // Online a quarter of the time, 100 / (100 + 300).
    let share = online as f64 / asked as f64;
    assert!((share - 0.25).abs() < 0.04, "{share}");
    let reseeded = AvailabilityConfig { seed: 9, ..config };
    let mut c = Availability::new(&reseeded, 50, None).unwrap();
    let differs =
        (1..=50).any(|client| c.online_until(client, 5000.0) != a.online_until(client, 5000.0));
    assert!(differs);
}

proptest::proptest! {
    /// `next_online(t)` is `t` exactly when the client is online at `t`, and
    /// otherwise the start of a spell that holds it.
    #[test]
    fn next_online_agrees_with_online_until(seed in 0u64..1000, time in 0.0f64..1e5) {
        let config = AvailabilityConfig {
            model: AvailabilityModel::OnOff,
            mean_online: 50.0,
            mean_offline: 70.0,
            seed,
            ..AvailabilityConfig::default()
        };
        let mut model = Availability::new(&config, 3, None).unwrap();
        for client in 1..=3 {
            let next = model.next_online(client, time).unwrap();
            let here = model.online_until(client, time);
            proptest::prop_assert_eq!(here.is_some(), next == time);
            proptest::prop_assert!(next >= time);
            let until = model.online_until(client, next);
            proptest::prop_assert!(until.is_some_and(|until| until > next));
        }
    }

    /// The index answers what asking every client would, at times that
    /// move forward (as a server's clock does) and back (a rebuild): the
    /// idle clients online, and the earliest time one of them is.
    #[test]
    fn the_online_index_agrees_with_asking_every_client(
        seed in 0u64..1000,
        steps in proptest::collection::vec((0.0f64..400.0, proptest::collection::vec(1u32..=40, 0..40)), 1..12),
    ) {
        let config = AvailabilityConfig {
            model: AvailabilityModel::OnOff,
            mean_online: 30.0,
            mean_offline: 90.0,
            seed,
            ..AvailabilityConfig::default()
        };
        let mut fast = Availability::new(&config, 40, None).unwrap();
        let mut slow = fast.clone();
        let mut index = OnlineIndex::default();
        let mut time = 0.0;
        for (step, (forward, busy)) in steps.iter().enumerate() {
            // Mostly forward; every fifth question goes back in time.
            time = if step % 5 == 4 { time / 2.0 } else { time + forward };
            let idle: Vec<u32> = (1..=40).filter(|c| !busy.contains(c)).collect();
            let online: Vec<u32> = idle
                .iter()
                .copied()
                .filter(|&c| slow.online_until(c, time).is_some())
                .collect();
            let earliest = idle
                .iter()
                .filter_map(|&c| slow.next_online(c, time))
                .min_by(f64::total_cmp);
            proptest::prop_assert_eq!(index.next_online_client(&mut fast, 40, time, busy), earliest);
            proptest::prop_assert_eq!(index.online_clients(&mut fast, 40, time, busy), online);
        }
    }
}

#[test]
fn every_client_busy_leaves_none_to_draw() {
    let mut always = Availability::Always;
    let mut index = OnlineIndex::default();
    let busy: Vec<u32> = (1..=5).rev().collect();
    assert!(index.online_clients(&mut always, 5, 1.0, &busy).is_empty());
    assert_eq!(index.next_online_client(&mut always, 5, 1.0, &busy), None);
    assert_eq!(
        index.online_clients(&mut always, 5, 1.0, &[2, 2, 4]),
        [1, 3, 5]
    );
    assert_eq!(
        index.next_online_client(&mut always, 5, 2.0, &[1]),
        Some(2.0)
    );
}

#[test]
fn the_index_follows_a_trace_to_its_last_spell() {
    let trace = "client,online_from,online_until\n1,10,20\n2,15,30\n";
    let config = AvailabilityConfig {
        model: AvailabilityModel::Trace,
        ..AvailabilityConfig::default()
    };
    let mut model = Availability::new(&config, 2, Some((trace, Path::new("t.csv")))).unwrap();
    let mut index = OnlineIndex::default();
    assert_eq!(
        index.next_online_client(&mut model, 2, 0.0, &[]),
        Some(10.0)
    );
    assert_eq!(index.online_clients(&mut model, 2, 16.0, &[]), [1, 2]);
    // Client 2 is busy: client 1 is the only one to wait for, and it is done.
    assert_eq!(index.next_online_client(&mut model, 2, 25.0, &[2]), None);
    assert_eq!(index.online_clients(&mut model, 2, 25.0, &[]), [2]);
    assert!(index.online_clients(&mut model, 2, 30.0, &[]).is_empty());
    assert_eq!(index.next_online_client(&mut model, 2, 30.0, &[]), None);
}
