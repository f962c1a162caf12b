//! Network mode's local client processes: `cohort run` can start its own
//! `cohort client`s on this machine, each writing to a log in the run folder,
//! and makes sure they are gone when the run ends, however it ends.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;

use cohort_core::config::LoadedConfig;

/// Folder of the run folder where the client processes a network-mode run
/// starts write their output.
pub const CLIENT_LOGS: &str = "logs";

/// Client processes `cohort run` starts for network mode.
#[derive(Debug, Clone)]
pub struct LocalClients {
    /// The `cohort` executable.
    pub program: PathBuf,
    pub count: usize,
    /// Extra arguments for `cohort client` (device flag, log level).
    pub args: Vec<String>,
}

/// The started client processes; killed when the run ends, however it ends.
pub(crate) struct ChildClients(Vec<std::process::Child>);

impl ChildClients {
    /// Starts `spec.count` clients of the server at `server`; each writes its
    /// output to `logs/client-N.log` in the run folder, appended on resume,
    /// so the server's terminal shows the server alone.
    pub(crate) fn spawn(
        spec: &LocalClients,
        server: std::net::SocketAddr,
        loaded: &LoadedConfig,
        tls: bool,
        run_dir: &Path,
    ) -> anyhow::Result<Self> {
        let logs = run_dir.join(CLIENT_LOGS);
        std::fs::create_dir_all(&logs)
            .with_context(|| format!("cannot create {}", logs.display()))?;
        let mut children = Vec::new();
        for index in 0..spec.count {
            let path = logs.join(format!("client-{index}.log"));
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .with_context(|| format!("cannot open the client log {}", path.display()))?;
            let mut command = std::process::Command::new(&spec.program);
            command.stdout(log.try_clone()?).stderr(log);
            command
                .arg("client")
                .arg("--server")
                .arg(server.to_string())
                .args(&spec.args);
            if let Some(token) = &loaded.config().server.auth_token {
                // The environment, not the command line: tokens stay out of `ps`.
                command.env("COHORT_TOKEN", token);
            }
            if tls && let Some(cert) = &loaded.config().server.tls_cert {
                command.arg("--tls-ca").arg(cert);
            }
            let child = command.spawn().with_context(|| {
                format!("cannot start a client process ({})", spec.program.display())
            })?;
            children.push(child);
        }
        Ok(Self(children))
    }
}

impl Drop for ChildClients {
    fn drop(&mut self) {
        // The server closing its streams ends the clients; give them a moment
        // to exit on their own before making sure.
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        for child in &mut self.0 {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
