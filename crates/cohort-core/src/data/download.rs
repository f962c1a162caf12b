//! Fetching dataset files from HTTP mirrors with SHA-256 verification.

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::DataFile;
use crate::fsutil::{atomic_write, temporary_sibling};

/// Largest file accepted from a mirror; the biggest file of the family is 26 MB.
const MAX_DOWNLOAD_BYTES: u64 = 256 << 20;

/// Whether and from where missing files are fetched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetch {
    Never,
    /// Base URLs tried in order; empty means the dataset's standard mirrors.
    FromMirrors(Vec<String>),
}

#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    #[error("{url}: {reason}")]
    Http { url: String, reason: String },
    #[error("{url}: SHA-256 mismatch: expected {expected}, got {actual}; the file was not kept")]
    Checksum {
        url: String,
        expected: String,
        actual: String,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no mirror had {file}: {attempts}")]
    AllMirrorsFailed { file: String, attempts: String },
}

/// Downloads `file` from the first mirror that serves it with the right
/// checksum and stores it atomically in `folder`.
pub fn fetch_verified(
    mirrors: &[String],
    file: &DataFile,
    folder: &Path,
) -> Result<(), DownloadError> {
    std::fs::create_dir_all(folder).map_err(|source| DownloadError::Write {
        path: folder.display().to_string(),
        source,
    })?;
    let mut attempts = Vec::new();
    for mirror in mirrors {
        let url = format!("{}/{}", mirror.trim_end_matches('/'), file.name);
        tracing::info!(%url, "downloading");
        match download_checked(&url, file.sha256) {
            Ok(bytes) => {
                let target = folder.join(file.name);
                return atomic_write(&target, &bytes).map_err(|source| DownloadError::Write {
                    path: target.display().to_string(),
                    source,
                });
            }
            Err(error @ DownloadError::Checksum { .. }) => return Err(error),
            Err(error) => attempts.push(error.to_string()),
        }
    }
    let _ = std::fs::remove_file(temporary_sibling(&folder.join(file.name)));
    Err(DownloadError::AllMirrorsFailed {
        file: file.name.to_owned(),
        attempts: attempts.join("; "),
    })
}

fn download_checked(url: &str, expected_sha256: &str) -> Result<Vec<u8>, DownloadError> {
    let http = |reason: String| DownloadError::Http {
        url: url.to_owned(),
        reason,
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(600)))
        .timeout_connect(Some(Duration::from_secs(15)))
        .build()
        .into();
    let response = agent.get(url).call().map_err(|e| http(e.to_string()))?;
    let mut bytes = Vec::new();
    response
        .into_body()
        .into_reader()
        .take(MAX_DOWNLOAD_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| http(format!("reading the body failed: {e}")))?;
    if bytes.len() as u64 > MAX_DOWNLOAD_BYTES {
        return Err(http(format!("body exceeds {MAX_DOWNLOAD_BYTES} bytes")));
    }
    let actual = format!("{:x}", Sha256::digest(&bytes));
    if actual != expected_sha256 {
        return Err(DownloadError::Checksum {
            url: url.to_owned(),
            expected: expected_sha256.to_owned(),
            actual,
        });
    }
    Ok(bytes)
}
