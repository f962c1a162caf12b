//! The masks' keystream: AES-128 in counter mode (NIST SP 800-38A, a
//! 128-bit big-endian counter), on x86-64 with AVX-512 VAES where the CPU
//! has it, else RustCrypto's `ctr` over `aes` (AES-NI, ARMv8's AES, or
//! constant-time software).
//!
//! Why a kernel of our own: masks were nearly all of a client's and the
//! server's compute in secure aggregation, and `aes` 0.8 encrypts one block
//! per AES-NI instruction (9.3 GB/s on one core of the 2-core machine);
//! VAES encrypts four per instruction (42.4 GB/s; `cargo bench -p
//! cohort-core --bench secagg -- --keystream`). Both paths give RustCrypto's bytes,
//! which `the_stream_in_use_is_the_portable_one` checks (the VAES kernel
//! only on a CPU that has it, as the 2-core build machine does).

use aes_gcm::aes::Aes128;
use ctr::cipher::{KeyIvInit, StreamCipher};

/// Bytes of one AES block.
const BLOCK: usize = 16;

/// An AES-128-CTR keystream, keyed by a seed's first half and counting from
/// its second half.
pub struct AesCtr {
    backend: Backend,
    /// Keystream bytes of a block begun and not yet handed out.
    spare: [u8; BLOCK],
    spare_len: usize,
}

enum Backend {
    Portable(Box<ctr::Ctr128BE<Aes128>>),
    #[cfg(target_arch = "x86_64")]
    Vaes(vaes::Stream),
}

impl AesCtr {
    /// The stream of `seed`, on VAES when this CPU has it.
    pub fn new(seed: &[u8; 32]) -> AesCtr {
        #[cfg(target_arch = "x86_64")]
        if vaes::available() {
            return AesCtr::with(Backend::Vaes(vaes::Stream::new(seed)));
        }
        AesCtr::portable(seed)
    }

    /// The stream of `seed` on RustCrypto's implementation, whatever the CPU.
    pub fn portable(seed: &[u8; 32]) -> AesCtr {
        let (key, counter) = seed.split_at(BLOCK);
        let cipher = ctr::Ctr128BE::<Aes128>::new(key.into(), counter.into());
        AesCtr::with(Backend::Portable(Box::new(cipher)))
    }

    fn with(backend: Backend) -> AesCtr {
        AesCtr {
            backend,
            spare: [0; BLOCK],
            spare_len: 0,
        }
    }

    /// Overwrites `out` with the stream's next `out.len()` bytes.
    pub fn fill(&mut self, out: &mut [u8]) {
        let from_spare = self.spare_len.min(out.len());
        let start = BLOCK - self.spare_len;
        out[..from_spare].copy_from_slice(&self.spare[start..start + from_spare]);
        self.spare_len -= from_spare;
        let rest = &mut out[from_spare..];
        let whole = rest.len() / BLOCK * BLOCK;
        let (blocks, tail) = rest.split_at_mut(whole);
        self.blocks(blocks);
        if !tail.is_empty() {
            let mut spare = [0u8; BLOCK];
            self.blocks(&mut spare);
            tail.copy_from_slice(&spare[..tail.len()]);
            self.spare = spare;
            self.spare_len = BLOCK - tail.len();
        }
    }

    /// Whole blocks of keystream into `out` (its length a multiple of 16).
    fn blocks(&mut self, out: &mut [u8]) {
        match &mut self.backend {
            Backend::Portable(cipher) => {
                out.fill(0);
                cipher.apply_keystream(out);
            }
            #[cfg(target_arch = "x86_64")]
            Backend::Vaes(stream) => stream.blocks(out),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vaes {
    use std::arch::x86_64::*;

    use super::BLOCK;

    /// Blocks encrypted per pass: four registers of four blocks, enough to
    /// keep the AES units' pipeline full.
    const PASS: usize = 16;

    pub fn available() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("vaes")
            && is_x86_feature_detected!("aes")
    }

    /// The expanded key and the next block's counter; only built where
    /// [`available`] holds.
    pub struct Stream {
        round_keys: [[u8; BLOCK]; 11],
        counter: u128,
    }

    impl Stream {
        pub fn new(seed: &[u8; 32]) -> Stream {
            let key: [u8; BLOCK] = seed[..BLOCK].try_into().expect("16 bytes");
            let counter: [u8; BLOCK] = seed[BLOCK..].try_into().expect("16 bytes");
            // SAFETY: `Stream`s are only made where `available()` holds,
            // which includes AES-NI.
            let round_keys = unsafe { expand_key(key) };
            Stream {
                round_keys,
                counter: u128::from_be_bytes(counter),
            }
        }

        pub fn blocks(&mut self, out: &mut [u8]) {
            debug_assert_eq!(out.len() % BLOCK, 0);
            // SAFETY: as in `new`: the CPU has AVX-512F/BW and VAES.
            unsafe { encrypt_counters(&self.round_keys, &mut self.counter, out) }
        }
    }

    /// AES-128's key schedule (FIPS 197, 5.2), with AES-NI's key-generation
    /// assist.
    #[target_feature(enable = "aes")]
    fn expand_key(key: [u8; BLOCK]) -> [[u8; BLOCK]; 11] {
        #[target_feature(enable = "aes")]
        fn next(key: __m128i, assist: __m128i) -> __m128i {
            let assist = _mm_shuffle_epi32::<0xff>(assist);
            let mut key = key;
            key = _mm_xor_si128(key, _mm_slli_si128::<4>(key));
            key = _mm_xor_si128(key, _mm_slli_si128::<4>(key));
            key = _mm_xor_si128(key, _mm_slli_si128::<4>(key));
            _mm_xor_si128(key, assist)
        }
        let mut keys = [_mm_setzero_si128(); 11];
        // SAFETY: reads 16 bytes of a 16-byte array.
        keys[0] = unsafe { _mm_loadu_si128(key.as_ptr().cast()) };
        keys[1] = next(keys[0], _mm_aeskeygenassist_si128::<0x01>(keys[0]));
        keys[2] = next(keys[1], _mm_aeskeygenassist_si128::<0x02>(keys[1]));
        keys[3] = next(keys[2], _mm_aeskeygenassist_si128::<0x04>(keys[2]));
        keys[4] = next(keys[3], _mm_aeskeygenassist_si128::<0x08>(keys[3]));
        keys[5] = next(keys[4], _mm_aeskeygenassist_si128::<0x10>(keys[4]));
        keys[6] = next(keys[5], _mm_aeskeygenassist_si128::<0x20>(keys[5]));
        keys[7] = next(keys[6], _mm_aeskeygenassist_si128::<0x40>(keys[6]));
        keys[8] = next(keys[7], _mm_aeskeygenassist_si128::<0x80>(keys[7]));
        keys[9] = next(keys[8], _mm_aeskeygenassist_si128::<0x1b>(keys[8]));
        keys[10] = next(keys[9], _mm_aeskeygenassist_si128::<0x36>(keys[9]));
        let mut bytes = [[0u8; BLOCK]; 11];
        for (out, key) in bytes.iter_mut().zip(keys) {
            // SAFETY: writes 16 bytes into a 16-byte array.
            unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), key) };
        }
        bytes
    }

    /// Encrypts the counter blocks `counter, counter + 1, …` into `out`, 16
    /// at a time, and advances `counter` past them. The counters are built
    /// in registers (little-endian, then byte-swapped), with 64-bit adds
    /// that hold while the low half does not wrap in a pass; a pass where it
    /// would (about once in 2^60 seeds) is built one block at a time.
    #[target_feature(enable = "avx512f,avx512bw,vaes,aes")]
    fn encrypt_counters(round_keys: &[[u8; BLOCK]; 11], counter: &mut u128, out: &mut [u8]) {
        // SAFETY: reads 16 bytes of each 16-byte round key.
        let keys: [__m512i; 11] = std::array::from_fn(|i| unsafe {
            _mm512_broadcast_i32x4(_mm_loadu_si128(round_keys[i].as_ptr().cast()))
        });
        // Reverses the bytes of each 128-bit lane: little- to big-endian.
        let swap = _mm512_broadcast_i32x4(_mm_set_epi8(
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
        ));
        let steps: [__m512i; 4] = std::array::from_fn(|r| {
            let first = 4 * r as i64;
            _mm512_set_epi64(0, first + 3, 0, first + 2, 0, first + 1, 0, first)
        });
        let mut chunks = out.chunks_exact_mut(PASS * BLOCK);
        for chunk in &mut chunks {
            let mut blocks = [_mm512_setzero_si512(); 4];
            if (*counter as u64).checked_add(PASS as u64 - 1).is_some() {
                let base = _mm512_broadcast_i32x4(_mm_set_epi64x(
                    (*counter >> 64) as u64 as i64,
                    *counter as u64 as i64,
                ));
                for (block, step) in blocks.iter_mut().zip(steps) {
                    *block = _mm512_shuffle_epi8(_mm512_add_epi64(base, step), swap);
                }
            } else {
                let mut counters = [0u8; PASS * BLOCK];
                for (j, c) in counters.chunks_exact_mut(BLOCK).enumerate() {
                    c.copy_from_slice(&counter.wrapping_add(j as u128).to_be_bytes());
                }
                for (r, block) in blocks.iter_mut().enumerate() {
                    // SAFETY: reads 64 of the 256 bytes of `counters`.
                    *block = unsafe { _mm512_loadu_si512(counters[64 * r..].as_ptr().cast()) };
                }
            }
            for block in &mut blocks {
                *block = _mm512_xor_si512(*block, keys[0]);
            }
            for key in &keys[1..10] {
                for block in &mut blocks {
                    *block = _mm512_aesenc_epi128(*block, *key);
                }
            }
            for (r, block) in blocks.iter().enumerate() {
                let last = _mm512_aesenclast_epi128(*block, keys[10]);
                // SAFETY: writes 64 of the chunk's 256 bytes.
                unsafe { _mm512_storeu_si512(chunk[64 * r..].as_mut_ptr().cast(), last) };
            }
            *counter = counter.wrapping_add(PASS as u128);
        }
        for block in chunks.into_remainder().chunks_exact_mut(BLOCK) {
            let state = _mm_set_epi64x((*counter >> 64) as u64 as i64, *counter as u64 as i64);
            let mut state = _mm_shuffle_epi8(state, _mm512_castsi512_si128(swap));
            state = _mm_xor_si128(state, _mm512_castsi512_si128(keys[0]));
            for key in &keys[1..10] {
                state = _mm_aesenc_si128(state, _mm512_castsi512_si128(*key));
            }
            state = _mm_aesenclast_si128(state, _mm512_castsi512_si128(keys[10]));
            // SAFETY: writes the block's 16 bytes.
            unsafe { _mm_storeu_si128(block.as_mut_ptr().cast(), state) };
            *counter = counter.wrapping_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stream_bytes(mut stream: AesCtr, pieces: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        for &len in pieces {
            let mut piece = vec![0xA5u8; len];
            stream.fill(&mut piece);
            out.extend(piece);
        }
        out
    }

    /// RustCrypto's AES-128-CTR keystream of `len` bytes in one call: the
    /// reference, which goes through none of [`AesCtr`]'s own code.
    fn reference(seed: &[u8; 32], len: usize) -> Vec<u8> {
        let (key, counter) = seed.split_at(BLOCK);
        let mut cipher = ctr::Ctr128BE::<Aes128>::new(key.into(), counter.into());
        let mut out = vec![0u8; len];
        cipher.apply_keystream(&mut out);
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The stream this machine uses (VAES where the CPU has it, else
        /// RustCrypto's cipher behind cohort's piecewise `fill`) and the
        /// portable one both give RustCrypto's AES-128-CTR keystream taken
        /// in one call, for any seed, in pieces of any lengths, and across
        /// the low counter half's wrap (the counter half of the seed is set
        /// near it when `near_wrap`).
        #[test]
        fn the_stream_in_use_is_the_portable_one(
            seed in proptest::array::uniform32(any::<u8>()),
            near_wrap in any::<bool>(),
            back in 0u8..40,
            pieces in proptest::collection::vec(0usize..700, 1..8),
        ) {
            let mut seed = seed;
            if near_wrap {
                seed[24..].copy_from_slice(&(u64::MAX - u64::from(back)).to_be_bytes());
            }
            let expected = reference(&seed, pieces.iter().sum());
            prop_assert_eq!(&stream_bytes(AesCtr::new(&seed), &pieces), &expected);
            prop_assert_eq!(&stream_bytes(AesCtr::portable(&seed), &pieces), &expected);
        }
    }
}
