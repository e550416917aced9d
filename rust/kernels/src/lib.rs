//! lora_pin's kernels: everything that moves bytes. The CPU LoRA kernels (AVX-512 shrink and expand,
//! their thread pool, DoRA's rescale) and reading an adapter's tensors into host memory while hashing
//! them (BLAKE3, many messages abreast). Which bytes move where is decided by `lora_pin_core`; from it
//! this crate takes only the error type, and the core never depends on this crate.

pub mod digests;
pub mod sgmv;
pub mod weights;
