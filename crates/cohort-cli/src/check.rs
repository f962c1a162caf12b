//! `cohort check`: everything about a run that can be known before it starts.
//!
//! Beyond the config's own validation (done when it loads), this looks at what
//! the config points to: the data set's files (from their headers only, so it
//! is quick on any size), the partitions the training set must hold, the TLS
//! files of network mode and the cluster file. Every problem is reported, not
//! just the first.

use std::path::Path;

use anyhow::bail;

use cohort_core::config::LoadedConfig;
use cohort_core::data::Obtain;
use cohort_core::data::survey::{self, Survey};
use cohort_core::data::tabular::{self, FileFormat, FileSpec};

/// The findings: lines to print, and problems that make the run fail.
#[derive(Debug, Default)]
pub struct Findings {
    pub notes: Vec<String>,
    pub problems: Vec<String>,
}

/// Checks what `loaded` points to, with datasets under `data_root` (else
/// `data.data_path`).
pub fn check(loaded: &LoadedConfig, data_root: Option<&Path>) -> Findings {
    let mut findings = Findings::default();
    if let Some(warning) = loaded.attack_warning() {
        findings.notes.push(format!("warning: {warning}"));
    }
    check_data(loaded, data_root, &mut findings);
    check_files(loaded, &mut findings);
    check_secure_aggregation(loaded, &mut findings);
    findings
}

/// How much dropout the secure-aggregation graph and threshold survive: a
/// round aborts when one secret has fewer shares left than the threshold,
/// and a SecAgg+ graph of small degree reaches that long before half the
/// clients are gone. Said before the run, since the config alone decides it.
fn check_secure_aggregation(loaded: &LoadedConfig, findings: &mut Findings) {
    let config = loaded.config();
    let Some(secure) = &config.secure_aggregation else {
        return;
    };
    let clients = config.clients.per_round as usize;
    // An error here is the config's own, reported when it loaded.
    let Ok(params) = secure.params_for(clients) else {
        return;
    };
    let k = params.shares_for(clients);
    let t = params.reconstruction_threshold;
    let tolerance = params.dropout_tolerance(clients, 0.01);
    let at = |dropout: f64| 100.0 * params.abort_bound(clients, dropout);
    findings.notes.push(format!(
        "secure aggregation: {clients} clients a round, {k} shares each, threshold {t}: a \
         round completes with probability at least 99 % while up to {tolerance} % of its \
         clients drop out independently (at 10 % dropout at most {:.2} % of rounds abort, \
         at 30 % at most {:.0} %; binomial tail, union bound over the clients)",
        at(0.1),
        at(0.3)
    ));
}

/// Prints the findings; fails naming every problem when there is one.
pub fn report(findings: &Findings) -> anyhow::Result<()> {
    for note in &findings.notes {
        println!("# {note}");
    }
    if !findings.problems.is_empty() {
        bail!("the run would fail:\n  {}", findings.problems.join("\n  "));
    }
    Ok(())
}

/// The data files a run reads: both splits, or only the test split when every
/// client brings its own training data (the server then only evaluates, and
/// cuts no partitions).
fn check_data(loaded: &LoadedConfig, data_root: Option<&Path>, findings: &mut Findings) {
    let data = &loaded.config().data;
    if FileFormat::from_name(&data.datasource).is_some() {
        check_file_data(loaded, data_root, findings);
        return;
    }
    let Some(source) = data.builtin_source() else {
        findings.notes.push(format!(
            "data: `{}` is a data set of the program's own registry; its files are read when \
             the run starts, not surveyed here",
            data.datasource
        ));
        return;
    };
    let survey = Survey::of(source, data_root.unwrap_or(&data.data_path));
    let own_data = loaded.config().clients.all_own_data();
    let (files, problems, why) = if own_data {
        (
            survey.test_files(),
            survey.test_problems(),
            " (the test set: every client brings its own training data)",
        )
    } else {
        (&survey.files[..], survey.problems(), "")
    };
    let missing: Vec<&str> = survey::missing(files).iter().map(|f| f.file.name).collect();
    if !missing.is_empty() {
        let line = format!(
            "data: {} missing from {}{why}",
            missing.join(", "),
            survey.folder.display()
        );
        match (survey.obtain(), data.download) {
            (Obtain::ByHand(how), _) => findings
                .problems
                .push(format!("{line}; they cannot be downloaded: {how}")),
            (_, true) => findings.notes.push(format!(
                "{line}; the run downloads them (data.download = true)"
            )),
            (_, false) => findings.problems.push(format!(
                "{line}, and data.download = false: put them there or set COHORT_DATA_DIR"
            )),
        }
    }
    findings.problems.extend(problems);
    let folder = survey.folder.display();
    match (own_data, survey.train_samples(), survey.test_samples()) {
        (true, _, Some(test)) => findings.notes.push(format!(
            "data: {folder} holds {test} test samples; every client brings its own training data"
        )),
        (false, Some(train), Some(test)) => findings.notes.push(format!(
            "data: {folder} holds {train} training and {test} test samples"
        )),
        _ => {}
    }
    if !own_data && let Some(train) = survey.train_samples() {
        findings
            .problems
            .extend(partition_fit(loaded, train as u64));
    }
}

/// A file data set (`CSV`, `NPZ`, `Safetensors`): its files' headers (a
/// CSV file is read whole: it has no other), the samples they declare, and
/// whether the partitions fit.
fn check_file_data(loaded: &LoadedConfig, data_root: Option<&Path>, findings: &mut Findings) {
    let data = &loaded.config().data;
    let Some(spec) = FileSpec::of(data, data_root.unwrap_or(&data.data_path)) else {
        return;
    };
    let survey = match tabular::survey(&spec) {
        Ok(survey) => survey,
        Err(error) => {
            findings.problems.push(format!("data: {error}"));
            return;
        }
    };
    let file = spec.train_file.display();
    let (train, test) = match (survey.test_samples, spec.test_fraction) {
        (Some(test), _) => (survey.train_samples, test),
        (None, fraction) => {
            let test = (survey.train_samples as f64 * fraction.unwrap_or(0.0)).round() as usize;
            (survey.train_samples.saturating_sub(test), test)
        }
    };
    let clients = if survey.has_clients {
        ", each with its client id"
    } else {
        ""
    };
    findings.notes.push(format!(
        "data: {file} holds {train} training and {test} test samples of shape {:?}{clients}",
        survey.sample_shape
    ));
    if data.sampler == cohort_core::config::Sampler::Natural && !survey.has_clients {
        let key = match spec.format {
            FileFormat::Csv => "a data.client_column",
            FileFormat::Npz | FileFormat::Safetensors => "a `client_id` array",
        };
        findings.problems.push(format!(
            "data.sampler = \"natural\" needs each training sample's client, and {file} has no \
             client ids: add {key}, or choose another data.sampler"
        ));
    }
    if !loaded.config().clients.all_own_data() {
        findings
            .problems
            .extend(partition_fit(loaded, train as u64));
    }
}

/// Whether the training set's `train` samples can be cut as the config asks:
/// the sizes alone decide it for iid partitions, and bound the others.
fn partition_fit(loaded: &LoadedConfig, train: u64) -> Option<String> {
    let (key, needed) = cohort_core::config::training_samples_needed(loaded.config())?;
    (needed > train).then(|| {
        format!(
            "`{key}`: {} clients need at least {needed} training samples, but the \
             training set has {train}",
            loaded.config().clients.total_clients
        )
    })
}

fn check_files(loaded: &LoadedConfig, findings: &mut Findings) {
    let config = &loaded.config();
    if !config.clients.comm_simulation {
        let server = &config.server;
        for (key, file) in [
            ("server.tls_cert", &server.tls_cert),
            ("server.tls_key", &server.tls_key),
        ] {
            if let Some(file) = file
                && let Err(error) = std::fs::File::open(file)
            {
                findings
                    .problems
                    .push(format!("`{key}`: cannot read {}: {error}", file.display()));
            }
        }
    }
    if let Some(path) = loaded.cluster_file() {
        match cohort_core::cluster::load(&path) {
            Ok(topology) => findings.notes.push(format!(
                "cluster: {} describes {} nodes",
                path.display(),
                topology.nodes().len()
            )),
            Err(error) => findings.problems.push(format!("`cluster.file`: {error}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(assignment: &str) -> cohort_core::config::Override {
        assignment.parse().unwrap()
    }

    fn loaded(text: &str) -> LoadedConfig {
        cohort_core::config::from_str(text, Path::new("job.toml")).unwrap()
    }

    const JOB: &str = "[parameters.optimizer]\nlearning_rate = 0.1\n\
                       [clients]\ntotal_clients = 4\nper_round = 2\n\
                       [data]\ndatasource = \"FashionMNIST\"\ndownload = false\n";

    fn fixture() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data")
    }

    #[test]
    fn secure_aggregation_says_how_much_dropout_its_rounds_survive() {
        let job = "[parameters.optimizer]\nlearning_rate = 0.1\n\
                   [clients]\ntotal_clients = 100\nper_round = 100\n\
                   [data]\ndatasource = \"FashionMNIST\"\ndownload = false\n\
                   [secure_aggregation]\nprotocol = \"secaggplus\"\n";
        let sparse = loaded(&format!(
            "{job}num_shares = 21\nreconstruction_threshold = 11\n"
        ));
        let findings = check(&sparse, Some(&fixture()));
        let note = findings
            .notes
            .iter()
            .find(|note| note.starts_with("secure aggregation"))
            .unwrap_or_else(|| panic!("no secure-aggregation note in {findings:?}"));
        assert!(
            note.contains("100 clients a round, 21 shares each, threshold 11")
                && note.contains("up to 15 % of its clients")
                && note.contains("at 30 % at most 100 %"),
            "{note}"
        );

        let plain = loaded(JOB);
        let findings = check(&plain, Some(&fixture()));
        assert!(
            !findings
                .notes
                .iter()
                .any(|note| note.starts_with("secure aggregation")),
            "{findings:?}"
        );
    }

    #[test]
    fn the_fixture_fits_partitions_up_to_its_size() {
        let fits = loaded(&format!("{JOB}partition_size = 150\n"));
        let findings = check(&fits, Some(&fixture()));
        assert!(findings.problems.is_empty(), "{findings:?}");
        assert!(
            findings.notes[0].contains("600 training and 200 test"),
            "{findings:?}"
        );

        let too_big = loaded(&format!("{JOB}partition_size = 151\n"));
        let findings = check(&too_big, Some(&fixture()));
        assert_eq!(findings.problems.len(), 1, "{findings:?}");
        assert!(
            findings.problems[0].contains("`data.partition_size`: 4 clients need at least 604"),
            "{findings:?}"
        );
    }

    #[test]
    fn a_run_whose_clients_all_bring_their_own_data_needs_the_test_files_alone() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("fashion-mnist");
        std::fs::create_dir(&folder).unwrap();
        for name in ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"] {
            std::fs::copy(
                fixture().join("fashion-mnist").join(name),
                folder.join(name),
            )
            .unwrap();
        }
        let base = loaded(&format!("{JOB}partition_size = 1000\n"));
        let own_data = |clients: u32| {
            base.with_overrides(&[
                set("clients.comm_simulation=false"),
                set(&format!("clients.own_data_clients={clients}")),
            ])
            .unwrap()
        };
        let own = own_data(4);
        let findings = check(&own, Some(dir.path()));
        assert!(findings.problems.is_empty(), "{findings:?}");
        assert!(
            findings.notes[0].contains("200 test samples; every client brings its own"),
            "{findings:?}"
        );

        // One simulated client trains a partition: the training files are needed.
        let findings = check(&own_data(3), Some(dir.path()));
        assert_eq!(findings.problems.len(), 1, "{findings:?}");
        assert!(
            findings.problems[0].contains("train-images-idx3-ubyte.gz")
                && findings.problems[0].contains("data.download = false"),
            "{findings:?}"
        );

        std::fs::remove_file(folder.join("t10k-labels-idx1-ubyte.gz")).unwrap();
        let findings = check(&own_data(4), Some(dir.path()));
        assert_eq!(findings.problems.len(), 1, "{findings:?}");
        assert!(
            findings.problems[0].contains("t10k-labels-idx1-ubyte.gz missing")
                && !findings.problems[0].contains("train-"),
            "{findings:?}"
        );
    }

    #[test]
    fn cifar_and_leaf_folders_are_surveyed_and_leaf_is_never_downloaded() {
        let job = |source: &str, classes: usize| {
            loaded(&format!(
                "[parameters.optimizer]\nlearning_rate = 0.1\n\
                 [parameters.model]\nnum_classes = {classes}\n\
                 [clients]\ntotal_clients = 3\nper_round = 2\n\
                 [data]\ndatasource = \"{source}\"\ndownload = true\n"
            ))
        };
        let findings = check(&job("CIFAR100", 100), Some(&fixture()));
        assert!(findings.problems.is_empty(), "{findings:?}");
        assert!(
            findings.notes[0].contains("6 training and 3 test"),
            "{findings:?}"
        );
        let empty = tempfile::tempdir().unwrap();
        let findings = check(&job("CIFAR100", 100), Some(empty.path()));
        assert!(findings.problems.is_empty(), "{findings:?}");
        assert!(
            findings.notes[0].contains("train.bin, test.bin missing")
                && findings.notes[0].contains("the run downloads them"),
            "{findings:?}"
        );
        let findings = check(&job("Shakespeare", 80), Some(&fixture()));
        assert!(findings.problems.is_empty(), "{findings:?}");
        assert!(
            findings.notes[0].contains("5 training and 2 test"),
            "{findings:?}"
        );
        let findings = check(&job("FEMNIST", 62), Some(empty.path()));
        assert_eq!(findings.problems.len(), 1, "{findings:?}");
        assert!(
            findings.problems[0].contains("train/*.json, test/*.json missing")
                && findings.problems[0].contains("cannot be downloaded"),
            "{findings:?}"
        );
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let job = loaded(&format!(
            "{JOB}[server]\ntls_cert = \"{0}/missing.pem\"\ntls_key = \"{0}/missing.key\"\n",
            dir.path().display()
        ));
        // Network mode reads the TLS files.
        let job = job
            .with_overrides(&[set("clients.comm_simulation=false")])
            .unwrap();
        let findings = check(&job, Some(dir.path()));
        assert_eq!(findings.problems.len(), 3, "{findings:?}");
        assert!(
            findings.problems[0].contains("data.download = false"),
            "{findings:?}"
        );
        assert!(
            findings.problems[1].contains("`server.tls_cert`"),
            "{findings:?}"
        );
        assert!(
            findings.problems[2].contains("`server.tls_key`"),
            "{findings:?}"
        );
        let error = report(&findings).unwrap_err().to_string();
        assert!(error.contains("the run would fail"), "{error}");
    }
}
