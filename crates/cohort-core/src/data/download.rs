//! Fetching dataset files from HTTP mirrors with SHA-256 verification.
//!
//! Three shapes of download: a single file ([`fetch_verified`]), a
//! gzip-compressed tar whose named members are taken ([`fetch_archive`]),
//! both held in memory up to `MAX_DOWNLOAD_BYTES` (256 MiB); and a zip archive of
//! known size and digest ([`KnownZip`], [`fetch_zip`]) too large for memory,
//! streamed to a temporary file beside its files, checked whole, then opened.
//! Whatever the shape, the SHA-256 is checked before anything is read out of
//! the download, a file's own name inside an archive never decides where it
//! is written, and no file is left half written.

use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
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

/// An HTTP agent whose requests, body included, end within `timeout`.
fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .timeout_connect(Some(Duration::from_secs(15)))
        .build()
        .into()
}

fn download_checked(url: &str, expected_sha256: &str) -> Result<Vec<u8>, DownloadError> {
    let http = |reason: String| DownloadError::Http {
        url: url.to_owned(),
        reason,
    };
    let response = agent(Duration::from_secs(600))
        .get(url)
        .call()
        .map_err(|e| http(e.to_string()))?;
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

/// A zip archive that holds a data set's files among others (NIST's
/// `gzip.zip` of every EMNIST split), described by what is known of it
/// before it is fetched. [`fetch_zip`] streams it to disk, never into
/// memory: at most `size` bytes are read, a body of any other size is
/// refused, and its SHA-256 is checked before it is opened as a zip. Only
/// the named files of `folder` are taken from it, each bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownZip {
    /// Its file name at each mirror (`gzip.zip`).
    pub name: &'static str,
    /// Its size in bytes: the bound of the download, and what a whole one
    /// holds.
    pub size: u64,
    pub sha256: &'static str,
    /// The folder inside the zip that holds the data set's files, with its
    /// trailing slash (`gzip/`).
    pub folder: &'static str,
    /// Most bytes one file taken from it may unpack to.
    pub max_member_bytes: u64,
    /// Most entries the zip may list.
    pub max_entries: usize,
}

/// Downloads `zip` from the first mirror that serves it whole with the right
/// checksum, to a temporary file in `folder`, writes its `members` (plain
/// file names inside `zip.folder`) to `folder` under the same names, and
/// removes the download. Until every member is found and unpacked whole,
/// nothing is written to `folder` but temporaries, all removed on failure
/// (with `folder` itself when this call created it), so a failure leaves
/// `folder` as it was. A mirror that fails over HTTP (unreachable, an
/// error status, a body of the wrong size) passes to the next; a wrong
/// checksum, or a right one on an archive that breaks a bound, ends the
/// fetch.
pub fn fetch_zip(
    mirrors: &[String],
    zip: &KnownZip,
    members: &[&str],
    folder: &Path,
) -> Result<(), DownloadError> {
    let existed = folder.is_dir();
    std::fs::create_dir_all(folder).map_err(|source| DownloadError::Write {
        path: folder.display().to_string(),
        source,
    })?;
    let download = temporary_sibling(&folder.join(zip.name));
    let mut attempts = Vec::new();
    let mut outcome = None;
    for mirror in mirrors {
        let url = format!("{}/{}", mirror.trim_end_matches('/'), zip.name);
        tracing::info!(%url, bytes = zip.size, "downloading");
        let result = download_to_file(&url, &download, zip.size, zip.sha256)
            .and_then(|()| extract_zip_members(&url, zip, &download, members, folder));
        let _ = std::fs::remove_file(&download);
        match result {
            Err(error @ DownloadError::Http { .. }) => attempts.push(error.to_string()),
            result => {
                outcome = Some(result);
                break;
            }
        }
    }
    let outcome = outcome.unwrap_or_else(|| {
        Err(DownloadError::AllMirrorsFailed {
            file: zip.name.to_owned(),
            attempts: attempts.join("; "),
        })
    });
    if outcome.is_err() && !existed {
        // Only an empty folder goes: this call created it.
        let _ = std::fs::remove_dir(folder);
    }
    outcome
}

/// Streams the body at `url` into `path` (created or truncated), hashing as
/// it goes, through one buffer: refused when the server announces more than
/// `size` bytes, when the body runs past `size` (reading stops there) or ends
/// short of it, and when its SHA-256 is not `expected_sha256`. The caller
/// removes `path` whatever the outcome.
fn download_to_file(
    url: &str,
    path: &Path,
    size: u64,
    expected_sha256: &str,
) -> Result<(), DownloadError> {
    let http = |reason: String| DownloadError::Http {
        url: url.to_owned(),
        reason,
    };
    let write = |source| DownloadError::Write {
        path: path.display().to_string(),
        source,
    };
    // Ten minutes and 128 KiB a second: 81 minutes for EMNIST's 562 MB.
    let timeout = Duration::from_secs(600 + size / (128 << 10));
    let response = agent(timeout)
        .get(url)
        .call()
        .map_err(|e| http(e.to_string()))?;
    if let Some(announced) = response.body().content_length().filter(|&n| n > size) {
        return Err(http(format!(
            "announces {announced} bytes, more than the {size} it should have"
        )));
    }
    let mut body = response.into_body().into_reader();
    let mut file = BufWriter::new(std::fs::File::create(path).map_err(write)?);
    let mut hasher = Sha256::new();
    let received = copy_at_most(
        &mut body,
        size,
        |chunk| {
            hasher.update(chunk);
            file.write_all(chunk).map_err(write)
        },
        |e| http(format!("reading the body failed: {e}")),
    )?
    .ok_or_else(|| http(format!("body exceeds {size} bytes")))?;
    file.flush().map_err(write)?;
    if received != size {
        return Err(http(format!(
            "body ended after {received} of its {size} bytes"
        )));
    }
    let actual = format!("{:x}", hasher.finalize());
    if actual != expected_sha256 {
        return Err(DownloadError::Checksum {
            url: url.to_owned(),
            expected: expected_sha256.to_owned(),
            actual,
        });
    }
    Ok(())
}

/// Copies `reader` into `sink` a buffer at a time until it ends: the bytes
/// copied, or `None` once more than `limit` came (reading stops there, so a
/// lying length or an endless stream costs at most `limit` bytes). A read
/// error becomes `read_failed`'s.
fn copy_at_most(
    reader: &mut impl Read,
    limit: u64,
    mut sink: impl FnMut(&[u8]) -> Result<(), DownloadError>,
    read_failed: impl Fn(std::io::Error) -> DownloadError,
) -> Result<Option<u64>, DownloadError> {
    let mut bounded = reader.take(limit.saturating_add(1));
    let mut buffer = vec![0u8; 1 << 16];
    let mut copied = 0u64;
    loop {
        let count = match bounded.read(&mut buffer) {
            Ok(0) => return Ok(Some(copied)),
            Ok(count) => count,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(read_failed(e)),
        };
        copied += count as u64;
        if copied > limit {
            return Ok(None);
        }
        sink(&buffer[..count])?;
    }
}

/// Writes the `members` of `zip.folder` in the zip at `archive` (downloaded
/// from `url` and checked) to `folder`, each under its own name. Every entry
/// is looked at before anything is written: the zip must list at most
/// `zip.max_entries`, every name must stay inside the folder it would be
/// unpacked to ([`stays_inside`]), and each member must be there once, a
/// regular file that declares at most `zip.max_member_bytes`. Each member is
/// then unpacked to a temporary beside its target, reading no more than the
/// bound whatever its header says, to exactly its declared size (the zip
/// reader checks its CRC-32); only when all are whole are they renamed into
/// place.
fn extract_zip_members(
    url: &str,
    zip: &KnownZip,
    archive: &Path,
    members: &[&str],
    folder: &Path,
) -> Result<(), DownloadError> {
    let broken = |reason: String| DownloadError::Archive {
        archive: url.to_owned(),
        reason,
    };
    let file = std::fs::File::open(archive).map_err(|source| DownloadError::Write {
        path: archive.display().to_string(),
        source,
    })?;
    let mut reader = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| broken(format!("is not a zip that can be read: {e}")))?;
    if reader.len() > zip.max_entries {
        return Err(broken(format!(
            "lists {} entries, more than the {} it may",
            reader.len(),
            zip.max_entries
        )));
    }
    let wanted: Vec<String> = members
        .iter()
        .map(|member| format!("{}{member}", zip.folder))
        .collect();
    let mut found: Vec<Option<usize>> = vec![None; members.len()];
    for index in 0..reader.len() {
        let entry = reader
            .by_index_raw(index)
            .map_err(|e| broken(format!("entry {index}: {e}")))?;
        let name = entry.name();
        if !stays_inside(name) {
            return Err(broken(format!(
                "entry {:?} is named to lead outside the folder it is unpacked to",
                name
            )));
        }
        let Some(which) = wanted.iter().position(|w| w == name) else {
            continue;
        };
        if found[which].replace(index).is_some() {
            return Err(broken(format!("holds {name} twice")));
        }
        // Unix's file type bits, where the zip records them: 0 is none.
        let file_type = entry.unix_mode().unwrap_or(0) & 0o170000;
        if entry.is_dir() || !matches!(file_type, 0 | 0o100000) {
            return Err(broken(format!("{name} is not a regular file")));
        }
        if entry.size() > zip.max_member_bytes {
            return Err(broken(format!(
                "{name} unpacks to {} bytes, more than the {} a file of it may",
                entry.size(),
                zip.max_member_bytes
            )));
        }
    }
    let absent: Vec<&str> = (wanted.iter().zip(&found))
        .filter(|(_, index)| index.is_none())
        .map(|(name, _)| name.as_str())
        .collect();
    if !absent.is_empty() {
        return Err(broken(format!("has no {}", absent.join(", "))));
    }

    let mut staged: Vec<(PathBuf, PathBuf)> = Vec::new();
    let mut unpack = || -> Result<(), DownloadError> {
        for ((member, name), index) in members.iter().zip(&wanted).zip(&found) {
            let target = folder.join(member);
            let temporary = temporary_sibling(&target);
            let write = |source| DownloadError::Write {
                path: temporary.display().to_string(),
                source,
            };
            let mut entry = reader
                .by_index(index.expect("every member was found"))
                .map_err(|e| broken(format!("{name}: {e}")))?;
            let declared = entry.size();
            staged.push((temporary.clone(), target));
            let mut out = BufWriter::new(std::fs::File::create(&temporary).map_err(write)?);
            let written = copy_at_most(
                &mut entry,
                zip.max_member_bytes,
                |chunk| out.write_all(chunk).map_err(write),
                |e| broken(format!("{name}: {e}")),
            )?
            .ok_or_else(|| {
                broken(format!(
                    "{name} unpacks to more than the {} bytes a file of it may \
                     (its entry declares {declared})",
                    zip.max_member_bytes
                ))
            })?;
            if written != declared {
                return Err(broken(format!(
                    "{name} unpacks to {written} bytes, but its entry declares {declared}"
                )));
            }
            out.into_inner()
                .map_err(|e| write(e.into_error()))?
                .sync_all()
                .map_err(write)?;
        }
        for (temporary, target) in &staged {
            std::fs::rename(temporary, target).map_err(|source| DownloadError::Write {
                path: target.display().to_string(),
                source,
            })?;
        }
        // The renames are durable only once the folder entry is on disk.
        if let Ok(folder) = std::fs::File::open(folder) {
            let _ = folder.sync_all();
        }
        Ok(())
    };
    let result = unpack();
    if result.is_err() {
        for (temporary, _) in &staged {
            let _ = std::fs::remove_file(temporary);
        }
    }
    result
}

/// Whether a zip entry's name stays inside the folder it would be unpacked
/// to on any system: relative, no `..` part, no backslash (Windows'
/// separator), no colon (a drive, or an NTFS stream), no NUL.
fn stays_inside(name: &str) -> bool {
    !name.starts_with('/')
        && !name.contains(['\\', ':', '\0'])
        && name.split('/').all(|part| part != "..")
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

#[cfg(test)]
mod zip_tests {
    use std::io::Write;

    use super::*;

    /// A zip of `(name, content)` entries, deflated, written to `dir`; a name
    /// ending in `/` is a folder.
    fn zip_at(dir: &Path, entries: &[(&str, &[u8])]) -> PathBuf {
        let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        let options =
            zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        for (name, content) in entries {
            if name.ends_with('/') {
                writer.add_directory(*name, options).unwrap();
            } else {
                writer.start_file(*name, options).unwrap();
                writer.write_all(content).unwrap();
            }
        }
        let path = dir.join("test.zip");
        std::fs::write(&path, writer.finish().unwrap().into_inner()).unwrap();
        path
    }

    /// A description whose bounds are `max_member_bytes` and `max_entries`
    /// (extraction reads no other field).
    fn known(max_member_bytes: u64, max_entries: usize) -> KnownZip {
        KnownZip {
            name: "test.zip",
            size: 0,
            sha256: "",
            folder: "gzip/",
            max_member_bytes,
            max_entries,
        }
    }

    /// Extracts `a` and `b` from `zip` into a fresh `out/` beside it: the
    /// error's text, and what `out/` holds afterwards.
    fn extract(zip: &Path, description: &KnownZip) -> (Result<(), String>, Vec<String>) {
        let out = zip.with_file_name("out");
        std::fs::create_dir_all(&out).unwrap();
        let result = extract_zip_members("http://m/test.zip", description, zip, &["a", "b"], &out)
            .map_err(|e| e.to_string());
        let mut left: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        std::fs::remove_dir_all(&out).unwrap();
        (result, left)
    }

    #[test]
    fn names_that_leave_the_folder_are_refused() {
        for name in [
            "../a",
            "gzip/../../a",
            "/etc/a",
            "gzip\\..\\a",
            "C:/a",
            "gzip/a\0",
        ] {
            assert!(!stays_inside(name), "{name:?}");
        }
        for name in ["gzip/a", "gzip/", "gzip/./a", "a..b", "gzip/..a"] {
            assert!(stays_inside(name), "{name:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let zip = zip_at(
            dir.path(),
            &[("gzip/a", b"1"), ("gzip/b", b"2"), ("gzip/../b", b"evil")],
        );
        let (result, left) = extract(&zip, &known(64, 8));
        let error = result.unwrap_err();
        assert!(
            error.contains("entry \"gzip/../b\" is named to lead outside"),
            "{error}"
        );
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn each_member_once_a_regular_file_within_the_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let twice = zip_at(
            dir.path(),
            &[("gzip/a", b"1"), ("gzip/b", b"2"), ("gzip/a", b"3")],
        );
        let (result, left) = extract(&twice, &known(64, 8));
        assert!(result.unwrap_err().contains("holds gzip/a twice"));
        assert!(left.is_empty());

        let folder = zip_at(dir.path(), &[("gzip/a", b"1"), ("gzip/b/", b"")]);
        let (result, left) = extract(&folder, &known(64, 8));
        let error = result.unwrap_err();
        // A zip's folder is `gzip/b/`, not the member `gzip/b`.
        assert!(error.contains("has no gzip/b"), "{error}");
        assert!(left.is_empty());

        let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        let options = zip::write::FileOptions::default();
        writer.start_file("gzip/a", options).unwrap();
        writer
            .add_symlink("gzip/b", "/etc/passwd", options)
            .unwrap();
        let link = dir.path().join("link.zip");
        std::fs::write(&link, writer.finish().unwrap().into_inner()).unwrap();
        let (result, left) = extract(&link, &known(64, 8));
        assert!(result.unwrap_err().contains("gzip/b is not a regular file"));
        assert!(left.is_empty());

        let many = zip_at(
            dir.path(),
            &[("gzip/a", b"1"), ("gzip/b", b"2"), ("gzip/c", b"3")],
        );
        let (result, _) = extract(&many, &known(64, 2));
        assert!(
            result
                .unwrap_err()
                .contains("lists 3 entries, more than the 2 it may")
        );
        let (result, left) = extract(&many, &known(1, 3));
        assert_eq!(result, Ok(()));
        assert_eq!(left, ["a", "b"], "gzip/c is no member");

        let (result, left) = extract(&many, &known(0, 3));
        let error = result.unwrap_err();
        assert!(
            error.contains("gzip/a unpacks to 1 bytes, more than the 0 a file of it may"),
            "{error}"
        );
        assert!(left.is_empty());
    }

    /// An entry whose headers declare less than it holds is cut at the
    /// bound, not at what it declares, and refused; within the bound, it is
    /// refused for not being what it declares. The member unpacked before
    /// it is not placed either.
    #[test]
    fn the_bound_holds_whatever_an_entry_declares() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        let stored =
            zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored);
        writer.start_file("gzip/a", stored).unwrap();
        writer.write_all(b"1").unwrap();
        writer.start_file("gzip/b", stored).unwrap();
        writer.write_all(&[7u8; 100]).unwrap();
        let mut bytes = writer.finish().unwrap().into_inner();
        // Declare 10 bytes for `gzip/b`: the uncompressed size at offset 22
        // of its local header and 24 of its central header, the second of
        // each.
        let second = |signature: [u8; 4]| {
            (0..bytes.len() - 4)
                .filter(|&i| bytes[i..i + 4] == signature)
                .nth(1)
                .unwrap()
        };
        let (local, central) = (
            second([0x50, 0x4b, 0x03, 0x04]),
            second([0x50, 0x4b, 0x01, 0x02]),
        );
        assert_eq!(bytes[local + 22..local + 26], 100u32.to_le_bytes());
        assert_eq!(bytes[central + 24..central + 28], 100u32.to_le_bytes());
        bytes[local + 22..local + 26].copy_from_slice(&10u32.to_le_bytes());
        bytes[central + 24..central + 28].copy_from_slice(&10u32.to_le_bytes());
        let lying = dir.path().join("lying.zip");
        std::fs::write(&lying, &bytes).unwrap();

        let (result, left) = extract(&lying, &known(64, 8));
        let error = result.unwrap_err();
        assert!(
            error.contains(
                "gzip/b unpacks to more than the 64 bytes a file of it may (its entry declares 10)"
            ),
            "{error}"
        );
        assert!(left.is_empty(), "neither `a` nor a temporary: {left:?}");

        let (result, left) = extract(&lying, &known(128, 8));
        let error = result.unwrap_err();
        assert!(
            error.contains("gzip/b unpacks to 100 bytes, but its entry declares 10"),
            "{error}"
        );
        assert!(left.is_empty(), "{left:?}");
    }
}
