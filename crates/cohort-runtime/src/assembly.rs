//! Everything a run needs, built from a validated config before the first
//! round, in one place (the spirit of ripgrep's `HiArgs`: build first, then
//! run): the run folder, the device, the data and its partitions, the
//! evaluator, the strategy, the start point (fresh or resumed), the
//! transport (worker threads, gRPC with its client processes, or ranks), the
//! loop's settings and the recorder.
//!
//! Each part a caller gave the [`crate::RunBuilder`] is used as given instead
//! of being built. The round loop ([`crate::round_loop`]) then runs on the
//! parts alone.

use anyhow::{Context, bail};

use cohort_core::checkpoint;
use cohort_core::config::LoadedConfig;
use cohort_core::data::Splits;
use cohort_core::fsutil::atomic_write;
use cohort_core::hooks::{NoHooks, ServerHooks};
use cohort_core::strategy::Strategy;
use cohort_core::tree::ParamTree;
use cohort_train::device::{self, Selected};
use cohort_train::init::seeded_parameters;
use cohort_train::trainer::ModelEvaluator;

use crate::children::ChildClients;
use crate::client::{ClientPartitions, LoadedData, load_data_for};
use crate::events::{RunEvent, RunFacts, RunObserver};
use crate::ranks::{DistributedRun, RankLink, join_ranks, partial_reduce};
use crate::record::{MODEL_FILE, RunFolder, SimulatedWallTime};
use crate::round_loop::{
    AsyncSettings, ClientFacts, LoopParts, LoopSettings, RankRole, RoundLoop, SecureSettings,
    Selection, SimDevices, SimulatedAttack,
};
use crate::run::{Parts, RunOptions, RunSummary, toml_text};
use crate::start::{ResumeChecks, StartPoint, fresh_start, resume_point};
use crate::transport::Transport;
use crate::updates::{OwnDataRules, expected_reports};

/// Builds the parts the caller left out, then runs the loop over them.
///
/// Longer than most functions here on purpose: it is the list of the parts
/// in the order they depend on each other (run folder, device, data and
/// model, evaluator, start point, transport, ranks, recorder), each taken
/// from the caller or built in a few lines, so that one screen shows the
/// whole assembly, as ripgrep's `HiArgs::from_low_args` does.
pub(crate) fn build_and_run(
    loaded: &LoadedConfig,
    options: &RunOptions,
    parts: Parts<'_>,
) -> anyhow::Result<RunSummary> {
    let mut observer = parts.observer;
    let mut no_hooks = NoHooks;
    let hooks: &mut dyn ServerHooks = parts.hooks.unwrap_or(&mut no_hooks);
    let mut strategy = match parts.strategy {
        Some(strategy) => strategy,
        None => options.registry.strategy_of(loaded)?,
    };
    if options.distributed.is_none() {
        // A rank other than 0 has no run folder, and ranks must agree: a
        // distributed run keeps per-client state in memory.
        strategy.keep_client_state(
            &options.run_dir.join("client_state"),
            loaded.config().server.client_state_memory_bytes,
        );
    }
    let leader = options
        .distributed
        .as_ref()
        .is_none_or(DistributedRun::leader);
    if leader {
        prepare_run_dir(loaded, options)?;
    }
    // Kernels tuned and compiled for this configuration only: a cache
    // shared with runs of other shapes gave wrong results (cubecl 0.11.3).
    device::key_kernel_cache(&loaded.result_hash());
    let selected = device::select(options.device)?;
    tracing::info!(device = selected.name, "compute device");
    let external = parts.external_clients;
    let (data, model) = match external {
        true => (external_data(loaded), None),
        false => {
            let (data, model) = data_and_model(loaded, options, parts.data)?;
            (data, Some(model))
        }
    };
    let config = loaded.config();
    let evaluator = match (parts.evaluator, &model) {
        (Some(evaluator), _) => evaluator,
        (None, Some(model)) => {
            let plain = model
                .evaluator(&selected.device, config.trainer.eval_batch_size)
                .with_context(|| format!("model `{}`", model.name()))?;
            crate::transports::evaluator_for(loaded, model, options, &selected, plain)?
        }
        (None, None) => bail!("a run of external clients needs the caller's evaluator"),
    };
    tracing::info!(strategy = strategy.name(), "strategy");
    if let Some(warning) = loaded.attack_warning() {
        tracing::warn!("{warning}");
    }
    let start = start_point(
        loaded,
        options,
        strategy.as_mut(),
        parts.initial_model,
        evaluator.as_ref(),
    )?;
    let facts = run_facts(loaded, options, strategy.name(), &selected, &data);
    observer.on_event(&RunEvent::RunStarted(RunFacts {
        resumed_at: options.resume.then_some(start.first_round),
        first_round: start.first_round,
        leader,
        data: match external {
            true => "the clients' own, in the caller's code".to_owned(),
            false => facts.data.clone(),
        },
        ..facts
    }));
    let rows_per_sample = model
        .as_ref()
        .map(|m| {
            m.rows_per_sample()
                .map_err(|error| anyhow::anyhow!("`{}` {error}", m.name()))
        })
        .transpose()?
        .map_or(1, |rows| rows as u64);
    let classes = model.as_ref().map_or(0, |m| m.spec.classes);
    let clients = ClientFacts {
        self_reported: external.then_some(config.clients.max_samples),
        ..client_facts(loaded, &data, rows_per_sample, classes)
    };
    let own_workers = parts.transport.is_none() && !external;
    let (train, test, partitions) = data.into_local();
    let (test, test_batches) = test_share(test, evaluator.as_ref(), options.distributed.as_ref())?;
    let (transport, child_clients) = match (parts.transport, &model) {
        (Some(transport), _) => (transport, None),
        (None, Some(model)) => crate::transports::start_transport(
            loaded,
            model,
            options,
            &selected,
            train,
            partitions,
            &mut observer,
        )?,
        (None, None) => bail!("a run of external clients needs the caller's transport"),
    };
    let (transport, ranks) = rank_role(loaded, options, strategy.as_ref(), hooks, transport)?;
    let ranks = ranks.map(|role| RankRole {
        test_batches,
        ..role
    });
    let mut settings = LoopSettings {
        secure: secure_settings(loaded, options, strategy.as_ref(), hooks, &clients)?,
        ..loop_settings(loaded, options, rows_per_sample)
    };
    settings.selection.policy.power_of_choice.loss =
        Some(candidate_loss(loaded, external, own_workers)?);
    settings.evaluation_threads = evaluation_threads(loaded, options, &selected);
    let parts = LoopParts {
        settings,
        strategy,
        transport,
        hooks,
        observer: &mut observer,
        evaluator,
        recorder: parts
            .recorder
            .unwrap_or_else(|| Box::new(RunFolder::for_config(options.run_dir.clone(), config))),
        test,
        clients,
        ranks,
        devices: sim_devices(loaded)?,
    };
    let (rounds, reached_target) = run_loop(parts, start, child_clients)?;
    if leader && rounds.is_empty() {
        bail!("no round ran");
    }
    Ok(RunSummary {
        rounds,
        run_dir: options.run_dir.clone(),
        model_path: options.run_dir.join(MODEL_FILE),
        reached_target,
    })
}

/// The data (the caller's, checked as a loader's would be, or the
/// config's) and the model the run trains on it.
fn data_and_model(
    loaded: &LoadedConfig,
    options: &RunOptions,
    given: Option<(Splits, ClientPartitions)>,
) -> anyhow::Result<(LoadedData, cohort_train::registry::RunModel)> {
    let total_clients = loaded.config().clients.total_clients;
    let was_given = given.is_some();
    // A rank trains only its block's clients, so it reads only their samples.
    // A network-mode server trains none (its clients read their own), so it
    // reads only the labels: what it must know of every client comes from
    // them, and its memory then does not grow with the training images.
    let block = match &options.distributed {
        Some(distributed) => Some(distributed.clients.first..=distributed.clients.last),
        #[allow(clippy::reversed_empty_ranges)]
        None if !loaded.config().clients.comm_simulation => Some(1..=0),
        None => None,
    };
    let data = match given {
        Some((splits, partitions)) => LoadedData {
            splits,
            partitions,
            held: None,
        },
        None => load_data_for(
            loaded,
            &options.registry,
            options.data_root.as_deref(),
            block,
        )?,
    };
    let model = options.registry.run_model_in(
        loaded,
        options.data_root.as_deref(),
        data.splits.train.sample_shape.clone(),
    )?;
    if was_given {
        check_given_data(&data.splits, &data.partitions, &model, total_clients)
            .context("the data given to RunBuilder::data")?;
    }
    Ok((data, model))
}

/// No data and no model for clients that bring their own
/// (`RunBuilder::external_clients`): empty splits, and an empty partition
/// for each client, so the server's facts about them are none.
fn external_data(loaded: &LoadedConfig) -> LoadedData {
    let none = cohort_core::data::Dataset {
        inputs: Vec::new(),
        labels: Vec::new(),
        sample_shape: Vec::new(),
    };
    let splits = Splits {
        train: none.clone(),
        test: none,
        train_users: None,
    };
    let clients = loaded.config().clients.total_clients as usize;
    let partitions = ClientPartitions {
        train: vec![Vec::new(); clients],
        test: vec![Vec::new(); clients],
    };
    LoadedData {
        splits,
        partitions,
        held: None,
    }
}

/// Runs the loop over its parts; its rows and whether it reached the
/// target. However it ends, the transport goes before the client processes
/// it serves: closing the streams lets them exit.
fn run_loop(
    parts: LoopParts<'_>,
    start: StartPoint,
    child_clients: Option<ChildClients>,
) -> anyhow::Result<(Vec<cohort_core::results::RoundRow>, bool)> {
    let mut round_loop = RoundLoop::new(parts, start)?;
    let reached_target = round_loop.run();
    let (transport, rounds) = round_loop.finish();
    drop(transport);
    drop(child_clients);
    Ok((rounds, reached_target?))
}

/// Creates the run folder and writes into it the config the run uses:
/// every key with its value, defaults filled in, and the data folder it
/// reads (`RunOptions::data_root` where one was given), so that `--resume`
/// needs nothing else and a reader sees every setting. A resumed run
/// rewrites config.toml too, since it may have changed keys that do not
/// change results (the number of rounds, ports, paths), and a later --resume
/// must see them. A config with a token is a secret: only its owner may read
/// it.
fn prepare_run_dir(loaded: &LoadedConfig, options: &RunOptions) -> anyhow::Result<()> {
    std::fs::create_dir_all(&options.run_dir)
        .with_context(|| format!("cannot create the run folder {}", options.run_dir.display()))?;
    let write = if loaded.config().server.auth_token.is_some() {
        cohort_core::fsutil::atomic_write_private
    } else {
        atomic_write
    };
    write(
        &options.run_dir.join("config.toml"),
        resolved_config(loaded, options)?.as_bytes(),
    )
    .context("cannot write config.toml into the run folder")
}

/// The run's config as it runs, in TOML.
fn resolved_config(loaded: &LoadedConfig, options: &RunOptions) -> anyhow::Result<String> {
    let text = cohort_core::config::to_toml(loaded.config())
        .context("cannot write the run's config as TOML")?;
    let mut table: toml::Table = text
        .parse()
        .context("the run's config does not read back as TOML")?;
    // The device files, relative to the config that named them, are read
    // from where they are: config.toml sits in another folder.
    for (section, key, path) in [
        ("profile", "file", loaded.profile_file()),
        ("availability", "trace_file", loaded.trace_file()),
    ] {
        let Some(path) = path else { continue };
        let path = std::fs::canonicalize(&path).unwrap_or(path);
        if let Some(toml::Value::Table(clients)) = table.get_mut("clients")
            && let Some(toml::Value::Table(part)) = clients.get_mut(section)
        {
            part.insert(
                key.to_owned(),
                toml::Value::String(path.display().to_string()),
            );
        }
    }
    if let Some(root) = &options.data_root {
        let root = std::fs::canonicalize(root).unwrap_or_else(|_| root.clone());
        if let Some(toml::Value::Table(data)) = table.get_mut("data") {
            let path = root.display().to_string();
            data.insert("data_path".to_owned(), toml::Value::String(path));
        }
    }
    Ok(format!(
        "# The config this run uses, every default filled in; `cohort run --resume` reads it.\n{}",
        toml_text(&table)
    ))
}

/// The newest checkpoint with `--resume`, else round 1 from the caller's
/// initial model or the seeded one.
fn start_point(
    loaded: &LoadedConfig,
    options: &RunOptions,
    strategy: &mut dyn Strategy,
    initial_model: Option<ParamTree>,
    evaluator: &dyn ModelEvaluator,
) -> anyhow::Result<StartPoint> {
    let run_dir = &options.run_dir;
    if options.resume && checkpoint::any_written(run_dir)? {
        let config = loaded.config();
        let checks = ResumeChecks {
            config_hash: &loaded.result_hash(),
            reference: &evaluator.parameters(),
            selection: selection(config),
        };
        return resume_point(&checks, run_dir, strategy);
    }
    // Starting over would release the rounds already published again, with
    // fresh noise: together the two releases leak what the noise hid.
    if options.resume && strategy.name() == "dp_fedavg" && run_dir.join(MODEL_FILE).exists() {
        bail!(
            "{} released models but wrote no checkpoint; dp_fedavg cannot start it over \
             without releasing those rounds twice with fresh noise. Start a new run",
            run_dir.display()
        );
    }
    if options.resume {
        // Killed before its first checkpoint: nothing of it is kept, so
        // starting over is exactly what an uninterrupted run does.
        tracing::info!("no checkpoint yet: the run starts over from round 1");
    }
    let config = loaded.config();
    let from_file = || -> anyhow::Result<Option<(ParamTree, String)>> {
        let Some(path) = &config.trainer.initial_model else {
            return Ok(None);
        };
        let tree = read_model_file(path, loaded.decode_limits())?;
        Ok(Some((
            tree,
            format!("trainer.initial_model = {}", path.display()),
        )))
    };
    let given = match initial_model {
        Some(model) => Some((model, "the initial model".to_owned())),
        None => from_file()?,
    };
    let initial = match given {
        Some((model, what)) => {
            cohort_core::tree::check_schema(
                &evaluator.parameters(),
                &model,
                cohort_core::tree::DTypeRule::Exact,
            )
            .map_err(|mismatch| {
                anyhow::anyhow!(
                    "{what}: does not fit model `{}`: {mismatch}",
                    config.trainer.model_name
                )
            })?;
            model
        }
        None => match config.trainer.model_seed {
            Some(seed) => seeded_parameters(&evaluator.parameters(), seed),
            None => evaluator.parameters(),
        },
    };
    Ok(fresh_start(initial, config.server.random_seed))
}

/// A model file in PyTorch's layout, as a tree of the model's parameters
/// (BatchNorm's counters, which the file carries, set aside). The file is
/// untrusted: a regular file, no larger than a payload may be.
fn read_model_file(
    path: &std::path::Path,
    limits: cohort_core::codec::DecodeLimits,
) -> anyhow::Result<ParamTree> {
    let context = || format!("trainer.initial_model = {}", path.display());
    let bytes =
        cohort_core::fsutil::read_bounded(path, limits.max_bytes as u64).with_context(context)?;
    let tree = cohort_core::codec::decode(&bytes, &limits).with_context(context)?;
    Ok(cohort_core::layout::from_model_file(tree))
}

/// What a loader would have checked of data a caller gives instead: both
/// splits whole and of one sample shape, what the task needs of them, and
/// one partition per client, each indexing the training split.
fn check_given_data(
    splits: &Splits,
    partitions: &ClientPartitions,
    model: &cohort_train::registry::RunModel,
    total_clients: u32,
) -> anyhow::Result<()> {
    for (name, split) in [("training", &splits.train), ("test", &splits.test)] {
        split.check().with_context(|| format!("the {name} split"))?;
        if split.sample_shape != model.spec.sample_shape {
            bail!(
                "the {name} split's samples are {:?}, the training split's {:?}",
                split.sample_shape,
                model.spec.sample_shape
            );
        }
        if let Err(problem) = model.task.check(split, model.spec.classes) {
            bail!("the {name} split, for {}: {problem}", model.task.name());
        }
    }
    let clients = total_clients as usize;
    if partitions.train.len() != clients || partitions.test.len() != clients {
        bail!(
            "{} training and {} held-out partitions, but clients.total_clients = {clients}",
            partitions.train.len(),
            partitions.test.len()
        );
    }
    let samples = splits.train.len();
    let lists = partitions.train.iter().chain(&partitions.test);
    for (index, list) in lists.enumerate() {
        if let Some(sample) = list.iter().find(|&&i| i as usize >= samples) {
            bail!(
                "client {}'s partition holds sample {sample}, but the training split has {samples}",
                index % clients + 1
            );
        }
    }
    Ok(())
}

/// What the server knows of each client from the partitions: label
/// histograms (none for own-data clients, whose labels are their own) and
/// the numbers every report must carry.
fn client_facts(
    loaded: &LoadedConfig,
    data: &LoadedData,
    rows_per_sample: u64,
    num_classes: usize,
) -> ClientFacts {
    let config = loaded.config();
    let own_data = config.clients.own_data_clients as usize;
    let partitions = &data.partitions;
    let histograms = partitions
        .train
        .iter()
        .enumerate()
        .map(|(index, part)| match index < own_data {
            true => Vec::new(),
            false => {
                cohort_core::partition::label_histogram(data.train_labels(), part, num_classes)
            }
        })
        .collect();
    ClientFacts {
        self_reported: None,
        histograms,
        expected: expected_reports(
            partitions,
            config.trainer.epochs,
            config.trainer.batch_size,
            rows_per_sample,
        ),
    }
}

/// A rank of a distributed simulation: its transport wraps the local one,
/// and it learns whether it leads and whether ranks exchange partial sums.
fn rank_role(
    loaded: &LoadedConfig,
    options: &RunOptions,
    strategy: &dyn Strategy,
    hooks: &dyn ServerHooks,
    local: Box<dyn Transport>,
) -> anyhow::Result<(Box<dyn Transport>, Option<RankRole>)> {
    let partial = partial_reduce(loaded, options.distributed.as_ref(), strategy, hooks)?;
    let Some(distributed) = &options.distributed else {
        return Ok((local, None));
    };
    let (transport, peers) = join_ranks(loaded, distributed, local, partial.is_some())?;
    suggest_strata(loaded.config(), distributed);
    Ok((
        transport,
        Some(RankRole {
            peers,
            leader: distributed.leader(),
            partial,
            test_batches: None,
        }),
    ))
}

/// Said once, by rank 0, where strata could even out the ranks' rounds and
/// the config has none that does: a uniform draw leaves a round waiting for
/// the rank that drew the most of its clients.
fn suggest_strata(config: &cohort_core::config::Config, distributed: &DistributedRun) {
    let clients = &config.clients;
    let ranks = distributed.world_size;
    let strata_possible = cohort_core::config::strata_refusal(config).is_none()
        && clients.drawn_per_round().min(clients.total_clients) >= ranks;
    if distributed.leader() && ranks > 1 && strata_possible && !clients.strata.is_multiple_of(ranks)
    {
        tracing::info!(
            ranks,
            strata = clients.strata,
            "each round waits for the rank that drew the most of its clients; \
             clients.strata = {ranks} (or a multiple) gives ranks of equal workers equal \
             shares (docs/SCALING.md, Speed-up with strata)"
        );
    }
}

/// The part of the test set this process scores, and, in a distributed run
/// whose evaluator scores batch by batch, how many batches each rank scores:
/// each rank keeps only its slice. With an evaluator that scores the set as
/// a whole, rank 0 keeps all of it and the others none.
fn test_share(
    test: cohort_core::data::Dataset,
    evaluator: &dyn ModelEvaluator,
    distributed: Option<&DistributedRun>,
) -> anyhow::Result<(cohort_core::data::Dataset, Option<Vec<usize>>)> {
    let Some(distributed) = distributed else {
        return Ok((test, None));
    };
    let Some(batch) = evaluator.evaluation_batch() else {
        let test = match distributed.leader() {
            true => test,
            false => cohort_core::data::Dataset {
                inputs: Vec::new(),
                labels: Vec::new(),
                sample_shape: test.sample_shape,
            },
        };
        return Ok((test, None));
    };
    let slices = cohort_core::cluster::evaluation_slices(test.len(), batch, distributed.world_size);
    let batches = slices.iter().map(|s| s.len().div_ceil(batch)).collect();
    let mine = slices
        .get(distributed.rank as usize)
        .cloned()
        .with_context(|| format!("rank {} of {}", distributed.rank, distributed.world_size))?;
    let rows: Vec<u32> = (mine.start as u32..mine.end as u32).collect();
    let slice = test
        .rows(&rows)
        .context("this rank's slice of the test set")?;
    Ok((slice, Some(batches)))
}

/// Who is drawn each round, from which stream.
fn selection(config: &cohort_core::config::Config) -> Selection {
    Selection {
        seed: config.server.random_seed,
        total_clients: config.clients.total_clients,
        per_round: config.clients.per_round,
        draws: config.clients.drawn_per_round(),
        replayable: config.server.synchronous
            && config.clients.availability.model == cohort_core::devices::AvailabilityModel::Always
            && config.clients.selection == cohort_core::selection::SelectionKind::Random,
        policy: cohort_core::selection::PolicyConfig {
            kind: config.clients.selection,
            power_of_choice: config.clients.power_of_choice,
            oort: config.clients.oort,
            per_round: config.clients.per_round,
            strata: config.clients.strata,
        },
    }
}

/// What ranks power-of-choice's candidates in this run: the config's
/// `clients.power_of_choice.loss`, or by default pow-d's evaluation where
/// the config allows it and the clients are the simulation's own workers
/// (`own_workers`). The caller's own clients (`external`) cannot evaluate:
/// they answer training tasks only.
fn candidate_loss(
    loaded: &LoadedConfig,
    external: bool,
    own_workers: bool,
) -> anyhow::Result<cohort_core::selection::PowerOfChoiceLoss> {
    use cohort_core::selection::PowerOfChoiceLoss;
    let config = loaded.config();
    let options = config.clients.power_of_choice;
    let possible = cohort_core::config::candidate_evaluation_refusal(config).is_none();
    if external && options.loss == Some(PowerOfChoiceLoss::Evaluated) {
        bail!(
            "clients.power_of_choice.loss = \"evaluated\" cannot run with the caller's own \
             clients (RunBuilder::external_clients, cohort.simulate), which answer training \
             tasks only; use \"last_reported\""
        );
    }
    Ok(options.loss_of(possible && own_workers))
}

/// The simulated devices of `[clients.profile]` and `[clients.availability]`,
/// their files read; `None` without a profile.
fn sim_devices(loaded: &LoadedConfig) -> anyhow::Result<Option<SimDevices>> {
    use cohort_core::devices::{Availability, AvailabilityModel, Profiles, read_file};
    let config = loaded.config();
    let clients = &config.clients;
    if !clients.profile.enabled() {
        return Ok(None);
    }
    let profiles = match loaded.profile_file() {
        Some(path) => {
            let text = read_file(&path).context("clients.profile.file")?;
            Profiles::from_csv(&text, &path, &clients.profile, clients.total_clients)
                .context("clients.profile.file")?
        }
        None => Profiles::draw(&clients.profile, clients.total_clients),
    };
    let trace = match loaded.trace_file() {
        Some(path) => Some((
            read_file(&path).context("clients.availability.trace_file")?,
            path,
        )),
        None => None,
    };
    let availability = Availability::new(
        &clients.availability,
        clients.total_clients,
        trace
            .as_ref()
            .map(|(text, path)| (text.as_str(), path.as_path())),
    )
    .context("clients.availability.trace_file")?;
    Ok(Some(SimDevices {
        profiles,
        availability,
        intermittent: clients.availability.model != AvailabilityModel::Always,
        epochs: config.trainer.epochs,
        online: Default::default(),
    }))
}

/// Threads of the server's test-set evaluation. On the CPU, every thread
/// the run was given (`max_concurrency` workers × `threads_per_worker`, no
/// more than the machine has): the workers are idle while a synchronous
/// round is evaluated, and a network-mode server's would be anyway. A GPU
/// evaluates on one stream, so it keeps one worker's threads.
fn evaluation_threads(loaded: &LoadedConfig, options: &RunOptions, selected: &Selected) -> usize {
    let trainer = &loaded.config().trainer;
    let per_worker = trainer.threads_per_worker.max(1) as usize;
    if selected.device != device::cpu() {
        return per_worker;
    }
    let workers = options
        .distributed
        .as_ref()
        .and_then(|d| d.workers)
        .unwrap_or(trainer.max_concurrency)
        .max(1) as usize;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    (workers * per_worker).min(cores.max(per_worker))
}

/// The loop's settings, read from the config once.
fn loop_settings(
    loaded: &LoadedConfig,
    options: &RunOptions,
    rows_per_sample: u64,
) -> LoopSettings {
    let config = loaded.config();
    let (trainer, clients, server) = (&config.trainer, &config.clients, &config.server);
    let pipelines = loaded.pipelines();
    LoopSettings {
        last_round: options.rounds.unwrap_or(trainer.rounds),
        selection: selection(config),
        min_per_round: loaded.min_per_round() as usize,
        target_accuracy: trainer.target_accuracy,
        checkpoint_interval: server.checkpoint_interval,
        learning_rate: loaded.optimizer().learning_rate(),
        schedule: loaded.lr_schedule(),
        outbound: pipelines.server_outbound,
        inbound: pipelines.server_inbound,
        limits: loaded.decode_limits(),
        attack: SimulatedAttack {
            kind: clients.attack,
            attackers_per_round: clients.attackers_per_round,
            scale: clients.attack_scale,
            warning: loaded.attack_warning(),
        },
        max_update_norm_ratio: server.max_update_norm_ratio,
        max_model_step_ratio: server.max_model_step_ratio,
        own_data: OwnDataRules {
            clients: clients.own_data_clients,
            max_samples: clients.max_samples,
            epochs: trainer.epochs,
            batch_size: trainer.batch_size,
            do_test: clients.do_test,
            rows_per_sample,
        },
        // Client processes are dropped after `payload_timeout`, so no honest
        // report claims more; in-process workers are waited for without one.
        max_report_seconds: if clients.comm_simulation {
            cohort_core::config::MAX_TIMEOUT_SECONDS
        } else {
            server.payload_timeout
        },
        wall_time: SimulatedWallTime {
            simulate: server.simulate_wall_time,
            downlink_mbps: clients.downlink_mbps,
            uplink_mbps: clients.uplink_mbps,
        },
        config_hash: loaded.result_hash(),
        evaluation_threads: trainer.threads_per_worker as usize,
        secure: None,
        round_deadline: server.round_deadline,
        // What the bytes in flight leave of `server.max_inflight_bytes`: a
        // network server's memory for a round's updates is then bounded by
        // it, plus the update being unpacked, whatever the number of clients.
        spill: (!clients.comm_simulation).then(|| crate::spill::SpillSettings {
            budget: loaded.inflight_split().keeping,
            folder: options.run_dir.clone(),
        }),
        asynchronous: (!server.synchronous).then_some(AsyncSettings {
            buffer: server.minimum_clients_aggregated as usize,
            staleness_bound: server.staleness_bound,
            real_time: !clients.comm_simulation,
        }),
    }
}

/// `[secure_aggregation]` as the loop needs it, after the checks only the
/// run's parts can answer: a strategy given in code that needs every
/// update, server hooks (which see every payload), ranks, and a client
/// whose partition is heavier than `max_weight` (its weight could not be
/// quantised, and it would drop out of every round).
fn secure_settings(
    loaded: &LoadedConfig,
    options: &RunOptions,
    strategy: &dyn Strategy,
    hooks: &dyn ServerHooks,
    clients: &ClientFacts,
) -> anyhow::Result<Option<SecureSettings>> {
    let config = loaded.config();
    let Some(secure) = &config.secure_aggregation else {
        return Ok(None);
    };
    if !strategy.aggregates_by_mean() {
        anyhow::bail!(
            "[secure_aggregation] reveals only the round's sum, but the strategy `{}` needs \
             every update; use one that aggregates by the weighted mean ({})",
            strategy.name(),
            cohort_core::config::secure::SUM_ONLY_STRATEGIES.join(", ")
        );
    }
    if !hooks.passes_through() {
        anyhow::bail!(
            "[secure_aggregation]: server hooks see every client's payload, which secure \
             aggregation hides from the server; run without hooks"
        );
    }
    if options.distributed.is_some() {
        anyhow::bail!(
            "[secure_aggregation] has no stages between the ranks of a distributed \
             simulation, which exchange updates in the clear"
        );
    }
    let params = secure
        .params_for(config.clients.per_round as usize)
        .map_err(|e| anyhow::anyhow!("{}: {e}", loaded.path().display()))?;
    let heaviest = clients
        .expected
        .iter()
        .enumerate()
        .max_by_key(|(_, e)| e.train_samples);
    if let Some((index, expected)) = heaviest
        && expected.train_samples as f64 > params.max_weight
    {
        anyhow::bail!(
            "secure_aggregation.max_weight = {} is below client {}'s {} training samples, its \
             weight in the sum; raise max_weight to at least {} (the largest partition)",
            params.max_weight,
            index + 1,
            expected.train_samples,
            expected.train_samples
        );
    }
    let noise = secure
        .ddg_params(config.clients.per_round as usize)
        .map_err(|e| anyhow::anyhow!("{}: {e}", loaded.path().display()))?;
    Ok(Some(SecureSettings {
        params,
        noise,
        seed: config.server.random_seed,
        simulated_dropout: secure.simulated_dropout,
        network: (!config.clients.comm_simulation).then(|| {
            std::time::Duration::from_secs_f64(
                secure.timeout.unwrap_or(config.server.payload_timeout),
            )
        }),
    }))
}

/// The banner's facts: where the run reads and writes, what it computes, on
/// what, and how its clients run.
fn run_facts(
    loaded: &LoadedConfig,
    options: &RunOptions,
    strategy: &str,
    selected: &Selected,
    data: &LoadedData,
) -> RunFacts {
    let config = loaded.config();
    let trainer = &config.trainer;
    let data = data_facts(loaded, options, data);
    let workers = options
        .distributed
        .as_ref()
        .and_then(|d| d.workers)
        .unwrap_or(trainer.max_concurrency);
    let plural =
        |count: u32, noun: &str| format!("{count} {noun}{}", if count == 1 { "" } else { "s" });
    let network = options.distributed.is_none() && !config.clients.comm_simulation;
    // A network-mode server trains nothing itself: its workers would be a
    // claim about processes it does not run.
    let device = if network {
        format!(
            "{} for evaluation; the clients train in their own processes",
            selected.name
        )
    } else {
        format!(
            "{}, {} × {} each",
            selected.name,
            plural(workers, "worker"),
            plural(trainer.threads_per_worker, "thread")
        )
    };
    let execution = match (&options.distributed, config.clients.comm_simulation) {
        (Some(distributed), _) => format!(
            "{} ranks over {}{}",
            distributed.world_size,
            match distributed.link {
                RankLink::Ring(_) => "the TCP ring",
                RankLink::Mpi => "MPI",
            },
            if config.cluster.reduce == Some(cohort_core::config::Reduce::Partial) {
                ", partial sums"
            } else {
                ", updates gathered to rank 0"
            }
        ),
        (None, true) => "one process (clients simulated in the worker pool)".to_owned(),
        (None, false) => network_facts(loaded, options),
    };
    RunFacts {
        config: loaded.path().to_path_buf(),
        run_dir: options.run_dir.clone(),
        resumed_at: None,
        strategy: strategy.to_owned(),
        first_round: 1,
        last_round: options.rounds.unwrap_or(trainer.rounds),
        per_round: config.clients.per_round,
        total_clients: config.clients.total_clients,
        data,
        device,
        execution,
        leader: true,
    }
}

/// How a network-mode server runs, in words: where it listens, how many
/// client processes it waits for before round 1 (and how many it starts
/// itself), and what a round needs of them.
fn network_facts(loaded: &LoadedConfig, options: &RunOptions) -> String {
    let config = loaded.config();
    let clients = &config.clients;
    let processes = crate::transports::expected_clients(options, config);
    let local = options.local_clients.as_ref().map_or(0, |c| c.count);
    let started_here = match local {
        0 => "none started here".to_owned(),
        n => format!(
            "{n} started here, output in {}",
            options.run_dir.join(crate::children::CLIENT_LOGS).display()
        ),
    };
    let own_data = match clients.own_data_clients {
        0 => String::new(),
        n => format!(" and {n} own-data client(s)"),
    };
    let rounds = if config.server.synchronous {
        format!(
            "each round gives {} clients to them and aggregates once {} updates are in",
            clients.per_round,
            loaded.min_per_round()
        )
    } else {
        format!(
            "keeps {} clients training on them and aggregates every {} updates as they arrive",
            clients.per_round, config.server.minimum_clients_aggregated
        )
    };
    format!(
        "gRPC on {}:{}; waits for {processes} client process(es) ({started_here}){own_data}; \
         {rounds}",
        config.server.address, config.server.port,
    )
}

/// Where the data comes from and how it is split, in words.
fn data_facts(loaded: &LoadedConfig, options: &RunOptions, data: &LoadedData) -> String {
    let config = loaded.config();
    let splits = &data.splits;
    let sizes = data.partitions.train.iter().map(Vec::len);
    let (smallest, largest) = (sizes.clone().min().unwrap_or(0), sizes.max().unwrap_or(0));
    let data_root = options.data_root.as_ref().unwrap_or(&config.data.data_path);
    // The names as the config spells them.
    let name_of = |value: toml::Value| value.as_str().map(str::to_owned).unwrap_or_default();
    let sampler =
        toml::Value::try_from(config.data.sampler).map_or_else(|_| String::new(), name_of);
    let source = &config.data.datasource;
    let folder = match config.data.builtin_source() {
        Some(builtin) => data_root.join(builtin.folder()),
        None => data_root.clone(),
    };
    if config.clients.all_own_data() {
        format!(
            "{source}: {} test samples from {}; every client trains on its own data",
            splits.test.len(),
            folder.display()
        )
    } else {
        let held = match &data.held {
            Some(_) if options.distributed.is_none() => {
                " (their labels only: the clients read their own samples)".to_owned()
            }
            Some(held) => format!(" (this rank holds its clients' {})", held.rows.len()),
            None => String::new(),
        };
        format!(
            "{source}: {} training{held} and {} test samples from {}; {sampler} partitions of {}",
            data.train_samples(),
            splits.test.len(),
            folder.display(),
            if smallest == largest {
                format!("{smallest} samples")
            } else {
                format!("{smallest} to {largest} samples")
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const JOB: &str = r#"
[clients]
total_clients = 4
per_round = 2
comm_simulation = COMM
[data]
datasource = "FashionMNIST"
download = false
partition_size = 100
[trainer]
rounds = 1
epochs = 2
batch_size = 30
optimizer = "sgd"
[parameters.optimizer]
learning_rate = 0.05
"#;

    /// A network-mode server trains no client, so it reads the labels and
    /// no training sample; what it knows of each client (label histograms,
    /// the reports it expects) is what a simulation of the same config
    /// knows, with and without held-out samples on the clients.
    #[test]
    fn a_network_server_holds_no_training_samples_and_knows_its_clients_as_a_simulation() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data");
        let dir = tempfile::tempdir().unwrap();
        let options = RunOptions {
            data_root: Some(root),
            ..RunOptions::new(dir.path().join("run"))
        };
        for extra in ["", "do_test = true\ntest_fraction = 0.25"] {
            let job = |comm: &str| {
                let text = JOB.replace("COMM", comm);
                let text = match extra {
                    "" => text,
                    _ => text.replace("per_round = 2", &format!("per_round = 2\n{extra}")),
                };
                cohort_core::config::from_str(&text, Path::new("job.toml")).unwrap()
            };
            let (simulated, network) = (job("true"), job("false"));
            let (sim, _) = data_and_model(&simulated, &options, None).unwrap();
            let (net, _) = data_and_model(&network, &options, None).unwrap();
            assert!(!sim.splits.train.is_empty());
            assert!(net.splits.train.is_empty() && net.splits.train.inputs.is_empty());
            assert_eq!(net.splits.test, sim.splits.test);
            assert_eq!(net.partitions, sim.partitions);
            assert_eq!(net.train_samples(), sim.train_samples());
            let facts =
                |loaded: &LoadedConfig, data: &LoadedData| client_facts(loaded, data, 1, 10);
            let (sim_facts, net_facts) = (facts(&simulated, &sim), facts(&network, &net));
            assert_eq!(net_facts.expected, sim_facts.expected, "{extra}");
            assert_eq!(net_facts.histograms, sim_facts.histograms, "{extra}");
            assert!(sim_facts.expected.iter().all(|e| e.train_samples > 0));
            assert_eq!(
                sim_facts.expected.iter().any(|e| e.test_samples > 0),
                !extra.is_empty()
            );
            let said = data_facts(&network, &options, &net);
            assert!(said.contains("their labels only"), "{said}");
            let (train, _, partitions) = net.into_local();
            assert!(train.is_empty());
            assert!(
                partitions
                    .train
                    .iter()
                    .chain(&partitions.test)
                    .all(Vec::is_empty)
            );
        }
    }
}
