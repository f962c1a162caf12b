use std::path::Path;

use crate::config::{ConfigErrors, LoadedConfig, Sampler, from_str};
use crate::data::DataSource;
use crate::optim::OptimizerSpec;

/// The keys of the seed's `fedavg_lenet5_mlx.toml`, its `[data]` include
/// written inline (Plato's `mnist_iid.toml`).
const MLX_REFERENCE: &str = r#"
[clients]
type = "simple"
total_clients = 10
per_round = 2
do_test = false
outbound_processors = ["safetensor_encode"]

[server]
type = "fedavg"
address = "127.0.0.1"
port = 9006
random_seed = 1
simulate_wall_time = true
inbound_processors = ["safetensor_decode"]

[data]
datasource = "Torchvision"
dataset_name = "MNIST"
download = true
partition_size = 20000
sampler = "iid"
random_seed = 1

[trainer]
type = "mlx"
framework = "mlx"
rounds = 5
max_concurrency = 1
target_accuracy = 0.97
model_name = "lenet5"
epochs = 5
batch_size = 32
optimizer = "adam"

[algorithm]
type = "mlx_fedavg"
framework = "mlx"

[parameters]

[parameters.model]
framework = "mlx"
num_classes = 10

[parameters.optimizer]
learning_rate = 0.001
"#;

/// The keys of Plato's `fedavg_lenet5_noniid.toml` (PyTorch trainer).
const NONIID: &str = r#"
[clients]
type = "simple"
total_clients = 3
per_round = 1
do_test = true

[server]
address = "127.0.0.1"
port = 8000

[data]
datasource = "Torchvision"
dataset_name = "MNIST"
download = true
partition_size = 20000
sampler = "noniid"
concentration = 0.5
random_seed = 1

[trainer]
type = "basic"
rounds = 5
max_concurrency = 3
target_accuracy = 0.94
model_name = "lenet5"
epochs = 5
batch_size = 32
optimizer = "SGD"

[algorithm]
type = "fedavg"

[parameters]

[parameters.optimizer]
lr = 0.01
momentum = 0.9
weight_decay = 0.0
"#;

fn load(text: &str) -> Result<LoadedConfig, ConfigErrors> {
    from_str(text, Path::new("plato.toml"))
}

fn errors_of(text: &str) -> ConfigErrors {
    load(text).expect_err("config should be rejected")
}

fn has_note(loaded: &LoadedConfig, fragment: &str) {
    assert!(
        loaded.notes.iter().any(|note| note.contains(fragment)),
        "no note with `{fragment}` in {:#?}",
        loaded.notes
    );
}

#[test]
fn the_seeds_mlx_config_loads_as_the_reference_job() {
    let loaded = load(MLX_REFERENCE).unwrap();
    let config = &loaded.config;
    assert_eq!(config.trainer.kind, "basic");
    assert_eq!(config.algorithm.name(), "fedavg");
    assert_eq!(config.trainer.model_name, "lenet5_compact");
    assert_eq!(config.data.builtin_source(), Some(DataSource::Mnist));
    assert_eq!(config.data.sampler, Sampler::IidCyclic);
    assert_eq!(config.data.partition_size, Some(20_000));
    assert_eq!(config.server.port, 9006);
    assert_eq!(
        loaded.optimizer,
        OptimizerSpec::from_config("adam", &config.parameters.optimizer).unwrap()
    );
    assert!(matches!(
        loaded.optimizer,
        OptimizerSpec::Adam { learning_rate, bias_correction: false, .. } if learning_rate == 0.001
    ));
    for fragment in [
        "trainer.framework = \"mlx\" accepted, no effect",
        "algorithm.framework = \"mlx\" accepted",
        "parameters.model.framework = \"mlx\" accepted",
        "trainer.type = \"mlx\" read as trainer.type = \"basic\"",
        "algorithm.type = \"mlx_fedavg\" read as algorithm.type = \"fedavg\"",
        "trainer.model_name = \"lenet5\" read as trainer.model_name = \"lenet5_compact\"",
        "data.datasource = \"Torchvision\" with dataset_name = \"MNIST\" read as data.datasource = \"MNIST\"",
        "read as data.sampler = \"iid_cyclic\"",
    ] {
        has_note(&loaded, fragment);
    }
    assert_eq!(loaded.notes.len(), 8, "{:#?}", loaded.notes);
}

#[test]
fn the_translated_config_is_cohorts_and_reloads_without_notes() {
    let loaded = load(MLX_REFERENCE).unwrap();
    let text = toml::to_string(&loaded.merged).unwrap();
    for plato_only in ["framework", "Torchvision", "dataset_name", "mlx"] {
        assert!(!text.contains(plato_only), "{plato_only} in {text}");
    }
    let again = load(&text).unwrap();
    assert!(again.notes.is_empty(), "{:#?}", again.notes);
    assert_eq!(again.config, loaded.config);
    assert_eq!(again.result_hash(), loaded.result_hash());
}

#[test]
fn platos_mnist_noniid_config_loads_as_dirichlet_with_pytorch_sgd() {
    let loaded = load(NONIID).unwrap();
    let config = &loaded.config;
    assert_eq!(config.data.sampler, Sampler::Dirichlet);
    assert_eq!(config.data.concentration, 0.5);
    assert_eq!(config.data.partition_size, None);
    // The PyTorch trainer's LeNet-5 is the padded one.
    assert_eq!(config.trainer.model_name, "lenet5");
    assert!(matches!(
        loaded.optimizer,
        OptimizerSpec::Sgd { learning_rate, momentum, weight_decay, .. }
            if learning_rate == 0.01 && momentum == 0.9 && weight_decay == 0.0
    ));
    has_note(
        &loaded,
        "data.sampler = \"noniid\" read as data.sampler = \"dirichlet\"",
    );
    has_note(
        &loaded,
        "data.partition_size = 20000 has no effect with \"noniid\"",
    );
    has_note(
        &loaded,
        "parameters.optimizer.lr = 0.01 read as parameters.optimizer.learning_rate = 0.01",
    );
    assert_eq!(loaded.notes.len(), 4, "{:#?}", loaded.notes);
}

#[test]
fn cohorts_own_names_leave_no_notes() {
    let text = MLX_REFERENCE
        .replace("type = \"mlx\"\nframework = \"mlx\"\n", "")
        .replace(
            "type = \"mlx_fedavg\"\nframework = \"mlx\"",
            "type = \"fedavg\"",
        )
        .replace("framework = \"mlx\"\n", "")
        .replace(
            "datasource = \"Torchvision\"\ndataset_name = \"MNIST\"",
            "datasource = \"MNIST\"",
        )
        .replace("partition_size = 20000", "partition_size = 6000");
    let loaded = load(&text).unwrap();
    assert!(loaded.notes.is_empty(), "{:#?}", loaded.notes);
    assert_eq!(loaded.config.data.sampler, Sampler::Iid);
    assert_eq!(loaded.config.trainer.model_name, "lenet5");
}

#[test]
fn platos_iid_that_fits_stays_cohorts_iid() {
    let loaded =
        load(&MLX_REFERENCE.replace("partition_size = 20000", "partition_size = 6000")).unwrap();
    assert_eq!(loaded.config.data.sampler, Sampler::Iid);
}

#[test]
fn an_oversized_iid_in_cohorts_names_is_refused_with_the_cyclic_hint() {
    let text = "[data]\ndatasource = \"MNIST\"\npartition_size = 20000\n\
                [parameters.optimizer]\nlearning_rate = 0.1\n";
    let errors = errors_of(text);
    assert_eq!(errors.errors().len(), 1, "{errors}");
    assert_eq!(errors.first().key.as_deref(), Some("data.partition_size"));
    assert!(errors.to_string().contains("iid_cyclic"), "{errors}");
}

#[test]
fn torchvision_needs_a_dataset_cohort_has() {
    let missing = errors_of(&MLX_REFERENCE.replace("dataset_name = \"MNIST\"\n", ""));
    assert_eq!(missing.first().key.as_deref(), Some("data.datasource"));
    assert!(missing.to_string().contains("dataset_name"), "{missing}");

    let other = errors_of(&MLX_REFERENCE.replace("\"MNIST\"", "\"FashonMNIST\""));
    assert_eq!(other.first().key.as_deref(), Some("data.dataset_name"));
    assert!(
        other.to_string().contains("did you mean `FashionMNIST`?"),
        "{other}"
    );

    let fashion = load(&MLX_REFERENCE.replace("\"MNIST\"", "\"FashionMNIST\"")).unwrap();
    assert_eq!(
        fashion.config.data.builtin_source(),
        Some(DataSource::FashionMnist)
    );

    let cifar = load(&MLX_REFERENCE.replace("\"MNIST\"", "\"CIFAR10\"")).unwrap();
    assert_eq!(
        cifar.config.data.builtin_source(),
        Some(DataSource::Cifar10)
    );
    // LEAF's data sets are cohort's, but not Torchvision's.
    let leaf = errors_of(&MLX_REFERENCE.replace("\"MNIST\"", "\"FEMNIST\""));
    assert_eq!(leaf.first().key.as_deref(), Some("data.dataset_name"));

    let stray = errors_of(&MLX_REFERENCE.replace("\"Torchvision\"", "\"MNIST\""));
    assert_eq!(stray.first().key.as_deref(), Some("data.dataset_name"));
}

#[test]
fn frameworks_cohort_cannot_stand_in_for_are_refused() {
    let errors =
        errors_of(&MLX_REFERENCE.replacen("framework = \"mlx\"", "framework = \"tensorflow\"", 1));
    assert_eq!(errors.first().key.as_deref(), Some("trainer.framework"));
    assert!(errors.to_string().contains("tensorflow"), "{errors}");

    let mixed = errors_of(&MLX_REFERENCE.replace(
        "framework = \"mlx\"\nnum_classes",
        "framework = \"pytorch\"\nnum_classes",
    ));
    assert_eq!(
        mixed.first().key.as_deref(),
        Some("parameters.model.framework")
    );
    assert!(mixed.to_string().contains("conflicts with"), "{mixed}");
}

#[test]
fn pytorch_adam_keeps_its_bias_correction() {
    let loaded = load(
        &NONIID
            .replace("optimizer = \"SGD\"", "optimizer = \"Adam\"")
            .replace("momentum = 0.9\nweight_decay = 0.0\n", ""),
    )
    .unwrap();
    assert!(matches!(
        loaded.optimizer,
        OptimizerSpec::Adam {
            bias_correction: true,
            ..
        }
    ));
    has_note(&loaded, "bias_correction = true");
}

#[test]
fn pytorch_names_that_cannot_map_are_refused() {
    let both = errors_of(&NONIID.replace("lr = 0.01", "lr = 0.01\nlearning_rate = 0.01"));
    assert_eq!(both.first().key.as_deref(), Some("parameters.optimizer.lr"));
    let dampened = errors_of(&NONIID.replace("momentum = 0.9", "momentum = 0.9\ndampening = 0.5"));
    assert_eq!(
        dampened.first().key.as_deref(),
        Some("parameters.optimizer.dampening")
    );
}

#[test]
fn typos_in_a_plato_config_are_still_errors_with_suggestions() {
    let errors = errors_of(
        &NONIID
            .replace("concentration = 0.5", "concentraton = 0.5")
            .replace("max_concurrency = 3", "max_concurency = 3"),
    );
    let shown = errors.to_string();
    assert_eq!(errors.errors().len(), 2, "{shown}");
    assert!(shown.contains("`data.concentraton`"), "{shown}");
    assert!(shown.contains("did you mean `concentration`?"), "{shown}");
    assert!(shown.contains("did you mean `max_concurrency`?"), "{shown}");
    assert!(shown.contains("plato.toml"), "{shown}");
}

#[test]
fn plato_keys_cohort_has_no_meaning_for_are_refused_not_dropped() {
    let errors = errors_of(&NONIID.replace("[server]", "[server]\ndisable_clients = true"));
    assert_eq!(
        errors.first().key.as_deref(),
        Some("server.disable_clients")
    );
}

#[test]
fn the_reference_config_is_the_seeds_mlx_job_in_cohorts_names() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cohort = crate::config::load(&root.join("configs/mnist/fedavg_lenet5.toml")).unwrap();
    let plato =
        crate::config::load(&root.join("tests/fixtures/plato/fedavg_lenet5_mlx.toml")).unwrap();
    assert!(cohort.notes.is_empty(), "{:#?}", cohort.notes);
    // The fixture also sets the spec's optional seeds and clipping.
    let differences = cohort.result_differences(&plato);
    let keys: Vec<&str> = differences
        .iter()
        .map(|d| d.split(':').next().unwrap())
        .collect();
    assert_eq!(
        keys,
        [
            "trainer.clip_grad_norm",
            "trainer.model_seed",
            "trainer.training_seed"
        ],
        "{differences:#?}"
    );
}

#[test]
fn platos_speed_and_sleep_simulation_read_as_a_device_profile() {
    use crate::devices::{ComputeUnit, Distribution};
    let text = r#"
[clients]
total_clients = 10
per_round = 2
speed_simulation = true
random_seed = 7
sleep_simulation = true
avg_training_time = 12

[clients.simulation_distribution]
distribution = "pareto"
alpha = 1

[server]
periodic_interval = 5

[trainer]
optimizer = "sgd"

[parameters.optimizer]
learning_rate = 0.01
"#;
    let loaded = from_str(text, Path::new("plato.toml")).unwrap();
    let profile = &loaded.config().clients.profile;
    assert_eq!(
        profile.compute,
        Some(Distribution::Pareto {
            alpha: 1.0,
            scale: 1.0
        })
    );
    assert_eq!(profile.compute_unit, ComputeUnit::Epoch);
    // Plato's default max_sleep_time.
    assert_eq!(profile.compute_max, Some(60.0));
    assert_eq!(profile.seed, 7);
    assert_eq!(profile.task_overhead, 12.0);
    let notes = loaded.notes().join("\n");
    for said in [
        "clients.speed_simulation = true",
        "clients.random_seed = 7 read as clients.profile.seed = 7",
        "avg_training_time = 12 read as clients.profile.task_overhead = 12",
        "server.periodic_interval = 5 accepted, no effect",
    ] {
        assert!(notes.contains(said), "{said}: {notes}");
    }
    let zipf = text.replace("\"pareto\"\nalpha = 1", "\"zipf\"\ns = 1.5");
    let errors = from_str(&zipf, Path::new("plato.toml")).unwrap_err();
    let error = errors.first();
    assert_eq!(
        error.key.as_deref(),
        Some("clients.simulation_distribution")
    );
    assert!(error.message.contains("zipf"), "{error}");
    // Without speed_simulation the keys change nothing, and say so.
    let off = text.replace("speed_simulation = true", "speed_simulation = false");
    let loaded = from_str(&off, Path::new("plato.toml")).unwrap();
    assert!(!loaded.config().clients.profile.enabled());
    assert!(
        loaded
            .notes()
            .join("\n")
            .contains("no effect without speed_simulation")
    );
}
