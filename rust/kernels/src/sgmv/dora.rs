//! DoRA rows' rescale on the CPU: `out[r] = f[slot] · (out[r] − bias) + bias` for a step's DoRA rows,
//! in place, in one call (`lora_pin/ops/dora.py`'s `scale_rows_` for float32 tensors).
//!
//! The torch formulation gathers the rows, rescales them and scatters them back: five dispatches whose
//! fixed cost is most of a decode step's DoRA work. Here each row is read and written once, in place.

use lora_pin_core::{Error, Result};

/// Rescales rows `rows[i]` of `out` (`[n_rows, width]` row-major) by the factors of slot `slots[i]`
/// (`factors` is `[n_slots, width]`) around `bias` (`[width]`, or none: a plain product).
///
/// Every index is checked before anything is written. A row listed twice is rescaled twice (the
/// callers list each once).
///
/// Errors: [`Error::OpArgument`] naming the width, length, row or slot that does not fit.
pub fn dora_scale_rows(
    out: &mut [f32],
    width: usize,
    bias: Option<&[f32]>,
    factors: &[f32],
    rows: &[i64],
    slots: &[i64],
) -> Result<()> {
    let arg = |msg: String| Err(Error::OpArgument(format!("dora_scale_rows: {msg}")));
    if width == 0 || !out.len().is_multiple_of(width) || !factors.len().is_multiple_of(width) {
        return arg(format!(
            "out ({} elements) and factors ({}) must be whole rows of width {width} > 0",
            out.len(),
            factors.len()
        ));
    }
    if let Some(b) = bias {
        if b.len() != width {
            return arg(format!("bias has {} elements, expected {width}", b.len()));
        }
    }
    if rows.len() != slots.len() {
        return arg(format!("{} rows but {} slots", rows.len(), slots.len()));
    }
    let (n_rows, n_slots) = (out.len() / width, factors.len() / width);
    for (&row, &slot) in rows.iter().zip(slots) {
        if !(0..n_rows as i64).contains(&row) {
            return arg(format!("row {row} outside [0, {n_rows})"));
        }
        if !(0..n_slots as i64).contains(&slot) {
            return arg(format!("slot {slot} outside [0, {n_slots})"));
        }
    }
    for (&row, &slot) in rows.iter().zip(slots) {
        let (row, slot) = (row as usize, slot as usize);
        let values = &mut out[row * width..(row + 1) * width];
        let factor = &factors[slot * width..(slot + 1) * width];
        match bias {
            Some(bias) => {
                for ((o, &f), &b) in values.iter_mut().zip(factor).zip(bias) {
                    *o = (*o - b) * f + b;
                }
            }
            None => {
                for (o, &f) in values.iter_mut().zip(factor) {
                    *o *= f;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rescales_listed_rows_around_the_bias_only() {
        let mut out = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let factors = [2.0, 3.0, 0.5, 0.25];
        dora_scale_rows(&mut out, 2, Some(&[1.0, -1.0]), &factors, &[2, 0], &[1, 0]).unwrap();
        assert_eq!(out, vec![1.0, 8.0, 3.0, 4.0, 3.0, 0.75]);
        let mut plain = vec![1.0, 2.0];
        dora_scale_rows(&mut plain, 2, None, &factors, &[0], &[1]).unwrap();
        assert_eq!(plain, vec![0.5, 0.5]);
    }

    #[test]
    fn refuses_bad_indices_and_shapes_writing_nothing() {
        let mut out = vec![1.0; 4];
        let factors = [2.0; 4];
        for (rows, slots) in [(&[0, 2][..], &[0, 0][..]), (&[0, 1], &[0, 2]), (&[-1], &[0]), (&[0], &[0, 1])]
        {
            assert!(matches!(
                dora_scale_rows(&mut out, 2, None, &factors, rows, slots),
                Err(Error::OpArgument(_))
            ));
        }
        assert!(dora_scale_rows(&mut out, 3, None, &factors, &[], &[]).is_err());
        assert!(dora_scale_rows(&mut out, 2, Some(&[0.0]), &factors, &[], &[]).is_err());
        assert_eq!(out, vec![1.0; 4]);
    }
}
