//! The host-file parser (`cohort_core::cluster::RankFile::parse`), which a
//! rank runs on a file anyone may have edited. The first byte picks the mode:
//! even, the rest of the input is the file's text (non-UTF-8 bytes replaced);
//! odd, a real host file (one of `fuzz/seeds/host_file/`, written by
//! `cohort place --emit`: ring, rdma, grpc, DNS names) is edited as JSON by
//! the input, which sets the fields `check` looks at (and others) to small,
//! boundary and wrong-typed values, drops keys, adds unknown ones, and grows
//! or shrinks the ring's host list and the RDMA matrix. Whatever parses must
//! keep every promise of `parse` (a rank and neighbours inside the world, a
//! client block inside 1..=num_clients, a host list and matrix of the world's
//! size) and serialize and parse again to an equal value.
#![no_main]

use cohort_core::cluster::RankFile;
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};

const SEEDS: [&str; 4] = [
    include_str!("../seeds/host_file/hosts-seedring-1.json"),
    include_str!("../seeds/host_file/hosts-seedrdma-0.json"),
    include_str!("../seeds/host_file/hosts-seedgrpc-0.json"),
    include_str!("../seeds/host_file/hosts-seedk8s-2.json"),
];

/// Where edits land: every field `check` reads, and some it does not.
const FIELDS: [&str; 18] = [
    "/world_size",
    "/num_clients",
    "/rank/rank",
    "/rank/clients/first",
    "/rank/clients/last",
    "/rank/ring/left/rank",
    "/rank/ring/right/rank",
    "/rank/ring/hosts",
    "/rdma_devices",
    "/rank/workers",
    "/rank/memory_needed",
    "/rank/listen",
    "/rank/coordinator",
    "/rank/ring/left/address",
    "/rank/ring",
    "/backend",
    "/instance",
    "/rank/ring/right/node",
];

const STRINGS: [&str; 12] = [
    "",
    "0.0.0.0:0",
    "[::1]:27500",
    "[fe80::1%2]:80",
    "fl-1.cohort:28489",
    "host:65536",
    "ring",
    "rdma",
    "mpi",
    "é\u{0}\"\\",
    "1.2.3.4",
    "a:b:c",
];

fn value(kind: u8, small: u8) -> Value {
    match kind % 12 {
        0 => json!(small),
        1 => json!(small as i64 - 128),
        2 => json!(u32::MAX as u64 - (small % 4) as u64),
        3 => json!(u32::MAX as u64 + 1 + small as u64),
        4 => json!(u64::MAX - small as u64),
        5 => json!(small as f64 + 0.5),
        6 => Value::Null,
        7 => json!(STRINGS[small as usize % STRINGS.len()]),
        8 => json!([]),
        9 => json!({}),
        10 => json!(vec![Value::Null; small as usize % 20]),
        _ => json!(small % 2 == 0),
    }
}

fn edit(file: &mut Value, bytes: &[u8]) {
    for step in bytes.chunks(3) {
        let [field, kind, small] = [0, 1, 2].map(|i| step.get(i).copied().unwrap_or(0));
        let pointer = FIELDS[field as usize % FIELDS.len()];
        let (parent, key) = pointer.rsplit_once('/').expect("pointers start with /");
        match kind >> 4 {
            // Drop the key.
            0 => {
                if let Some(Value::Object(map)) = file.pointer_mut(parent) {
                    map.remove(key);
                }
            }
            // Add a key no host file has.
            1 => {
                if let Some(Value::Object(map)) = file.pointer_mut(parent) {
                    map.insert(format!("extra{}", small % 3), json!(small));
                }
            }
            // Grow or shrink a list (ring hosts, matrix and its rows).
            2 | 3 => match file.pointer_mut(pointer) {
                Some(Value::Array(list)) => {
                    if kind & 1 == 0 {
                        list.truncate(small as usize % (list.len() + 1));
                    } else {
                        let last = list.last().cloned().unwrap_or(Value::Null);
                        list.extend(std::iter::repeat_n(last, small as usize % 5));
                    }
                    if let Some(Value::Array(row)) = list.get_mut((small % 4) as usize) {
                        row.truncate((kind % 4) as usize);
                    }
                }
                _ => set(file, parent, key, value(kind, small)),
            },
            // Set the field to a value (the same type mostly, wrong ones too).
            _ => set(file, parent, key, value(kind, small)),
        }
    }
}

fn set(file: &mut Value, parent: &str, key: &str, value: Value) {
    if let Some(Value::Object(map)) = file.pointer_mut(parent) {
        map.insert(key.to_owned(), value);
    }
}

fn check(text: &str) {
    let Ok(file) = RankFile::parse(text) else {
        return;
    };
    let world = file.world_size;
    let rank = &file.rank;
    assert!(world > 0);
    assert!(rank.rank < world);
    assert!(1 <= rank.clients.first);
    assert!(rank.clients.first <= rank.clients.last);
    assert!(rank.clients.last <= file.num_clients);
    if let Some(ring) = &rank.ring {
        assert!(ring.left.rank < world && ring.right.rank < world);
        assert_eq!(ring.hosts.len(), world as usize);
    }
    if let Some(matrix) = &file.rdma_devices {
        assert_eq!(matrix.len(), world as usize);
        assert!(matrix.iter().all(|row| row.len() == world as usize));
    }
    for again in [
        serde_json::to_string(&file).expect("a host file serializes"),
        serde_json::to_string_pretty(&file).expect("a host file serializes"),
    ] {
        match RankFile::parse(&again) {
            Ok(read) => assert_eq!(read, file, "{again}"),
            Err(error) => panic!("a parsed host file does not parse again: {error}\n{again}"),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        check(&String::from_utf8_lossy(rest));
    } else {
        let seed = SEEDS[(mode as usize >> 1) % SEEDS.len()];
        let mut file: Value = serde_json::from_str(seed).expect("the seeds are JSON");
        edit(&mut file, rest);
        check(&file.to_string());
    }
});
