//! The transport a run's config asks for, built: worker threads of this
//! process (one client each, or K vectorized clients sized to the device), or
//! a gRPC server with the client processes it waits for.

use std::sync::Arc;

use anyhow::Context;

use cohort_core::config::{LoadedConfig, VectorizedClients};
use cohort_core::data::Dataset;
use cohort_train::device::Selected;
use cohort_train::registry::RunModel;
use cohort_train::trainer::ModelEvaluator;
use cohort_train::vectorized::StackedEvaluator;

use crate::admission::Admission;
use crate::children::ChildClients;
use crate::client::{BatchRunner, ClientPartitions, ClientRunner};
use crate::events::{RunEvent, RunObserver};
use crate::grpc::{GrpcTransport, ServerSettings};
use crate::pool::{Runner, WorkerPool};
use crate::run::{RunOptions, toml_text};
use crate::transport::Transport;

/// The pool's workers and how many tasks each takes at a time: one client
/// each, or with `trainer.vectorized_clients` K clients as one batch.
fn pool_runners(
    loaded: &LoadedConfig,
    model: &RunModel,
    selected: &Selected,
    workers: u32,
) -> anyhow::Result<(Vec<Runner>, usize)> {
    let Some(chunk) = clients_per_batch(loaded, model, selected, workers)? else {
        let runners = (0..workers)
            .map(|_| ClientRunner::new(loaded, model, selected).map(Runner::One))
            .collect::<anyhow::Result<_>>()?;
        return Ok((runners, 1));
    };
    tracing::info!(
        clients_per_batch = chunk,
        workers,
        device_memory = selected.memory_bytes,
        max_buffer = selected.max_buffer_bytes,
        "vectorized clients: each worker trains up to {chunk} clients as one batch"
    );
    let runners = (0..workers)
        .map(|_| BatchRunner::new(loaded, model, selected).map(Runner::Batch))
        .collect::<anyhow::Result<_>>()
        .context("trainer.vectorized_clients")?;
    Ok((runners, chunk))
}

/// The most clients a worker trains as one batch (`None` where clients train
/// one at a time).
fn clients_per_batch(
    loaded: &LoadedConfig,
    model: &RunModel,
    selected: &Selected,
    workers: u32,
) -> anyhow::Result<Option<usize>> {
    let image = cohort_train::vectorized::image_of_shape(&model.spec.sample_shape);
    Ok(match loaded.config().trainer.vectorized_clients {
        VectorizedClients::Off => None,
        VectorizedClients::Clients(k) => {
            Some(checked_batch(loaded, model, selected, image, k as usize)?)
        }
        VectorizedClients::Auto => Some(auto_batch(loaded, model, selected, workers, image)?),
    })
}

/// The worker threads of this process: a rank's from its plan, else
/// `trainer.max_concurrency`.
fn workers(loaded: &LoadedConfig, options: &RunOptions) -> u32 {
    options
        .distributed
        .as_ref()
        .and_then(|d| d.workers)
        .unwrap_or(loaded.config().trainer.max_concurrency)
}

/// The evaluator of the global model: where vectorized clients train in
/// this process on a GPU, the clients' stacked net scoring the test set in
/// batches of `trainer.batch_size`, as many a pass as the largest job of a
/// full round holds clients (`pool::job_sizes`), so that evaluation runs the
/// kernels and shapes training compiled ([`StackedEvaluator`]); elsewhere
/// `plain`, the model's own at `trainer.eval_batch_size`.
///
/// Not on the ranks of a distributed run: they cut the test set on
/// evaluation batches, and a rank on a GPU and another on a CPU would cut
/// it at different sizes.
pub(crate) fn evaluator_for(
    loaded: &LoadedConfig,
    model: &RunModel,
    options: &RunOptions,
    selected: &Selected,
    plain: Box<dyn ModelEvaluator>,
) -> anyhow::Result<Box<dyn ModelEvaluator>> {
    let config = loaded.config();
    let accelerated = model.accelerated()?;
    let single_process = options.distributed.is_none() && config.clients.comm_simulation;
    let (false, true, Some(accelerated)) = (selected.is_cpu(), single_process, accelerated) else {
        return Ok(plain);
    };
    let workers = workers(loaded, options);
    let Some(chunk) = clients_per_batch(loaded, model, selected, workers)? else {
        return Ok(plain);
    };
    let tasks = config.clients.drawn_per_round() as usize;
    let clients = crate::pool::job_sizes(tasks, chunk, workers as usize)
        .next()
        .unwrap_or(1);
    tracing::info!(
        batch = config.trainer.batch_size,
        clients,
        "evaluation with the vectorized clients' net"
    );
    Ok(Box::new(StackedEvaluator::new(
        plain,
        accelerated,
        &selected.device,
        config.trainer.batch_size,
        clients,
    )))
}

/// K as the config gives it, or an error where one tensor of the largest
/// batch a worker can get (K, or a round's clients where those are fewer)
/// would not fit the largest buffer the device allocates.
fn checked_batch(
    loaded: &LoadedConfig,
    model: &RunModel,
    selected: &Selected,
    image: [usize; 3],
    k: usize,
) -> anyhow::Result<usize> {
    let largest = k.min(loaded.config().clients.per_round as usize);
    let fit = cohort_train::vectorized::clients_per_buffer(
        model.accelerated()?,
        image,
        loaded.config().trainer.batch_size,
        selected.max_buffer_bytes,
    );
    anyhow::ensure!(
        largest <= fit,
        "trainer.vectorized_clients = {k}: a batch of {largest} clients needs a tensor larger \
         than the largest buffer {} allocates ({} bytes); use at most {fit}, or \"auto\"",
        selected.name,
        selected.max_buffer_bytes.unwrap_or(0),
    );
    Ok(k)
}

/// `"auto"`: K from the memory each worker may use and the largest buffer, or
/// an error where not even one client fits a buffer.
fn auto_batch(
    loaded: &LoadedConfig,
    model: &RunModel,
    selected: &Selected,
    workers: u32,
    image: [usize; 3],
) -> anyhow::Result<usize> {
    let trainer = &loaded.config().trainer;
    let budget = cohort_train::vectorized::memory_budget(selected.memory_bytes, workers);
    tracing::debug!(
        device_memory = selected.memory_bytes,
        max_buffer = selected.max_buffer_bytes,
        budget,
        "vectorized clients: K from the memory each worker may use"
    );
    let k = cohort_train::vectorized::clients_for_memory(
        model.accelerated()?,
        image,
        trainer.batch_size,
        budget,
        selected.max_buffer_bytes,
    );
    anyhow::ensure!(
        k > 0,
        "trainer.vectorized_clients = \"auto\": one client at trainer.batch_size = {} needs a \
         tensor larger than the largest buffer {} allocates ({} bytes); lower the batch size",
        trainer.batch_size,
        selected.name,
        selected.max_buffer_bytes.unwrap_or(0),
    );
    Ok(k)
}

/// Before the worker threads start: where the model has a tensor of tens of
/// MiB, they share glibc's main arena (`memory::share_one_arena_for`).
fn share_one_arena_for_large_tensors(model: &RunModel) -> anyhow::Result<()> {
    // A host with its own allocator settings (Python) builds no model for it.
    if !cohort_train::memory::retains_freed_memory() {
        return Ok(());
    }
    let template = model.template()?;
    let largest = template
        .leaves()
        .iter()
        .map(|(_, a)| a.size_in_bytes())
        .max();
    let largest = largest.unwrap_or(0);
    if cohort_train::memory::share_one_arena_for(largest) {
        tracing::debug!(
            largest_tensor_bytes = largest,
            "the worker threads share one malloc arena"
        );
    }
    Ok(())
}

/// Whether this process's round takes its workers' updates as the trees
/// they were packed from, with no bytes written
/// (`ClientRunner::hand_over_updates`): both pipelines the codec alone, and
/// nothing that needs the bytes themselves (a rank of a plan ships them to
/// the others; a secure-aggregation client masks what it would send).
fn takes_updates_as_trees(loaded: &LoadedConfig, options: &RunOptions) -> bool {
    let pipelines = loaded.pipelines();
    pipelines.client_outbound.is_codec_alone()
        && pipelines.server_inbound.is_codec_alone()
        && options.distributed.is_none()
        && loaded.config().secure_aggregation.is_none()
}

/// The transport `clients.comm_simulation` asks for: worker threads, or a
/// gRPC server (with the local client processes it starts).
pub(crate) fn start_transport(
    loaded: &LoadedConfig,
    model: &RunModel,
    options: &RunOptions,
    selected: &Selected,
    train: Dataset,
    partitions: ClientPartitions,
    observer: &mut dyn RunObserver,
) -> anyhow::Result<(Box<dyn Transport>, Option<ChildClients>)> {
    let config = &loaded.config();
    let trainer = &config.trainer;
    if config.clients.comm_simulation {
        // A rank of a plan runs the workers the plan gave it.
        let workers = workers(loaded, options);
        share_one_arena_for_large_tensors(model)?;
        let (mut runners, chunk) = pool_runners(loaded, model, selected, workers)?;
        if takes_updates_as_trees(loaded, options) {
            runners.iter_mut().for_each(Runner::hand_over_updates);
        }
        let pool = WorkerPool::start(
            runners,
            Arc::new(train),
            Arc::new(partitions),
            trainer.threads_per_worker as usize,
            chunk,
        )?;
        return Ok((Box::new(pool), None));
    }
    start_server(loaded, options, model.spec.classes, observer)
}

/// The config the client processes receive. A file data set's classes come
/// from the server's files, which an own-data client does not hold: they
/// travel in it as `parameters.model.num_classes`.
fn config_for_clients(loaded: &LoadedConfig, classes: usize) -> String {
    let config = loaded.config();
    let from_file = cohort_core::data::tabular::FileFormat::from_name(&config.data.datasource);
    if from_file.is_none() || loaded.num_classes_set().is_some() {
        return toml_text(loaded.merged());
    }
    let mut merged = loaded.merged().clone();
    let model = merged
        .entry("parameters")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .and_then(|parameters| {
            parameters
                .entry("model")
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
        });
    if let Some(model) = model {
        model.insert(
            "num_classes".to_owned(),
            toml::Value::Integer(i64::try_from(classes).unwrap_or(i64::MAX)),
        );
    }
    toml_text(&merged)
}

/// Network mode: the gRPC server, the client processes this run starts on
/// its own machine, and the wait for every process the run needs.
fn start_server(
    loaded: &LoadedConfig,
    options: &RunOptions,
    classes: usize,
    observer: &mut dyn RunObserver,
) -> anyhow::Result<(Box<dyn Transport>, Option<ChildClients>)> {
    let config = &loaded.config();
    let server = &config.server;
    warn_of_exposure(server);
    let bind = format!("{}:{}", server.address, server.port);
    let bind = std::net::ToSocketAddrs::to_socket_addrs(&bind)
        .with_context(|| format!("server.address / server.port: cannot resolve `{bind}`"))?
        .next()
        .with_context(|| format!("server.address / server.port: `{bind}` has no address"))?;
    let grpc = GrpcTransport::start(ServerSettings {
        bind,
        config_toml: config_for_clients(loaded, classes),
        auth_token: server.auth_token.clone(),
        tls: server.tls_cert.clone().zip(server.tls_key.clone()),
        payload_timeout: std::time::Duration::from_secs_f64(server.payload_timeout),
        registration_timeout: std::time::Duration::from_secs_f64(server.registration_timeout),
        max_payload_bytes: loaded.decode_limits().max_bytes,
        max_inflight_bytes: usize::try_from(loaded.inflight_split().receiving)
            .unwrap_or(usize::MAX),
        stream_window_bytes: server.stream_window_bytes,
        admission: admission(options, config),
        own_data: crate::grpc::OwnDataSettings {
            clients: config.clients.own_data_clients,
            max_samples: config.clients.max_samples,
            tokens: match &config.clients.own_data_token_file {
                Some(path) => own_data_tokens(path, config.clients.own_data_clients)?,
                None => Vec::new(),
            },
        },
    })?;
    observer.on_event(&RunEvent::Listening {
        address: grpc.local_addr(),
    });
    let children = match &options.local_clients {
        Some(spec) => Some(ChildClients::spawn(
            spec,
            grpc.local_addr(),
            loaded,
            server.tls_cert.is_some(),
            &options.run_dir,
        )?),
        None => None,
    };
    let expected = expected_clients(options, config);
    let registered = grpc.wait_for_clients_with(expected, &mut |waiting| {
        observer.on_event(&RunEvent::Registered {
            processes: waiting.processes,
            expected: waiting.expected,
            own_data_missing: waiting.own_data_missing,
        });
    });
    if let Err(error) = registered {
        // The server goes first: closing its streams lets the children exit.
        drop(grpc);
        drop(children);
        return Err(error);
    }
    Ok((Box::new(grpc), children))
}

/// What a network-mode server exposes without a token, or sends in the
/// clear without TLS: said loudly at start.
fn warn_of_exposure(server: &cohort_core::config::Server) {
    if server.auth_token.is_none() {
        tracing::warn!(
            address = %server.address,
            "network mode without server.auth_token: anyone who reaches {}:{} can register as \
             a client, hold its connection slots and send updates (see docs/SECURITY.md)",
            server.address,
            server.port
        );
    }
    if server.auth_token.is_some() && server.tls_cert.is_none() {
        tracing::warn!(
            "server.auth_token is set but TLS is off: the token crosses the network in the \
             clear (set server.tls_cert and server.tls_key)"
        );
    }
}

/// Shortest own-data token accepted: a guessable one would be no credential.
const MIN_TOKEN_CHARS: usize = 16;

/// `clients.own_data_token_file`: one `ID TOKEN` line for each own-data
/// client 1..=`clients` (blank lines and `#` comments aside), each id once,
/// each token its own; the tokens by id.
fn own_data_tokens(path: &std::path::Path, clients: u32) -> anyhow::Result<Vec<String>> {
    let text = cohort_core::fsutil::read_bounded_text(path, 1 << 20)
        .with_context(|| format!("clients.own_data_token_file = {}", path.display()))?;
    let mut tokens = vec![None; clients as usize];
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = || format!("{}, line {}", path.display(), number + 1);
        let (id, token) = match line.split_whitespace().collect::<Vec<_>>()[..] {
            [id, token] => (id, token),
            _ => anyhow::bail!("{}: expected `ID TOKEN`", at()),
        };
        let slot = id
            .parse::<u32>()
            .ok()
            .filter(|id| (1..=clients).contains(id))
            .and_then(|id| tokens.get_mut(id as usize - 1))
            .with_context(|| {
                format!(
                    "{}: `{id}` is not an own-data client id, 1 to {clients}",
                    at()
                )
            })?;
        anyhow::ensure!(slot.is_none(), "{}: client {id} has a token already", at());
        anyhow::ensure!(
            token.chars().count() >= MIN_TOKEN_CHARS,
            "{}: client {id}'s token is shorter than {MIN_TOKEN_CHARS} characters",
            at()
        );
        *slot = Some(token.to_owned());
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(index, token)| {
            token.with_context(|| {
                format!(
                    "{}: no token for own-data client {}",
                    path.display(),
                    index + 1
                )
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let mut unique = tokens.clone();
    unique.sort();
    unique.dedup();
    anyhow::ensure!(
        unique.len() == tokens.len(),
        "{}: two own-data clients share a token; each needs its own",
        path.display()
    );
    Ok(tokens)
}

/// How many ordinary client processes network mode waits for: those it
/// starts, or `trainer.max_concurrency` started elsewhere; none when every
/// client brings its own data (those are waited for by id).
/// Room for every client process the run waits for, and then some; the
/// processes it starts itself all come from this machine's address.
fn admission(options: &RunOptions, config: &cohort_core::config::Config) -> Admission {
    let waited_for = expected_clients(options, config) + config.clients.own_data_clients as usize;
    let local = options.local_clients.as_ref().map_or(0, |spec| spec.count);
    Admission {
        max_connections: 256.max(waited_for + 64),
        max_per_address: (config.server.max_connections_per_address as usize).max(local + 8),
        ..Default::default()
    }
}

/// The ordinary client processes a network-mode server waits for before
/// round 1: those it starts, else one per `trainer.max_concurrency` (none when
/// every client brings its own data).
pub(crate) fn expected_clients(
    options: &RunOptions,
    config: &cohort_core::config::Config,
) -> usize {
    let clients = &config.clients;
    match &options.local_clients {
        Some(spec) => spec.count.max(1),
        None if clients.own_data_clients == clients.total_clients => 0,
        None => (config.trainer.max_concurrency as usize).max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_data_token_files_name_each_id_once_with_a_token_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens");
        let read = |text: &str| {
            std::fs::write(&file, text).unwrap();
            own_data_tokens(&file, 2).map_err(|e| format!("{e:#}"))
        };
        let (a, b) = ("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb");
        assert_eq!(
            read(&format!("# ids and tokens\n2 {b}\n\n1 {a}\n")).unwrap(),
            [a, b]
        );
        for (text, expected) in [
            (
                format!("1 {a}\n"),
                "no token for own-data client 2".to_owned(),
            ),
            (
                format!("1 {a}\n1 {b}\n"),
                "line 2: client 1 has a token already".to_owned(),
            ),
            (
                format!("1 {a}\n3 {b}\n"),
                "line 2: `3` is not an own-data client id, 1 to 2".to_owned(),
            ),
            (format!("1 {a}\n2 {a}\n"), "share a token".to_owned()),
            (
                "1 short\n2 x\n".to_owned(),
                "line 1: client 1's token is shorter than 16".to_owned(),
            ),
            (
                format!("1 {a} extra\n"),
                "line 1: expected `ID TOKEN`".to_owned(),
            ),
        ] {
            let error = read(&text).unwrap_err();
            assert!(error.contains(&expected), "{text:?}: {error}");
        }
    }

    #[test]
    fn a_batch_too_large_for_the_devices_buffers_is_an_error_naming_the_key() {
        let loaded = cohort_core::config::from_str(
            &std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../../configs/fashion_mnist/vectorized_100.toml"),
            )
            .unwrap(),
            std::path::Path::new("vectorized_100.toml"),
        )
        .unwrap();
        let images = Dataset {
            inputs: Vec::new(),
            labels: Vec::new(),
            sample_shape: vec![1, 28, 28],
        };
        let model = cohort_train::registry::Registry::builtin()
            .run_model(&loaded, images.sample_shape.clone())
            .unwrap();
        let image = [1, 28, 28];
        // One LeNet-5 client at batch 32: 3,763,200 bytes in its largest tensor.
        let gpu = |max_buffer_bytes| Selected {
            device: cohort_train::device::cpu(),
            name: "gpu (test)",
            memory_bytes: Some(1 << 40),
            max_buffer_bytes,
        };
        let ten = gpu(Some(10 * 3_763_200));
        assert_eq!(checked_batch(&loaded, &model, &ten, image, 10).unwrap(), 10);
        let error = checked_batch(&loaded, &model, &ten, image, 11)
            .unwrap_err()
            .to_string();
        assert!(error.contains("trainer.vectorized_clients = 11"), "{error}");
        assert!(error.contains("at most 10"), "{error}");
        assert_eq!(
            checked_batch(&loaded, &model, &gpu(None), image, 100_000).unwrap(),
            100_000
        );
        // A K beyond the round's 100 clients trains batches of 100 at most.
        let hundred = gpu(Some(100 * 3_763_200));
        assert_eq!(
            checked_batch(&loaded, &model, &hundred, image, 1_000).unwrap(),
            1_000
        );
        let error = checked_batch(&loaded, &model, &ten, image, 1_000)
            .unwrap_err()
            .to_string();
        assert!(error.contains("a batch of 100 clients"), "{error}");
        // "auto" stays within both the memory and the buffer, and says so
        // where not even one client fits.
        assert_eq!(auto_batch(&loaded, &model, &ten, 1, image).unwrap(), 10);
        let error = auto_batch(&loaded, &model, &gpu(Some(3_763_200 - 256)), 1, image).unwrap_err();
        assert!(
            error.to_string().contains("lower the batch size"),
            "{error}"
        );
    }
}
