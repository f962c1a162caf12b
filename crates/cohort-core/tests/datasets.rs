//! Every loader on the committed fixtures (tests/fixtures/data, written by
//! scripts/make_data_fixtures.py), held to what the script says it wrote
//! (expected.json): labels, users, and sampled values; then what a missing
//! or damaged file gives, through the loaders and `cohort check`'s survey.

use std::path::{Path, PathBuf};

use cohort_core::data::leaf::{self, Leaf};
use cohort_core::data::survey::{self, FileState, Survey};
use cohort_core::data::{self, DataSource, Dataset, Fetch};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data")
}

fn expected(source: DataSource, split: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    let all: Value = serde_json::from_str(&text).unwrap();
    all[source.to_string()][split].clone()
}

fn numbers(value: &Value) -> Vec<u32> {
    let list = value.as_array().expect("a list");
    list.iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

/// Each `[sample, flat index, raw]` of `checks` against the loaded value,
/// normalized as `source` normalizes channel `flat index / plane`.
fn assert_values(source: DataSource, set: &Dataset, checks: &Value, scale: f32) {
    let normalization = source.normalization().unwrap();
    let per_sample = set.values_per_sample();
    let plane = per_sample / set.sample_shape[0];
    let checks = checks.as_array().unwrap();
    assert!(!checks.is_empty());
    for check in checks {
        let (sample, index) = (check[0].as_u64().unwrap(), check[1].as_u64().unwrap());
        let raw = check[2].as_f64().unwrap() as f32 / scale;
        let channel = (index as usize / plane).min(normalization.mean.len() - 1);
        let want = (raw - normalization.mean[channel]) / normalization.std[channel];
        let got = set.inputs[sample as usize * per_sample + index as usize];
        assert!(
            (got - want).abs() < 1e-5,
            "{source} sample {sample} value {index}: {got} != {want}"
        );
    }
}

#[test]
fn cifar_fixtures_load_as_written() {
    for (source, train) in [(DataSource::Cifar10, 15), (DataSource::Cifar100, 6)] {
        let splits = data::load(source, &fixtures(), &Fetch::Never).unwrap();
        assert_eq!(splits.train.len(), train, "{source}");
        assert_eq!(splits.train.sample_shape, [3, 32, 32]);
        for (name, set) in [("train", &splits.train), ("test", &splits.test)] {
            let expected = expected(source, name);
            assert_eq!(set.labels, numbers(&expected["labels"]), "{source} {name}");
            assert_values(source, set, &expected["checks"], 255.0);
        }
        // CIFAR-100's fine labels run past the 20 coarse ones.
        if source == DataSource::Cifar100 {
            assert!(splits.train.labels.iter().any(|&l| l >= 20));
        }
        let test = data::load_test(source, &fixtures(), &Fetch::Never).unwrap();
        assert_eq!(test, splits.test);
    }
}

#[test]
fn emnist_images_are_transposed_upright() {
    let source = DataSource::Emnist;
    let splits = data::load(source, &fixtures(), &Fetch::Never).unwrap();
    assert_eq!((splits.train.len(), splits.test.len()), (20, 10));
    for (name, set) in [("train", &splits.train), ("test", &splits.test)] {
        let expected = expected(source, name);
        assert_eq!(set.labels, numbers(&expected["labels"]));
        // The script's checks index the upright image, row-major.
        assert_values(source, set, &expected["checks"], 255.0);
    }
    // The L's bar runs down the left (rows 4..24 of column 7), not along the top.
    let column: f32 = (4..24).map(|row| splits.train.inputs[row * 28 + 7]).sum();
    let top_row: f32 = (8..24).map(|col| splits.train.inputs[5 * 28 + col]).sum();
    assert!(column > top_row, "{column} {top_row}");
}

#[test]
fn femnist_fixture_loads_with_its_writers() {
    let source = DataSource::Femnist;
    let folder = fixtures().join(source.folder());
    let loaded = leaf::load(Leaf::Femnist, &folder, source.normalization().as_ref()).unwrap();
    for (name, split) in [("train", &loaded.train), ("test", &loaded.test)] {
        let expected = expected(source, name);
        assert_eq!(split.data.labels, numbers(&expected["labels"]), "{name}");
        let users: Vec<&str> = split
            .users
            .of_sample
            .iter()
            .map(|&id| split.users.names[id as usize].as_str())
            .collect();
        let want: Vec<&str> = (expected["users"].as_array().unwrap().iter())
            .map(|u| u.as_str().unwrap())
            .collect();
        assert_eq!(users, want, "{name}");
        assert_values(source, &split.data, &expected["checks"], 1.0);
    }
    assert_eq!(loaded.train.users.names.len(), 3);
    let splits = data::load(source, &fixtures(), &Fetch::Never).unwrap();
    assert_eq!(splits, loaded.clone().splits());
    let test = data::load_test(source, &fixtures(), &Fetch::Never).unwrap();
    assert_eq!(test, loaded.test.data);
}

#[test]
fn shakespeare_fixture_is_token_ids_with_the_next_character_as_label() {
    let source = DataSource::Shakespeare;
    let splits = data::load(source, &fixtures(), &Fetch::Never).unwrap();
    assert_eq!(splits.train.sample_shape, [80]);
    for (name, set) in [("train", &splits.train), ("test", &splits.test)] {
        let expected = expected(source, name);
        assert_eq!(set.labels, numbers(&expected["labels"]), "{name}");
        let first: Vec<f32> = numbers(&expected["first_tokens"])
            .into_iter()
            .map(|t| t as f32)
            .collect();
        assert_eq!(set.inputs[..80], first[..], "{name}: not normalized");
    }
    let folder = fixtures().join(source.folder());
    let loaded = leaf::load(Leaf::Shakespeare, &folder, None).unwrap();
    assert_eq!(
        loaded.train.users.names,
        ["THE_TEMPEST_MIRANDA", "HAMLET_HAMLET"]
    );
    assert_eq!(loaded.train.users.of_sample, [0, 0, 0, 1, 1]);
}

/// A copy of `source`'s fixture folder under a temporary root.
fn copy_of(source: DataSource) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_tree(
        &fixtures().join(source.folder()),
        &dir.path().join(source.folder()),
    );
    dir
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_tree(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}

#[test]
fn a_truncated_or_mislabelled_cifar_batch_is_an_error_naming_it() {
    let dir = copy_of(DataSource::Cifar10);
    let batch = dir.path().join("cifar-10-batches-bin/data_batch_4.bin");
    let bytes = std::fs::read(&batch).unwrap();
    std::fs::write(&batch, &bytes[..bytes.len() - 100]).unwrap();
    let error = data::load(DataSource::Cifar10, dir.path(), &Fetch::Never)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("data_batch_4.bin: 9119 bytes is not a whole number of 3073-byte"),
        "{error}"
    );
    let survey = Survey::of(DataSource::Cifar10, dir.path());
    assert_eq!(survey.train_samples(), None);
    assert_eq!(survey.test_samples(), Some(4));
    assert_eq!(survey.problems().len(), 1, "{:?}", survey.problems());
    assert!(survey.test_problems().is_empty());

    let mut bad = bytes.clone();
    bad[3073] = 10; // the second record's label
    std::fs::write(&batch, &bad).unwrap();
    let error = data::load(DataSource::Cifar10, dir.path(), &Fetch::Never)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("data_batch_4.bin: record 1 has label 10, expected one below 10"),
        "{error}"
    );
}

#[test]
fn missing_cifar_files_are_named_with_the_archive_to_fetch() {
    let dir = copy_of(DataSource::Cifar100);
    std::fs::remove_file(dir.path().join("cifar-100-binary/train.bin")).unwrap();
    let error = data::load(DataSource::Cifar100, dir.path(), &Fetch::Never)
        .unwrap_err()
        .to_string();
    for needle in [
        "CIFAR100 data files are missing from",
        "  train.bin\n",
        "data.download = false",
        "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
        "58a81ae192c23a4be8b1804d68e518ed807d710a4eb253b1f2a199162a40d8ec",
        "unpacks to `cifar-100-binary/`",
    ] {
        assert!(error.contains(needle), "{needle}: {error}");
    }
    assert!(!error.contains("test.bin"), "{error}");
    // The test split alone is there.
    assert!(data::load_test(DataSource::Cifar100, dir.path(), &Fetch::Never).is_ok());
    let survey = Survey::of(DataSource::Cifar100, dir.path());
    let missing: Vec<&str> = survey::missing(&survey.files)
        .iter()
        .map(|f| f.file.name)
        .collect();
    assert_eq!(missing, ["train.bin"]);
}

/// With downloading off, EMNIST's error says which files to put where and
/// where they are: the folder of NIST's zip, its size and its SHA-256.
#[test]
fn missing_emnist_files_are_named_with_the_zip_they_are_in() {
    let empty = tempfile::tempdir().unwrap();
    let error = data::load(DataSource::Emnist, empty.path(), &Fetch::Never)
        .unwrap_err()
        .to_string();
    for needle in [
        "EMNIST data files are missing from",
        "  emnist-balanced-train-images-idx3-ubyte.gz\n",
        "  emnist-balanced-train-labels-idx1-ubyte.gz\n",
        "  emnist-balanced-test-images-idx3-ubyte.gz\n",
        "  emnist-balanced-test-labels-idx1-ubyte.gz\n",
        "Downloading is off (data.download = false).",
        "(they are in the `gzip/` folder of https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip, \
         561753746 bytes, SHA-256 fb9bb67e33772a9cc0b895e4ecf36d2cf35be8b709693c3564cea2a019fcda8e)",
        "or point data.data_path or COHORT_DATA_DIR at a folder that has a `emnist/` subfolder",
    ] {
        assert!(error.contains(needle), "{needle}: {error}");
    }
    assert!(listing_is_empty(empty.path()), "nothing is made");
    let error = data::load_test(DataSource::Emnist, empty.path(), &Fetch::Never)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("emnist-balanced-test-labels-idx1-ubyte.gz") && !error.contains("train-"),
        "{error}"
    );
}

fn listing_is_empty(folder: &Path) -> bool {
    std::fs::read_dir(folder).unwrap().next().is_none()
}

#[test]
fn files_that_cannot_be_downloaded_say_where_they_come_from() {
    let empty = tempfile::tempdir().unwrap();
    let fetch = Fetch::FromMirrors(Vec::new());
    for source in [DataSource::Femnist, DataSource::Shakespeare] {
        let error = data::load(source, empty.path(), &fetch)
            .unwrap_err()
            .to_string();
        let folder = source.folder();
        for needle in [
            "no train/*.json and no test/*.json".to_owned(),
            format!("copy those two folders to {folder}/train and {folder}/test"),
        ] {
            assert!(error.contains(&needle), "{needle}: {error}");
        }
    }
}

#[test]
fn a_malformed_leaf_file_names_the_file_and_the_user() {
    let dir = copy_of(DataSource::Femnist);
    let file = dir
        .path()
        .join("femnist/train/all_data_1_niid_0_keep_0_train_9.json");
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(
        &file,
        text.replace("\"num_samples\": [2]", "\"num_samples\": [5]"),
    )
    .unwrap();
    let error = data::load(DataSource::Femnist, dir.path(), &Fetch::Never)
        .unwrap_err()
        .to_string();
    assert!(
        error
            .contains("all_data_1_niid_0_keep_0_train_9.json: user `f0100_33`: num_samples says 5"),
        "{error}"
    );
    std::fs::write(&file, &text[..text.len() / 2]).unwrap();
    let survey = Survey::of(DataSource::Femnist, dir.path());
    assert_eq!(survey.train_samples(), None);
    assert!(
        survey.problems()[0].contains("not one of LEAF's JSON files"),
        "{:?}",
        survey.problems()
    );
}

#[test]
fn the_survey_counts_every_fixture_from_sizes_and_headers() {
    for (source, train, test) in [
        (DataSource::Cifar10, 15, 4),
        (DataSource::Cifar100, 6, 3),
        (DataSource::Emnist, 20, 10),
        (DataSource::Femnist, 7, 3),
        (DataSource::Shakespeare, 5, 2),
        (DataSource::FashionMnist, 600, 200),
    ] {
        let survey = Survey::of(source, &fixtures());
        assert_eq!(survey.train_samples(), Some(train), "{source}");
        assert_eq!(survey.test_samples(), Some(test), "{source}");
        assert!(survey.problems().is_empty(), "{:?}", survey.problems());
        assert!(survey::missing(&survey.files).is_empty());
    }
    let cifar = Survey::of(DataSource::Cifar10, &fixtures());
    assert_eq!(cifar.files.len(), 6);
    assert_eq!(cifar.test_files()[0].file.name, "test_batch.bin");
    assert_eq!(cifar.files[0].state, FileState::Present(vec![3, 3, 32, 32]));
    let empty = tempfile::tempdir().unwrap();
    let leaf = Survey::of(DataSource::Shakespeare, empty.path());
    let missing: Vec<&str> = survey::missing(&leaf.files)
        .iter()
        .map(|f| f.file.name)
        .collect();
    assert_eq!(missing, ["train/*.json", "test/*.json"]);
}

#[test]
fn every_name_is_plato_s_and_declares_its_shape() {
    let names: Vec<String> = DataSource::ALL.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        names,
        [
            "MNIST",
            "FashionMNIST",
            "EMNIST",
            "CIFAR10",
            "CIFAR100",
            "FEMNIST",
            "Shakespeare"
        ]
    );
    for source in DataSource::ALL {
        assert_eq!(DataSource::from_name(&source.to_string()), Some(source));
        if let Some(normalization) = source.normalization() {
            let channels = source.sample_shape()[0];
            assert_eq!(normalization.mean.len().max(channels), channels, "{source}");
        }
    }
    assert_eq!(DataSource::Shakespeare.classes(), 80);
    assert_eq!(DataSource::Cifar100.classes(), 100);
}

#[test]
fn the_natural_sampler_makes_a_client_of_each_writer() {
    let splits = data::load(DataSource::Femnist, &fixtures(), &Fetch::Never).unwrap();
    let users = splits
        .train_users
        .clone()
        .expect("FEMNIST's samples have writers");
    let config = |clients: u32, seed: u64| {
        let text = format!(
            "[clients]\ntotal_clients = {clients}\nper_round = 1\n[data]\n\
             datasource = \"FEMNIST\"\nsampler = \"natural\"\nrandom_seed = {seed}\n\
             [parameters.model]\nnum_classes = 62\n[parameters.optimizer]\nlearning_rate = 0.01\n"
        );
        cohort_core::config::from_str(&text, Path::new("natural.toml")).unwrap()
    };
    let labels = &splits.train.labels;
    let parts = config(3, 1).partitions(labels, Some(&users)).unwrap();
    // Each client is one writer, with every sample of that writer.
    let mut writers: Vec<u32> = Vec::new();
    for part in &parts {
        let writer = users[part[0] as usize];
        assert!(
            part.iter().all(|&i| users[i as usize] == writer),
            "{parts:?}"
        );
        let count = users.iter().filter(|&&u| u == writer).count();
        assert_eq!(part.len(), count);
        writers.push(writer);
    }
    writers.sort_unstable();
    assert_eq!(writers, [0, 1, 2]);
    // Fewer clients take the first writers of the seeded order.
    let two = config(2, 1).partitions(labels, Some(&users)).unwrap();
    assert_eq!(two[..], parts[..2]);
    // More clients than writers, or a data set without writers, is an error
    // that says what to change.
    let error = config(4, 1)
        .partitions(labels, Some(&users))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("4 clients, but the training set has 3 users"),
        "{error}"
    );
    let error = config(3, 1)
        .partitions(labels, None)
        .unwrap_err()
        .to_string();
    assert!(error.contains("FEMNIST has none"), "{error}");
}

/// A loader asked for some training rows gives exactly those samples of the
/// full load, in order, chosen from the full labels (and users); the test
/// split is the full one.
#[test]
fn chosen_rows_are_the_full_loads_rows() {
    let sources = [
        DataSource::FashionMnist,
        DataSource::Emnist,
        DataSource::Cifar10,
        DataSource::Cifar100,
        DataSource::Femnist,
        DataSource::Shakespeare,
    ];
    for source in sources {
        let full = data::load(source, &fixtures(), &Fetch::Never).unwrap();
        let mut seen = None;
        let mut every_other = |labels: &[u32], users: Option<&[u32]>| {
            seen = Some((labels.to_vec(), users.map(<[u32]>::to_vec)));
            Ok((0..labels.len() as u32).step_by(2).collect())
        };
        let some = data::load_rows(source, &fixtures(), &Fetch::Never, &mut every_other).unwrap();
        let (labels, users) = seen.expect("the chooser was asked");
        assert_eq!(
            labels, full.train.labels,
            "{source}: the chooser saw every label"
        );
        assert_eq!(users, full.train_users, "{source}: and every user");
        let rows: Vec<u32> = (0..full.train.len() as u32).step_by(2).collect();
        assert!(
            rows.len() < full.train.len(),
            "{source}: a fixture of one sample"
        );
        assert_eq!(some.train, full.train.rows(&rows).unwrap(), "{source}");
        assert_eq!(some.test, full.test, "{source}");
        assert_eq!(some.train_users, full.train_users, "{source}");
    }
}

/// A chooser's rows out of order or out of range, or its refusal, stop the
/// load with its reason.
#[test]
fn a_bad_choice_of_rows_is_an_error() {
    let cases: [(Result<Vec<u32>, String>, &str); 3] = [
        (Ok(vec![3, 1]), "ascend"),
        (Ok(vec![0, 1_000_000]), "row 1000000 was chosen"),
        (Err("no clients here".to_owned()), "no clients here"),
    ];
    for source in [
        DataSource::FashionMnist,
        DataSource::Cifar10,
        DataSource::Femnist,
    ] {
        for (answer, message) in &cases {
            let mut choose = |_: &[u32], _: Option<&[u32]>| answer.clone();
            let error = data::load_rows(source, &fixtures(), &Fetch::Never, &mut choose)
                .unwrap_err()
                .to_string();
            assert!(error.contains(message), "{source}: {error}");
        }
    }
}

/// An own-data client (`cohort client --data`) given a data set's own files
/// holds exactly what the server's loader reads from them: the training
/// samples, then the test ones, with the same values to the bit after the
/// data set's normalization.
#[test]
fn own_data_in_each_data_sets_format_holds_what_its_loader_reads() {
    use cohort_core::data::own::{Expected, OwnData};
    let cases = [
        (DataSource::Cifar10, "cifar-10-batches-bin"),
        (DataSource::Cifar100, "cifar-100-binary"),
        (DataSource::Femnist, "femnist"),
        (DataSource::Shakespeare, "shakespeare"),
    ];
    for (source, folder) in cases {
        let splits = data::load(source, &fixtures(), &Fetch::Never).unwrap();
        let own = OwnData::load(&fixtures().join(folder), 100_000)
            .unwrap_or_else(|e| panic!("{source}: {e}"));
        assert_eq!(own.train.len(), splits.train.len(), "{source}");
        assert_eq!(own.test_len(), splits.test.len(), "{source}");
        let normalization = source.normalization();
        let shape = source.sample_shape();
        let held = own
            .into_dataset(Expected {
                sample_shape: &shape,
                classes: source.classes(),
                normalization: normalization.as_ref(),
                datasource: folder,
            })
            .unwrap_or_else(|e| panic!("{source}: {e}"));
        let mut inputs = splits.train.inputs.clone();
        inputs.extend(&splits.test.inputs);
        let mut labels = splits.train.labels.clone();
        labels.extend(&splits.test.labels);
        assert_eq!(held.labels, labels, "{source}");
        assert_eq!(held.sample_shape, shape, "{source}");
        let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&held.inputs), bits(&inputs), "{source}");
    }
}

/// CSV and NPZ own data read as the file data sets read them: features as
/// float32, the label column the client names, the NPZ file's own test arrays.
#[test]
fn own_data_in_csv_and_npz_files_holds_what_the_file_data_sets_read() {
    use cohort_core::data::own::OwnData;
    use cohort_core::data::tabular::{self, FileFormat};
    let folder = fixtures().join("../tabular");
    for (file, format) in [
        ("train.csv", FileFormat::Csv),
        ("tabular.npz", FileFormat::Npz),
    ] {
        let path = folder.join(file);
        let (train, test) = tabular::read_own(&path, format, "label").unwrap();
        let own = OwnData::load(&path, 100_000).unwrap();
        assert_eq!(own.train.values, train.inputs, "{file}");
        assert_eq!(own.train.labels, train.labels, "{file}");
        assert_eq!(own.train.shape, train.sample_shape, "{file}");
        assert_eq!(own.test_len(), test.map_or(0, |t| t.len()), "{file}");
    }
    let own = OwnData::load(&folder.join("tabular.npz"), 100_000).unwrap();
    assert_eq!((own.train.len(), own.test_len()), (300, 60));
    assert_eq!(own.train.shape, [2, 2]);
    // Another label column: `client` holds whole numbers too, and `label`
    // becomes a fifth feature.
    let by_client = OwnData::load_with(&folder.join("train.csv"), 100_000, "client").unwrap();
    assert_eq!(by_client.train.shape, [5]);
    let missing = OwnData::load_with(&folder.join("train.csv"), 100_000, "target").unwrap_err();
    assert!(missing.to_string().contains("target"), "{missing}");
}

/// More samples than the client accepts are refused from the files' sizes
/// and headers, naming the limit, in every format.
#[test]
fn own_data_beyond_max_samples_is_refused_in_every_format() {
    use cohort_core::data::own::OwnData;
    for path in [
        fixtures().join("cifar-10-batches-bin"),
        fixtures().join("cifar-100-binary"),
        fixtures().join("femnist"),
        fixtures().join("shakespeare"),
        fixtures().join("../tabular/train.csv"),
        fixtures().join("../tabular/tabular.npz"),
    ] {
        let refused = OwnData::load(&path, 2).unwrap_err().to_string();
        assert!(
            refused.contains("more than the 2 this client accepts"),
            "{}: {refused}",
            path.display()
        );
    }
}

/// A folder whose LEAF files hold neither data set's samples, and CIFAR
/// batches of a wrong size, are refused naming the file.
#[test]
fn own_data_folders_of_damaged_files_are_refused_naming_them() {
    use cohort_core::data::own::OwnData;
    let dir = tempfile::tempdir().unwrap();
    let leaf = dir.path().join("leaf");
    std::fs::create_dir_all(leaf.join("train")).unwrap();
    std::fs::write(
        leaf.join("train/a.json"),
        r#"{"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [7], "y": [1]}}}"#,
    )
    .unwrap();
    let refused = OwnData::load(&leaf, 100).unwrap_err().to_string();
    assert!(
        refused.contains("a.json") && refused.contains("neither"),
        "{refused}"
    );
    let cifar = dir.path().join("cifar");
    std::fs::create_dir_all(&cifar).unwrap();
    std::fs::write(cifar.join("data_batch_1.bin"), vec![0u8; 100]).unwrap();
    let refused = OwnData::load(&cifar, 100).unwrap_err().to_string();
    assert!(refused.contains("data_batch_1.bin"), "{refused}");
}
