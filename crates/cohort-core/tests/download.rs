//! The download path for real: an HTTP server on loopback serves the fixture
//! files, and `fetch_verified` fetches them with a matching and a mismatching
//! checksum; CIFAR's archive and EMNIST's zip are made from the fixtures at
//! test time, in their publishers' layouts, and served the same way.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::thread;

use cohort_core::data::download::{DownloadError, fetch_verified, fetch_zip};
use cohort_core::data::{self, DataFile, DataSource, Fetch, KnownZip};
use sha2::{Digest, Sha256};

fn fixture_folder() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data/fashion-mnist")
}

/// Serves files of `root` over HTTP/1.1 on loopback; answers 404 for others.
fn serve(root: PathBuf) -> String {
    serve_with(root, true)
}

/// [`serve`], with the length of each body announced or, without
/// `announce`, left for the closed connection to tell.
fn serve_with(root: PathBuf, announce: bool) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request_line = String::new();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            // Drain the headers.
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            let path = request_line
                .split_whitespace()
                .nth(1)
                .unwrap_or("/")
                .trim_start_matches('/')
                .to_owned();
            match std::fs::read(root.join(&path)) {
                Ok(body) => {
                    let length = if announce {
                        format!("Content-Length: {}\r\n", body.len())
                    } else {
                        String::new()
                    };
                    let _ = write!(
                        stream,
                        "HTTP/1.1 200 OK\r\n{length}Connection: close\r\n\r\n"
                    );
                    let _ = stream.write_all(&body);
                }
                Err(_) => {
                    let _ = write!(
                        stream,
                        "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    );
                }
            }
        }
    });
    format!("http://{address}/")
}

fn sha256_of(path: &Path) -> String {
    format!("{:x}", Sha256::digest(std::fs::read(path).unwrap()))
}

#[test]
fn matching_checksum_downloads_and_stores_the_file() {
    let mirror = serve(fixture_folder());
    let target = tempfile::tempdir().unwrap();
    let name = "t10k-labels-idx1-ubyte.gz";
    let expected = sha256_of(&fixture_folder().join(name));
    let file = DataFile {
        name,
        sha256: Box::leak(expected.into_boxed_str()),
    };
    fetch_verified(&[mirror], &file, target.path()).unwrap();
    assert_eq!(
        std::fs::read(target.path().join(name)).unwrap(),
        std::fs::read(fixture_folder().join(name)).unwrap()
    );
}

#[test]
fn mismatching_checksum_is_refused_and_nothing_is_kept() {
    let mirror = serve(fixture_folder());
    let target = tempfile::tempdir().unwrap();
    let file = DataFile {
        name: "t10k-labels-idx1-ubyte.gz",
        sha256: "00",
    };
    let error = fetch_verified(&[mirror], &file, target.path()).unwrap_err();
    assert!(matches!(error, DownloadError::Checksum { .. }), "{error}");
    assert!(error.to_string().contains("SHA-256 mismatch"), "{error}");
    assert_eq!(
        std::fs::read_dir(target.path()).unwrap().count(),
        0,
        "no file, no temporary"
    );
}

#[test]
fn a_failing_mirror_falls_through_to_the_next() {
    let empty = tempfile::tempdir().unwrap();
    let dead = serve(empty.path().to_path_buf());
    let good = serve(fixture_folder());
    let target = tempfile::tempdir().unwrap();
    let name = "t10k-labels-idx1-ubyte.gz";
    let expected = sha256_of(&fixture_folder().join(name));
    let file = DataFile {
        name,
        sha256: Box::leak(expected.into_boxed_str()),
    };
    fetch_verified(&[dead, good], &file, target.path()).unwrap();
    assert!(target.path().join(name).is_file());
}

#[test]
fn dataset_load_downloads_missing_files_and_explains_failure() {
    // The real catalogue checksums do not match the fixtures, so loading
    // through the catalogue must fail on the checksum and say what to do.
    let mirror = serve(fixture_folder());
    let target = tempfile::tempdir().unwrap();
    let error = data::load(
        DataSource::FashionMnist,
        target.path(),
        &Fetch::FromMirrors(vec![mirror]),
    )
    .unwrap_err();
    let message = error.to_string();
    assert!(message.contains("SHA-256 mismatch"), "{message}");
    assert!(message.contains("Put these files in"), "{message}");

    let unreachable = data::load(
        DataSource::FashionMnist,
        target.path(),
        &Fetch::FromMirrors(vec!["http://127.0.0.1:9/".to_owned()]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        unreachable.contains("Downloading them failed"),
        "{unreachable}"
    );
    assert!(
        unreachable.contains("train-images-idx3-ubyte.gz"),
        "{unreachable}"
    );
}

/// `cifar-10-binary.tar.gz` as the CIFAR page serves it (the folder
/// `cifar-10-batches-bin/` with the batches and a readme), made from the
/// fixture's batches, in a folder of its own.
fn cifar_archive() -> (tempfile::TempDir, String) {
    let fixtures = fixture_folder().join("../cifar-10-batches-bin");
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    for file in DataSource::Cifar10.files() {
        let path = format!("cifar-10-batches-bin/{}", file.name);
        builder
            .append_path_with_name(fixtures.join(file.name), path)
            .unwrap();
    }
    let mut header = tar::Header::new_gnu();
    header.set_size(5);
    header.set_cksum();
    builder
        .append_data(
            &mut header,
            "cifar-10-batches-bin/readme.html",
            &b"hello"[..],
        )
        .unwrap();
    let bytes = builder.into_inner().unwrap().finish().unwrap();
    let folder = tempfile::tempdir().unwrap();
    std::fs::write(folder.path().join("cifar-10-binary.tar.gz"), &bytes).unwrap();
    (folder, format!("{:x}", Sha256::digest(&bytes)))
}

#[test]
fn an_archive_is_downloaded_checked_and_unpacked_to_the_files_alone() {
    let (served, digest) = cifar_archive();
    let mirror = serve(served.path().to_path_buf());
    let target = tempfile::tempdir().unwrap();
    let archive = DataFile {
        name: "cifar-10-binary.tar.gz",
        sha256: Box::leak(digest.into_boxed_str()),
    };
    let members: Vec<String> = DataSource::Cifar10
        .files()
        .iter()
        .map(|f| format!("cifar-10-batches-bin/{}", f.name))
        .collect();
    cohort_core::data::download::fetch_archive(
        std::slice::from_ref(&mirror),
        &archive,
        &members,
        target.path(),
    )
    .unwrap();
    let folder = target.path().join("cifar-10-batches-bin");
    assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 6, "no readme");
    let fixtures = fixture_folder().join("../");
    assert_eq!(
        data::load(DataSource::Cifar10, target.path(), &Fetch::Never).unwrap(),
        data::load(DataSource::Cifar10, &fixtures, &Fetch::Never).unwrap()
    );

    // Through the catalogue the published digest is held against it.
    let fresh = tempfile::tempdir().unwrap();
    let message = data::load(
        DataSource::Cifar10,
        fresh.path(),
        &Fetch::FromMirrors(vec![mirror]),
    )
    .unwrap_err()
    .to_string();
    for needle in [
        "SHA-256 mismatch: expected c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
        "data_batch_1.bin",
        "Put these files in",
    ] {
        assert!(message.contains(needle), "{needle}: {message}");
    }
    assert!(!fresh.path().join("cifar-10-batches-bin").exists());
}

/// The balanced split's four fixture files, by name.
fn emnist_files() -> Vec<(&'static str, Vec<u8>)> {
    let folder = fixture_folder().join("../emnist");
    (DataSource::Emnist.files().iter())
        .map(|f| (f.name, std::fs::read(folder.join(f.name)).unwrap()))
        .collect()
}

/// NIST's `gzip.zip` in its layout (the `gzip/` folder, every split's files
/// and mappings), with the fixture's files as the balanced split's and
/// `extra` entries after them, less any entry named in `leave_out`; stored
/// as `gzip.zip` in a folder of its own. Its SHA-256 and size come back.
fn emnist_zip(extra: &[(&str, &[u8])], leave_out: &str) -> (tempfile::TempDir, String, u64) {
    let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options =
        zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Deflated);
    writer.add_directory("gzip/", options).unwrap();
    let mut entries: Vec<(String, Vec<u8>)> = Vec::new();
    for (name, bytes) in emnist_files() {
        entries.push((format!("gzip/{name}"), bytes));
    }
    // Other splits' files, which must stay in the zip.
    for split in ["byclass", "letters", "digits"] {
        for part in ["train-images-idx3", "test-labels-idx1"] {
            let name = format!("gzip/emnist-{split}-{part}-ubyte.gz");
            entries.push((name, split.as_bytes().to_vec()));
        }
        entries.push((
            format!("gzip/emnist-{split}-mapping.txt"),
            b"0 48\n".to_vec(),
        ));
    }
    entries.push((
        "gzip/emnist-balanced-mapping.txt".into(),
        b"0 48\n".to_vec(),
    ));
    // The balanced split's names outside `gzip/`.
    let stray = "emnist-balanced-test-labels-idx1-ubyte.gz";
    entries.push((stray.into(), b"not this one".to_vec()));
    for (name, bytes) in extra {
        entries.push(((*name).into(), bytes.to_vec()));
    }
    for (name, bytes) in entries.iter().filter(|(name, _)| name != leave_out) {
        writer.start_file(name.as_str(), options).unwrap();
        writer.write_all(bytes).unwrap();
    }
    let bytes = writer.finish().unwrap().into_inner();
    let folder = tempfile::tempdir().unwrap();
    std::fs::write(folder.path().join("gzip.zip"), &bytes).unwrap();
    let digest = format!("{:x}", Sha256::digest(&bytes));
    (folder, digest, bytes.len() as u64)
}

/// A description of the archive with its own digest and size, and the real
/// archive's bounds on its files.
fn known(digest: String, size: u64) -> KnownZip {
    KnownZip {
        sha256: Box::leak(digest.into_boxed_str()),
        size,
        ..data::EMNIST_ZIP
    }
}

fn balanced() -> Vec<&'static str> {
    DataSource::Emnist.files().iter().map(|f| f.name).collect()
}

/// What `folder` holds, by name; nothing when it is not there.
fn listing(folder: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn the_emnist_zip_gives_the_four_files_alone_byte_for_byte() {
    let (served, digest, size) = emnist_zip(&[], "");
    let mirror = serve(served.path().to_path_buf());
    let target = tempfile::tempdir().unwrap();
    let folder = target.path().join("emnist");
    fetch_zip(&[mirror], &known(digest, size), &balanced(), &folder).unwrap();
    let mut want: Vec<String> = balanced().iter().map(|n| n.to_string()).collect();
    want.sort();
    assert_eq!(
        listing(&folder),
        want,
        "the four files, no archive, no temporary"
    );
    assert_eq!(listing(target.path()), ["emnist"]);
    for (name, bytes) in emnist_files() {
        assert_eq!(std::fs::read(folder.join(name)).unwrap(), bytes, "{name}");
    }
    let fixtures = fixture_folder().join("../");
    assert_eq!(
        data::load(DataSource::Emnist, target.path(), &Fetch::Never).unwrap(),
        data::load(DataSource::Emnist, &fixtures, &Fetch::Never).unwrap()
    );
}

#[test]
fn a_wrong_digest_is_refused_before_anything_is_unpacked() {
    let (served, digest, size) = emnist_zip(&[], "");
    let mirror = serve(served.path().to_path_buf());
    let target = tempfile::tempdir().unwrap();
    let folder = target.path().join("emnist");
    let wrong = "ab".repeat(32);
    let error =
        fetch_zip(&[mirror], &known(wrong.clone(), size), &balanced(), &folder).unwrap_err();
    assert!(matches!(error, DownloadError::Checksum { .. }), "{error}");
    let message = error.to_string();
    for needle in [
        "/gzip.zip: SHA-256 mismatch",
        format!("expected {wrong}, got {digest}").as_str(),
    ] {
        assert!(message.contains(needle), "{needle}: {message}");
    }
    assert!(!folder.exists(), "{:?}", listing(&folder));

    // A folder that was there stays, as it was.
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("notes.txt"), b"mine").unwrap();
    let mirror = serve(served.path().to_path_buf());
    fetch_zip(&[mirror], &known(wrong, size), &balanced(), &folder).unwrap_err();
    assert_eq!(listing(&folder), ["notes.txt"]);
}

#[test]
fn an_emnist_zip_past_its_size_or_short_of_it_is_refused() {
    let (served, digest, size) = emnist_zip(&[], "");
    let target = tempfile::tempdir().unwrap();
    let folder = target.path().join("emnist");
    for (bound, announce, needle) in [
        (
            size - 1,
            true,
            format!(
                "announces {size} bytes, more than the {} it should have",
                size - 1
            ),
        ),
        // Unannounced, the body is read up to the bound and no further.
        (size - 1, false, format!("body exceeds {} bytes", size - 1)),
        (
            size + 1,
            true,
            format!("body ended after {size} of its {} bytes", size + 1),
        ),
    ] {
        let mirror = serve_with(served.path().to_path_buf(), announce);
        let error = fetch_zip(
            &[mirror],
            &known(digest.clone(), bound),
            &balanced(),
            &folder,
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("no mirror had gzip.zip"), "{error}");
        assert!(error.contains(&needle), "{needle}: {error}");
        assert!(!folder.exists(), "{:?}", listing(&folder));
    }
}

#[test]
fn an_emnist_zip_without_a_file_is_refused_naming_it() {
    let absent = "gzip/emnist-balanced-test-labels-idx1-ubyte.gz";
    let (served, digest, size) = emnist_zip(&[], absent);
    let mirror = serve(served.path().to_path_buf());
    let target = tempfile::tempdir().unwrap();
    let folder = target.path().join("emnist");
    let error = fetch_zip(&[mirror], &known(digest, size), &balanced(), &folder)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(&format!("/gzip.zip: has no {absent}")),
        "{error}"
    );
    assert!(
        !error.contains("train-images"),
        "only the absent one: {error}"
    );
    // Not even the three that are there.
    assert!(!folder.exists(), "{:?}", listing(&folder));
}

#[test]
fn an_emnist_zip_with_a_hostile_or_oversized_entry_is_refused() {
    let target = tempfile::tempdir().unwrap();
    let folder = target.path().join("data/emnist");
    for name in ["gzip/../../escape.gz", "../escape.gz", "/escape.gz"] {
        let (served, digest, size) = emnist_zip(&[(name, b"never")], "");
        let mirror = serve(served.path().to_path_buf());
        let error = fetch_zip(&[mirror], &known(digest, size), &balanced(), &folder)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(&format!("entry {name:?} is named to lead outside")),
            "{error}"
        );
        assert!(!folder.exists(), "{:?}", listing(&folder));
        assert!(!target.path().join("escape.gz").exists());
    }

    // The training images unpack to more than a file of the archive may.
    let (served, digest, size) = emnist_zip(&[], "");
    let mirror = serve(served.path().to_path_buf());
    let images = emnist_files()[0].1.len() as u64;
    let small = KnownZip {
        max_member_bytes: images - 1,
        ..known(digest, size)
    };
    let error = fetch_zip(&[mirror], &small, &balanced(), &folder)
        .unwrap_err()
        .to_string();
    let needle = format!(
        "gzip/emnist-balanced-train-images-idx3-ubyte.gz unpacks to {images} bytes, more than \
         the {} a file of it may",
        images - 1
    );
    assert!(error.contains(&needle), "{needle}: {error}");
    assert!(!folder.exists(), "{:?}", listing(&folder));
}

/// Through the catalogue, NIST's digest is held against the served zip, and
/// the error says where the files come from and what to put where.
#[test]
fn the_catalogue_fetches_emnist_from_nist_s_zip_and_explains_failure() {
    let (served, digest, size) = emnist_zip(&[], "");
    let mirror = serve(served.path().to_path_buf());
    let fresh = tempfile::tempdir().unwrap();
    let message = data::load(
        DataSource::Emnist,
        fresh.path(),
        &Fetch::FromMirrors(vec![mirror]),
    )
    .unwrap_err()
    .to_string();
    for needle in [
        "Downloading them failed",
        // The fixture is not NIST's zip: its size gives it away first.
        format!("gzip.zip: body ended after {size} of its 561753746 bytes").as_str(),
        "emnist-balanced-train-images-idx3-ubyte.gz",
        "emnist-balanced-test-labels-idx1-ubyte.gz",
        "the `gzip/` folder of https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",
        "SHA-256 fb9bb67e33772a9cc0b895e4ecf36d2cf35be8b709693c3564cea2a019fcda8e",
    ] {
        assert!(message.contains(needle), "{needle}: {message}");
    }
    assert!(!message.contains(&digest), "{message}");
    assert!(
        listing(fresh.path()).is_empty(),
        "{:?}",
        listing(fresh.path())
    );
    assert_eq!(
        DataSource::Emnist.mirrors()[0].to_owned() + data::EMNIST_ZIP.name,
        "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip"
    );
}
