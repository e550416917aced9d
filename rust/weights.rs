//! Reading an adapter's stored tensors from its weight file into host memory, hashing each one as it
//! is read: the one copy the host tier makes and the adapter's content digest in a single pass.
//!
//! Each tensor is read in pieces of [`PIECE_BYTES`] and every piece is hashed right after it lands,
//! while it is still in the core's cache, so the bytes cross memory once. A load's tensors are shared
//! out over a few threads (about equal bytes each, never under [`MIN_BYTES_PER_THREAD`] a thread):
//! reading from the page cache and BLAKE3 both scale with cores, and a small adapter stays on the
//! calling thread.
//!
//! The digest of one tensor is the layout `lora_pin/weights/digest.py` documents and
//! `tensor_digest` there computes with the Python `blake3` package (tests compare the two): BLAKE3
//! of [`TENSOR_TAG`], then the name and the safetensors dtype name (each as its UTF-8 length, u64
//! little endian, then its bytes), the number of dimensions and each dimension (u64 little endian),
//! then the tensor's bytes as stored.

use std::io;

use crate::error::{Error, Result};

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

/// A BLAKE3 hasher that has taken a tensor's tag, name, dtype and shape: its bytes come next.
pub fn tensor_hasher(name: &str, dtype: &str, shape: &[u64]) -> blake3::Hasher {
    let mut hasher = blake3::Hasher::new();
    hasher.update(TENSOR_TAG);
    for text in [name, dtype] {
        hasher.update(&(text.len() as u64).to_le_bytes());
        hasher.update(text.as_bytes());
    }
    hasher.update(&(shape.len() as u64).to_le_bytes());
    for dim in shape {
        hasher.update(&dim.to_le_bytes());
    }
    hasher
}

/// The 32-byte digest of one stored tensor whose bytes are `data` (see the module's layout).
pub fn tensor_digest(name: &str, dtype: &str, shape: &[u64], data: &[u8]) -> [u8; 32] {
    let mut hasher = tensor_hasher(name, dtype, shape);
    hasher.update(data);
    *hasher.finalize().as_bytes()
}

/// Reads every tensor of `reads` from `source` into its `out` and returns their digests, in the order
/// of `reads`, on up to `threads` threads (the calling thread included).
///
/// # Errors
/// [`Error::WeightFile`] naming the first tensor (in the order of `reads`) whose bytes could not be
/// read: an I/O error, or the source ending before the tensor's last byte (a file truncated while it
/// was read). The other tensors' `out` may then hold some of their bytes.
pub fn read_tensors<R: ReadAt + ?Sized>(
    source: &R,
    reads: &mut [TensorRead<'_>],
    threads: usize,
) -> Result<Vec<[u8; 32]>> {
    let total: usize = reads.iter().map(|r| r.out.len()).sum();
    let threads = threads.min(total / MIN_BYTES_PER_THREAD).clamp(1, reads.len().max(1));
    let mut digests = vec![[0u8; 32]; reads.len()];
    if threads == 1 {
        return read_run(source, reads, &mut digests).map(|()| digests);
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
    let (mut rest_reads, mut rest_digests) = (reads, digests.as_mut_slice());
    for pair in bounds.windows(2) {
        let (run, tail) = rest_reads.split_at_mut(pair[1] - pair[0]);
        let (out, tail_digests) = rest_digests.split_at_mut(pair[1] - pair[0]);
        runs.push((run, out));
        (rest_reads, rest_digests) = (tail, tail_digests);
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
    outcomes.into_iter().collect::<Result<Vec<()>>>().map(|_| digests)
}

fn read_run<R: ReadAt + ?Sized>(
    source: &R,
    reads: &mut [TensorRead<'_>],
    digests: &mut [[u8; 32]],
) -> Result<()> {
    for (read, digest) in reads.iter_mut().zip(digests) {
        let mut hasher = tensor_hasher(&read.name, &read.dtype, &read.shape);
        for (i, piece) in read.out.chunks_mut(PIECE_BYTES).enumerate() {
            let at = read.offset + (i * PIECE_BYTES) as u64;
            fill(source, piece, at)
                .map_err(|why| Error::WeightFile(format!("tensor {:?}: {why}", read.name)))?;
            hasher.update(piece);
        }
        *digest = *hasher.finalize().as_bytes();
    }
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
                assert_eq!(*digest, tensor_digest(&format!("t{i}"), "U8", &[out.len() as u64], want));
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
    fn nothing_to_read_gives_no_digests() {
        assert!(read_tensors([0u8; 4].as_slice(), &mut [], 4).unwrap().is_empty());
    }
}
