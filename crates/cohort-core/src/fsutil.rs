//! Atomic file writes (a reader sees the old file or the new one, never half
//! of one) and bounded reads of regular files.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` through a temporary file in the same folder,
/// fsyncs it, renames it over `path` and fsyncs the folder, so a crash at any
/// point leaves either the previous content or the new one.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomically(path, bytes, false)
}

/// [`atomic_write`] for files with secrets (a config with an auth token):
/// readable and writable by the owner only, from the first byte on (Unix).
pub fn atomic_write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomically(path, bytes, true)
}

fn create(path: &Path, private: bool) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = private;
    options.open(path)
}

fn write_atomically(path: &Path, bytes: &[u8], private: bool) -> std::io::Result<()> {
    refuse_unless_regular(path)?;
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let temporary = temporary_sibling(path);
    let result = (|| {
        // A leftover temporary of this process could carry other permissions.
        let _ = std::fs::remove_file(&temporary);
        let mut file = create(&temporary, private)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&temporary, path)?;
        // The rename is durable only once the folder entry is on disk.
        if let Ok(folder) = std::fs::File::open(parent) {
            let _ = folder.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result
}

/// Largest model file, checkpoint part or results file cohort reads: far
/// beyond any model it trains, and a bound on what a hostile path costs.
pub const MAX_READ_BYTES: u64 = 1 << 30;

/// The bytes of the regular file at `path`, refused when larger than
/// `max_bytes`. A path from a user or a run folder can name a device
/// (`/dev/zero` never ends), a FIFO (which blocks until a writer comes) or a
/// link to either; a read never allocates more than the bound.
pub fn read_bounded(path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    let metadata = std::fs::metadata(path)?;
    if !metadata.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{} is not a regular file ({})",
                path.display(),
                kind_of(&metadata.file_type())
            ),
        ));
    }
    let too_large = |size: u64| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{} is larger than {max_bytes} bytes ({size} bytes or more)",
                path.display()
            ),
        )
    };
    if metadata.len() > max_bytes {
        return Err(too_large(metadata.len()));
    }
    let mut bytes = Vec::with_capacity(metadata.len() as usize);
    std::io::Read::take(std::fs::File::open(path)?, max_bytes + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// [`read_bounded`] for text.
pub fn read_bounded_text(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    String::from_utf8(read_bounded(path, max_bytes)?).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is not UTF-8 text", path.display()),
        )
    })
}

/// A rename replaces whatever has the name: a device node (`/dev/full`),
/// a FIFO, a directory or a symbolic link would be swapped for a regular file,
/// or written where the link points. Only a regular file, or nothing, may be
/// replaced.
fn refuse_unless_regular(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(metadata) if !metadata.file_type().is_file() => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{} exists and is not a regular file ({}); refusing to replace it",
                path.display(),
                kind_of(&metadata.file_type())
            ),
        )),
        _ => Ok(()),
    }
}

fn kind_of(file_type: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if file_type.is_char_device() || file_type.is_block_device() {
            return "a device";
        }
        if file_type.is_fifo() {
            return "a FIFO";
        }
        if file_type.is_socket() {
            return "a socket";
        }
    }
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_symlink() {
        "a symbolic link"
    } else {
        "not a file"
    }
}

/// `name.tmp-<pid>` beside `path`: unique per process, same filesystem.
pub fn temporary_sibling(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_of_regular_files_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"12345").unwrap();
        assert_eq!(read_bounded(&file, 5).unwrap(), b"12345");
        let error = read_bounded(&file, 4).unwrap_err().to_string();
        assert!(error.contains("is larger than 4 bytes"), "{error}");
        let error = read_bounded(dir.path(), 4).unwrap_err().to_string();
        assert!(
            error.contains("not a regular file (a directory)"),
            "{error}"
        );
        #[cfg(unix)]
        {
            // A device that never ends, directly and through a link.
            let error = read_bounded(Path::new("/dev/zero"), 1 << 20)
                .unwrap_err()
                .to_string();
            assert!(error.contains("(a device)"), "{error}");
            let link = dir.path().join("zero");
            std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
            assert!(read_bounded(&link, 1 << 20).is_err());
        }
        std::fs::write(&file, [0xff, 0xfe]).unwrap();
        let error = read_bounded_text(&file, 10).unwrap_err().to_string();
        assert!(error.contains("not UTF-8"), "{error}");
    }

    #[test]
    fn only_a_regular_file_or_nothing_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("folder");
        std::fs::create_dir(&folder).unwrap();
        let error = atomic_write(&folder, b"x").unwrap_err().to_string();
        assert!(
            error.contains("is not a regular file (a directory)"),
            "{error}"
        );
        assert!(folder.is_dir());
        #[cfg(unix)]
        {
            let link = dir.path().join("link");
            std::os::unix::fs::symlink("/dev/null", &link).unwrap();
            let error = atomic_write_private(&link, b"x").unwrap_err().to_string();
            assert!(error.contains("(a symbolic link)"), "{error}");
            assert!(link.symlink_metadata().unwrap().file_type().is_symlink());
            // A device node itself (root may write /dev/full).
            let error = atomic_write(Path::new("/dev/full"), b"x")
                .unwrap_err()
                .to_string();
            assert!(error.contains("(a device)"), "{error}");
        }
        let file = dir.path().join("file");
        atomic_write(&file, b"a").unwrap();
        atomic_write(&file, b"b").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"b");
    }

    #[test]
    fn replaces_content_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.csv");
        atomic_write(&path, b"one").unwrap();
        atomic_write(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn failure_keeps_the_previous_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-folder").join("out.csv");
        assert!(atomic_write(&path, b"x").is_err());
    }
}
