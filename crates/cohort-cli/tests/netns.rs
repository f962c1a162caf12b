//! Three hosts on one machine: three network namespaces joined pairwise by
//! veth pairs (a triangle, each pair on its own subnet), one rank of a ring
//! plan in each, placed by `cohort place` from a cluster file that describes
//! exactly those links. The run must give the single-process model; then the
//! link between two namespaces is cut mid-run, the ranks stop with errors
//! naming the unreachable rank, and after the link is back `--resume` on all
//! three ends the run with the model an unbroken run gives.
//!
//! Needs root and iproute2 (`ip netns`). Traffic stays between the
//! namespaces the test made: they have no route anywhere else. A plain
//! `cargo test` ignores it; `.ci/run` (root) runs it, and there a missing
//! `ip netns` fails it.

mod common;

use std::process::{Child, Command, Output, Stdio};

use common::{
    cohort, fixture_data, only_run_dir, run_dir_after_rounds, single_process_model, write_config,
};

/// The namespaces and veth pairs of one test; removed on drop.
struct Hosts {
    names: Vec<String>,
}

/// Links of the triangle: (node a, node b, subnet); node a gets .1, node b .2.
const LINKS: [(usize, usize, u8); 3] = [(0, 1, 1), (1, 2, 2), (2, 0, 3)];

fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

impl Hosts {
    fn create() -> Result<Self, String> {
        let tag = std::process::id() % 100_000;
        let hosts = Hosts {
            names: (0..3).map(|i| format!("cohort{tag}-{i}")).collect(),
        };
        for name in &hosts.names {
            ip(&["netns", "add", name])?;
            ip(&["-n", name, "link", "set", "lo", "up"])?;
        }
        for (a, b, subnet) in LINKS {
            let (end_a, end_b) = (hosts.device(a, subnet), hosts.device(b, subnet));
            ip(&[
                "link", "add", &end_a, "type", "veth", "peer", "name", &end_b,
            ])?;
            for (node, end, host) in [(a, &end_a, 1), (b, &end_b, 2)] {
                let ns = &hosts.names[node];
                ip(&["link", "set", end, "netns", ns])?;
                let address = format!("10.77.{subnet}.{host}/24");
                ip(&["-n", ns, "addr", "add", &address, "dev", end])?;
                ip(&["-n", ns, "link", "set", end, "up"])?;
            }
        }
        Ok(hosts)
    }

    /// The veth end of `node` on link `subnet` (names stay under 16 bytes).
    fn device(&self, node: usize, subnet: u8) -> String {
        format!("c{}l{subnet}n{node}", std::process::id() % 100_000)
    }

    fn set_link(&self, node: usize, subnet: u8, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&[
            "-n",
            &self.names[node],
            "link",
            "set",
            &self.device(node, subnet),
            state,
        ])
        .unwrap();
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth ends inside it.
        for name in &self.names {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// The cluster file of the triangle: each node's interfaces by subnet.
fn cluster_file() -> String {
    let mut text = String::new();
    for node in 0..3 {
        let interfaces: Vec<String> = LINKS
            .iter()
            .filter_map(|&(a, b, subnet)| {
                let host = if a == node { 1 } else if b == node { 2 } else { return None };
                Some(format!(
                    "{{ name = \"l{subnet}\", address = \"10.77.{subnet}.{host}\", kind = \"ethernet\" }}"
                ))
            })
            .collect();
        text += &format!(
            "[[nodes]]\nid = \"n{node}\"\nmemory = \"4 GiB\"\ncores = 2\ninterfaces = [{}]\n\n",
            interfaces.join(", ")
        );
    }
    for (a, b, subnet) in LINKS {
        text += &format!("[[links]]\nfrom = \"n{a}.l{subnet}\"\nto = \"n{b}.l{subnet}\"\n\n");
    }
    text
}

fn job(rounds: u32) -> String {
    format!(
        r#"
[clients]
total_clients = 6
per_round = 4
[server]
random_seed = 7
payload_timeout = 4
registration_timeout = 20
[data]
datasource = "FashionMNIST"
download = false
partition_size = 40
[trainer]
rounds = {rounds}
epochs = 1
batch_size = 10
max_concurrency = 1
optimizer = "sgd"
model_seed = 3
training_seed = 5
[parameters.optimizer]
learning_rate = 0.05
"#
    )
}

fn rank_in(hosts: &Hosts, rank: usize, args: &[&str]) -> Child {
    Command::new("ip")
        .args([
            "netns",
            "exec",
            &hosts.names[rank],
            env!("CARGO_BIN_EXE_cohort"),
            "worker",
        ])
        .args(args)
        .args(["--rank", &rank.to_string(), "--cpu", "--quiet"])
        .env("COHORT_DATA_DIR", fixture_data())
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn text(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
#[ignore = "needs root and iproute2 (network namespaces): .ci/run runs ignored tests"]
fn a_ring_across_three_namespaces_survives_a_cut_link_by_resuming() {
    let hosts = Hosts::create().unwrap_or_else(|problem| {
        panic!("network namespaces unavailable (root and iproute2 needed): {problem}")
    });
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("triangle.toml");
    std::fs::write(&cluster, cluster_file()).unwrap();

    // Unbroken: three ranks, one per namespace, equal the single process.
    let short = write_config(dir.path(), &job(3));
    let plan = dir.path().join("plan");
    let place = cohort(
        &[
            "place",
            "--cluster",
            cluster.to_str().unwrap(),
            "--config",
            short.to_str().unwrap(),
            "--backend",
            "ring",
            "--ranks",
            "3",
            "--min-nodes",
            "3",
            "--instance",
            "tri",
            "--emit",
            plan.to_str().unwrap(),
        ],
        &fixture_data(),
    );
    assert!(place.status.success(), "{}", text(&place));
    let base = dir.path().join("ring");
    let common_args = [
        "--config",
        short.to_str().unwrap(),
        "--plan",
        plan.to_str().unwrap(),
        "--base",
        base.to_str().unwrap(),
    ];
    let ranks: Vec<Child> = (0..3).map(|r| rank_in(&hosts, r, &common_args)).collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "rank {rank}: {}", text(&output));
    }
    let expected = single_process_model(&short, &dir.path().join("short/single"), &fixture_data());
    let model = std::fs::read(only_run_dir(&base).join("model.safetensors")).unwrap();
    assert!(
        model == expected,
        "the 3-namespace model differs from the single-process one"
    );

    // Cut the link between ranks 1 and 2 (subnet 2) mid-run.
    let long_dir = dir.path().join("long");
    std::fs::create_dir_all(&long_dir).unwrap();
    let long = write_config(&long_dir, &job(30));
    let base = dir.path().join("cut");
    let long_args = [
        "--config",
        long.to_str().unwrap(),
        "--plan",
        plan.to_str().unwrap(),
        "--base",
        base.to_str().unwrap(),
    ];
    let ranks: Vec<Child> = (0..3).map(|r| rank_in(&hosts, r, &long_args)).collect();
    let run_dir = run_dir_after_rounds(&base, 2);
    hosts.set_link(1, 2, false);
    let outputs: Vec<Output> = ranks
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (rank, output) in outputs.iter().enumerate() {
        assert!(
            !output.status.success(),
            "rank {rank} finished across a cut link"
        );
    }
    // Rank 2 hears nothing from rank 1 over the dead link.
    let rank2 = text(&outputs[2]);
    assert!(
        rank2.contains("its left neighbour rank 1 (n1 at 10.77.2.1:"),
        "{rank2}"
    );
    assert!(rank2.contains("I/O timeout"), "{rank2}");

    hosts.set_link(1, 2, true);
    let resume = [
        "--plan",
        plan.to_str().unwrap(),
        "--resume",
        run_dir.to_str().unwrap(),
    ];
    let ranks: Vec<Child> = (0..3).map(|r| rank_in(&hosts, r, &resume)).collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "resumed rank {rank}: {}",
            text(&output)
        );
    }
    let expected = single_process_model(&long, &long_dir.join("single"), &fixture_data());
    let model = std::fs::read(run_dir.join("model.safetensors")).unwrap();
    assert!(
        model == expected,
        "the resumed run's model differs from an unbroken one"
    );
}
