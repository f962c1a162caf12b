use super::*;

const MINIMAL: &str = r#"
[clients]
total_clients = 10
per_round = 2

[trainer]
optimizer = "sgd"

[parameters.optimizer]
learning_rate = 0.01
momentum = 0.9
"#;

fn load_text(text: &str) -> Result<LoadedConfig, ConfigErrors> {
    from_str(text, Path::new("run.toml"))
}

/// The one problem of a config that has exactly one: a check that also
/// reported something else would be a wrong report.
fn error_of(text: &str) -> ConfigError {
    let errors = load_text(text).expect_err("config should be rejected");
    assert_eq!(errors.errors().len(), 1, "{errors}");
    errors.first().clone()
}

#[test]
fn minimal_config_loads_with_defaults() {
    let loaded = load_text(MINIMAL).unwrap();
    assert_eq!(loaded.config.trainer.batch_size, 32);
    assert_eq!(loaded.config.server.random_seed, 1);
    assert!(matches!(loaded.optimizer, OptimizerSpec::Sgd { momentum, .. } if momentum == 0.9));
}

#[test]
fn unknown_key_names_file_key_and_suggestion() {
    let error = error_of(&MINIMAL.replace("per_round = 2", "per_rond = 2"));
    assert_eq!(error.file, Path::new("run.toml"));
    assert_eq!(error.key.as_deref(), Some("clients.per_rond"));
    assert!(
        error.message.contains("did you mean `per_round`?"),
        "{error}"
    );
    assert!(error.message.contains("valid keys:"), "{error}");
}

#[test]
fn unknown_section_is_refused_with_suggestion() {
    let error = error_of(&format!("{MINIMAL}\n[trainr]\nepochs = 1\n"));
    assert_eq!(error.key.as_deref(), Some("trainr"));
    assert!(error.message.contains("did you mean `trainer`?"), "{error}");
}

#[test]
fn wrong_type_names_the_key_and_the_expected_type() {
    let error = error_of(&MINIMAL.replace("per_round = 2", "per_round = \"two\""));
    assert_eq!(error.key.as_deref(), Some("clients.per_round"));
    assert!(
        error.message.contains("invalid type: string \"two\""),
        "{error}"
    );
    assert!(
        error
            .message
            .ends_with("expected a whole number from 0 to 4294967295"),
        "{error}"
    );
    assert!(!error.message.contains("u32"), "{error}");
}

#[test]
fn flower_names_point_to_cohorts_keys() {
    let error = error_of(&MINIMAL.replace("per_round = 2", "per_round = 2\nfraction_fit = 0.2"));
    assert_eq!(error.key.as_deref(), Some("clients.fraction_fit"));
    assert!(
        error
            .message
            .contains("(Flower's `fraction_fit` is cohort's `clients.per_round`, a number"),
        "{error}"
    );
    let text = format!("{MINIMAL}\n[algorithm]\ntype = \"fedprox\"\nproximal_mu = 0.1\n");
    let errors = load_text(&text).unwrap_err();
    let error = errors
        .errors()
        .iter()
        .find(|e| e.key.as_deref() == Some("algorithm.proximal_mu"))
        .unwrap_or_else(|| panic!("{errors}"));
    assert!(
        error
            .message
            .contains("(Flower's `proximal_mu` is cohort's `algorithm.mu`)"),
        "{error}"
    );
}

#[test]
fn negative_count_is_a_type_error_not_a_wraparound() {
    let error = error_of(&MINIMAL.replace("total_clients = 10", "total_clients = -3"));
    assert_eq!(error.key.as_deref(), Some("clients.total_clients"));
}

#[test]
fn per_round_above_total_clients_is_impossible() {
    let error = error_of(&MINIMAL.replace("per_round = 2", "per_round = 11"));
    assert_eq!(error.key.as_deref(), Some("clients.per_round"));
    assert!(error.message.contains("total_clients = 10"), "{error}");
}

#[test]
fn zero_batch_size_is_impossible() {
    let error =
        error_of(&MINIMAL.replace("optimizer = \"sgd\"", "optimizer = \"sgd\"\nbatch_size = 0"));
    assert_eq!(error.key.as_deref(), Some("trainer.batch_size"));
}

#[test]
fn out_of_range_values_are_refused() {
    for (line, key) in [
        ("target_accuracy = 97.0", "trainer.target_accuracy"),
        ("clip_grad_norm = -1.0", "trainer.clip_grad_norm"),
        ("clip_grad_norm = nan", "trainer.clip_grad_norm"),
        ("max_concurrency = 0", "trainer.max_concurrency"),
        ("max_concurrency = 100000", "trainer.max_concurrency"),
        ("threads_per_worker = 0", "trainer.threads_per_worker"),
        (
            "threads_per_worker = 4294967295",
            "trainer.threads_per_worker",
        ),
        ("epochs = 0", "trainer.epochs"),
        ("rounds = 0", "trainer.rounds"),
    ] {
        let error = error_of(&MINIMAL.replace(
            "optimizer = \"sgd\"",
            &format!("optimizer = \"sgd\"\n{line}"),
        ));
        assert_eq!(error.key.as_deref(), Some(key), "{line}: {error}");
    }
}

#[test]
fn zero_clip_norm_is_valid() {
    load_text(&MINIMAL.replace(
        "optimizer = \"sgd\"",
        "optimizer = \"sgd\"\nclip_grad_norm = 0.0",
    ))
    .unwrap();
}

#[test]
fn invalid_toml_names_the_file_and_line() {
    let error = error_of("[clients\ntotal_clients = 1");
    assert_eq!(error.key, None);
    assert!(error.message.contains("invalid TOML"), "{error}");
    assert!(error.message.contains("line 1"), "{error}");
}

#[test]
fn optimizer_option_errors_carry_the_dotted_key() {
    // Plato's MLX path passes options to MLX as written, and MLX has no `lr`;
    // the PyTorch path's `lr` is mapped (see plato_tests.rs).
    let mlx = MINIMAL
        .replace("learning_rate = 0.01", "lr = 0.01")
        .replace("optimizer = \"sgd\"", "optimizer = \"sgd\"\ntype = \"mlx\"");
    let error = error_of(&mlx);
    assert_eq!(error.key.as_deref(), Some("parameters.optimizer.lr"));
    assert!(error.message.contains("learning_rate"), "{error}");
}

#[test]
fn include_merges_keys_and_section_keys_win() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("common.toml"),
        "total_clients = 100\nper_round = 10\n",
    )
    .unwrap();
    let main = dir.path().join("main.toml");
    std::fs::write(
        &main,
        "[clients]\ninclude = \"common.toml\"\nper_round = 5\n\n[parameters.optimizer]\nlearning_rate = 0.1\n",
    )
    .unwrap();
    let loaded = load(&main).unwrap();
    assert_eq!(loaded.config.clients.total_clients, 100);
    assert_eq!(loaded.config.clients.per_round, 5);
    assert_eq!(
        loaded.origin_of("clients.total_clients"),
        dir.path().join("common.toml")
    );
}

#[test]
fn error_in_included_file_names_that_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("common.toml"), "total_clientz = 100\n").unwrap();
    let main = dir.path().join("main.toml");
    std::fs::write(&main, "[clients]\ninclude = \"common.toml\"\n").unwrap();
    let error = load(&main).unwrap_err().first().clone();
    assert_eq!(error.file, dir.path().join("common.toml"));
    assert_eq!(error.key.as_deref(), Some("clients.total_clientz"));
}

#[test]
fn missing_and_cyclic_includes_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("main.toml");
    std::fs::write(&main, "[clients]\ninclude = \"nope.toml\"\n").unwrap();
    let error = load(&main).unwrap_err().first().clone();
    assert_eq!(error.key.as_deref(), Some("clients.include"));
    assert!(error.message.contains("nope.toml"), "{error}");

    std::fs::write(dir.path().join("a.toml"), "include = \"b.toml\"\n").unwrap();
    std::fs::write(dir.path().join("b.toml"), "include = \"a.toml\"\n").unwrap();
    std::fs::write(&main, "[clients]\ninclude = \"a.toml\"\n").unwrap();
    let error = load(&main).unwrap_err().first().clone();
    assert!(error.message.contains("includes itself"), "{error}");
}

#[test]
fn hash_ignores_layout_but_not_values() {
    let a = load_text(MINIMAL).unwrap().hash();
    let reordered = load_text(
        "[parameters.optimizer]\nmomentum = 0.9\nlearning_rate = 0.01\n[trainer]\noptimizer = \"sgd\"\n[clients]\nper_round = 2\ntotal_clients = 10\n",
    )
    .unwrap()
    .hash();
    assert_eq!(a, reordered);
    let changed = load_text(&MINIMAL.replace("per_round = 2", "per_round = 3"))
        .unwrap()
        .hash();
    assert_ne!(a, changed);
}

#[test]
fn reference_configs_load() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    for name in [
        "mnist/fedavg_lenet5.toml",
        "fashion_mnist/fedavg_lenet5_r1.toml",
    ] {
        let loaded = load(&root.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(loaded.config.clients.total_clients, 10, "{name}");
    }
}

#[test]
fn result_hash_ignores_neutral_keys_and_defaults_written_out() {
    let base = load_text(MINIMAL).unwrap();
    let neutral = load_text(&format!(
        "{MINIMAL}\n[general]\nbase_path = \"elsewhere\"\n"
    ))
    .unwrap();
    let explicit_default =
        load_text(&MINIMAL.replace("per_round = 2", "per_round = 2\ncomm_simulation = true"))
            .unwrap();
    assert_eq!(base.result_hash(), neutral.result_hash());
    assert_eq!(base.result_hash(), explicit_default.result_hash());
    let changed =
        load_text(&MINIMAL.replace("learning_rate = 0.01", "learning_rate = 0.02")).unwrap();
    assert_ne!(base.result_hash(), changed.result_hash());
    assert_eq!(
        base.result_differences(&changed),
        ["parameters.optimizer.learning_rate: 0.01 → 0.02"]
    );
}

#[test]
fn lr_schedules_load_and_validate() {
    use crate::schedule::LrSchedule;
    let step = load_text(&MINIMAL.replace(
        "optimizer = \"sgd\"",
        "optimizer = \"sgd\"\nlr_scheduler = \"step\"\nlr_step_size = 2\nlr_gamma = 0.5",
    ))
    .unwrap();
    assert_eq!(
        step.lr_schedule(),
        LrSchedule::Step {
            step_size: 2,
            gamma: 0.5
        }
    );
    assert_eq!(
        load_text(MINIMAL).unwrap().lr_schedule(),
        LrSchedule::Constant
    );
    for (line, key) in [
        ("lr_scheduler = \"cosin\"", "trainer.lr_scheduler"),
        ("lr_step_size = 0", "trainer.lr_step_size"),
        ("lr_gamma = 0.0", "trainer.lr_gamma"),
        ("lr_min = 1.0", "trainer.lr_min"),
    ] {
        let error = error_of(&MINIMAL.replace(
            "optimizer = \"sgd\"",
            &format!("optimizer = \"sgd\"\n{line}"),
        ));
        assert_eq!(error.key.as_deref(), Some(key), "{line}: {error}");
    }
}

#[test]
fn rounds_matter_to_the_hash_only_under_a_cosine_schedule() {
    let with = |extra: &str| {
        load_text(&MINIMAL.replace(
            "optimizer = \"sgd\"",
            &format!("optimizer = \"sgd\"\n{extra}"),
        ))
        .unwrap()
        .result_hash()
    };
    assert_eq!(with("rounds = 5"), with("rounds = 9"));
    assert_ne!(
        with("rounds = 5\nlr_scheduler = \"cosine\""),
        with("rounds = 9\nlr_scheduler = \"cosine\"")
    );
}

#[test]
fn pipelines_that_cannot_work_are_refused_at_load() {
    let error = error_of(&MINIMAL.replace(
        "per_round = 2",
        "per_round = 2\noutbound_processors = [\"zstd_compress\", \"safetensor_encode\"]",
    ));
    assert_eq!(error.key.as_deref(), Some("clients.outbound_processors"));
    assert!(
        error.message.contains("put `safetensor_encode` before it"),
        "{error}"
    );
    assert!(error.to_string().contains("run.toml"), "{error}");

    let error = error_of(&MINIMAL.replace(
        "per_round = 2",
        "per_round = 2\noutbound_processors = [\"safetensor_encode\", \"zstd_compress\"]",
    ));
    assert_eq!(error.key.as_deref(), Some("server.inbound_processors"));
    assert!(
        error
            .message
            .contains("\"zstd_decompress\", \"safetensor_decode\""),
        "{error}"
    );

    let both = MINIMAL.replace(
        "per_round = 2",
        "per_round = 2\noutbound_processors = [\"fp16_quantize\", \"safetensor_encode\", \
         \"zstd_compress\"]\n\n[server]\ninbound_processors = [\"zstd_decompress\", \
         \"safetensor_decode\", \"fp16_dequantize\"]",
    );
    let loaded = load_text(&both).unwrap();
    assert_eq!(loaded.pipelines().client_outbound.steps().len(), 3);
}

#[test]
fn network_keys_are_checked() {
    let loaded =
        load_text(&MINIMAL.replace("per_round = 2", "per_round = 2\ncomm_simulation = false"))
            .unwrap();
    assert!(!loaded.config.clients.comm_simulation);
    assert_eq!(loaded.min_per_round(), 2);
    let error = error_of(&MINIMAL.replace("per_round = 2", "per_round = 2\nmin_per_round = 3"));
    assert_eq!(error.key.as_deref(), Some("clients.min_per_round"));
    let error = error_of(&MINIMAL.replace("per_round = 2", "per_round = 2\nuplink_mbps = 0"));
    assert_eq!(error.key.as_deref(), Some("clients.uplink_mbps"));
    let error = error_of(&format!("{MINIMAL}\n[server]\npayload_timeout = -1\n"));
    assert_eq!(error.key.as_deref(), Some("server.payload_timeout"));
    let error = error_of(&format!("{MINIMAL}\n[server]\ntls_cert = \"cert.pem\"\n"));
    assert_eq!(error.key.as_deref(), Some("server.tls_cert"));
}

#[test]
fn bandwidths_are_bounded_to_a_range_that_keeps_transfer_times_finite() {
    let with = |line: &str| MINIMAL.replace("per_round = 2", &format!("per_round = 2\n{line}"));
    for (line, key) in [
        ("uplink_mbps = 1e-310", "clients.uplink_mbps"),
        ("downlink_mbps = 1e-310", "clients.downlink_mbps"),
        ("uplink_mbps = 0.0009", "clients.uplink_mbps"),
        ("downlink_mbps = 1e10", "clients.downlink_mbps"),
        ("uplink_mbps = -5.0", "clients.uplink_mbps"),
        ("downlink_mbps = inf", "clients.downlink_mbps"),
        ("uplink_mbps = nan", "clients.uplink_mbps"),
    ] {
        let error = error_of(&with(line));
        assert_eq!(error.key.as_deref(), Some(key), "{line}");
        assert!(
            error.message.contains("[0.001, 1000000000] Mbit/s"),
            "{line}: {}",
            error.message
        );
    }
    let tiny = error_of(&with("uplink_mbps = 1e-310"));
    assert!(tiny.message.ends_with("got 1e-310"), "{}", tiny.message);
    for line in [
        "uplink_mbps = 0.001",
        "downlink_mbps = 1e9",
        "uplink_mbps = 10.0",
    ] {
        assert!(load_text(&with(line)).is_ok(), "{line}");
    }
}

#[test]
fn own_data_clients_need_network_mode_and_a_bounded_sample_count() {
    let network = |extra: &str| {
        MINIMAL.replace(
            "per_round = 2",
            &format!("per_round = 2\ncomm_simulation = false\n{extra}"),
        )
    };
    let loaded = load_text(&network("own_data_clients = 2\nmax_samples = 500")).unwrap();
    assert_eq!(loaded.config.clients.own_data_clients, 2);
    assert_eq!(loaded.config.clients.max_samples, 500);
    let error = error_of(&MINIMAL.replace("per_round = 2", "per_round = 2\nown_data_clients = 1"));
    assert_eq!(error.key.as_deref(), Some("clients.own_data_clients"));
    assert!(error.message.contains("comm_simulation = false"), "{error}");
    let error = error_of(&network("own_data_clients = 1000"));
    assert_eq!(error.key.as_deref(), Some("clients.own_data_clients"));
    for bad in ["0", "4294967297"] {
        let error = error_of(&network(&format!("max_samples = {bad}")));
        assert_eq!(error.key.as_deref(), Some("clients.max_samples"), "{bad}");
    }
}

fn with_data(lines: &str) -> String {
    format!("{MINIMAL}\n[data]\n{lines}\n")
}

#[test]
fn plato_noniid_sampler_loads_as_dirichlet() {
    let loaded = load_text(&with_data("sampler = \"noniid\"\nconcentration = 0.5")).unwrap();
    assert_eq!(loaded.config.data.sampler, Sampler::Dirichlet);
    assert_eq!(loaded.config.data.concentration, 0.5);
    // `cohort check` prints the canonical name, and its output loads back.
    let printed = to_toml(&loaded.config).unwrap();
    assert!(printed.contains("sampler = \"dirichlet\""), "{printed}");
    assert!(printed.contains("concentration = 0.5"), "{printed}");
    assert_eq!(load_text(&printed).unwrap().config, loaded.config);
}

#[test]
fn every_sampler_round_trips_through_check_output() {
    for name in ["iid", "dirichlet", "shards", "quantity_skew"] {
        let loaded = load_text(&with_data(&format!("sampler = \"{name}\""))).unwrap();
        assert_eq!(loaded.config.data.sampler.name(), name);
        let printed = to_toml(&loaded.config).unwrap();
        assert!(
            printed.contains(&format!("sampler = \"{name}\"")),
            "{printed}"
        );
        assert_eq!(load_text(&printed).unwrap().config, loaded.config);
    }
    let defaults = Data::default();
    assert_eq!(defaults.sampler, Sampler::Iid);
    assert_eq!(
        (
            defaults.concentration,
            defaults.shards_per_client,
            defaults.min_partition_size
        ),
        (1.0, 2, 10)
    );
}

#[test]
fn unknown_sampler_names_the_key_and_the_valid_ones() {
    let error = error_of(&with_data("sampler = \"dirichlett\""));
    assert_eq!(error.key.as_deref(), Some("data.sampler"));
    assert_eq!(error.file, Path::new("run.toml"));
    for name in ["dirichlett", "iid", "dirichlet", "shards", "quantity_skew"] {
        assert!(error.message.contains(name), "{error}");
    }
}

#[test]
fn partition_sizes_with_a_non_iid_sampler_are_refused() {
    for (lines, key) in [
        (
            "sampler = \"dirichlet\"\npartition_size = 600",
            "data.partition_size",
        ),
        (
            "sampler = \"shards\"\npartition_sizes = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]",
            "data.partition_sizes",
        ),
        (
            "sampler = \"quantity_skew\"\npartition_size = 600",
            "data.partition_size",
        ),
    ] {
        let error = error_of(&with_data(lines));
        assert_eq!(error.key.as_deref(), Some(key), "{lines}: {error}");
        assert!(error.message.contains("data.sampler"), "{error}");
        assert!(error.message.contains(key), "{error}");
    }
    // Options of other samplers may stay at their defaults, or be set.
    load_text(&with_data(
        "sampler = \"iid\"\npartition_size = 600\nconcentration = 0.1",
    ))
    .unwrap();
}

#[test]
fn non_iid_options_are_range_checked() {
    for (line, key) in [
        ("concentration = 0.0", "data.concentration"),
        ("concentration = -1.0", "data.concentration"),
        ("concentration = nan", "data.concentration"),
        ("concentration = inf", "data.concentration"),
        ("shards_per_client = 0", "data.shards_per_client"),
        ("min_partition_size = 0", "data.min_partition_size"),
        ("shards_per_client = -1", "data.shards_per_client"),
    ] {
        let error = error_of(&with_data(line));
        assert_eq!(error.key.as_deref(), Some(key), "{line}: {error}");
    }
}

#[test]
fn partitions_dispatch_on_the_sampler() {
    use crate::partition;
    // 10 classes × 100 samples, 10 clients (MINIMAL).
    let labels: Vec<u32> = (0..1000).map(|i| (i % 10) as u32).collect();
    let parts = |lines: &str| {
        load_text(&with_data(lines))
            .unwrap()
            .partitions(&labels, None)
            .unwrap()
    };
    assert_eq!(parts(""), partition::iid(1000, 10, None, 1).unwrap());
    assert_eq!(
        parts("partition_size = 50\nrandom_seed = 3"),
        partition::iid(1000, 10, Some(50), 3).unwrap()
    );
    assert_eq!(
        parts("sampler = \"noniid\"\nconcentration = 0.3"),
        partition::dirichlet(&labels, 10, 10, 0.3, 10, 1).unwrap()
    );
    assert_eq!(
        parts("sampler = \"shards\"\nshards_per_client = 3"),
        partition::shards(&labels, 10, 3, 1).unwrap()
    );
    assert_eq!(
        parts("sampler = \"quantity_skew\"\nmin_partition_size = 20"),
        partition::quantity_skew(1000, 10, 1.0, 20, 1).unwrap()
    );
}

#[test]
fn noniid_dirichlet_reference_config_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../configs/fashion_mnist/noniid_dirichlet.toml");
    let loaded = load(&path).unwrap_or_else(|e| panic!("{e}"));
    let config = &loaded.config;
    assert_eq!(
        (config.clients.total_clients, config.clients.per_round),
        (100, 10)
    );
    assert_eq!(config.data.sampler, Sampler::Dirichlet);
    assert_eq!(config.data.concentration, 0.5);
    assert_eq!(
        config.data.builtin_source(),
        Some(crate::data::DataSource::FashionMnist)
    );
    assert_eq!(config.trainer.epochs, 1);
    // 100 clients fit Fashion-MNIST's 60,000 balanced training labels.
    let labels: Vec<u32> = (0..60_000).map(|i| (i % 10) as u32).collect();
    let parts = loaded.partitions(&labels, None).unwrap();
    assert_eq!(parts.len(), 100);
    assert!(parts.iter().all(|p| p.len() >= 10));
    assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), 60_000);
}

#[test]
fn every_enum_valued_key_gets_a_suggestion_from_its_type() {
    for (section, key, wrong, right) in [
        ("trainer", "lr_scheduler", "cosin", "cosine"),
        ("data", "sampler", "dirichlett", "dirichlet"),
        ("clients", "attack", "signflip", "sign_flip"),
    ] {
        let error = error_of(&format!(
            "[parameters.optimizer]\nlearning_rate = 0.01\n[{section}]\n{key} = \"{wrong}\"\n"
        ));
        assert_eq!(
            error.key.as_deref(),
            Some(format!("{section}.{key}").as_str())
        );
        assert!(
            error.message.contains(&format!("did you mean `{right}`?")),
            "{error}"
        );
    }
}

#[test]
fn configs_that_used_to_panic_at_run_time_are_refused_at_load() {
    let base = "[parameters.optimizer]\nlearning_rate = 0.01\n";
    for (section, line, key) in [
        ("server", "payload_timeout = 1e20", "server.payload_timeout"),
        (
            "server",
            "registration_timeout = 1e20",
            "server.registration_timeout",
        ),
        (
            "data",
            "partition_sizes = [9223372036854775807, 9223372036854775807]\n[clients]\ntotal_clients = 2",
            "data.partition_sizes",
        ),
        ("general", "run_name = \"../../x\"", "general.run_name"),
        ("general", "run_name = \"nested/x\"", "general.run_name"),
        ("general", "run_name = \"..\"", "general.run_name"),
    ] {
        let errors = load_text(&format!("{base}[{section}]\n{line}\n")).unwrap_err();
        assert!(
            errors
                .errors()
                .iter()
                .all(|e| e.key.as_deref() == Some(key)),
            "{errors}"
        );
    }
    assert!(load_text(&format!("{base}[general]\nrun_name = \"plain-name_1\"\n")).is_ok());
}

#[test]
fn includes_and_config_files_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    // A chain of 100 distinct files, each including the next.
    for i in 0..100 {
        let next = format!("include = \"part{}.toml\"\n", i + 1);
        let body = if i < 99 { next } else { String::new() };
        std::fs::write(dir.path().join(format!("part{i}.toml")), body).unwrap();
    }
    let main = dir.path().join("run.toml");
    std::fs::write(
        &main,
        "[clients]\ninclude = \"part0.toml\"\n[parameters.optimizer]\nlearning_rate = 0.1\n",
    )
    .unwrap();
    let error = load(&main).unwrap_err().first().clone();
    assert!(
        error.message.contains("more than 64 included files"),
        "{error}"
    );

    let huge = dir.path().join("huge.toml");
    std::fs::write(&huge, vec![b'#'; (MAX_CONFIG_BYTES + 10) as usize]).unwrap();
    let error = load(&huge).unwrap_err().first().clone();
    assert!(error.message.contains("larger than"), "{error}");
}

#[test]
fn inflight_room_must_hold_one_largest_update() {
    let error = error_of(
        "[parameters.optimizer]\nlearning_rate = 0.1\n[server]\nmax_payload_bytes = 1000\nmax_inflight_bytes = 999\n",
    );
    assert_eq!(error.key.as_deref(), Some("server.max_inflight_bytes"));
}

#[test]
fn the_inflight_limit_is_split_between_receiving_and_keeping() {
    let split = |server: &str| {
        load_text(&format!("{MINIMAL}\n[server]\n{server}\n"))
            .unwrap()
            .inflight_split()
    };
    let halves = split("max_payload_bytes = 1000\nmax_inflight_bytes = 10001");
    assert_eq!((halves.receiving, halves.keeping), (5000, 5001));
    // Room for one largest upload comes first.
    let one_upload = split("max_payload_bytes = 7000\nmax_inflight_bytes = 10000");
    assert_eq!((one_upload.receiving, one_upload.keeping), (7000, 3000));
    let nothing_kept = split("max_payload_bytes = 7000\nmax_inflight_bytes = 7000");
    assert_eq!((nothing_kept.receiving, nothing_kept.keeping), (7000, 0));
    let default = split("");
    assert_eq!(default.receiving + default.keeping, 1 << 32);
    assert_eq!(default.receiving, 1 << 31);
}

#[test]
fn a_stream_window_must_be_one_http2_allows() {
    for window in [0u64, 65_534, 1 << 31] {
        let error = error_of(&format!(
            "[parameters.optimizer]\nlearning_rate = 0.1\n[server]\nstream_window_bytes = {window}\n"
        ));
        assert_eq!(
            error.key.as_deref(),
            Some("server.stream_window_bytes"),
            "{window}"
        );
    }
    let loaded = load_text(&format!(
        "{MINIMAL}\n[server]\nstream_window_bytes = 65535\n"
    ))
    .unwrap();
    assert_eq!(loaded.config.server.stream_window_bytes, Some(65_535));
}

#[test]
fn cluster_section_is_optional_and_loads_every_key() {
    assert_eq!(
        load_text(MINIMAL).unwrap().config.cluster,
        Cluster::default()
    );
    let loaded = load_text(&format!(
        "{MINIMAL}\n[cluster]\nbackend = \"ring\"\nfile = \"clusters/lab.toml\"\nranks = 3\nmin_nodes = 2\n"
    ))
    .unwrap();
    let cluster = &loaded.config.cluster;
    assert_eq!(cluster.backend, Some(crate::cluster::Backend::Ring));
    assert_eq!((cluster.ranks, cluster.min_nodes), (Some(3), Some(2)));
    // What `cohort check` prints loads back to the same section.
    let printed = to_toml(&loaded.config).unwrap();
    let again = from_str(&printed, Path::new("run.toml")).unwrap();
    assert_eq!(&again.config.cluster, cluster);
}

#[test]
fn the_cluster_file_resolves_against_the_file_that_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("main.toml");
    let lr = "[parameters.optimizer]\nlearning_rate = 0.01\n";
    std::fs::write(&main, format!("{lr}[cluster]\nfile = \"lab.toml\"\n")).unwrap();
    assert_eq!(
        load(&main).unwrap().cluster_file(),
        Some(dir.path().join("lab.toml"))
    );
    // Set in an included file, it is relative to that file, like `include`.
    std::fs::create_dir(dir.path().join("shared")).unwrap();
    std::fs::write(
        dir.path().join("shared/cluster.toml"),
        "file = \"lab.toml\"\n",
    )
    .unwrap();
    std::fs::write(
        &main,
        format!("{lr}[cluster]\ninclude = \"shared/cluster.toml\"\n"),
    )
    .unwrap();
    assert_eq!(
        load(&main).unwrap().cluster_file(),
        Some(dir.path().join("shared/lab.toml"))
    );
    assert_eq!(load_text(MINIMAL).unwrap().cluster_file(), None);
}

#[test]
fn an_unknown_backend_gets_a_did_you_mean_and_the_valid_names() {
    let error = error_of(&format!("{MINIMAL}\n[cluster]\nbackend = \"rnig\"\n"));
    assert_eq!(error.file, Path::new("run.toml"));
    assert_eq!(error.key.as_deref(), Some("cluster.backend"));
    assert!(error.message.contains("did you mean `ring`?"), "{error}");
    assert!(error.message.contains("grpc, ring, mpi, rdma"), "{error}");
    let error = error_of(&format!("{MINIMAL}\n[cluster]\nbackend = \"nccl\"\n"));
    assert!(error.message.contains("NCCL"), "{error}");
    let error = error_of(&format!("{MINIMAL}\n[cluster]\nbackends = \"ring\"\n"));
    assert_eq!(error.key.as_deref(), Some("cluster.backends"));
    assert!(error.message.contains("did you mean `backend`?"), "{error}");
}

#[test]
fn cluster_ranges_are_checked_at_load() {
    for (lines, key, expected) in [
        ("ranks = 0", "cluster.ranks", "at least 1"),
        ("min_nodes = 0", "cluster.min_nodes", "at least 1"),
        ("ranks = 11", "cluster.ranks", "clients.total_clients = 10"),
        (
            "min_nodes = 11",
            "cluster.min_nodes",
            "clients.total_clients = 10",
        ),
        ("ranks = 2\nmin_nodes = 3", "cluster.min_nodes", "ranks = 2"),
        ("file = \"\"", "cluster.file", "is empty"),
    ] {
        let error = error_of(&format!("{MINIMAL}\n[cluster]\n{lines}\n"));
        assert_eq!(error.key.as_deref(), Some(key), "{lines}: {error}");
        assert!(error.message.contains(expected), "{lines}: {error}");
    }
    assert!(
        load_text(&format!(
            "{MINIMAL}\n[cluster]\nranks = 10\nmin_nodes = 10\n"
        ))
        .is_ok()
    );
}

#[test]
fn a_backend_this_build_lacks_names_the_file_the_key_and_the_feature() {
    use crate::cluster::Backend;
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("main.toml");
    std::fs::write(
        &main,
        "[parameters.optimizer]\nlearning_rate = 0.01\n[cluster]\ninclude = \"c.toml\"\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("c.toml"), "backend = \"mpi\"\n").unwrap();
    let loaded = load(&main).unwrap();
    let error = loaded
        .check_cluster_backend(&[Backend::Grpc, Backend::Ring])
        .unwrap_err();
    assert_eq!(error.file, dir.path().join("c.toml"));
    assert_eq!(error.key.as_deref(), Some("cluster.backend"));
    assert!(error.message.contains("--features mpi"), "{error}");
    assert!(error.message.contains("grpc and ring"), "{error}");
    assert!(loaded.check_cluster_backend(&[Backend::Mpi]).is_ok());
    assert!(
        load_text(MINIMAL)
            .unwrap()
            .check_cluster_backend(&[])
            .is_ok()
    );
}

#[test]
fn where_the_ranks_run_does_not_change_the_result_hash() {
    let base = load_text(MINIMAL).unwrap();
    let spread = load_text(&format!(
        "{MINIMAL}\n[cluster]\nbackend = \"ring\"\nfile = \"lab.toml\"\nranks = 2\nmin_nodes = 2\n"
    ))
    .unwrap();
    assert_eq!(base.result_hash(), spread.result_hash());
    assert_ne!(base.hash(), spread.hash());
}

#[test]
fn config_md_documents_exactly_the_cluster_keys() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/CONFIG.md"))
            .unwrap();
    let section = doc
        .split("## `[cluster]`")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/CONFIG.md has a `[cluster]` section");
    let documented: Vec<&str> = section
        .lines()
        .filter_map(|line| line.strip_prefix("| `")?.split_once("` |"))
        .map(|(key, _)| key)
        .collect();
    let mut keys = introspect::fields_of::<Cluster>().to_vec();
    keys.sort_unstable();
    let mut sorted = documented.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted, keys,
        "docs/CONFIG.md's [cluster] table and `Cluster`"
    );
}

#[test]
fn iid_partitions_larger_than_the_training_set_are_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.toml");
    std::fs::write(
        &path,
        "[clients]\ntotal_clients = 100\nper_round = 10\n[data]\ndatasource = \"FashionMNIST\"\n\
         partition_size = 601\n[parameters.optimizer]\nlearning_rate = 0.1\n",
    )
    .unwrap();
    let message = load(&path).unwrap_err().to_string();
    assert!(message.contains("big.toml"), "{message}");
    assert!(message.contains("`data.partition_size`"), "{message}");
    assert!(
        message.contains(
            "100 clients need 60100 training samples in all, but fashion-mnist has 60000"
        ),
        "{message}"
    );
    // Exactly the training set fits; other samplers are not held to it.
    std::fs::write(
        &path,
        "[clients]\ntotal_clients = 100\nper_round = 10\n[data]\npartition_size = 600\n[parameters.optimizer]\nlearning_rate = 0.1\n",
    )
    .unwrap();
    assert!(load(&path).is_ok());
    std::fs::write(
        &path,
        "[clients]\ntotal_clients = 2\nper_round = 2\n[data]\npartition_sizes = [60000, 1]\n[parameters.optimizer]\nlearning_rate = 0.1\n",
    )
    .unwrap();
    let message = load(&path).unwrap_err().to_string();
    assert!(message.contains("`data.partition_sizes`"), "{message}");
}

#[test]
fn set_overrides_win_over_includes_and_are_checked_like_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("common.toml"), "total_clients = 100\n").unwrap();
    let main = dir.path().join("main.toml");
    std::fs::write(
        &main,
        "[clients]\ninclude = \"common.toml\"\nper_round = 5\n\n[parameters.optimizer]\nlearning_rate = 0.1\n",
    )
    .unwrap();
    let set =
        |texts: &[&str]| -> Vec<Override> { texts.iter().map(|t| t.parse().unwrap()).collect() };

    let loaded = load_with(
        &main,
        &set(&[
            "clients.total_clients=20",
            "clients.per_round=4",
            "trainer.rounds=3",
        ]),
    )
    .unwrap();
    assert_eq!(loaded.config.clients.total_clients, 20);
    assert_eq!(loaded.config.clients.per_round, 4);
    assert_eq!(loaded.config.trainer.rounds, 3);
    // The run records the merged table, overrides included.
    assert_eq!(loaded.merged["trainer"]["rounds"].as_integer(), Some(3));
    assert_eq!(
        loaded.origin_of("trainer.rounds"),
        Path::new("--set trainer.rounds=3")
    );

    let errors = load_with(&main, &set(&["clients.per_rund=4"])).unwrap_err();
    let error = &errors.errors()[0];
    assert_eq!(error.file, Path::new("--set clients.per_rund=4"));
    assert!(
        error.message.contains("did you mean `per_round`"),
        "{error}"
    );

    let errors = load_with(&main, &set(&["clients.per_round=200"])).unwrap_err();
    let error = &errors.errors()[0];
    assert_eq!(error.key.as_deref(), Some("clients.per_round"));

    let errors = load_with(&main, &set(&["trainer.rounds=many"])).unwrap_err();
    let error = &errors.errors()[0];
    assert_eq!(error.file, Path::new("--set trainer.rounds=\"many\""));
    assert_eq!(error.key.as_deref(), Some("trainer.rounds"));
}

#[test]
fn every_problem_of_a_file_is_reported_at_once() {
    let text = format!(
        "{MINIMAL}\n[data]\nsamplr = \"iid\"\nrandom_seed = \"one\"\n\n[server]\nport = 8000\n\
         payload_timeout = -1.0\n\n[algorithm]\ntype = \"fedavg\"\nmu = 0.1\n"
    )
    .replace("per_round = 2", "per_round = 11");
    let errors = load_text(&text).unwrap_err();
    let keys: Vec<&str> = errors
        .errors()
        .iter()
        .map(|e| e.key.as_deref().unwrap_or(""))
        .collect();
    for key in [
        "data.samplr",
        "algorithm.mu",
        "data.random_seed",
        "clients.per_round",
        "server.payload_timeout",
    ] {
        assert!(keys.contains(&key), "{key} missing from {errors}");
    }
    assert_eq!(keys.len(), 5, "{errors}");
    assert!(
        errors
            .errors()
            .iter()
            .all(|e| e.file == Path::new("run.toml"))
    );
    let shown = errors.to_string();
    assert!(shown.starts_with("5 problems in the config:"), "{shown}");
    assert!(shown.contains("did you mean `sampler`?"), "{shown}");
}

#[test]
fn one_problem_reads_as_before() {
    let errors = load_text(&MINIMAL.replace("per_round = 2", "per_round = 11")).unwrap_err();
    assert_eq!(errors.to_string(), errors.first().to_string());
}

#[test]
fn a_list_of_errors_has_one_line_per_error() {
    let errors = load_text(
        &MINIMAL
            .replace("per_round = 2", "per_round = \"two\"")
            .replace(
                "optimizer = \"sgd\"",
                "optimizer = \"sgd\"\nepochs = \"five\"",
            ),
    )
    .unwrap_err();
    assert_eq!(errors.errors().len(), 2, "{errors}");
    assert_eq!(errors.to_string().lines().count(), 3, "{errors}");
}

#[test]
fn vectorized_clients_takes_off_auto_or_a_count() {
    let with = |line: &str| {
        MINIMAL.replace(
            "optimizer = \"sgd\"",
            &format!("optimizer = \"sgd\"\n{line}"),
        )
    };
    let value = |line: &str| {
        load_text(&with(line))
            .unwrap()
            .config
            .trainer
            .vectorized_clients
    };
    assert_eq!(value(""), VectorizedClients::Off);
    assert_eq!(
        value("vectorized_clients = \"auto\""),
        VectorizedClients::Auto
    );
    assert_eq!(
        value("vectorized_clients = \"off\""),
        VectorizedClients::Off
    );
    assert_eq!(
        value("vectorized_clients = 64"),
        VectorizedClients::Clients(64)
    );
    for line in [
        "vectorized_clients = 0",
        "vectorized_clients = -2",
        "vectorized_clients = \"fast\"",
    ] {
        let error = error_of(&with(line));
        assert_eq!(
            error.key.as_deref(),
            Some("trainer.vectorized_clients"),
            "{line}: {error}"
        );
        assert!(error.message.contains("\"auto\""), "{line}: {error}");
    }
}

#[test]
fn vectorized_clients_refuses_an_optimizer_it_cannot_train_and_names_the_key() {
    // Whether the model can be stacked is the model registry's check.
    let text = MINIMAL
        .replace(
            "optimizer = \"sgd\"",
            "optimizer = \"adam\"\nvectorized_clients = 8",
        )
        .replace("momentum = 0.9\n", "");
    let error = error_of(&text);
    assert_eq!(
        error.key.as_deref(),
        Some("trainer.vectorized_clients"),
        "{error}"
    );
    assert!(error.message.contains("trainer.optimizer"), "{error}");
}

#[test]
fn more_attackers_than_a_robust_strategy_withstands_are_warned_of() {
    let with = |algorithm: &str, attackers: u32| {
        load_text(&format!(
            "[clients]\ntotal_clients = 20\nper_round = 10\nattack = \"sign_flip\"\n\
             attackers_per_round = {attackers}\n[trainer]\noptimizer = \"sgd\"\n\
             [parameters.optimizer]\nlearning_rate = 0.01\n[algorithm]\n{algorithm}\n"
        ))
        .unwrap()
        .attack_warning()
    };
    // Krum's byzantine, ⌊0.2 · 10⌋ = 2 trimmed a side, the median's ⌈10/2⌉ − 1 = 4.
    for (algorithm, tolerated) in [
        ("type = \"krum\"\nbyzantine = 1", 1),
        ("type = \"multi_krum\"\nbyzantine = 2", 2),
        ("type = \"trimmed_mean\"\nbeta = 0.2", 2),
        ("type = \"median\"", 4),
    ] {
        assert_eq!(with(algorithm, tolerated), None, "{algorithm}");
        let warning = with(algorithm, tolerated + 1).expect(algorithm);
        assert!(
            warning.contains(&format!(
                "clients.attackers_per_round = {} is more than",
                tolerated + 1
            )) && warning.contains(&format!("updates ({tolerated})")),
            "{warning}"
        );
    }
    // The means claim no tolerance: nothing to warn against.
    assert_eq!(with("type = \"fedavg\"", 5), None);
}

#[test]
fn the_update_norm_bound_is_a_ratio_above_one() {
    for bad in ["1.0", "0.5", "nan", "inf", "-3.0"] {
        let error = error_of(&format!(
            "{MINIMAL}[server]\nmax_update_norm_ratio = {bad}\n"
        ));
        assert_eq!(
            error.key.as_deref(),
            Some("server.max_update_norm_ratio"),
            "{bad}"
        );
    }
    let loaded = load_text(&format!(
        "{MINIMAL}[server]\nmax_update_norm_ratio = 10.0\n"
    ))
    .unwrap();
    assert_eq!(loaded.config().server.max_update_norm_ratio, Some(10.0));
}

#[test]
fn an_own_data_token_file_needs_own_data_clients_and_changes_no_result() {
    let error = error_of(&MINIMAL.replace(
        "per_round = 2\n",
        "per_round = 2\nown_data_token_file = \"tokens\"\n",
    ));
    assert_eq!(error.key.as_deref(), Some("clients.own_data_token_file"));
    let network = MINIMAL.replace(
        "per_round = 2\n",
        "per_round = 2\ncomm_simulation = false\nown_data_clients = 2\n",
    );
    let with = load_text(&network.replace(
        "own_data_clients = 2\n",
        "own_data_clients = 2\nown_data_token_file = \"tokens\"\n",
    ))
    .unwrap();
    assert_eq!(
        with.result_hash(),
        load_text(&network).unwrap().result_hash()
    );
}

#[test]
fn classes_are_the_data_sets_and_leaf_sizes_are_not_known_before_loading() {
    let cifar = format!("{MINIMAL}[data]\ndatasource = \"CIFAR100\"\n");
    assert_eq!(
        load_text(&cifar)
            .unwrap()
            .config
            .parameters
            .model
            .num_classes,
        100
    );
    let error = error_of(&format!("{cifar}[parameters.model]\nnum_classes = 10\n"));
    assert_eq!(error.key.as_deref(), Some("parameters.model.num_classes"));
    assert!(
        error
            .message
            .contains("10 classes requested, but CIFAR100 has 100"),
        "{error}"
    );
    load_text(&format!("{cifar}[parameters.model]\nnum_classes = 100\n")).unwrap();
    // 10 × 60,000 exceeds CIFAR-10's 50,000 training images, not what
    // LEAF's scripts may have cut: that is checked once the files are read.
    let oversized = |source: &str, classes: usize| {
        format!(
            "{MINIMAL}[data]\ndatasource = \"{source}\"\npartition_size = 60000\n\
             [parameters.model]\nnum_classes = {classes}\n"
        )
    };
    let error = error_of(&oversized("CIFAR10", 10));
    assert_eq!(error.key.as_deref(), Some("data.partition_size"));
    load_text(&oversized("FEMNIST", 62)).unwrap();
}

#[test]
fn model_options_are_kept_as_read_for_the_model_registry_and_printed_back() {
    let text = format!(
        "{MINIMAL}[parameters.model]\nnum_classes = 10\nnorm = \"group\"\nhidden = [64, 32]\n"
    );
    let loaded = load_text(&text).unwrap();
    let model = &loaded.config.parameters.model;
    assert_eq!(model.num_classes, 10);
    assert_eq!(model.options.len(), 2, "{:?}", model.options);
    assert_eq!(model.options["norm"].as_str(), Some("group"));
    let printed = to_toml(&loaded.config).unwrap();
    let again = load_text(&printed).unwrap();
    assert_eq!(again.config.parameters.model, *model, "{printed}");
    // Options change what a run computes: they are part of its hash.
    let without = format!("{MINIMAL}[parameters.model]\nnum_classes = 10\n");
    assert_ne!(loaded.hash(), load_text(&without).unwrap().hash());
}

#[test]
fn a_model_option_can_be_set_on_the_command_line() {
    let loaded = load_text(MINIMAL).unwrap();
    let set: Override = "parameters.model.norm=group".parse().unwrap();
    let again = loaded.with_overrides(&[set]).unwrap();
    let options = &again.config.parameters.model.options;
    assert_eq!(options["norm"].as_str(), Some("group"), "{options:?}");
    assert!(loaded.config.parameters.model.options.is_empty());
}

#[test]
fn file_data_sets_need_a_train_file_and_their_keys_belong_to_them() {
    let with = |data: &str| format!("{MINIMAL}\n[data]\n{data}\n");
    let loaded = load_text(&with(
        "datasource = \"CSV\"\ntrain_file = \"t.csv\"\ntest_fraction = 0.2",
    ))
    .unwrap();
    assert_eq!(loaded.num_classes_set(), None, "the default");
    let set = load_text(&format!(
        "{}\n[parameters.model]\nnum_classes = 5\n",
        with("datasource = \"NPZ\"\ntrain_file = \"t.npz\"")
    ))
    .unwrap();
    assert_eq!(set.num_classes_set(), Some(5));

    let error = error_of(&with("datasource = \"CSV\""));
    assert_eq!(error.key.as_deref(), Some("data.datasource"));
    assert!(error.message.contains("data.train_file"), "{error}");
    let error = error_of(&with("datasource = \"MNIST\"\ntrain_file = \"t.csv\""));
    assert_eq!(error.key.as_deref(), Some("data.train_file"));
    assert!(
        error.message.contains("applies only to the file data sets"),
        "{error}"
    );
    let error = error_of(&with(
        "datasource = \"NPZ\"\ntrain_file = \"t.npz\"\nlabel_column = \"y\"",
    ));
    assert_eq!(error.key.as_deref(), Some("data.label_column"));
    for fraction in ["0.0", "1.0", "-0.5", "nan"] {
        let error = error_of(&with(&format!(
            "datasource = \"CSV\"\ntrain_file = \"t.csv\"\ntest_fraction = {fraction}"
        )));
        assert_eq!(
            error.key.as_deref(),
            Some("data.test_fraction"),
            "{fraction}"
        );
    }
    let error = error_of(&with(
        "datasource = \"CSV\"\ntrain_file = \"t.csv\"\ntest_file = \"u.csv\"\ntest_fraction = 0.5",
    ));
    assert!(error.message.contains("keep one"), "{error}");
    let error = error_of(&with(
        "datasource = \"CSV\"\ntrain_file = \"t.csv\"\nsplit_seed = 3",
    ));
    assert_eq!(error.key.as_deref(), Some("data.split_seed"));
    let error = error_of(&with(
        "datasource = \"CSV\"\ntrain_file = \"t.csv\"\nlabel_column = \"c\"\nclient_column = \"c\"",
    ));
    assert_eq!(error.key.as_deref(), Some("data.client_column"));
}

#[test]
fn config_md_documents_exactly_the_data_keys() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/CONFIG.md"))
            .unwrap();
    let table = doc
        .split("## `[data]`")
        .nth(1)
        .and_then(|rest| rest.split("\n### ").next())
        .expect("docs/CONFIG.md has a `[data]` section");
    let mut documented: Vec<&str> = table
        .lines()
        .filter_map(|line| line.strip_prefix("| `")?.split_once("` |"))
        .map(|(key, _)| key)
        .collect();
    documented.sort_unstable();
    let mut keys = introspect::fields_of::<Data>().to_vec();
    keys.sort_unstable();
    assert_eq!(documented, keys, "docs/CONFIG.md's [data] table and `Data`");
}

#[test]
fn config_md_documents_exactly_the_secure_aggregation_keys() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/CONFIG.md"))
            .unwrap();
    let table = doc
        .split("## `[secure_aggregation]`")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/CONFIG.md has a `[secure_aggregation]` section");
    let mut documented: Vec<&str> = table
        .lines()
        .filter_map(|line| line.strip_prefix("| `")?.split_once("` |"))
        .map(|(key, _)| key)
        .collect();
    documented.sort_unstable();
    let mut keys = introspect::fields_of::<SecureAggregation>().to_vec();
    keys.sort_unstable();
    assert_eq!(
        documented, keys,
        "docs/CONFIG.md's [secure_aggregation] table and `SecureAggregation`"
    );
}

const SECURE: &str = "\n[secure_aggregation]\nnum_shares = 3\nreconstruction_threshold = 2\n";

#[test]
fn secure_aggregation_loads_and_counts_in_the_result_hash() {
    let plain = load_text(MINIMAL).unwrap();
    assert_eq!(plain.config.secure_aggregation, None);
    let secure = load_text(&format!("{MINIMAL}{SECURE}")).unwrap();
    let section = secure.config.secure_aggregation.as_ref().unwrap();
    assert_eq!(section.num_shares, Some(ShareCount::Count(3)));
    assert_eq!(section.protocol, SecAggProtocol::SecAggPlus);
    assert_ne!(plain.result_hash(), secure.result_hash());
    // The timeout changes nothing computed.
    let waited = load_text(&format!("{MINIMAL}{SECURE}timeout = 5.0\n")).unwrap();
    assert_eq!(secure.result_hash(), waited.result_hash());
    // Written back and read again, the section is the same.
    let again = load_text(&to_toml(&secure.config).unwrap()).unwrap();
    assert_eq!(
        again.config.secure_aggregation,
        secure.config.secure_aggregation
    );
    let fractions = load_text(&format!(
        "{MINIMAL}\n[secure_aggregation]\nprotocol = \"secagg\"\nreconstruction_threshold = 1.0\n"
    ))
    .unwrap();
    assert_eq!(
        fractions
            .config
            .secure_aggregation
            .unwrap()
            .reconstruction_threshold,
        Some(ShareCount::Fraction(1.0))
    );
}

#[test]
fn secure_aggregation_errors_name_their_key() {
    let key_of = |extra: &str| error_of(&format!("{MINIMAL}{extra}")).key;
    let key = |k: &str| Some(k.to_owned());
    assert_eq!(
        key_of("\n[secure_aggregation]\nreconstruction_threshold = 2\n"),
        key("secure_aggregation.num_shares")
    );
    assert_eq!(
        key_of("\n[secure_aggregation]\nnum_shares = 3\nreconstruction_threshold = 1\n"),
        key("secure_aggregation.reconstruction_threshold")
    );
    assert_eq!(
        key_of(&format!("{SECURE}protocol = \"secaggplus2\"\n")),
        key("secure_aggregation.protocol")
    );
    assert_eq!(
        key_of(&format!("{SECURE}num_share = 3\n")),
        key("secure_aggregation.num_share")
    );
    assert_eq!(
        key_of(&format!("{SECURE}modulus_range = 1000\n")),
        key("secure_aggregation.modulus_range")
    );
    assert_eq!(
        key_of(&format!("{SECURE}timeout = -1.0\n")),
        key("secure_aggregation.timeout")
    );
    assert_eq!(
        key_of(&format!("{SECURE}simulated_dropout = 1.0\n")),
        key("secure_aggregation.simulated_dropout")
    );
    // A fraction above 1 is refused as read (and then missing: two errors).
    let errors = load_text(&format!(
        "{MINIMAL}\n[secure_aggregation]\nnum_shares = 1.5\nreconstruction_threshold = 2\n"
    ))
    .unwrap_err();
    assert!(
        errors
            .errors()
            .iter()
            .all(|e| e.key == key("secure_aggregation.num_shares"))
            && errors.to_string().contains("not a fraction in (0, 1]"),
        "{errors}"
    );
    let unknown = error_of(&format!("{MINIMAL}{SECURE}num_share = 3\n"));
    assert!(
        unknown.message.contains("did you mean `num_shares`"),
        "{}",
        unknown.message
    );
}

const NOISY: &str =
    "noise = \"distributed_discrete_gaussian\"\nclip_norm = 1.0\nnoise_multiplier = 1.1\n";

#[test]
fn noise_loads_and_its_default_stays_out_of_the_result_hash() {
    let secure = load_text(&format!("{MINIMAL}{SECURE}")).unwrap();
    let section = secure.config.secure_aggregation.as_ref().unwrap();
    assert_eq!(section.noise, SecAggNoise::None);
    assert_eq!(section.ddg_params(10), Ok(None));
    let explicit = load_text(&format!("{MINIMAL}{SECURE}noise = \"none\"\n")).unwrap();
    assert_eq!(secure.result_hash(), explicit.result_hash());
    assert!(!to_toml(&secure.config).unwrap().contains("noise"));
    let noisy = load_text(&format!("{MINIMAL}{SECURE}{NOISY}")).unwrap();
    assert_ne!(secure.result_hash(), noisy.result_hash());
    let section = noisy.config.secure_aggregation.as_ref().unwrap();
    let per_round = noisy.config.clients.per_round as usize;
    let params = section.ddg_params(per_round).unwrap().unwrap();
    assert_eq!(
        (params.clip_norm, params.noise_multiplier, params.delta),
        (1.0, 1.1, 1e-5)
    );
    assert_eq!(params.expected_clients, per_round);
    let again = load_text(&to_toml(&noisy.config).unwrap()).unwrap();
    assert_eq!(
        again.config.secure_aggregation,
        noisy.config.secure_aggregation
    );
}

#[test]
fn noise_errors_name_their_key_value_and_expectation() {
    let error = |extra: &str| error_of(&format!("{MINIMAL}{SECURE}{extra}"));
    let key = |k: &str| Some(format!("secure_aggregation.{k}"));
    let cases = [
        (
            "noise = \"laplace\"\n",
            "noise",
            "distributed_discrete_gaussian",
        ),
        ("clip_norm = 1.0\n", "clip_norm", "is for noise"),
        ("delta = 1e-6\n", "delta", "is for noise"),
        (
            "noise = \"distributed_discrete_gaussian\"\nnoise_multiplier = 1.0\n",
            "clip_norm",
            "is required",
        ),
        (
            "noise = \"distributed_discrete_gaussian\"\nclip_norm = 1.0\n",
            "noise_multiplier",
            "is required",
        ),
        (
            &format!("{NOISY}granularity = -0.5\n"),
            "granularity",
            "is -0.5; expected a finite number above 0",
        ),
        (
            &format!("{NOISY}delta = 1.0\n"),
            "delta",
            "is 1; expected a number in (0, 1)",
        ),
    ];
    for (extra, name, words) in cases {
        let e = error(extra);
        assert_eq!(e.key, key(name), "{extra}: {}", e.message);
        assert!(e.message.contains(words), "{extra}: {}", e.message);
    }
    // 4 clients at 4 standard deviations need modulus² > 64.
    let small = SecureAggregation {
        modulus_range: 8,
        ..load_text(&format!("{MINIMAL}{SECURE}{NOISY}"))
            .unwrap()
            .config
            .secure_aggregation
            .unwrap()
    };
    let e = small.ddg_params(4).unwrap_err();
    assert_eq!(e.key, "modulus_range");
    assert!(
        e.message
            .contains("modulus_range 8 cannot hold the sum of 4 clients"),
        "{}",
        e.message
    );
    let bad_clip =
        "noise = \"distributed_discrete_gaussian\"\nclip_norm = 0.0\nnoise_multiplier = 1.0\n";
    let e = error(bad_clip);
    assert_eq!(e.key, key("clip_norm"));
    assert!(
        e.message.contains("is 0; expected a finite number above 0"),
        "{}",
        e.message
    );
    let zero =
        "noise = \"distributed_discrete_gaussian\"\nclip_norm = 1.0\nnoise_multiplier = 0.0\n";
    let e = error(zero);
    assert_eq!(e.key, key("noise_multiplier"));
    assert!(
        e.message.contains("is 0; expected a finite number above 0"),
        "{}",
        e.message
    );
}

#[test]
fn secure_aggregation_refuses_what_needs_each_update() {
    let refused = |extra: &str| error_of(&format!("{MINIMAL}{SECURE}{extra}"));
    let strategy = error_of(&format!(
        "{MINIMAL}{SECURE}\n[algorithm]\ntype = \"median\"\n"
    ));
    assert_eq!(strategy.key.as_deref(), Some("algorithm.type"));
    assert!(
        strategy
            .message
            .contains("`median` cannot run with [secure_aggregation]")
            && strategy.message.contains("fedavg"),
        "{}",
        strategy.message
    );
    for (extra, key) in [
        (
            "\n[results]\nkeep_client_updates = true\n",
            "results.keep_client_updates",
        ),
        (
            "\n[server]\nmax_update_norm_ratio = 3.0\n",
            "server.max_update_norm_ratio",
        ),
    ] {
        assert_eq!(refused(extra).key.as_deref(), Some(key), "{extra}");
    }
    // Network mode runs the protocol over the client processes; a draw of
    // vanishing clients is simulation's alone.
    let network = |extra: &str| {
        format!(
            "{}{SECURE}{extra}",
            MINIMAL.replace(
                "per_round = 2\n",
                "per_round = 2\ncomm_simulation = false\n"
            )
        )
    };
    load_text(&network("")).unwrap();
    let dropout = error_of(&network("simulated_dropout = 0.25\n"));
    assert_eq!(
        dropout.key.as_deref(),
        Some("secure_aggregation.simulated_dropout")
    );
    // The server holds no update for a simulated attacker to replace.
    let attack = error_of(&network("").replace(
        "comm_simulation = false\n",
        "comm_simulation = false\nattack = \"scale\"\nattackers_per_round = 1\n",
    ));
    assert_eq!(attack.key.as_deref(), Some("clients.attack"));
    for accepted in [
        "fedavg",
        "fedprox",
        "fedavgm",
        "fedadam",
        "fedyogi",
        "fedadagrad",
    ] {
        let text = format!("{MINIMAL}{SECURE}\n[algorithm]\ntype = \"{accepted}\"\n");
        assert!(
            load_text(&text).is_ok(),
            "{accepted}: {:?}",
            load_text(&text).err()
        );
    }
}

#[test]
fn a_device_profile_and_availability_load() {
    let text = format!(
        "{MINIMAL}\n[clients.profile]\ncompute = {{ distribution = \"lognormal\", median = 0.01, \
         sigma = 1 }}\nuplink_mbps = 5\nseed = 3\n\n[clients.availability]\nmodel = \
         \"on_off\"\nmean_online = 600\nmean_offline = 300\n"
    );
    let loaded = load_text(&text).unwrap();
    let profile = &loaded.config.clients.profile;
    assert!(profile.enabled());
    assert_eq!(
        profile.compute,
        Some(crate::devices::Distribution::Lognormal {
            median: 0.01,
            sigma: 1.0
        })
    );
    assert_eq!(
        profile.uplink_mbps,
        Some(crate::devices::Distribution::Constant { value: 5.0 })
    );
    // The profile changes results: it is in the hash, and config.toml
    // writes it back as it was read.
    assert!(loaded.result_fields().contains_key("clients.profile.seed"));
    let written = to_toml(&loaded.config).unwrap();
    let again = load_text(&written).unwrap();
    assert_eq!(again.config.clients, loaded.config.clients);
    // Unset, the new keys stay out of the hash: older runs still resume.
    let plain = load_text(MINIMAL).unwrap().result_fields();
    let new_keys = [
        "clients.profile",
        "clients.availability",
        "clients.over_selection",
        "server.synchronous",
        "server.minimum_clients_aggregated",
        "server.staleness_bound",
        "server.round_deadline",
    ];
    assert!(
        !plain
            .keys()
            .any(|k| new_keys.iter().any(|n| k.starts_with(n))),
        "{plain:?}"
    );
}

#[test]
fn device_problems_name_their_key() {
    let profile = |body: &str| format!("{MINIMAL}\n[clients.profile]\n{body}\n");
    let cases = [
        (
            profile("compute = -1"),
            "clients.profile.compute",
            "`value` must be",
        ),
        (
            profile("compute = { distribution = \"lognorml\", median = 1, sigma = 1 }"),
            "clients.profile.compute",
            "unknown value `lognorml` (did you mean `lognormal`?)",
        ),
        (
            profile("uplink_mbps = 5"),
            "clients.profile.uplink_mbps",
            "needs clients.profile.compute",
        ),
        (
            format!("{MINIMAL}\n[clients.availability]\nmodel = \"on_off\"\n"),
            "clients.availability.model",
            "needs a [clients.profile]",
        ),
        (
            format!(
                "{}\n[clients.profile]\ncompute = 0.01\n",
                MINIMAL.replace("per_round = 2", "per_round = 2\nuplink_mbps = 3")
            ),
            "clients.uplink_mbps",
            "write clients.profile.uplink_mbps instead",
        ),
        (
            format!(
                "{}\n[clients.profile]\ncompute = 0.01\n[clients.availability]\nmodel = \"trace\"\n",
                MINIMAL
            ),
            "clients.availability.trace_file",
            "needs a trace_file",
        ),
    ];
    for (text, key, message) in cases {
        let error = error_of(&text);
        assert_eq!(error.key.as_deref(), Some(key), "{error}");
        assert!(error.message.contains(message), "{error}");
    }
}

#[test]
fn the_asynchronous_server_loads_and_refuses_what_it_cannot_run() {
    let text = format!(
        "{MINIMAL}\n[server]\nsynchronous = false\nminimum_clients_aggregated = 2\n\
         staleness_bound = 3\n\n[clients.profile]\ncompute = 0.01\n"
    );
    let loaded = load_text(&text).unwrap();
    assert!(!loaded.config.server.synchronous);
    assert_eq!(loaded.config.server.staleness_bound, Some(3));
    // Without a profile there is no clock to order the updates by.
    let unprofiled = text.replace("[clients.profile]\ncompute = 0.01\n", "");
    let error = error_of(&unprofiled);
    assert_eq!(error.key.as_deref(), Some("clients.profile.compute"));
    assert!(error.message.contains("simulated clock"), "{error}");
    // In network mode the updates' real order is the clock: no profile, and
    // one would be refused as simulated.
    let network = unprofiled.replace("per_round = 2", "per_round = 2\ncomm_simulation = false");
    let loaded = load_text(&network).unwrap();
    assert!(!loaded.config.server.synchronous && !loaded.config.clients.comm_simulation);
    let profiled = text.replace("per_round = 2", "per_round = 2\ncomm_simulation = false");
    assert_eq!(
        error_of(&profiled).key.as_deref(),
        Some("clients.comm_simulation")
    );
    // K above the clients in flight could never aggregate.
    let error = error_of(&text.replace(
        "minimum_clients_aggregated = 2",
        "minimum_clients_aggregated = 3",
    ));
    assert_eq!(
        error.key.as_deref(),
        Some("server.minimum_clients_aggregated")
    );
    // A strategy that cannot take stale updates says why.
    let scaffold = format!("{text}\n[algorithm]\ntype = \"scaffold\"\n");
    let errors = load_text(&scaffold).unwrap_err();
    let refusal = errors
        .errors()
        .iter()
        .find(|e| e.key.as_deref() == Some("algorithm.type"))
        .expect("scaffold is refused");
    assert!(refusal.message.contains("control variates"), "{refusal}");
    let median = format!("{text}\n[algorithm]\ntype = \"median\"\n");
    assert_eq!(error_of(&median).key.as_deref(), Some("algorithm.type"));
    // Keys of the asynchronous server in a synchronous run do nothing.
    let stray = format!("{MINIMAL}\n[server]\nstaleness_bound = 3\n");
    assert_eq!(
        error_of(&stray).key.as_deref(),
        Some("server.staleness_bound")
    );
    let fedbuff = format!("{text}\n[algorithm]\ntype = \"fedbuff\"\nserver_learning_rate = 2\n");
    assert!(load_text(&fedbuff).is_ok());
    // Keeping no checkpoint would leave --resume nothing.
    let none_kept = format!("{MINIMAL}\n[server]\ncheckpoints_kept = 0\n");
    let error = error_of(&none_kept);
    assert_eq!(error.key.as_deref(), Some("server.checkpoints_kept"));
    assert!(error.message.contains("--resume"), "{error}");
    // The asynchronous server takes updates one by one: there is no round
    // whose updates could be masked together, so it would see them all.
    let secure = format!("{text}\n[secure_aggregation]\nprotocol = \"secaggplus\"\n");
    let errors = load_text(&secure).unwrap_err();
    let refusal = errors
        .errors()
        .iter()
        .find(|e| e.key.as_deref() == Some("secure_aggregation"))
        .expect("secure aggregation is refused with the asynchronous server");
    assert!(refusal.message.contains("in the clear"), "{refusal}");
}

#[test]
fn client_selection_loads_and_refuses_what_it_cannot_do() {
    let with = |clients: &str, rest: &str| {
        format!(
            "{}\n{rest}\n",
            MINIMAL.replace("per_round = 2", &format!("per_round = 2\n{clients}"))
        )
    };
    let oort = with(
        "selection = \"oort\"",
        "[clients.oort]\nround_penalty = 1.5\nblacklist_rounds = 10",
    );
    let loaded = load_text(&oort).unwrap();
    let clients = &loaded.config.clients;
    assert_eq!(clients.selection, crate::selection::SelectionKind::Oort);
    assert_eq!(clients.oort.round_penalty, 1.5);
    assert_eq!(clients.oort.blacklist_rounds, Some(10));
    assert_eq!(clients.oort.exploration_factor, 0.9);
    // Set, it changes results; config.toml gives it back as it was read.
    let fields = loaded.result_fields();
    assert_eq!(fields["clients.selection"], "\"oort\"");
    assert!(fields.contains_key("clients.oort.round_penalty"));
    let again = load_text(&to_toml(&loaded.config).unwrap()).unwrap();
    assert_eq!(again.config.clients, loaded.config.clients);
    // Unset, none of its keys is in the hash: older runs still resume.
    let plain = load_text(MINIMAL).unwrap().result_fields();
    assert!(
        !plain.keys().any(|k| k.starts_with("clients.selection")
            || k.starts_with("clients.oort")
            || k.starts_with("clients.power_of_choice")),
        "{plain:?}"
    );
    let power = with(
        "selection = \"power_of_choice\"",
        "[clients.power_of_choice]\ncandidates = 4",
    );
    assert_eq!(
        load_text(&power)
            .unwrap()
            .config
            .clients
            .power_of_choice
            .candidates,
        Some(4)
    );
    // `loss` counts only when set; unset, each run takes what it can do.
    let pow = load_text(&power).unwrap();
    assert!(
        !pow.result_fields()
            .contains_key("clients.power_of_choice.loss")
    );
    let options = pow.config.clients.power_of_choice;
    let possible = super::candidate_evaluation_refusal(&pow.config).is_none();
    assert!(possible);
    assert_eq!(
        options.loss_of(possible),
        crate::selection::PowerOfChoiceLoss::Evaluated
    );
    let asynchronous = format!("{power}\n[server]\nsynchronous = false\n")
        .replace("per_round = 2", "per_round = 2\ncomm_simulation = false");
    let asynchronous = load_text(&asynchronous).unwrap();
    assert!(super::candidate_evaluation_refusal(&asynchronous.config).is_some());
    let rpow = with(
        "selection = \"power_of_choice\"",
        "[clients.power_of_choice]\nloss = \"last_reported\"",
    );
    let rpow = load_text(&rpow).unwrap();
    assert_eq!(
        rpow.result_fields()["clients.power_of_choice.loss"],
        "\"last_reported\""
    );

    let cases = [
        (
            with("selection = \"random\"", "[clients.oort]\npacer_step = 5"),
            "clients.oort",
            "is for clients.selection = \"oort\"",
        ),
        (
            with(
                "selection = \"power_of_choice\"",
                "[clients.power_of_choice]\ncandidates = 11",
            ),
            "clients.power_of_choice.candidates",
            "between clients.per_round = 2 and clients.total_clients = 10, got 11",
        ),
        (
            with("selection = \"oort\"", "[clients.oort]\ncut_off_util = 0"),
            "clients.oort.cut_off_util",
            "must be in (0, 1], got 0",
        ),
        (
            with(
                "selection = \"oort\"\nown_data_clients = 1\ncomm_simulation = false",
                "",
            ),
            "clients.selection",
            "own-data client",
        ),
        (
            with(
                "selection = \"power_of_choice\"\ncomm_simulation = false",
                "[clients.power_of_choice]\nloss = \"evaluated\"\n[server]\nsynchronous = false",
            ),
            "clients.power_of_choice.loss",
            "\"evaluated\" cannot run here: an asynchronous run (server.synchronous = false)",
        ),
        (
            with(
                "selection = \"power_of_choice\"\ncomm_simulation = false",
                "[clients.power_of_choice]\nloss = \"evaluated\"",
            ),
            "clients.power_of_choice.loss",
            "network clients (clients.comm_simulation = false)",
        ),
        (
            with(
                "selection = \"power_of_choice\"",
                "[clients.power_of_choice]\nloss = \"evaluate\"",
            ),
            "clients.power_of_choice.loss",
            "evaluated",
        ),
    ];
    for (text, key, message) in cases {
        let error = error_of(&text);
        assert_eq!(error.key.as_deref(), Some(key), "{error}");
        assert!(error.message.contains(message), "{error}");
    }
    let unknown = load_text(&with("selection = \"ort\"", "")).unwrap_err();
    assert!(unknown.to_string().contains("oort"), "{unknown}");
}

#[test]
fn strata_load_count_in_the_hash_only_when_set_and_refuse_what_they_cannot_split() {
    let with = |extra: &str, tail: &str| {
        format!(
            "{}\n{tail}\n",
            MINIMAL.replace("per_round = 2", &format!("per_round = 2\n{extra}"))
        )
    };
    let loaded = load_text(&with("strata = 2", "")).unwrap();
    assert_eq!(loaded.config.clients.strata, 2);
    assert!(loaded.result_fields().contains_key("clients.strata"));
    assert!(
        !load_text(MINIMAL)
            .unwrap()
            .result_fields()
            .contains_key("clients.strata")
    );
    let written = to_toml(&loaded.config).unwrap();
    assert_eq!(load_text(&written).unwrap().config.clients.strata, 2);
    let asynchronous = "[server]\nsynchronous = false\nminimum_clients_aggregated = 2\n\
                        staleness_bound = 3\n\n[clients.profile]\ncompute = 0.01\n";
    let cases = [
        (with("strata = 0", ""), "must be at least 1, got 0"),
        (
            with("strata = 3", ""),
            "at most the clients drawn per round (2)",
        ),
        (
            with("strata = 2\nselection = \"oort\"", ""),
            "this run selects by \"oort\"",
        ),
        (
            with("strata = 2", asynchronous),
            "is for synchronous rounds",
        ),
        (
            with(
                "strata = 2",
                "[algorithm]\ntype = \"dp_fedavg\"\nclip_norm = 1.0\nnoise_multiplier = 1.0\n",
            ),
            "a uniform sample",
        ),
    ];
    for (text, message) in cases {
        let error = error_of(&text);
        assert_eq!(error.key.as_deref(), Some("clients.strata"), "{error}");
        assert!(error.message.contains(message), "{error}");
    }
}
