//! The scalar reference kernel: the seeds' algorithm grown to the full contract. Written to be
//! obviously right, not fast; every faster kernel is tested against it.
//!
//! Twin of `cpp/src/reference_kernel.cpp`: same passes, same order, same numerics.
//!
//! Shapes (see `problem.rs`):
//!   q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) -> out (B, Hq, Lq, Dv), lse (B, Hq, Lq)
//!   mask (B, Hq, Lq, Lk) bool or float bias; q_offset (B,), kv_lens (B,);
//!   alibi_slopes (B, Hq), sinks (Hq,) when given.
//!   Query head h reads KV head h / group, group = Hq / Hkv.
//!
//! For each query row i of sequence b, head h, at position p = q_offset[b] + i, in float64:
//!   1. select the visible keys and score them: key j is visible iff j < kv_lens[b], and
//!      (not causal or j <= p), and (window_left < 0 or j >= p - window_left), and
//!      (window_right < 0 or j <= p + window_right), and (bool mask[b,h,i,j] or no bool mask),
//!      and its float bias is not -inf; score_j = scale * (q_i . k_j), then
//!      softcap * tanh(score_j / softcap) when softcap > 0, then - slope[b,h] * |p - j| (ALiBi),
//!      then + bias_ij.
//!   2. row_max = max(sink[h], max_j score_j) (sink = -inf without sinks; NaN when any score is
//!      NaN).
//!   3. e_j = exp(score_j - row_max), row_sum = exp(sink[h] - row_max) + sum_j e_j.
//!   4. normalise: p_j = e_j / row_sum.
//!   5. out_i = sum_j p_j v_j, lse_i = row_max + ln(row_sum) (+inf when row_max is +inf).
//!
//! Only visible keys are ever touched after pass 1 (and k_j is read in pass 1 only once j has
//! passed the position, length, window and mask tests), so hidden keys cannot contribute, not
//! even as 0 * NaN. A key whose score is -inf (bias, or inf in q or k) is left out like a hidden
//! one. A row with no visible key gets out = 0 and lse = sink[h] (-inf without sinks).
//!
//! Non-finite inputs at visible positions propagate as in twinattn/reference.py: a NaN score
//! makes the row's out and lse NaN (row_max is NaN); a +inf score makes out NaN (inf / inf) and
//! lse +inf; NaN or inf in v reaches the columns it is in. Hidden positions never matter.
//!
//! Threads: the B*Hq (b, h) pairs, numbered b*Hq + h, are cut into `num_threads` contiguous
//! chunks, chunk t = [pairs*t/threads, pairs*(t+1)/threads). Chunk 0 runs on the calling thread,
//! the others on scoped threads started for this call. Each thread owns one score buffer (Lk)
//! and one accumulator (Dv), reused for all its rows. Rows never depend on the split, so every
//! thread count gives bit-identical results.

use crate::element::{BFloat16, Element, Float16, Load};
use crate::problem::{
    check_num_threads, check_problem, try_filled, AttentionProblem, ElementType, MaskKind,
    ParamView3, ProblemError,
};

/// Computes attention for `p` with `num_threads` threads, after [`check_problem`] and
/// [`check_num_threads`], whose errors it returns without touching any memory; a scratch buffer
/// that cannot be allocated gives [`ProblemError::out_of_memory`].
///
/// # Safety
///
/// Every view in `p` must describe memory valid for its whole shape: q, k, v and the mask
/// readable at every in-bounds index (k and v rows j >= kv_lens[b] excepted: they are never read),
/// out and lse (when requested) writeable at every in-bounds index, and nothing else may write
/// any of that memory, or read out or lse, during the call. check_problem then guarantees that
/// out and lse overlap neither themselves nor any input, so the threads' writes are disjoint.
pub unsafe fn attention_reference(
    p: &AttentionProblem,
    num_threads: usize,
) -> Result<(), ProblemError> {
    check_problem(p)?;
    let threads = check_num_threads(i64::try_from(num_threads).unwrap_or(i64::MAX))?;
    let [batch, q_heads, q_len, _] = p.q.shape;
    let pairs = (batch * q_heads) as usize;
    if pairs == 0 || q_len == 0 {
        return Ok(());
    }
    let threads = threads.min(pairs);
    let chunk = |t: usize| pairs * t / threads..pairs * (t + 1) / threads;

    // Scratch for every thread, allocated here so that a failed allocation reaches the caller
    // (as C++'s std::bad_alloc does) instead of aborting the process.
    let mut scratch = Vec::new();
    scratch
        .try_reserve_exact(threads)
        .map_err(|_| ProblemError::out_of_memory())?;
    let longest_kv_len = p.kv_lens.iter().copied().max().unwrap_or(0) as usize;
    for _ in 0..threads {
        let mut visible = Vec::new();
        visible
            .try_reserve_exact(longest_kv_len)
            .map_err(|_| ProblemError::out_of_memory())?;
        scratch.push(RowScratch {
            visible,
            out_row: try_filled(p.v.shape[3] as usize, 0.0)?,
        });
    }

    // SAFETY: forwarded from this function's contract; check_problem has passed.
    let shared = unsafe { SharedProblem::new(p) };
    let (first, others) = scratch.split_first_mut().expect("threads >= 1");
    std::thread::scope(|scope| {
        for (t, scratch) in others.iter_mut().enumerate() {
            let shared = &shared;
            scope.spawn(move || attend_pairs(shared, chunk(t + 1), scratch));
        }
        attend_pairs(&shared, chunk(0), first);
    });
    Ok(())
}

/// A visible key of the row: its index j and its score_j, then e_j, then p_j as the passes go.
#[derive(Clone, Copy)]
struct VisibleKey {
    key: usize,
    score: f64,
}

/// One thread's buffers, allocated once per call before any thread starts.
struct RowScratch {
    /// capacity: the longest kv_len
    visible: Vec<VisibleKey>,
    /// Dv accumulators
    out_row: Vec<f64>,
}

/// A checked problem whose memory the caller vouched for, shareable across the threads of one
/// call. Raw pointers are neither Send nor Sync, so Rust needs this wrapper; C++ does not.
struct SharedProblem<'p, 'a> {
    p: &'p AttentionProblem<'a>,
}

impl<'p, 'a> SharedProblem<'p, 'a> {
    /// # Safety
    /// `p` has passed check_problem and meets the contract of [`attention_reference`].
    unsafe fn new(p: &'p AttentionProblem<'a>) -> Self {
        SharedProblem { p }
    }
}

// SAFETY: the threads only read q, k, v and the mask, which nobody writes during the call, and
// each writes the out and lse rows of its own (b, h) pairs; check_problem has proven that out
// and lse do not overlap themselves, each other or the inputs, so no two threads touch the same
// output element and no write is seen by a read.
unsafe impl Sync for SharedProblem<'_, '_> {}

/// Every row of the (sequence, query head) pairs in `pairs`, pair = b * Hq + h.
fn attend_pairs(shared: &SharedProblem, pairs: std::ops::Range<usize>, scratch: &mut RowScratch) {
    let p = shared.p;
    let q_heads = p.q.shape[1] as usize;
    let attend_row = match (p.dtype, p.kv_int8) {
        (ElementType::Float32, false) => attend_row::<f32, f32>,
        (ElementType::Float16, false) => attend_row::<Float16, Float16>,
        (ElementType::BFloat16, false) => attend_row::<BFloat16, BFloat16>,
        (ElementType::Float32, true) => attend_row::<f32, i8>,
        (ElementType::Float16, true) => attend_row::<Float16, i8>,
        (ElementType::BFloat16, true) => attend_row::<BFloat16, i8>,
    };
    for pair in pairs {
        let (b, h) = (pair / q_heads, pair % q_heads);
        for i in 0..p.q.shape[2] as usize {
            // SAFETY: the problem is checked and its memory valid (SharedProblem's contract);
            // this thread owns pair (b, h), so it alone writes its out and lse rows.
            unsafe { attend_row(p, b, h, i, scratch) };
        }
    }
}

/// The absolute position q_offset[b] + i of row i (exact: no int64 overflow).
fn position_of(p: &AttentionProblem, b: usize, i: usize) -> i128 {
    i128::from(p.q_offset.get(b).copied().unwrap_or(0)) + i as i128
}

/// Row i of (b, h). T: the element type of q and out (f32, Float16 or BFloat16), KV that of k
/// and v (T, or i8: dequantized as float32(x) * scale in float32, then used as float32 inputs
/// are). Each element read is converted exactly to float32 (then float64); each out element is
/// rounded to float32 first, then to T (for float16 and bfloat16 that double rounding is the
/// contract's "round the float32 result").
///
/// # Safety
/// `p` is checked and its memory valid ([`attention_reference`]'s contract); b < B, h < Hq,
/// i < Lq; nobody else touches out and lse row (b, h, i) meanwhile.
unsafe fn attend_row<T: Element, KV: Load>(
    p: &AttentionProblem,
    b: usize,
    h: usize,
    i: usize,
    scratch: &mut RowScratch,
) {
    let head_dim = p.q.shape[3] as usize;
    let value_dim = p.v.shape[3] as usize;
    let kv_head = h / (p.q.shape[1] / p.k.shape[1]) as usize;
    let at = |index: [usize; 4], stride: &[i64; 4]| -> isize {
        (0..4)
            .map(|axis| index[axis] as i64 * stride[axis])
            .sum::<i64>() as isize
    };
    let scale_at = |view: &ParamView3, j: usize| -> f32 {
        // SAFETY: b < B, kv_head < Hkv, j < Lk: inside the (B, Hkv, Lk) scales (checked shape;
        // present when kv_int8).
        unsafe {
            *view.data.offset(at(
                [b, kv_head, j, 0],
                &[view.stride[0], view.stride[1], view.stride[2], 0],
            ))
        }
    };
    let int8 = KV::SCALED;
    // SAFETY: forwarded from this function's contract: every index is inside a checked view
    // (keys j < kv_len <= Lk; the mask, slopes and sinks at in-bounds indices when given).
    unsafe {
        let q_row = p.q.data.cast::<T>().offset(at([b, h, i, 0], &p.q.stride));
        let k_head =
            p.k.data
                .cast::<KV>()
                .offset(at([b, kv_head, 0, 0], &p.k.stride));
        let v_head =
            p.v.data
                .cast::<KV>()
                .offset(at([b, kv_head, 0, 0], &p.v.stride));
        let out_row = p
            .out
            .data
            .cast::<T>()
            .offset(at([b, h, i, 0], &p.out.stride));
        // out32 (float16 / bfloat16, when given): out before its rounding to T
        let out32_row = if p.out32.data.is_null() {
            std::ptr::null_mut()
        } else {
            p.out32
                .data
                .cast::<f32>()
                .offset(at([b, h, i, 0], &p.out32.stride))
        };
        let mask_row = at([b, h, i, 0], &p.mask.stride);

        // 1. Select the visible keys and score them.
        let visible = &mut scratch.visible;
        visible.clear(); // keeps capacity: no allocation here
        let kv_len = p.kv_lens[b] as usize;
        let softcap = f64::from(p.softcap);
        let slope = if p.alibi_slopes.data.is_null() {
            0.0
        } else {
            let stride = &p.alibi_slopes.stride;
            f64::from(
                *p.alibi_slopes
                    .data
                    .offset(at([b, h, 0, 0], &[stride[0], stride[1], 0, 0])),
            )
        };
        let sink = if p.sinks.data.is_null() {
            f64::NEG_INFINITY
        } else {
            f64::from(*p.sinks.data.offset(h as isize * p.sinks.stride[0] as isize))
        };
        for j in 0..kv_len {
            if !in_window(p, b, i, j) {
                continue;
            }
            let mut bias = 0.0f64;
            let mask_index = mask_row + j as isize * p.mask.stride[3] as isize;
            match p.mask.kind {
                // read as a byte: any nonzero value means "may attend"
                MaskKind::Bool if *p.mask.data.offset(mask_index) == 0 => continue,
                MaskKind::Float => {
                    bias = f64::from(*p.mask.data.cast::<f32>().offset(mask_index));
                    if bias == f64::NEG_INFINITY {
                        continue; // hidden before k_j is read
                    }
                }
                _ => {}
            }
            let k_row = k_head.offset(j as isize * p.k.stride[2] as isize);
            let k_multiplier = if int8 { scale_at(&p.k_scale, j) } else { 1.0 };
            let mut dot = 0.0f64;
            for d in 0..head_dim {
                let k_value = if int8 {
                    (*k_row.add(d)).to_f32() * k_multiplier
                } else {
                    (*k_row.add(d)).to_f32()
                };
                dot += f64::from((*q_row.add(d)).to_f32()) * f64::from(k_value);
            }
            let mut score = f64::from(p.scale) * dot;
            if softcap > 0.0 {
                score = softcap * (score / softcap).tanh();
            }
            if !p.alibi_slopes.data.is_null() {
                let distance = position_of(p, b, i) - j as i128;
                score -= slope * distance.abs() as f64;
            }
            score += bias;
            if score == f64::NEG_INFINITY {
                continue; // an all-(-inf) row ends up with no visible key
            }
            visible.push(VisibleKey { key: j, score });
        }

        let lse = if p.lse.is_requested() {
            p.lse.data.offset(
                b as isize * p.lse.stride[0] as isize
                    + h as isize * p.lse.stride[1] as isize
                    + i as isize * p.lse.stride[2] as isize,
            )
        } else {
            std::ptr::null_mut()
        };
        if visible.is_empty() {
            for d in 0..value_dim {
                *out_row.add(d) = T::from_f32(0.0);
            }
            for d in (0..value_dim).filter(|_| !out32_row.is_null()) {
                *out32_row.add(d) = 0.0;
            }
            if !lse.is_null() {
                *lse = sink as f32; // -inf without sinks
            }
            return;
        }

        // 2. Row max (the sink is a key without a value).
        let mut row_max = sink;
        for key in visible.iter() {
            // NaN-propagating: a NaN score stays the row max
            if !row_max.is_nan() && (key.score.is_nan() || key.score > row_max) {
                row_max = key.score;
            }
        }

        // 3. Exponentiate and sum.
        let mut row_sum = if sink == f64::NEG_INFINITY {
            0.0
        } else {
            (sink - row_max).exp()
        };
        for key in visible.iter_mut() {
            key.score = (key.score - row_max).exp(); // <= 1: no large positive exponentials
            row_sum += key.score;
        }

        // 4. Normalise.
        for key in visible.iter_mut() {
            key.score /= row_sum;
        }

        // 5. Weight the values; write out and lse.
        let out_acc = &mut scratch.out_row;
        out_acc.fill(0.0);
        for key in visible.iter() {
            let v_row = v_head.offset(key.key as isize * p.v.stride[2] as isize);
            let v_multiplier = if int8 {
                scale_at(&p.v_scale, key.key)
            } else {
                1.0
            };
            for (d, acc) in out_acc.iter_mut().enumerate() {
                let v_value = if int8 {
                    (*v_row.add(d)).to_f32() * v_multiplier
                } else {
                    (*v_row.add(d)).to_f32()
                };
                *acc += key.score * f64::from(v_value);
            }
        }
        for (d, &acc) in out_acc.iter().enumerate() {
            *out_row.add(d) = T::from_f32(acc as f32);
        }
        for (d, &acc) in out_acc.iter().enumerate().filter(|_| !out32_row.is_null()) {
            *out32_row.add(d) = acc as f32;
        }
        if !lse.is_null() {
            // a +inf score: ln(sum) = +inf, though the weights are inf / inf
            *lse = if row_max == f64::INFINITY {
                f32::INFINITY
            } else {
                (row_max + row_sum.ln()) as f32
            };
        }
    }
}

/// Whether key j < kv_lens[b] is visible to row i by position (causal and window).
fn in_window(p: &AttentionProblem, b: usize, i: usize, j: usize) -> bool {
    if !p.causal && p.window_left < 0 && p.window_right < 0 {
        return true;
    }
    let position = position_of(p, b, i);
    let j = j as i128;
    !(p.causal && j > position
        || p.window_left >= 0 && j < position - i128::from(p.window_left)
        || p.window_right >= 0 && j > position + i128::from(p.window_right))
}
