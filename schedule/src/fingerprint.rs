//! [`PlanFingerprint`]: a stable 64-bit digest of a plan, and the hasher behind it.
//!
//! The hash is our own and fixed forever (never std's `DefaultHasher`, whose output may
//! change between Rust versions): the plan's canonical little-endian encoding is cut into
//! 64-bit words, each word is folded in with `state = (state.rotate_left(23) ^ word) * K`
//! (a bijection of the state for a fixed word, so two encodings of equal length that differ
//! in one word always differ), and the length is mixed in at the end with a 64-bit
//! finalizer (MurmurHash3's `fmix64`). Byte strings are length-prefixed and zero-padded to
//! whole words, so the encoding is prefix-free. The same inputs give the same fingerprint on
//! every platform and in every process.

use std::fmt;

use collsched_buckets::CanonicalSink;

/// A stable 64-bit digest of a [`Plan`](crate::Plan): equal on every platform and process
/// for equal plans, so ranks can compare plans cheaply. Printed as 16 lower-case hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PlanFingerprint(pub u64);

impl fmt::Display for PlanFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The stable hasher of fingerprints; also a [`CanonicalSink`].
///
/// # Examples
/// ```
/// use collsched_schedule::StableHasher;
/// let mut h = StableHasher::new();
/// h.word(7);
/// h.bytes(b"qkv");
/// let a = h.finish();
/// let mut h = StableHasher::new();
/// h.word(7);
/// h.bytes(b"qkw");
/// assert_ne!(a, h.finish());
/// ```
#[derive(Clone, Debug)]
pub struct StableHasher {
    state: u64,
    words: u64,
}

const SEED: u64 = 0x636f_6c6c_7363_6865; // "collsche"
const K: u64 = 0x9e37_79b9_7f4a_7c15;

impl StableHasher {
    /// A fresh hasher.
    pub fn new() -> Self {
        StableHasher { state: SEED, words: 0 }
    }

    /// Folds in one 64-bit word.
    #[inline]
    pub fn word(&mut self, w: u64) {
        self.state = (self.state.rotate_left(23) ^ w).wrapping_mul(K);
        self.words += 1;
    }

    /// Folds in a byte string: its length, then its bytes as little-endian words (the last
    /// one zero-padded).
    pub fn bytes(&mut self, b: &[u8]) {
        self.word(b.len() as u64);
        let mut chunks = b.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.word(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.word(u64::from_le_bytes(w));
        }
    }

    /// The digest of everything folded in so far.
    pub fn finish(&self) -> u64 {
        let mut h = self.state ^ self.words.wrapping_mul(K);
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

impl Default for StableHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl CanonicalSink for StableHasher {
    fn word(&mut self, w: u64) {
        StableHasher::word(self, w);
    }

    fn bytes(&mut self, b: &[u8]) {
        StableHasher::bytes(self, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference implementation written out longhand, so a change to the fast path that
    /// alters the output (and thereby every fingerprint ever exchanged) is caught.
    fn reference(words: &[u64]) -> u64 {
        let mut s = SEED;
        for &w in words {
            s = s.rotate_left(23) ^ w;
            s = s.wrapping_mul(K);
        }
        let mut h = s ^ (words.len() as u64).wrapping_mul(K);
        for (shift, mul) in [(33, 0xff51_afd7_ed55_8ccdu64), (33, 0xc4ce_b9fe_1a85_ec53)] {
            h ^= h >> shift;
            h = h.wrapping_mul(mul);
        }
        h ^ (h >> 33)
    }

    #[test]
    fn bytes_are_length_prefixed_little_endian_words() {
        let mut h = StableHasher::new();
        h.bytes(b"abcdefghij");
        let w0 = u64::from_le_bytes(*b"abcdefgh");
        let w1 = u64::from_le_bytes([b'i', b'j', 0, 0, 0, 0, 0, 0]);
        assert_eq!(h.finish(), reference(&[10, w0, w1]));
    }

    #[test]
    fn prefix_free_strings() {
        let digest = |parts: &[&[u8]]| {
            let mut h = StableHasher::new();
            for p in parts {
                h.bytes(p);
            }
            h.finish()
        };
        assert_ne!(digest(&[b"ab", b"c"]), digest(&[b"a", b"bc"]));
        assert_ne!(digest(&[b"a\0"]), digest(&[b"a"]));
    }

    /// The real hasher, against the longhand reference and against itself with any single
    /// bit of any word flipped.
    #[test]
    fn single_word_changes_always_change_the_digest() {
        let hash = |words: &[u64]| {
            let mut h = StableHasher::new();
            words.iter().for_each(|&w| h.word(w));
            h.finish()
        };
        let base: Vec<u64> = (0..50).map(|i| i * 0x9e37_79b9).collect();
        let d = hash(&base);
        assert_eq!(d, reference(&base), "the hasher left its documented formula");
        for i in 0..base.len() {
            for bit in [0, i % 64, 63] {
                let mut v = base.clone();
                v[i] ^= 1 << bit;
                assert_ne!(hash(&v), d, "word {i} bit {bit}");
            }
        }
    }
}
