//! Fetching dataset files from HTTP mirrors with SHA-256 verification.

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::DataFile;
use crate::fsutil::{atomic_write, temporary_sibling};

/// Largest file accepted from a mirror: the biggest file of the MNIST
/// family is 26 MB, CIFAR's archives 170 MB.
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
    #[error("{archive}: {reason}")]
    Archive { archive: String, reason: String },
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

/// Downloads the archive `file` from the first mirror that serves it with
/// the right checksum and stores its `members` (paths inside the archive,
/// such as `cifar-10-batches-bin/test_batch.bin`) under `root`, each at the
/// same relative path. The archive itself is not kept.
pub fn fetch_archive(
    mirrors: &[String],
    file: &DataFile,
    members: &[String],
    root: &Path,
) -> Result<(), DownloadError> {
    let mut attempts = Vec::new();
    for mirror in mirrors {
        let url = format!("{}/{}", mirror.trim_end_matches('/'), file.name);
        tracing::info!(%url, "downloading");
        match download_checked(&url, file.sha256) {
            Ok(bytes) => return extract_members(file.name, &bytes, members, root),
            Err(error @ DownloadError::Checksum { .. }) => return Err(error),
            Err(error) => attempts.push(error.to_string()),
        }
    }
    Err(DownloadError::AllMirrorsFailed {
        file: file.name.to_owned(),
        attempts: attempts.join("; "),
    })
}

/// Writes the entries of the gzip-compressed tar `bytes` named in `members`
/// under `root`, atomically each, and nothing else: an entry's own path
/// never decides where it is written (no `..`, no absolute path, no link
/// can lead outside `root`), and an entry is read only up to the bound of a
/// download.
pub fn extract_members(
    archive: &str,
    bytes: &[u8],
    members: &[String],
    root: &Path,
) -> Result<(), DownloadError> {
    let broken = |reason: String| DownloadError::Archive {
        archive: archive.to_owned(),
        reason,
    };
    let mut found = vec![false; members.len()];
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(bytes));
    let entries = tar.entries().map_err(|e| broken(e.to_string()))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| broken(e.to_string()))?;
        let path = entry.path().map_err(|e| broken(e.to_string()))?;
        let name = path.to_string_lossy().trim_start_matches("./").to_owned();
        let Some(index) = members.iter().position(|m| *m == name) else {
            continue;
        };
        if !entry.header().entry_type().is_file() || entry.size() > MAX_DOWNLOAD_BYTES {
            return Err(broken(format!(
                "{name} is not a regular file of at most {MAX_DOWNLOAD_BYTES} bytes"
            )));
        }
        let mut content = Vec::with_capacity(entry.size() as usize);
        (&mut entry)
            .take(MAX_DOWNLOAD_BYTES)
            .read_to_end(&mut content)
            .map_err(|e| broken(format!("{name}: {e}")))?;
        let target = root.join(&members[index]);
        let write = |source| DownloadError::Write {
            path: target.display().to_string(),
            source,
        };
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(write)?;
        }
        atomic_write(&target, &content).map_err(write)?;
        found[index] = true;
    }
    let absent: Vec<&str> = members
        .iter()
        .zip(&found)
        .filter(|(_, found)| !**found)
        .map(|(member, _)| member.as_str())
        .collect();
    if !absent.is_empty() {
        return Err(broken(format!("has no {}", absent.join(", "))));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A gzip-compressed tar of `(path, content)` entries.
    fn tar_gz(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
            Vec::new(),
            flate2::Compression::fast(),
        ));
        for (path, content) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_size(content.len() as u64);
            header.set_mode(0o644);
            // `set_path` refuses `..`; the raw name field is what a hostile
            // archive would carry.
            let name = &mut header.as_old_mut().name;
            name[..path.len()].copy_from_slice(path.as_bytes());
            header.set_cksum();
            builder.append(&header, *content).unwrap();
        }
        builder.into_inner().unwrap().finish().unwrap()
    }

    #[test]
    fn only_the_named_members_are_written_where_cohort_says() {
        let root = tempfile::tempdir().unwrap();
        let bytes = tar_gz(&[
            ("cifar-10-batches-bin/readme.html", b"skip"),
            ("../escape.bin", b"never"),
            ("./cifar-10-batches-bin/test_batch.bin", b"abc"),
        ]);
        let members = vec!["cifar-10-batches-bin/test_batch.bin".to_owned()];
        extract_members("a.tar.gz", &bytes, &members, &root.path().join("data")).unwrap();
        let folder = root.path().join("data/cifar-10-batches-bin");
        assert_eq!(
            std::fs::read(folder.join("test_batch.bin")).unwrap(),
            b"abc"
        );
        assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 1);
        assert!(!root.path().join("escape.bin").exists());

        let members = vec![
            members[0].clone(),
            "cifar-10-batches-bin/data_batch_1.bin".into(),
        ];
        let error = extract_members("a.tar.gz", &bytes, &members, root.path())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("a.tar.gz: has no cifar-10-batches-bin/data_batch_1.bin"),
            "{error}"
        );
        let error = extract_members("b.tar.gz", b"not gzip", &members, root.path())
            .unwrap_err()
            .to_string();
        assert!(error.starts_with("b.tar.gz: "), "{error}");
    }
}
