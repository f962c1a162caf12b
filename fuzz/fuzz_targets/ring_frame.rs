//! The ring backend's frame decoder (`cohort_core::cluster::decode_frame`,
//! which the runtime's ring calls on every header it reads): arbitrary bytes
//! against arbitrary expectations. The input's first 25 bytes choose the
//! expected sequence, origin, world size and byte bound, and whether the
//! expected magic, sequence and origin are written into the frame (so that
//! the length and truncation checks behind them are reached at once); the
//! rest is the frame. What decodes must meet every expectation and encode
//! again to the same bytes; what is refused must be refused for a reason the
//! bytes show.
#![no_main]

use cohort_core::cluster::{
    FRAME_HEADER_BYTES, FRAME_MAGIC, FrameError, FrameExpectation, decode_frame, encode_frame,
};
use libfuzzer_sys::fuzz_target;

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

fuzz_target!(|data: &[u8]| {
    let Some((choice, rest)) = data.split_first_chunk::<25>() else {
        return;
    };
    let flags = choice[0];
    let mut world_size = u32_at(choice, 1);
    if flags & 2 != 0 {
        world_size %= 17; // small rings, as real ones are
    }
    let mut origin = u32_at(choice, 5);
    if flags & 4 != 0 && world_size > 0 {
        origin %= world_size;
    }
    let sequence = u64_at(choice, 9);
    let mut max_bytes = u64_at(choice, 17);
    if flags & 8 != 0 {
        max_bytes %= 4096;
    }
    let expected = FrameExpectation {
        sequence,
        origin,
        world_size,
        max_bytes,
    };
    let mut frame = rest.to_vec();
    if flags & 1 != 0 && frame.len() >= 16 {
        frame[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        frame[4..12].copy_from_slice(&sequence.to_le_bytes());
        frame[12..16].copy_from_slice(&origin.to_le_bytes());
    }
    match decode_frame(&frame, &expected) {
        Ok((header, block, after)) => {
            assert_eq!(header.sequence, sequence);
            assert_eq!(header.origin, origin);
            assert!(header.origin < world_size);
            assert!(header.length <= max_bytes);
            assert_eq!(block.len() as u64, header.length);
            let used = FRAME_HEADER_BYTES + block.len();
            assert_eq!(header.encode()[..], frame[..FRAME_HEADER_BYTES]);
            assert_eq!(encode_frame(sequence, origin, block), frame[..used]);
            assert_eq!(after, &frame[used..]);
        }
        Err(error) => {
            let _ = error.to_string();
            match error {
                FrameError::ShortHeader { got } => {
                    assert!(frame.len() < FRAME_HEADER_BYTES);
                    assert_eq!(got, frame.len());
                }
                FrameError::OutOfStep {
                    magic,
                    got_sequence,
                    got_origin,
                    ..
                } => {
                    assert_eq!(magic, u32_at(&frame, 0));
                    assert_eq!(got_sequence, u64_at(&frame, 4));
                    assert_eq!(got_origin, u32_at(&frame, 12));
                    assert!(
                        magic != FRAME_MAGIC || got_sequence != sequence || got_origin != origin
                    );
                }
                FrameError::OriginOutsideRing { .. } => assert!(origin >= world_size),
                FrameError::TooLong { length, .. } => {
                    assert_eq!(length, u64_at(&frame, 16));
                    assert!(length > max_bytes);
                }
                FrameError::ShortBlock { got, length } => {
                    assert!(length <= max_bytes);
                    assert_eq!(got, (frame.len() - FRAME_HEADER_BYTES) as u64);
                    assert!(got < length);
                }
            }
        }
    }
});
