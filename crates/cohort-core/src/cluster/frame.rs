//! The ring backend's data frames, without I/O: a 24-byte header (magic,
//! sequence number, origin rank, length, all little-endian) and then `length`
//! bytes of one rank's block. The runtime's ring writes and reads them on its
//! sockets; everything a frame's bytes are checked for lives here, so that it
//! can be tested and fuzzed without sockets or the runtime's dependencies.
//!
//! A received header is checked before any of the block is read: the magic,
//! the step's sequence number, the origin rank the step expects (inside the
//! world), and a length at most the caller's bound, so that a peer cannot make
//! a rank allocate or wait for more than one block of the allowed size.

/// First four bytes of every data frame.
pub const FRAME_MAGIC: u32 = 0xC04F_2701;
/// Bytes of a frame header: magic (4), sequence (8), origin (4), length (8).
pub const FRAME_HEADER_BYTES: usize = 24;

/// What the header of one step's frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The all-gather step, counted over the ring's life.
    pub sequence: u64,
    /// The rank whose block the frame carries.
    pub origin: u32,
    /// Bytes of the block that follow the header.
    pub length: u64,
}

/// What a rank expects of the next frame from its left neighbour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameExpectation {
    /// The step's sequence number.
    pub sequence: u64,
    /// The rank whose block this step brings.
    pub origin: u32,
    /// Ranks in the ring: an origin must be below it.
    pub world_size: u32,
    /// The most bytes a block may have.
    pub max_bytes: u64,
}

/// Why a frame is refused. The messages read after the sending rank's name
/// ("its left neighbour rank 2 (…) sent frame …").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Wrong magic, sequence or origin: not the frame this step waits for.
    #[error(
        "sent frame {got_sequence} of rank {got_origin} (magic {magic:#x}) where frame \
         {sequence} of rank {origin} belongs: the ranks are out of step"
    )]
    OutOfStep {
        magic: u32,
        got_sequence: u64,
        got_origin: u32,
        sequence: u64,
        origin: u32,
    },
    /// The expected origin itself is outside the ring (a caller's mistake).
    #[error("sent frame {sequence} of rank {origin}, outside a ring of {world_size} ranks")]
    OriginOutsideRing {
        sequence: u64,
        origin: u32,
        world_size: u32,
    },
    /// A block larger than the bound.
    #[error("announced {length} bytes for rank {origin}, more than the {max_bytes} allowed")]
    TooLong {
        length: u64,
        origin: u32,
        max_bytes: u64,
    },
    /// Fewer bytes than a header.
    #[error("closed the connection after {got} of {FRAME_HEADER_BYTES} header bytes")]
    ShortHeader { got: usize },
    /// Fewer bytes than the header announced.
    #[error("closed the connection after {got} of {length} bytes")]
    ShortBlock { got: u64, length: u64 },
}

impl FrameHeader {
    /// The header's 24 bytes.
    pub fn encode(&self) -> [u8; FRAME_HEADER_BYTES] {
        let mut head = [0u8; FRAME_HEADER_BYTES];
        head[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        head[4..12].copy_from_slice(&self.sequence.to_le_bytes());
        head[12..16].copy_from_slice(&self.origin.to_le_bytes());
        head[16..24].copy_from_slice(&self.length.to_le_bytes());
        head
    }

    /// Reads a header and checks it against what the step expects: magic,
    /// sequence and origin first (a frame of another step says so, whatever
    /// its length), then the length bound.
    pub fn decode(
        head: &[u8; FRAME_HEADER_BYTES],
        expected: &FrameExpectation,
    ) -> Result<Self, FrameError> {
        let magic = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes"));
        let sequence = u64::from_le_bytes(head[4..12].try_into().expect("8 bytes"));
        let origin = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
        let length = u64::from_le_bytes(head[16..24].try_into().expect("8 bytes"));
        if magic != FRAME_MAGIC || sequence != expected.sequence || origin != expected.origin {
            return Err(FrameError::OutOfStep {
                magic,
                got_sequence: sequence,
                got_origin: origin,
                sequence: expected.sequence,
                origin: expected.origin,
            });
        }
        if origin >= expected.world_size {
            return Err(FrameError::OriginOutsideRing {
                sequence,
                origin,
                world_size: expected.world_size,
            });
        }
        if length > expected.max_bytes {
            return Err(FrameError::TooLong {
                length,
                origin,
                max_bytes: expected.max_bytes,
            });
        }
        Ok(Self {
            sequence,
            origin,
            length,
        })
    }
}

/// A whole frame: header and block.
pub fn encode_frame(sequence: u64, origin: u32, block: &[u8]) -> Vec<u8> {
    let header = FrameHeader {
        sequence,
        origin,
        length: block.len() as u64,
    };
    let mut bytes = Vec::with_capacity(FRAME_HEADER_BYTES + block.len());
    bytes.extend_from_slice(&header.encode());
    bytes.extend_from_slice(block);
    bytes
}

/// Decodes the frame at the start of `bytes`: its checked header, its block,
/// and the bytes after it (the next frames of a stream).
pub fn decode_frame<'a>(
    bytes: &'a [u8],
    expected: &FrameExpectation,
) -> Result<(FrameHeader, &'a [u8], &'a [u8]), FrameError> {
    let Some((head, rest)) = bytes.split_first_chunk::<FRAME_HEADER_BYTES>() else {
        return Err(FrameError::ShortHeader { got: bytes.len() });
    };
    let header = FrameHeader::decode(head, expected)?;
    // The length is at most max_bytes, but that may exceed usize on 32 bits.
    match usize::try_from(header.length) {
        Ok(length) if length <= rest.len() => {
            let (block, after) = rest.split_at(length);
            Ok((header, block, after))
        }
        _ => Err(FrameError::ShortBlock {
            got: rest.len() as u64,
            length: header.length,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPECT: FrameExpectation = FrameExpectation {
        sequence: 7,
        origin: 2,
        world_size: 3,
        max_bytes: 100,
    };

    #[test]
    fn a_frame_decodes_to_what_was_encoded_and_leaves_the_rest() {
        let mut stream = encode_frame(7, 2, b"block");
        stream.extend_from_slice(b"next");
        let (header, block, rest) = decode_frame(&stream, &EXPECT).unwrap();
        assert_eq!(
            header,
            FrameHeader {
                sequence: 7,
                origin: 2,
                length: 5
            }
        );
        assert_eq!((block, rest), (&b"block"[..], &b"next"[..]));
        assert_eq!(&stream[..4], &FRAME_MAGIC.to_le_bytes());
        assert_eq!(header.encode()[..], stream[..FRAME_HEADER_BYTES]);
        // An empty block and one of exactly the bound are frames too.
        assert_eq!(
            decode_frame(&encode_frame(7, 2, b""), &EXPECT).unwrap().1,
            b""
        );
        let full = vec![9u8; 100];
        assert_eq!(
            decode_frame(&encode_frame(7, 2, &full), &EXPECT).unwrap().1,
            full
        );
    }

    #[test]
    fn frames_of_another_step_or_rank_or_protocol_are_out_of_step() {
        let message = |bytes: &[u8]| decode_frame(bytes, &EXPECT).unwrap_err().to_string();
        assert_eq!(
            message(&encode_frame(8, 2, b"x")),
            "sent frame 8 of rank 2 (magic 0xc04f2701) where frame 7 of rank 2 belongs: the \
             ranks are out of step"
        );
        assert!(message(&encode_frame(7, 1, b"x")).starts_with("sent frame 7 of rank 1 "));
        let mut foreign = encode_frame(7, 2, b"x");
        foreign[0] ^= 1;
        assert!(message(&foreign).contains("(magic 0xc04f2700)"));
        // Out of step wins over a length past the bound: the step is named.
        let mut huge = encode_frame(9, 2, b"");
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(message(&huge).contains("out of step"));
    }

    #[test]
    fn blocks_past_the_bound_are_refused_before_they_are_read() {
        let mut head = encode_frame(7, 2, b"");
        head[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            decode_frame(&head, &EXPECT).unwrap_err(),
            FrameError::TooLong {
                length: u64::MAX,
                origin: 2,
                max_bytes: 100
            }
        );
        assert_eq!(
            decode_frame(&encode_frame(7, 2, &[0; 101]), &EXPECT)
                .unwrap_err()
                .to_string(),
            "announced 101 bytes for rank 2, more than the 100 allowed"
        );
    }

    #[test]
    fn an_origin_outside_the_ring_is_refused_even_when_expected() {
        let outside = FrameExpectation {
            origin: 3,
            ..EXPECT
        };
        assert_eq!(
            decode_frame(&encode_frame(7, 3, b""), &outside)
                .unwrap_err()
                .to_string(),
            "sent frame 7 of rank 3, outside a ring of 3 ranks"
        );
        let none = FrameExpectation {
            origin: 0,
            world_size: 0,
            ..EXPECT
        };
        assert!(decode_frame(&encode_frame(7, 0, b""), &none).is_err());
    }

    #[test]
    fn truncated_frames_say_how_much_arrived() {
        let frame = encode_frame(7, 2, b"block");
        assert_eq!(
            decode_frame(&frame[..10], &EXPECT).unwrap_err().to_string(),
            "closed the connection after 10 of 24 header bytes"
        );
        assert_eq!(
            decode_frame(&frame[..26], &EXPECT).unwrap_err().to_string(),
            "closed the connection after 2 of 5 bytes"
        );
        assert!(decode_frame(&[], &EXPECT).is_err());
    }
}
