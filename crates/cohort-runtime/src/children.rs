//! Network mode's local client processes: `cohort run` can start its own
//! `cohort client`s on this machine, each writing to a log in the run folder,
//! and makes sure they are gone when the run ends, however it ends.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
/// A watcher says on the server's side when one exits before that, and why
/// (the error it printed into its log), so a client that stops for a reason
/// is not only a line in a file nobody reads.
pub(crate) struct ChildClients {
    children: Arc<Mutex<Vec<Watched>>>,
    stop: Arc<AtomicBool>,
    watcher: Option<std::thread::JoinHandle<()>>,
}

struct Watched {
    child: std::process::Child,
    log: PathBuf,
    exited: bool,
}

/// How often the watcher looks at the client processes.
const WATCH_INTERVAL: Duration = Duration::from_millis(250);

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
            children.push(Watched {
                child,
                log: path,
                exited: false,
            });
        }
        let children = Arc::new(Mutex::new(children));
        let stop = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (children, stop) = (Arc::clone(&children), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("client-watcher".into())
                .spawn(move || watch(&children, &stop))
                .context("cannot start the client processes' watcher")?
        };
        Ok(Self {
            children,
            stop,
            watcher: Some(watcher),
        })
    }
}

/// Until `stop`, reports each client process that exits: a failure with the
/// reason from its log, as a warning; a clean exit at info level.
fn watch(children: &Mutex<Vec<Watched>>, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        if let Ok(mut children) = children.lock() {
            for (index, watched) in children.iter_mut().enumerate() {
                if watched.exited {
                    continue;
                }
                let Ok(Some(status)) = watched.child.try_wait() else {
                    continue;
                };
                watched.exited = true;
                if status.success() {
                    tracing::info!(index, "client process {index} exited");
                } else {
                    tracing::warn!(
                        index,
                        %status,
                        log = %watched.log.display(),
                        "client process {index} exited ({status}): {}",
                        last_error(&watched.log)
                            .unwrap_or_else(|| "no error line in its log".to_owned())
                    );
                }
            }
        }
        std::thread::sleep(WATCH_INTERVAL);
    }
}

/// The last `error: …` line a client process wrote into its log (how
/// `cohort` reports what ended it), read from the log's last 64 KiB.
fn last_error(log: &Path) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    const TAIL: u64 = 64 * 1024;
    let mut file = std::fs::File::open(log).ok()?;
    let length = file.metadata().ok()?.len();
    file.seek(SeekFrom::Start(length.saturating_sub(TAIL)))
        .ok()?;
    let mut tail = Vec::new();
    file.take(TAIL).read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    text.lines()
        .rev()
        .find_map(|line| line.strip_prefix("error: "))
        .map(|reason| reason.chars().take(1000).collect())
}

impl Drop for ChildClients {
    fn drop(&mut self) {
        // The end of the run ends the clients: that exit is no news.
        self.stop.store(true, Ordering::SeqCst);
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
        let Ok(mut children) = self.children.lock() else {
            return;
        };
        // The server closing its streams ends the clients; give them a moment
        // to exit on their own before making sure.
        let deadline = Instant::now() + Duration::from_secs(5);
        for Watched { child, .. } in children.iter_mut() {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reason_is_the_last_error_line_of_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("client-0.log");
        std::fs::write(&log, "INFO connected\nerror: first\nINFO more\nerror: cannot read the data set: no such file\n").unwrap();
        assert_eq!(
            last_error(&log).as_deref(),
            Some("cannot read the data set: no such file")
        );
        std::fs::write(&log, "INFO connected\n").unwrap();
        assert_eq!(last_error(&log), None);
        assert_eq!(last_error(&dir.path().join("missing.log")), None);
    }
}
