//! Reading an adapter's stored tensors from its weight file into host memory, hashing each one as it
//! is read: the one copy the host tier makes and the adapter's content digest in a single pass.
//!
//! A tensor larger than [`PIECE_BYTES`] is read in pieces of that size and every piece is hashed
//! right after it lands, while it is still in the core's cache, so the bytes cross memory once.
//! A smaller one is read whole and hashed as far as it can be alone right after, also in cache;
//! the chunks on the left edges of the small tensors' trees, which a tensor alone compresses one to
//! eight abreast, are compressed sixteen abreast across tensors at the end ([`crate::digests`]):
//! those are each tensor's first 16 KiB read a second time. A load's tensors are shared
//! out over a few threads (about equal bytes each, never under [`MIN_BYTES_PER_THREAD`] a thread):
//! reading from the page cache and BLAKE3 both scale with cores, and a small adapter stays on the
//! calling thread.
//!
//! Float tensors (`F64`, `F32`, `F16`, `BF16`) are also searched for NaN and infinities in the same
//! pass, piece by piece while the bytes are hot, so the host tier needs no second pass over memory to
//! refuse them.
//!
//! The digest of one tensor is the layout `lora_pin/weights/digest.py` documents and
//! `tensor_digest` there computes with the Python `blake3` package (tests compare the two): BLAKE3
//! of [`TENSOR_TAG`], then the name and the safetensors dtype name (each as its UTF-8 length, u64
//! little endian, then its bytes), the number of dimensions and each dimension (u64 little endian),
//! then the tensor's bytes as stored.

use std::io;

use crate::digests::Digests;
use lora_pin_core::{Error, Result};

/// The tag every tensor digest starts with: a new layout of what is hashed gets a new tag.
pub const TENSOR_TAG: &[u8] = b"lora_pin tensor v1\0";
/// Bytes read, then hashed, at a time: small enough to be hashed from the core's L2 cache.
pub const PIECE_BYTES: usize = 256 << 10;
/// The least a thread of its own is worth (below it, starting a thread costs more than it saves).
pub const MIN_BYTES_PER_THREAD: usize = 2 << 20;

/// A source of bytes at offsets, such as a weight file opened by the caller.
pub trait ReadAt: Sync {
    /// Reads up to `buf.len()` bytes at `offset` into `buf`; returns how many (0 at the end).
    ///
    /// # Errors
    /// What the operating system reports for the read.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
}

#[cfg(unix)]
impl ReadAt for std::fs::File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(self, buf, offset)
    }
}

impl ReadAt for [u8] {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(self.len());
        let n = buf.len().min(self.len() - start);
        buf[..n].copy_from_slice(&self[start..start + n]);
        Ok(n)
    }
}

/// One stored tensor to read: what its digest covers, where its bytes lie in the file, and where they
/// go (exactly the tensor's bytes long).
#[derive(Debug)]
pub struct TensorRead<'a> {
    /// The tensor's name in the file.
    pub name: String,
    /// Its safetensors dtype name (`F32`, `BF16` ...).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// The file offset of its first byte.
    pub offset: u64,
    /// Where its bytes go.
    pub out: &'a mut [u8],
}

/// What reading one tensor found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorOutcome {
    /// Its digest (see the module's layout).
    pub digest: [u8; 32],
    /// How many of its elements are NaN or infinite, for the dtypes searched (`F64`, `F32`, `F16`,
    /// `BF16`); `None` for the others.
    pub non_finite: Option<u64>,
}

/// The number of NaN or infinite elements in `data` of safetensors dtype `dtype` (little endian), for
/// `F64`, `F32`, `F16` and `BF16`; `None` for other dtypes. An element is NaN or infinite exactly when
/// all its exponent bits are set.
pub fn count_non_finite(dtype: &str, data: &[u8]) -> Option<u64> {
    Some(match dtype {
        "F64" => count_exponent_all_ones::<8>(data, 0x7ff0_0000_0000_0000),
        "F32" => count_exponent_all_ones::<4>(data, 0x7f80_0000),
        "F16" => count_exponent_all_ones::<2>(data, 0x7c00),
        "BF16" => count_exponent_all_ones::<2>(data, 0x7f80),
        _ => return None,
    })
}

/// How many little-endian `N`-byte words (`N` = 2, 4 or 8) of `data` have every bit of `mask` set:
/// [`count_words`], with AVX2 where the CPU has it.
fn count_exponent_all_ones<const N: usize>(data: &[u8], mask: u64) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (just detected), all `count_words_avx2` requires.
        return unsafe { count_words_avx2::<N>(data, mask) };
    }
    count_words::<N>(data, mask)
}

/// [`count_words`] compiled for AVX2: on 4 MiB of `F32` 0.08 ms against the baseline's (SSE2) 0.17
/// ms, about an eighth of BLAKE3's time over the same bytes instead of a quarter.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn count_words_avx2<const N: usize>(data: &[u8], mask: u64) -> u64 {
    count_words::<N>(data, mask)
}

/// [`count_exponent_all_ones`] for any CPU. Counted in `u32` per block of words, each word compared
/// at its own width, so that the compiler turns the inner loop into vector compares (a `u64` count
/// per word took twice as long).
#[inline(always)]
fn count_words<const N: usize>(data: &[u8], mask: u64) -> u64 {
    const BLOCK: usize = 1 << 14;
    let mut total = 0u64;
    for block in data.chunks(BLOCK * N) {
        let found: u32 = match N {
            2 => {
                let mask = mask as u16;
                block
                    .chunks_exact(2)
                    .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]) & mask == mask))
                    .sum()
            }
            4 => {
                let mask = mask as u32;
                block
                    .chunks_exact(4)
                    .map(|c| u32::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & mask == mask))
                    .sum()
            }
            _ => block
                .chunks_exact(8)
                .map(|c| {
                    let word = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
                    u32::from(word & mask == mask)
                })
                .sum(),
        };
        total += u64::from(found);
    }
    total
}

/// What a tensor's digest hashes before its bytes: its tag, name, dtype and shape (see the module's
/// layout).
pub fn tensor_head(name: &str, dtype: &str, shape: &[u64]) -> Vec<u8> {
    let mut head = Vec::with_capacity(TENSOR_TAG.len() + 24 + name.len() + dtype.len() + 8 * shape.len());
    head.extend_from_slice(TENSOR_TAG);
    for text in [name, dtype] {
        head.extend_from_slice(&(text.len() as u64).to_le_bytes());
        head.extend_from_slice(text.as_bytes());
    }
    head.extend_from_slice(&(shape.len() as u64).to_le_bytes());
    for dim in shape {
        head.extend_from_slice(&dim.to_le_bytes());
    }
    head
}

/// A BLAKE3 hasher that has taken a tensor's tag, name, dtype and shape: its bytes come next.
pub fn tensor_hasher(name: &str, dtype: &str, shape: &[u64]) -> blake3::Hasher {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&tensor_head(name, dtype, shape));
    hasher
}

/// The 32-byte digest of one stored tensor whose bytes are `data` (see the module's layout).
pub fn tensor_digest(name: &str, dtype: &str, shape: &[u64], data: &[u8]) -> [u8; 32] {
    let mut hasher = tensor_hasher(name, dtype, shape);
    hasher.update(data);
    *hasher.finalize().as_bytes()
}

/// Reads every tensor of `reads` from `source` into its `out` and returns what each one gave (its
/// digest, and its NaN/infinity count for the float dtypes searched), in the order of `reads`, on up
/// to `threads` threads (the calling thread included).
///
/// # Errors
/// [`Error::WeightFile`] naming the first tensor (in the order of `reads`) whose bytes could not be
/// read: an I/O error, or the source ending before the tensor's last byte (a file truncated while it
/// was read). The other tensors' `out` may then hold some of their bytes.
pub fn read_tensors<R: ReadAt + ?Sized>(
    source: &R,
    reads: &mut [TensorRead<'_>],
    threads: usize,
) -> Result<Vec<TensorOutcome>> {
    let total: usize = reads.iter().map(|r| r.out.len()).sum();
    let threads = threads.min(total / MIN_BYTES_PER_THREAD).clamp(1, reads.len().max(1));
    let mut found = vec![TensorOutcome { digest: [0; 32], non_finite: None }; reads.len()];
    if threads == 1 {
        return read_run(source, reads, &mut found).map(|()| found);
    }
    // Contiguous runs of about total / threads bytes each, so each thread reads the file forward.
    let mut bounds = vec![0];
    let mut filled = 0;
    for (i, read) in reads.iter().enumerate() {
        filled += read.out.len();
        if filled * threads >= total * bounds.len() && bounds.len() < threads && i + 1 < reads.len() {
            bounds.push(i + 1);
        }
    }
    bounds.push(reads.len());
    let mut runs = Vec::with_capacity(bounds.len() - 1);
    let (mut rest_reads, mut rest_found) = (reads, found.as_mut_slice());
    for pair in bounds.windows(2) {
        let (run, tail) = rest_reads.split_at_mut(pair[1] - pair[0]);
        let (out, tail_found) = rest_found.split_at_mut(pair[1] - pair[0]);
        runs.push((run, out));
        (rest_reads, rest_found) = (tail, tail_found);
    }
    let first = runs.remove(0);
    let outcomes = std::thread::scope(|scope| {
        let others: Vec<_> =
            runs.into_iter().map(|(run, out)| scope.spawn(move || read_run(source, run, out))).collect();
        let mut outcomes = vec![read_run(source, first.0, first.1)];
        outcomes
            .extend(others.into_iter().map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p))));
        outcomes
    });
    // Runs are in the order of `reads`: the first failure is the earliest tensor's.
    outcomes.into_iter().collect::<Result<Vec<()>>>().map(|_| found)
}

fn read_run<R: ReadAt + ?Sized>(
    source: &R,
    reads: &mut [TensorRead<'_>],
    outcomes: &mut [TensorOutcome],
) -> Result<()> {
    // Tensors of at most a piece are read whole and searched and hashed as far as each can be alone
    // while in cache; their left edges are compressed together at the end ([`Digests`]). A larger
    // tensor is read and hashed a piece at a time.
    let mut small = Digests::default();
    let mut small_at = Vec::new();
    for (i, (read, outcome)) in reads.iter_mut().zip(outcomes.iter_mut()).enumerate() {
        if read.out.len() > PIECE_BYTES {
            read_large(source, read, outcome)?;
            continue;
        }
        fill(source, read.out, read.offset)
            .map_err(|why| Error::WeightFile(format!("tensor {:?}: {why}", read.name)))?;
        outcome.non_finite = count_non_finite(&read.dtype, read.out);
        small.add(&tensor_head(&read.name, &read.dtype, &read.shape), &*read.out);
        small_at.push(i);
    }
    for (i, digest) in small_at.into_iter().zip(small.finish()) {
        outcomes[i].digest = digest;
    }
    Ok(())
}

fn read_large<R: ReadAt + ?Sized>(
    source: &R,
    read: &mut TensorRead<'_>,
    outcome: &mut TensorOutcome,
) -> Result<()> {
    let mut hasher = tensor_hasher(&read.name, &read.dtype, &read.shape);
    let mut non_finite = count_non_finite(&read.dtype, &[]);
    for (i, piece) in read.out.chunks_mut(PIECE_BYTES).enumerate() {
        let at = read.offset + (i * PIECE_BYTES) as u64;
        fill(source, piece, at).map_err(|why| Error::WeightFile(format!("tensor {:?}: {why}", read.name)))?;
        hasher.update(piece);
        // A piece is a multiple of every element size, so no element straddles two.
        non_finite = non_finite.map(|n| n + count_non_finite(&read.dtype, piece).unwrap_or(0));
    }
    *outcome = TensorOutcome { digest: *hasher.finalize().as_bytes(), non_finite };
    Ok(())
}

/// Fills `buf` from `source` at `offset`, or says why it could not.
fn fill<R: ReadAt + ?Sized>(source: &R, buf: &mut [u8], offset: u64) -> std::result::Result<(), String> {
    let mut done = 0;
    while done < buf.len() {
        match source.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                return Err(format!(
                    "the file changed while it was read (it ends at byte {}, before the tensor's bytes \
                     {offset}..{})",
                    offset + done as u64,
                    offset + buf.len() as u64
                ))
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("cannot read: {e}")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_bytes(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 + i / 251) as u8).collect()
    }

    fn reads<'a>(outs: &'a mut [Vec<u8>], offsets: &[u64]) -> Vec<TensorRead<'a>> {
        outs.iter_mut()
            .zip(offsets)
            .enumerate()
            .map(|(i, (out, &offset))| TensorRead {
                name: format!("t{i}"),
                dtype: "U8".into(),
                shape: vec![out.len() as u64],
                offset,
                out: out.as_mut_slice(),
            })
            .collect()
    }

    #[test]
    fn every_thread_count_reads_and_hashes_alike() {
        let file = file_bytes(9 << 20);
        let sizes = [0usize, 1, 3 << 20, PIECE_BYTES + 7, 5, 2 << 20, 1 << 20];
        let mut offsets = vec![];
        let mut at = 11u64;
        for size in sizes {
            offsets.push(at);
            at += size as u64;
        }
        let mut results = vec![];
        for threads in [1, 2, 3, 8] {
            let mut outs: Vec<Vec<u8>> = sizes.iter().map(|&s| vec![0; s]).collect();
            let digests = read_tensors(file.as_slice(), &mut reads(&mut outs, &offsets), threads).unwrap();
            for ((out, &offset), digest) in outs.iter().zip(&offsets).zip(&digests) {
                let want = &file[offset as usize..offset as usize + out.len()];
                assert_eq!(out.as_slice(), want);
                let i = outs.iter().position(|o| std::ptr::eq(o, out)).unwrap();
                assert_eq!(digest.digest, tensor_digest(&format!("t{i}"), "U8", &[out.len() as u64], want));
                assert_eq!(digest.non_finite, None);
            }
            results.push(digests);
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]));
    }

    #[test]
    fn the_digest_is_the_documented_layout() {
        // Independent of tensor_hasher: the bytes the layout names, hashed in one call.
        let mut message = TENSOR_TAG.to_vec();
        for text in ["lora_A", "BF16"] {
            message.extend((text.len() as u64).to_le_bytes());
            message.extend(text.as_bytes());
        }
        message.extend(2u64.to_le_bytes());
        message.extend(3u64.to_le_bytes());
        message.extend(1u64.to_le_bytes());
        message.extend([1, 2, 3, 4, 5, 6]);
        let want = *blake3::hash(&message).as_bytes();
        assert_eq!(tensor_digest("lora_A", "BF16", &[3, 1], &[1, 2, 3, 4, 5, 6]), want);
        assert_ne!(tensor_digest("lora_A", "BF16", &[1, 3], &[1, 2, 3, 4, 5, 6]), want);
    }

    #[test]
    fn a_short_source_names_the_first_tensor_it_cuts() {
        let file = file_bytes(6 << 20);
        let mut outs = vec![vec![0; 1 << 20], vec![0; 3 << 20], vec![0; 3 << 20]];
        let offsets = [0, 1 << 20, 4 << 20];
        for threads in [1, 2] {
            let err = read_tensors(file.as_slice(), &mut reads(&mut outs, &offsets), threads).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, Error::WeightFile(_)), "{msg}");
            assert!(msg.contains("\"t2\"") && msg.contains("ends at byte 6291456"), "{msg}");
        }
    }

    #[test]
    fn an_io_error_names_its_tensor() {
        struct Failing;
        impl ReadAt for Failing {
            fn read_at(&self, _: &mut [u8], _: u64) -> io::Result<usize> {
                Err(io::Error::other("disk on fire"))
            }
        }
        let mut outs = vec![vec![0; 4]];
        let err = read_tensors(&Failing, &mut reads(&mut outs, &[0]), 4).unwrap_err();
        assert_eq!(err.to_string(), "tensor \"t0\": cannot read: disk on fire");
    }

    #[test]
    fn non_finite_values_are_counted_by_their_exponent_bits() {
        let f32s = [0.0f32, -1.5, f32::MAX, f32::MIN_POSITIVE / 2.0, f32::NAN, f32::INFINITY, -f32::INFINITY];
        let bytes: Vec<u8> = f32s.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(count_non_finite("F32", &bytes), Some(3));
        let f64s = [f64::MAX, -0.0, f64::NAN, f64::NEG_INFINITY, 1e-310];
        let bytes: Vec<u8> = f64s.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(count_non_finite("F64", &bytes), Some(2));
        // f16: 65504 (max), 1.0, +inf, a NaN, -inf; bf16: max, 1.0, +inf, a NaN.
        let f16s: [u16; 5] = [0x7bff, 0x3c00, 0x7c00, 0x7e01, 0xfc00];
        let bytes: Vec<u8> = f16s.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(count_non_finite("F16", &bytes), Some(3));
        let bf16s: [u16; 4] = [0x7f7f, 0x3f80, 0x7f80, 0xffc1];
        let bytes: Vec<u8> = bf16s.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(count_non_finite("BF16", &bytes), Some(2));
        assert_eq!(count_non_finite("I32", &[0xff; 8]), None);
        assert_eq!(count_non_finite("F8_E5M2", &[0xff; 8]), None);
    }

    #[test]
    fn counts_agree_with_is_finite_across_blocks() {
        // Words on both sides of the counter's block boundaries (every 16,384 words), in every width.
        let at = [0usize, 16_383, 16_384, 16_385, 32_767, 40_000, 49_156];
        let words = 49_157;
        let f64s: Vec<f64> = (0..words)
            .map(|i| if at.contains(&i) { [f64::NAN, f64::INFINITY][i % 2] } else { i as f64 })
            .collect();
        let bytes: Vec<u8> = f64s.iter().flat_map(|x| x.to_le_bytes()).collect();
        let want = f64s.iter().filter(|x| !x.is_finite()).count() as u64;
        assert_eq!((want, count_non_finite("F64", &bytes)), (7, Some(7)));
        let f32s: Vec<f32> = f64s.iter().map(|&x| x as f32).collect();
        let bytes: Vec<u8> = f32s.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(
            count_non_finite("F32", &bytes),
            Some(f32s.iter().filter(|x| !x.is_finite()).count() as u64)
        );
        // f16 and bf16 by their bits: exponent all ones exactly at the marked words.
        for (dtype, inf) in [("F16", 0x7c00u16), ("BF16", 0x7f80u16)] {
            let bytes: Vec<u8> = (0..words)
                .flat_map(|i| {
                    (if at.contains(&i) { inf | (i as u16 & 1) } else { (i % 1000) as u16 }).to_le_bytes()
                })
                .collect();
            assert_eq!(count_non_finite(dtype, &bytes), Some(7), "{dtype}");
        }
    }

    #[test]
    fn the_vector_and_plain_counts_agree() {
        let bytes: Vec<u8> = (0..100_003usize).map(|i| [0xff, 0x7f, 0x80, 0x7c, 0x00][i % 5]).collect();
        for (n, mask) in [(2, 0x7c00u64), (2, 0x7f80), (4, 0x7f80_0000), (8, 0x7ff0_0000_0000_0000)] {
            let (fast, plain) = match n {
                2 => (count_exponent_all_ones::<2>(&bytes, mask), count_words::<2>(&bytes, mask)),
                4 => (count_exponent_all_ones::<4>(&bytes, mask), count_words::<4>(&bytes, mask)),
                _ => (count_exponent_all_ones::<8>(&bytes, mask), count_words::<8>(&bytes, mask)),
            };
            assert_eq!(fast, plain, "{n} bytes, mask {mask:#x}");
            assert!(plain > 0, "{n} bytes, mask {mask:#x}: the data must hold some");
        }
    }

    #[test]
    fn a_read_counts_the_non_finite_values_of_every_piece() {
        let mut values = vec![1.0f32; 3 * PIECE_BYTES / 4 + 5];
        for i in [0, PIECE_BYTES / 4 - 1, PIECE_BYTES / 4, values.len() - 1] {
            values[i] = f32::NAN;
        }
        let file: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut out = vec![0u8; file.len()];
        let mut read = [TensorRead {
            name: "t".into(),
            dtype: "F32".into(),
            shape: vec![values.len() as u64],
            offset: 0,
            out: &mut out,
        }];
        let found = read_tensors(file.as_slice(), &mut read, 1).unwrap();
        assert_eq!(found[0].non_finite, Some(4));
        assert_eq!(found[0].digest, tensor_digest("t", "F32", &[values.len() as u64], &file));
    }

    #[test]
    fn nothing_to_read_gives_no_digests() {
        assert!(read_tensors([0u8; 4].as_slice(), &mut [], 4).unwrap().is_empty());
    }
}
