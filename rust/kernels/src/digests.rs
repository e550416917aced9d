//! BLAKE3 digests of many short messages at once, each bit-identical to `blake3::hash` of it.
//!
//! A tensor's digest message is a short head (tag, name, dtype, shape: about 100 bytes) followed by
//! the tensor's bytes. Hashed alone, such a message's first 16 chunks sit in subtrees of 1, 1, 2, 4
//! and 8 chunks (the head's chunk and the tree's left edge), and BLAKE3 compresses a subtree's chunks
//! abreast only as many as the subtree has: for an adapter's 16-176 KiB tensors most of the work
//! then runs one to eight lanes wide instead of sixteen, and 56 of them cost 1.4x the same bytes
//! hashed in one piece. Here the full chunks on every message's left edge are compressed together
//! across messages, sixteen abreast (chunks of one position share a counter, so any sixteen of
//! them make one SIMD call), the aligned subtrees of 16 chunks or more inside a message's bytes are
//! hashed by the `blake3` crate's own wide path, and each message's tree is then merged from those
//! chaining values with the crate's `hazmat` functions.
//!
//! The chunk compression across messages uses `blake3::platform::Platform::hash_many`, the crate's
//! SIMD kernel selection, which the crate exports but does not document: `Cargo.toml` pins the
//! crate's exact version for that reason, and the tests here compare every path against
//! `blake3::hash` (and the Python tests against the Python `blake3` package).

use blake3::hazmat::ChainingValue;
use blake3::hazmat::{left_subtree_len, merge_subtrees_non_root, merge_subtrees_root, HasherExt, Mode};
use blake3::platform::Platform;
use blake3::{Hasher, IncrementCounter, CHUNK_LEN};

/// BLAKE3's initial chaining value, the key words of the plain hash mode.
const IV: [u32; 8] =
    [0x6A09_E667, 0xBB67_AE85, 0x3C6E_F372, 0xA54F_F53A, 0x510E_527F, 0x9B05_688C, 0x1F83_D9AB, 0x5BE0_CD19];
/// The block flags of a chunk's first and last blocks.
const CHUNK_START: u8 = 1;
const CHUNK_END: u8 = 2;
/// Subtrees of at least this many bytes inside a message's body go to the crate's wide path: at
/// sixteen chunks its SIMD kernels run full width (AVX-512 compresses 16 chunks abreast).
const WIDE_BYTES: usize = 16 * CHUNK_LEN;

/// One message: `head` then `body`, hashed as their concatenation.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    /// The first bytes (short: a tensor's tag, name, dtype and shape).
    pub head: &'a [u8],
    /// The rest.
    pub body: &'a [u8],
}

impl Message<'_> {
    /// Bytes `[start, start + len)` of the message, copied into `out`.
    fn copy(&self, start: usize, len: usize, out: &mut [u8]) {
        let head = self.head.len();
        let from_head = head.saturating_sub(start).min(len);
        out[..from_head].copy_from_slice(&self.head[start..start + from_head]);
        if from_head < len {
            let body_at = start + from_head - head;
            out[from_head..len].copy_from_slice(&self.body[body_at..body_at + len - from_head]);
        }
    }
}

/// A leaf of a message's tree as this module splits it: its chaining value once computed.
enum Leaf<'a> {
    /// A full chunk, compressed later with the other messages' chunks of its position.
    Chunk { counter: u64, bytes: ChunkBytes<'a> },
    /// A chaining value already computed (a wide subtree, or a message's last, partial chunk).
    Done(ChainingValue),
}

enum ChunkBytes<'a> {
    Body(&'a [u8; CHUNK_LEN]),
    /// A chunk that holds head bytes, assembled into `copies[i]`.
    Copied(usize),
}

/// The BLAKE3 hash of each message, in order: `blake3::hash(head ++ body)`.
pub fn digests(messages: &[Message<'_>]) -> Vec<[u8; 32]> {
    let mut batch = Digests::default();
    for message in messages {
        batch.add(message.head, message.body);
    }
    batch.finish()
}

/// Digests of messages added one at a time: [`Digests::add`] hashes what a message needs alone
/// (its wide subtrees and its last chunk) at once, while its body is in cache, and keeps its
/// left-edge chunks for [`Digests::finish`], which compresses them across messages.
#[derive(Default)]
pub struct Digests<'a> {
    leaves: Vec<Leaf<'a>>,
    copies: Vec<[u8; CHUNK_LEN]>,
    /// Per message: its head's length and its length, or its hash for a message of one chunk.
    messages: Vec<Result<(usize, usize), [u8; 32]>>,
}

impl<'a> Digests<'a> {
    /// Adds the message `head ++ body`; `body` is read again by [`Digests::finish`].
    pub fn add(&mut self, head: &[u8], body: &'a [u8]) {
        let len = head.len() + body.len();
        if len <= CHUNK_LEN {
            let mut hasher = Hasher::new();
            hasher.update(head).update(body);
            self.messages.push(Err(*hasher.finalize().as_bytes()));
            return;
        }
        let left = left_subtree_len(len as u64) as usize;
        self.split(head, body, 0, left);
        self.split(head, body, left, len - left);
        self.messages.push(Ok((head.len(), len)));
    }

    /// The hash of every message added, in order.
    pub fn finish(self) -> Vec<[u8; 32]> {
        let cvs = compress_chunks(&self.leaves, &self.copies);
        let mut cvs = cvs.iter();
        self.messages
            .iter()
            .map(|message| match *message {
                Err(hash) => hash,
                Ok((head, len)) => {
                    let left = left_subtree_len(len as u64) as usize;
                    let left_cv = merge(head, 0, left, &mut cvs);
                    let right_cv = merge(head, left, len - left, &mut cvs);
                    *merge_subtrees_root(&left_cv, &right_cv, Mode::Hash).as_bytes()
                }
            })
            .collect()
    }

    /// Appends the leaves of the non-root subtree `[start, start + len)` of `head ++ body`, left to
    /// right.
    fn split(&mut self, head: &[u8], body: &'a [u8], start: usize, len: usize) {
        if !is_leaf(head.len(), start, len) {
            let left = left_subtree_len(len as u64) as usize;
            self.split(head, body, start, left);
            self.split(head, body, start + left, len - left);
            return;
        }
        let counter = (start / CHUNK_LEN) as u64;
        let in_body = start.checked_sub(head.len()).map(|at| &body[at..at + len]);
        let leaf = match in_body {
            Some(body) if len == CHUNK_LEN => {
                let bytes = body.try_into().expect("a chunk's bytes are CHUNK_LEN long");
                Leaf::Chunk { counter, bytes: ChunkBytes::Body(bytes) }
            }
            Some(body) => Leaf::Done(subtree_cv(start, body)),
            None => {
                let mut bytes = [0; CHUNK_LEN];
                Message { head, body }.copy(start, len, &mut bytes);
                if len == CHUNK_LEN {
                    self.copies.push(bytes);
                    Leaf::Chunk { counter, bytes: ChunkBytes::Copied(self.copies.len() - 1) }
                } else {
                    Leaf::Done(subtree_cv(start, &bytes[..len]))
                }
            }
        };
        self.leaves.push(leaf);
    }
}

/// Whether the non-root subtree `[start, start + len)` of a message whose head is `head` bytes long
/// is one leaf (else it is split at its left subtree's length, as BLAKE3's tree is).
fn is_leaf(head: usize, start: usize, len: usize) -> bool {
    len <= CHUNK_LEN || (len >= WIDE_BYTES && start >= head)
}

/// The chaining value of the non-root subtree of `bytes` starting at message offset `start`.
fn subtree_cv(start: usize, bytes: &[u8]) -> ChainingValue {
    Hasher::new().set_input_offset(start as u64).update(bytes).finalize_non_root()
}

/// Every leaf's chaining value, in order: the pending chunks compressed by position, as many abreast
/// as share one.
fn compress_chunks(leaves: &[Leaf<'_>], copies: &[[u8; CHUNK_LEN]]) -> Vec<ChainingValue> {
    let mut cvs: Vec<ChainingValue> =
        leaves.iter().map(|leaf| if let Leaf::Done(cv) = leaf { *cv } else { [0; 32] }).collect();
    let mut pending: Vec<(u64, usize, &[u8; CHUNK_LEN])> = leaves
        .iter()
        .enumerate()
        .filter_map(|(i, leaf)| match leaf {
            Leaf::Chunk { counter, bytes: ChunkBytes::Body(bytes) } => Some((*counter, i, *bytes)),
            Leaf::Chunk { counter, bytes: ChunkBytes::Copied(c) } => Some((*counter, i, &copies[*c])),
            Leaf::Done(_) => None,
        })
        .collect();
    pending.sort_unstable_by_key(|&(counter, i, _)| (counter, i));
    let platform = Platform::detect();
    let mut out = Vec::new();
    for run in pending.chunk_by(|a, b| a.0 == b.0) {
        let inputs: Vec<&[u8; CHUNK_LEN]> = run.iter().map(|p| p.2).collect();
        out.resize(32 * inputs.len(), 0);
        platform.hash_many(&inputs, &IV, run[0].0, IncrementCounter::No, 0, CHUNK_START, CHUNK_END, &mut out);
        for (&(_, i, _), cv) in run.iter().zip(out.chunks_exact(32)) {
            cvs[i].copy_from_slice(cv);
        }
    }
    cvs
}

/// The chaining value of the non-root subtree `[start, start + len)` of `message`, merged from its
/// leaves' (taken from `cvs` in the order `split` appended them); `head`: its head's length.
fn merge(
    head: usize,
    start: usize,
    len: usize,
    cvs: &mut std::slice::Iter<'_, ChainingValue>,
) -> ChainingValue {
    if is_leaf(head, start, len) {
        return *cvs.next().expect("one chaining value per leaf");
    }
    let left = left_subtree_len(len as u64) as usize;
    let left_cv = merge(head, start, left, cvs);
    let right_cv = merge(head, start + left, len - left, cvs);
    merge_subtrees_non_root(&left_cv, &right_cv, Mode::Hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize, seed: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 + i / 251 + seed * 7) as u8).collect()
    }

    fn check(parts: &[(Vec<u8>, Vec<u8>)]) {
        let messages: Vec<Message<'_>> = parts.iter().map(|(head, body)| Message { head, body }).collect();
        let want: Vec<[u8; 32]> =
            parts.iter().map(|(head, body)| *blake3::hash(&[&head[..], body].concat()).as_bytes()).collect();
        assert_eq!(digests(&messages), want);
    }

    #[test]
    fn each_digest_is_blake3_of_head_and_body_at_tree_boundaries() {
        // Message lengths on both sides of a chunk, of 2 and 16 chunks, and of the wide threshold
        // with the head inside and outside the first chunk; heads of 0, 1, 100, 1024 and 3000 bytes.
        let mut parts = vec![];
        for (h, head_len) in [0usize, 1, 100, 1023, 1024, 1025, 3000].into_iter().enumerate() {
            for total in [0usize, 1, 1023, 1024, 1025, 2048, 2049, 16 * 1024 - 1, 16 * 1024, 16 * 1024 + 1] {
                for extra in [0usize, 17 * 1024, 64 * 1024] {
                    let body = (total + extra).saturating_sub(head_len);
                    parts.push((bytes(head_len, h), bytes(body, total + extra)));
                }
            }
        }
        check(&parts);
        // One at a time, too: no batch partner for any chunk position.
        for part in &parts[..40] {
            check(std::slice::from_ref(part));
        }
    }

    #[test]
    fn a_batch_of_adapter_like_tensors_matches_blake3() {
        let mut parts = vec![];
        for (i, size) in [16usize, 64, 176, 64, 16, 300, 1, 0].iter().cycle().take(40).enumerate() {
            let head = bytes(90 + i % 13, i);
            parts.push((head, bytes(size * 1024 + i % 3, i)));
        }
        check(&parts);
        check(&[]);
    }
}
