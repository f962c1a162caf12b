//! `cohort place` and `[cluster]` against the real binary: the plan of R1 on
//! the shipped three-node cluster, its JSON, host files of two instances in
//! one folder, and the errors that name what is missing.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;

use cohort_core::cluster::RankFile;
use common::{cohort, fixture_data, repo_root};

fn r1() -> PathBuf {
    repo_root().join("configs/fashion_mnist/fedavg_lenet5_r1.toml")
}

fn three_nodes() -> PathBuf {
    repo_root().join("configs/clusters/three_nodes.toml")
}

/// `cohort place --config R1 --cluster three_nodes.toml EXTRA...`.
fn place(extra: &[&str]) -> Output {
    let (config, cluster) = (r1(), three_nodes());
    let mut args = vec![
        "place",
        "--config",
        config.to_str().unwrap(),
        "--cluster",
        cluster.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    cohort(&args, &fixture_data())
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn succeeded(output: &Output) {
    assert!(output.status.success(), "{}", stderr(output));
}

/// Fails, with every one of `words` in its error.
fn failed_naming(output: &Output, words: &[&str]) {
    assert!(!output.status.success(), "{}", stdout(output));
    let error = stderr(output);
    for word in words {
        assert!(error.contains(word), "`{word}` not in: {error}");
    }
}

#[test]
fn r1_on_three_nodes_with_min_nodes_3_puts_a_rank_on_each_node() {
    let output = place(&["--min-nodes", "3", "--backend", "ring"]);
    succeeded(&output);
    let table = stdout(&output);
    assert!(
        table.contains("backend ring, 3 rank(s) on 3 node(s), 10 clients"),
        "{table}"
    );
    for (rank, node) in [(0, "alpha"), (1, "beta"), (2, "gamma")] {
        let row = table
            .lines()
            .find(|line| line.starts_with(&format!("{rank} ")))
            .unwrap_or_else(|| panic!("no row for rank {rank}: {table}"));
        assert!(row.contains(node), "{row}");
    }
    // Without --min-nodes, one node holds R1.
    let output = place(&[]);
    succeeded(&output);
    assert!(stdout(&output).contains("1 rank(s) on 1 node(s)"));
}

#[test]
fn the_json_plan_has_the_world_size_and_client_blocks_covering_every_client() {
    let output = place(&["--min-nodes", "3", "--json"]);
    succeeded(&output);
    let plan: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(plan["world_size"], 3);
    let ranks = plan["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 3);
    let mut next = 1;
    for (index, rank) in ranks.iter().enumerate() {
        assert_eq!(rank["rank"], index);
        let (first, last) = (&rank["clients"]["first"], &rank["clients"]["last"]);
        assert_eq!(first, next, "{rank}");
        next = last.as_u64().unwrap() + 1;
    }
    assert_eq!(next, 11, "clients 1..=10 in contiguous blocks");
}

fn emit(dir: &Path, instance: &str) {
    succeeded(&place(&[
        "--min-nodes",
        "3",
        "--backend",
        "ring",
        "--instance",
        instance,
        "--emit",
        dir.to_str().unwrap(),
    ]));
}

/// Every file in `dir`, by name, with its bytes.
fn files_of(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_owned();
            (name, std::fs::read(&path).unwrap())
        })
        .collect()
}

#[test]
fn two_instances_emitted_into_one_folder_keep_their_own_files_and_ports() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("plan");
    emit(&dir, "first");
    let before = files_of(&dir);
    emit(&dir, "second");
    let after = files_of(&dir);
    for name in before.keys() {
        assert_eq!(before[name], after[name], "{name} was overwritten");
    }
    let mut ports: Vec<BTreeSet<u16>> = Vec::new();
    for instance in ["first", "second"] {
        let mut mine = BTreeSet::new();
        for rank in 0..3u32 {
            let name = format!("hosts-{instance}-{rank}.json");
            let file: RankFile = serde_json::from_slice(&after[&name]).unwrap();
            assert_eq!((file.instance.as_str(), file.rank.rank), (instance, rank));
            assert_eq!(file.world_size, 3);
            assert!(file.rank.ring.is_some(), "{name}: ring neighbours");
            mine.insert(file.rank.listen.port());
        }
        assert_eq!(mine.len(), 3, "{instance}: {mine:?}");
        ports.push(mine);
        let slurm =
            String::from_utf8_lossy(&after[&format!("slurm-hosts-{instance}")]).into_owned();
        assert_eq!(slurm, "alpha.lab\nbeta.lab\ngamma.lab\n");
        let launch =
            String::from_utf8_lossy(&after[&format!("launch-{instance}.txt")]).into_owned();
        for line in [
            format!("--plan {} --instance {instance} --rank 2", dir.display()),
            "cohort worker --config ".to_owned(),
            "mpirun -n 3 --host alpha.lab:1,beta.lab:1,gamma.lab:1".to_owned(),
            "srun --ntasks=3".to_owned(),
        ] {
            assert!(launch.contains(&line), "`{line}` not in:\n{launch}");
        }
    }
    assert!(ports[0].is_disjoint(&ports[1]), "{ports:?}");
    assert_eq!(after.len(), 2 * (3 + 2), "{:?}", after.keys());
    // The same instance again, on fewer ranks: its own stale rank is gone.
    succeeded(&place(&[
        "--ranks",
        "2",
        "--min-nodes",
        "2",
        "--instance",
        "second",
        "--emit",
        dir.to_str().unwrap(),
    ]));
    let last = files_of(&dir);
    assert!(
        !last.contains_key("hosts-second-2.json"),
        "{:?}",
        last.keys()
    );
    assert!(last.contains_key("hosts-first-2.json"));
}

/// `cohort place --emit` gives every host file of a plan one secret, drawn
/// fresh for each plan, and writes them readable by their owner only.
#[test]
fn emitted_host_files_share_a_fresh_secret_and_are_private() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("plan");
    let secrets = |dir: &Path| {
        (0..3u32)
            .map(|rank| {
                let path = dir.join(format!("hosts-s-{rank}.json"));
                #[cfg(unix)]
                {
                    use std::os::unix::fs::PermissionsExt;
                    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
                    assert_eq!(mode & 0o777, 0o600, "{}", path.display());
                }
                let text = std::fs::read_to_string(&path).unwrap();
                RankFile::parse(&text).unwrap().secret.unwrap().to_hex()
            })
            .collect::<BTreeSet<String>>()
    };
    emit(&dir, "s");
    let first = secrets(&dir);
    assert_eq!(first.len(), 1, "{first:?}");
    emit(&dir, "s");
    let second = secrets(&dir);
    assert_eq!(second.len(), 1, "{second:?}");
    assert_ne!(first, second, "the same secret for two plans");
    let launch = std::fs::read_to_string(dir.join("launch-s.txt")).unwrap();
    assert!(!launch.contains(first.first().unwrap()));
}

#[cfg(not(feature = "mpi"))]
#[test]
fn mpi_in_a_default_build_names_the_valid_backends_and_the_feature() {
    failed_naming(
        &place(&["--backend", "mpi"]),
        &[
            "backend `mpi` is not in this build",
            "grpc and ring",
            "--features mpi",
        ],
    );
}

#[test]
fn rdma_over_three_nodes_names_the_pair_without_an_rdma_link() {
    // In a build without `mpi` too: rebuilding would not make the mesh full.
    failed_naming(
        &place(&["--backend", "rdma", "--min-nodes", "3"]),
        &["`alpha` and `gamma`", "partial mesh"],
    );
}

#[test]
fn a_cluster_without_the_memory_says_what_is_needed_and_what_is_there() {
    let temp = tempfile::tempdir().unwrap();
    let cluster = temp.path().join("tiny.toml");
    std::fs::write(
        &cluster,
        "[[nodes]]\nid = \"small\"\nmemory = \"64 MiB\"\ncores = 2\n",
    )
    .unwrap();
    let config = r1();
    let output = cohort(
        &[
            "place",
            "--config",
            config.to_str().unwrap(),
            "--cluster",
            cluster.to_str().unwrap(),
        ],
        &fixture_data(),
    );
    failed_naming(
        &output,
        &["not enough memory", "has 64.0 MiB", "need", "node `small`"],
    );
}

fn config_with_cluster(dir: &Path, cluster: &str) -> PathBuf {
    let text = std::fs::read_to_string(r1()).unwrap();
    let path = dir.join("job.toml");
    std::fs::write(&path, format!("{text}\n[cluster]\n{cluster}\n")).unwrap();
    path
}

#[test]
fn check_refuses_a_misspelled_backend_with_a_did_you_mean() {
    let temp = tempfile::tempdir().unwrap();
    let config = config_with_cluster(temp.path(), "backend = \"rnig\"");
    failed_naming(
        &cohort(
            &["check", "--config", config.to_str().unwrap()],
            &fixture_data(),
        ),
        &["job.toml", "`cluster.backend`", "did you mean `ring`?"],
    );
}

#[cfg(not(feature = "mpi"))]
#[test]
fn check_refuses_a_backend_this_build_lacks_naming_the_file_and_key() {
    let temp = tempfile::tempdir().unwrap();
    let config = config_with_cluster(temp.path(), "backend = \"mpi\"");
    failed_naming(
        &cohort(
            &["check", "--config", config.to_str().unwrap()],
            &fixture_data(),
        ),
        &["job.toml", "`cluster.backend`", "--features mpi"],
    );
}

#[test]
fn place_takes_the_cluster_file_and_backend_from_the_config() {
    let temp = tempfile::tempdir().unwrap();
    std::fs::copy(three_nodes(), temp.path().join("lab.toml")).unwrap();
    let config = config_with_cluster(
        temp.path(),
        "backend = \"ring\"\nfile = \"lab.toml\"\nmin_nodes = 2",
    );
    let output = cohort(
        &["place", "--config", config.to_str().unwrap()],
        &fixture_data(),
    );
    succeeded(&output);
    assert!(
        stdout(&output).contains("backend ring, 2 rank(s) on 2 node(s)"),
        "{}",
        stdout(&output)
    );
    let bare = config_with_cluster(temp.path(), "");
    failed_naming(
        &cohort(
            &["place", "--config", bare.to_str().unwrap()],
            &fixture_data(),
        ),
        &["no cluster file", "--cluster FILE", "cluster.file"],
    );
}

#[test]
fn set_unset_and_rounds_of_place_go_into_every_launch_line() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan");
    let output = place(&[
        "--backend",
        "ring",
        "--ranks",
        "2",
        "--instance",
        "t",
        "--set",
        "clients.per_round=4",
        "--rounds",
        "3",
        "--emit",
        plan.to_str().unwrap(),
    ]);
    succeeded(&output);
    let launch = std::fs::read_to_string(plan.join("launch-t.txt")).unwrap();
    let lines: Vec<&str> = launch
        .lines()
        .filter(|line| line.contains("--plan"))
        .collect();
    assert!(lines.len() >= 3, "{launch}");
    for line in lines {
        assert!(
            line.contains("--set clients.per_round=4 --rounds 3 --plan"),
            "{line}"
        );
    }
    // The plan is made from the config with the changes: a bad one is refused.
    failed_naming(
        &place(&["--set", "clients.per_rond=4"]),
        &["per_rond", "did you mean `per_round`"],
    );
}
