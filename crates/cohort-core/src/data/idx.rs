//! Reader for the IDX format of MNIST and Fashion-MNIST, gzip-compressed.
//!
//! An IDX file is a big-endian header (two zero bytes, a type code, the number
//! of dimensions, one u32 per dimension) followed by the elements. Every field
//! is checked against what the caller expects, and a short or corrupt file is an
//! [`IdxError`], never a panic.

use std::io::Read;
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;

/// Type code of unsigned bytes, the only element type the datasets use.
const UBYTE: u8 = 0x08;
/// More than any IDX dataset of this family needs; protects against a header
/// that claims terabytes.
const MAX_ELEMENTS: u64 = 1 << 32;

#[derive(Debug, thiserror::Error)]
pub enum IdxError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a valid IDX file: {reason}")]
    Format { path: PathBuf, reason: String },
}

/// A decoded IDX array of unsigned bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

/// Reads a gzip-compressed IDX file and checks it has `expected_rank`
/// dimensions.
pub fn read_idx_gz(path: &Path, expected_rank: usize) -> Result<IdxArray, IdxError> {
    let file = open(path)?;
    read_stream(
        path,
        GzDecoder::new(std::io::BufReader::new(file)),
        expected_rank,
        "gzip stream is corrupt or truncated",
    )
}

/// Reads an IDX file, gzip-compressed or not (told apart by gzip's magic
/// bytes), and checks it has `expected_rank` dimensions.
pub fn read_idx(path: &Path, expected_rank: usize) -> Result<IdxArray, IdxError> {
    let mut magic = [0u8; 2];
    let mut file = open(path)?;
    let gzip = file.read_exact(&mut magic).is_ok() && magic == [0x1f, 0x8b];
    if gzip {
        return read_idx_gz(path, expected_rank);
    }
    read_stream(
        path,
        std::io::BufReader::new(open(path)?),
        expected_rank,
        "file is truncated",
    )
}

/// The file at `path`, if it is a regular one: a device or a FIFO would
/// never end or never start.
fn open(path: &Path) -> Result<std::fs::File, IdxError> {
    let io = |source| IdxError::Io {
        path: path.to_path_buf(),
        source,
    };
    let metadata = std::fs::metadata(path).map_err(io)?;
    if !metadata.is_file() {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        )));
    }
    std::fs::File::open(path).map_err(io)
}

fn read_stream(
    path: &Path,
    mut stream: impl Read,
    expected_rank: usize,
    broken: &str,
) -> Result<IdxArray, IdxError> {
    // The header is read and checked before the body, and the body only up
    // to the size the header claims (plus one byte to notice trailing data):
    // a small gzip bomb cannot fill memory.
    let format_error = |reason: String| IdxError::Format {
        path: path.to_path_buf(),
        reason,
    };
    let corrupt = |e: std::io::Error| format_error(format!("{broken} ({e})"));
    let mut raw = vec![0u8; 4];
    stream.read_exact(&mut raw).map_err(corrupt)?;
    let rank = raw[3] as usize;
    raw.resize(4 + 4 * rank, 0);
    stream.read_exact(&mut raw[4..]).map_err(corrupt)?;
    let (_, count) = parse_header(&raw, expected_rank).map_err(format_error)?;
    stream
        .take(count.saturating_add(1))
        .read_to_end(&mut raw)
        .map_err(corrupt)?;
    parse_idx(&raw, expected_rank).map_err(format_error)
}

/// The dimensions an IDX file declares, gzip-compressed or not, from its
/// header alone (a few bytes read or inflated): what `cohort check` needs to
/// know the sizes of a data set, and what a reader checks before it
/// allocates for the body.
pub fn read_idx_dims(path: &Path, expected_rank: usize) -> Result<Vec<usize>, IdxError> {
    let mut magic = [0u8; 2];
    let gzip = open(path)?.read_exact(&mut magic).is_ok() && magic == [0x1f, 0x8b];
    let file = std::io::BufReader::new(open(path)?);
    let stream: Box<dyn Read> = if gzip {
        Box::new(GzDecoder::new(file))
    } else {
        Box::new(file)
    };
    read_header(path, stream, expected_rank)
}

fn read_header(
    path: &Path,
    mut stream: impl Read,
    expected_rank: usize,
) -> Result<Vec<usize>, IdxError> {
    let format_error = |reason: String| IdxError::Format {
        path: path.to_path_buf(),
        reason,
    };
    let corrupt = |e: std::io::Error| format_error(format!("stream is corrupt or truncated ({e})"));
    let mut raw = vec![0u8; 4];
    stream.read_exact(&mut raw).map_err(corrupt)?;
    raw.resize(4 + 4 * raw[3] as usize, 0);
    stream.read_exact(&mut raw[4..]).map_err(corrupt)?;
    let (dims, _) = parse_header(&raw, expected_rank).map_err(format_error)?;
    Ok(dims)
}

/// Checks the magic number and dimensions at the start of `raw`; returns the
/// dimensions and the number of elements they claim.
fn parse_header(raw: &[u8], expected_rank: usize) -> Result<(Vec<usize>, u64), String> {
    let header = raw.get(..4).ok_or_else(|| {
        format!(
            "file is {} bytes, shorter than the 4-byte magic number",
            raw.len()
        )
    })?;
    if header[0] != 0 || header[1] != 0 {
        return Err(format!(
            "magic number starts with {:#04x} {:#04x}, expected two zero bytes",
            header[0], header[1]
        ));
    }
    if header[2] != UBYTE {
        return Err(format!(
            "element type code {:#04x}, expected {UBYTE:#04x} (unsigned byte)",
            header[2]
        ));
    }
    let rank = header[3] as usize;
    if rank != expected_rank {
        return Err(format!("{rank} dimensions, expected {expected_rank}"));
    }
    let dims_end = 4 + 4 * rank;
    let dims_bytes = raw
        .get(4..dims_end)
        .ok_or_else(|| format!("header truncated: {} bytes, need {dims_end}", raw.len()))?;
    let dims: Vec<usize> = dims_bytes
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes(c.try_into().expect("chunks of 4")) as usize)
        .collect();
    let count = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .unwrap_or(u64::MAX);
    if count > MAX_ELEMENTS {
        return Err(format!(
            "dimensions {dims:?} claim {count} elements, more than any dataset of this kind"
        ));
    }
    Ok((dims, count))
}

/// Parses uncompressed IDX bytes.
pub fn parse_idx(raw: &[u8], expected_rank: usize) -> Result<IdxArray, String> {
    let (dims, count) = parse_header(raw, expected_rank)?;
    let dims_end = 4 + 4 * dims.len();
    let body = &raw[dims_end..];
    if body.len() as u64 != count {
        return Err(format!(
            "dimensions {dims:?} need {count} data bytes, file has {} ({})",
            body.len(),
            if (body.len() as u64) < count {
                "truncated"
            } else {
                "trailing bytes"
            }
        ));
    }
    Ok(IdxArray {
        dims,
        data: body.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idx(dims: &[u32], body: &[u8]) -> Vec<u8> {
        let mut raw = vec![0, 0, UBYTE, dims.len() as u8];
        for d in dims {
            raw.extend(d.to_be_bytes());
        }
        raw.extend(body);
        raw
    }

    #[test]
    fn a_gzip_bomb_is_read_only_as_far_as_its_header_claims() {
        use std::io::Write;
        // 10 claimed elements, then 256 MiB of zeros (a ~250 KB gzip file).
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bomb.gz");
        let mut encoder = flate2::write::GzEncoder::new(
            std::fs::File::create(&path).unwrap(),
            flate2::Compression::best(),
        );
        encoder.write_all(&idx(&[10], &[])).unwrap();
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..256 {
            encoder.write_all(&zeros).unwrap();
        }
        encoder.finish().unwrap();
        let started = std::time::Instant::now();
        let error = read_idx_gz(&path, 1).unwrap_err().to_string();
        assert!(error.contains("trailing bytes"), "{error}");
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        // A header claiming more than any dataset is refused before the body.
        let path = dir.path().join("claims.gz");
        let mut encoder = flate2::write::GzEncoder::new(
            std::fs::File::create(&path).unwrap(),
            flate2::Compression::best(),
        );
        encoder.write_all(&idx(&[u32::MAX, u32::MAX], &[])).unwrap();
        encoder.finish().unwrap();
        let error = read_idx_gz(&path, 2).unwrap_err().to_string();
        assert!(error.contains("more than any dataset"), "{error}");
    }

    #[test]
    fn parses_a_valid_file() {
        let array = parse_idx(&idx(&[2, 2], &[1, 2, 3, 4]), 2).unwrap();
        assert_eq!(array.dims, [2, 2]);
        assert_eq!(array.data, [1, 2, 3, 4]);
    }

    #[test]
    fn rejects_truncation_corruption_and_wrong_shape() {
        let cases: Vec<(Vec<u8>, usize, &str)> = vec![
            (vec![], 1, "shorter than the 4-byte magic"),
            (vec![0, 0, UBYTE, 1, 0, 0], 1, "header truncated"),
            (idx(&[4], &[1, 2, 3]), 1, "truncated"),
            (idx(&[2], &[1, 2, 3]), 1, "trailing bytes"),
            (idx(&[2], &[1, 2]), 3, "1 dimensions, expected 3"),
            (
                vec![1, 0, UBYTE, 1, 0, 0, 0, 0],
                1,
                "expected two zero bytes",
            ),
            (vec![0, 0, 0x0D, 1, 0, 0, 0, 0], 1, "element type code"),
            (idx(&[u32::MAX, u32::MAX], &[]), 2, "more than any dataset"),
        ];
        for (raw, rank, needle) in cases {
            let error = parse_idx(&raw, rank).unwrap_err();
            assert!(error.contains(needle), "{needle}: {error}");
        }
    }

    #[test]
    fn corrupt_gzip_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.gz");
        std::fs::write(&path, b"\x1f\x8b\x08\x00garbage").unwrap();
        let error = read_idx_gz(&path, 1).unwrap_err();
        assert!(error.to_string().contains("bad.gz"), "{error}");
        assert!(
            error.to_string().contains("corrupt or truncated"),
            "{error}"
        );
    }
}
