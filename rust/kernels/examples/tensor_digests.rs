//! Hashing an adapter's tensors: the digests of 56 tensors (the layout of `benches/load_adapters.py`'s
//! adapters: 4 layers, hidden 1024, intermediate 2816, rank 16, fp32, 4.4 MiB) one tensor at a time
//! (`tensor_digest`, each with its own hasher) and together (`digests::digests`, chunks compressed
//! across tensors), against BLAKE3 over the same bytes in one piece; minimum of 400 runs each, in
//! alternating rounds.
//!
//!     cargo run --release --example tensor_digests

use std::hint::black_box;
use std::time::Instant;

use lora_pin_kernels::digests::{digests, Message};
use lora_pin_kernels::weights::{tensor_digest, tensor_head};

fn main() {
    let mut tensors = vec![];
    for layer in 0..4 {
        for (module, a, b) in [
            ("self_attn.q_proj", [16, 1024], [1024, 16]),
            ("self_attn.k_proj", [16, 1024], [256, 16]),
            ("self_attn.v_proj", [16, 1024], [256, 16]),
            ("self_attn.o_proj", [16, 1024], [1024, 16]),
            ("mlp.gate_proj", [16, 1024], [2816, 16]),
            ("mlp.up_proj", [16, 1024], [2816, 16]),
            ("mlp.down_proj", [16, 2816], [1024, 16]),
        ] {
            for (half, shape) in [("A", a), ("B", b)] {
                let name = format!("base_model.model.model.layers.{layer}.{module}.lora_{half}.weight");
                tensors.push((name, vec![shape[0], shape[1]]));
            }
        }
    }
    let total: u64 = tensors.iter().map(|(_, s)| s[0] * s[1] * 4).sum();
    let whole: Vec<u8> = (0..total as usize).map(|i| (i * 131 + i / 251) as u8).collect();
    let mut parts = vec![];
    let mut at = 0;
    for (name, shape) in &tensors {
        let len = (shape[0] * shape[1] * 4) as usize;
        parts.push((name.as_str(), shape.as_slice(), &whole[at..at + len]));
        at += len;
    }
    let one_at_a_time = || -> Vec<[u8; 32]> {
        parts.iter().map(|(name, shape, data)| tensor_digest(name, "F32", shape, data)).collect()
    };
    let together = || -> Vec<[u8; 32]> {
        let heads: Vec<Vec<u8>> =
            parts.iter().map(|(name, shape, _)| tensor_head(name, "F32", shape)).collect();
        let messages: Vec<Message<'_>> =
            parts.iter().zip(&heads).map(|((_, _, body), head)| Message { head, body }).collect();
        digests(&messages)
    };
    assert_eq!(one_at_a_time(), together());
    let best = |f: &dyn Fn()| {
        (0..400)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min)
    };
    println!("{} tensors, {:.2} MiB", parts.len(), total as f64 / (1 << 20) as f64);
    let mut ratios = (vec![], vec![]);
    for _ in 0..5 {
        let piece = best(&|| {
            black_box(blake3::hash(black_box(&whole)));
        });
        let alone = best(&|| {
            black_box(one_at_a_time());
        });
        let batched = best(&|| {
            black_box(together());
        });
        println!(
            "one piece {:.3} ms; one tensor at a time {:.3} ms ({:.2}x); together {:.3} ms ({:.2}x)",
            piece * 1e3,
            alone * 1e3,
            alone / piece,
            batched * 1e3,
            batched / piece
        );
        ratios.0.push(alone / piece);
        ratios.1.push(batched / piece);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "median against one piece: one tensor at a time {:.2}x, together {:.2}x",
        median(&mut ratios.0),
        median(&mut ratios.1)
    );
}
