//! The download path for real: an HTTP server on loopback serves the fixture
//! files, and `fetch_verified` fetches them with a matching and a mismatching
//! checksum.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::thread;

use cohort_core::data::download::{DownloadError, fetch_verified};
use cohort_core::data::{self, DataFile, DataSource, Fetch};
use sha2::{Digest, Sha256};

fn fixture_folder() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data/fashion-mnist")
}

/// Serves files of `root` over HTTP/1.1 on loopback; answers 404 for others.
fn serve(root: PathBuf) -> String {
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
                    let _ = write!(
                        stream,
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
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
