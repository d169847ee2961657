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
//! For each (sequence b, query head h) pair, for each query row i at position
//! p = q_offset[b] + i, in float64:
//!   1. Scores of the visible keys. Key j is visible iff j < kv_lens[b], and (not causal or
//!      j <= p), and (window_left < 0 or j >= p - window_left), and (window_right < 0 or
//!      j <= p + window_right), and (no bool mask or mask[b,h,i,j]), and its float bias (if any)
//!      is not -inf. Its score is s = scale * (q[b,h,i,:] . k[b,h/group,j,:]), then
//!      softcap * tanh(s / softcap) when softcap > 0, then minus slope[b,h] * |p - j| (ALiBi),
//!      then plus bias[b,h,i,j] (float mask only). A hidden key scores -inf without its k row being
//!      read; keys j >= kv_lens[b] are not even looked at. row_max = the largest score, NaN when
//!      any score is NaN.
//!   2. A row whose row_max is -inf (no visible key, or every score -inf) gets out = 0 and
//!      lse = sink[h] (-inf without sinks), and stops here. Otherwise the sink (a key without a
//!      value) joins: row_max = max(row_max, sink[h]) (NaN stays NaN).
//!   3. Weights: p_j = exp(score_j - row_max), row_sum = exp(sink[h] - row_max) + sum_j p_j.
//!   4. Output: out[b,h,i,:] = sum_j (p_j / row_sum) * v[b,h/group,j,:], skipping every hidden
//!      key (score -inf), so its value never enters, not even as 0 * NaN. A visible key whose
//!      weight underflows to 0 is not skipped (as in C++ and NumPy: 0 * NaN stays NaN).
//!   5. lse[b,h,i] = row_max + ln(row_sum), when requested; +inf when row_max is +inf.
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

use crate::element::{BFloat16, Dtype, Element, Float16, Load};
use crate::problem::{
    check_num_threads, check_problem, try_filled, AttentionProblem, MaskKind, ParamView3,
    ProblemError,
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
    for _ in 0..threads {
        scratch.push(RowScratch {
            scores: try_filled(p.k.shape[2] as usize, 0.0)?,
            acc: try_filled(p.v.shape[3] as usize, 0.0)?,
        });
    }

    // SAFETY: forwarded from this function's contract; check_problem has passed.
    let shared = unsafe { SharedProblem::new(p) };
    let (first, others) = scratch.split_first_mut().expect("threads >= 1");
    let run_pairs = match (p.dtype, p.kv_int8) {
        (Dtype::Float32, false) => run_pairs::<f32, f32>,
        (Dtype::Float16, false) => run_pairs::<Float16, Float16>,
        (Dtype::BFloat16, false) => run_pairs::<BFloat16, BFloat16>,
        (Dtype::Float32, true) => run_pairs::<f32, i8>,
        (Dtype::Float16, true) => run_pairs::<Float16, i8>,
        (Dtype::BFloat16, true) => run_pairs::<BFloat16, i8>,
    };
    std::thread::scope(|scope| {
        for (t, scratch) in others.iter_mut().enumerate() {
            let shared = &shared;
            scope.spawn(move || run_pairs(shared, chunk(t + 1), scratch));
        }
        run_pairs(&shared, chunk(0), first);
    });
    Ok(())
}

/// One thread's buffers: the scores of a row (Lk) and its output accumulator (Dv).
struct RowScratch {
    scores: Vec<f64>,
    acc: Vec<f64>,
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

/// Element offset of index `index` in a view with element strides `stride`.
fn offset<const N: usize>(index: [i64; N], stride: &[i64; N]) -> isize {
    index.iter().zip(stride).map(|(&i, &s)| i * s).sum::<i64>() as isize
}

/// The `len` contiguous elements of type T at element offset `at` from `data`; empty when `len`
/// is 0, without touching the pointer (NumPy may hand an empty array a dangling or null pointer).
///
/// # Safety
/// When `len > 0`, `data + at` (in elements of T) must be aligned and valid for reading `len`
/// elements, and nobody may write them while the slice lives.
unsafe fn row<'x, T>(data: *const u8, at: isize, len: i64) -> &'x [T] {
    if len == 0 {
        return &[];
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { std::slice::from_raw_parts(data.cast::<T>().offset(at), len as usize) }
}

/// Like [`row`], writeable.
///
/// # Safety
/// When `len > 0`, `data + at` must be aligned and valid for writing `len` floats, and nobody
/// else may access them while the slice lives.
unsafe fn row_mut<'x, T>(data: *mut u8, at: isize, len: i64) -> &'x mut [T] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { std::slice::from_raw_parts_mut(data.cast::<T>().offset(at), len as usize) }
}

/// Runs the (b, h) pairs numbered in `pair_range`, row by row, on q, k, v and out stored as T:
/// each element read is converted exactly to float32 (then float64); each out element is
/// rounded to float32 first, then to T (for float16 and bfloat16 that double rounding is the
/// contract's "round the float32 result", and the same in C++). KV: the storage of k and v (T,
/// or i8: each element dequantized as float32(x) * its token's scale in float32, then used as a
/// float32 input is).
fn run_pairs<T: Element, KV: Load>(
    shared: &SharedProblem,
    pair_range: std::ops::Range<usize>,
    scratch: &mut RowScratch,
) {
    let p = shared.p;
    let [_, q_heads, q_len, head_dim] = p.q.shape;
    let [_, kv_heads, _, _] = p.k.shape;
    let value_dim = p.v.shape[3];
    let group = q_heads / kv_heads;
    let scale = f64::from(p.scale);
    let RowScratch { scores, acc } = scratch;

    for pair in pair_range {
        let b = pair as i64 / q_heads;
        let h = pair as i64 % q_heads;
        let kv_head = h / group;
        let kv_len = p.kv_lens[b as usize];
        let softcap = f64::from(p.softcap);
        let slope = if p.alibi_slopes.data.is_null() {
            0.0
        } else {
            let at = offset([b, h], &p.alibi_slopes.stride);
            // SAFETY: b < B, h < Hq: inside the (B, Hq) slopes (checked shape).
            f64::from(unsafe { *p.alibi_slopes.data.offset(at) })
        };
        let sink = if p.sinks.data.is_null() {
            f64::NEG_INFINITY
        } else {
            // SAFETY: h < Hq: inside the (Hq,) sinks (checked shape).
            f64::from(unsafe { *p.sinks.data.offset(offset([h], &p.sinks.stride)) })
        };
        // int8: the float32 scale of key j of this (b, kv_head); 1 (unused) otherwise.
        let token_scale = |view: &ParamView3, j: i64| {
            if p.kv_int8 {
                // SAFETY: b < B, kv_head < Hkv, j < Lk: inside the (B, Hkv, Lk) scales (checked
                // shape; present when kv_int8).
                unsafe { *view.data.offset(offset([b, kv_head, j], &view.stride)) }
            } else {
                1.0
            }
        };
        let dequantize = |x: KV, multiplier: f32| {
            if p.kv_int8 {
                x.to_f32() * multiplier
            } else {
                x.to_f32()
            }
        };
        for i in 0..q_len {
            // The keys to look at: j < kv_len, then each tested against causality and the window.
            let key_end = kv_len;
            let position =
                i128::from(p.q_offset.get(b as usize).copied().unwrap_or(0)) + i128::from(i);

            // SAFETY: b < B, h < Hq, i < Lq: a valid q row of D elements, stride 1 (or D <= 1).
            let q_row: &[T] = unsafe { row(p.q.data, offset([b, h, i, 0], &p.q.stride), head_dim) };

            // 1. Scores of the visible keys; hidden keys score -inf.
            let mut row_max = f64::NEG_INFINITY;
            for j in 0..key_end {
                let hidden = !in_window(p, position, j)
                    || match p.mask.kind {
                        MaskKind::Bool => !mask_allows(shared, [b, h, i, j]),
                        // hidden before k_j is read, so a NaN there cannot enter
                        _ => mask_bias(shared, [b, h, i, j]) == f64::NEG_INFINITY,
                    };
                let score = if hidden {
                    f64::NEG_INFINITY
                } else {
                    // SAFETY: j < kv_len <= Lk and kv_head < Hkv: a valid key row of D elements.
                    let k_row: &[KV] =
                        unsafe { row(p.k.data, offset([b, kv_head, j, 0], &p.k.stride), head_dim) };
                    let k_multiplier = token_scale(&p.k_scale, j);
                    let dot: f64 = q_row
                        .iter()
                        .zip(k_row)
                        .map(|(&x, &y)| {
                            f64::from(x.to_f32()) * f64::from(dequantize(y, k_multiplier))
                        })
                        .sum();
                    let mut score = scale * dot;
                    if softcap > 0.0 {
                        score = softcap * (score / softcap).tanh();
                    }
                    if !p.alibi_slopes.data.is_null() {
                        score -= slope * (position - i128::from(j)).abs() as f64;
                    }
                    score + mask_bias(shared, [b, h, i, j])
                };
                scores[j as usize] = score;
                // NaN-propagating (f64::max would drop a NaN score)
                if !row_max.is_nan() && (score.is_nan() || score > row_max) {
                    row_max = score;
                }
            }

            // SAFETY: b < B, h < Hq, i < Lq: a valid out row of Dv elements, written only by the
            // thread that owns pair (b, h).
            let out_row: &mut [T] =
                unsafe { row_mut(p.out.data, offset([b, h, i, 0], &p.out.stride), value_dim) };

            // 2. No visible key: zeros and lse = the sink (-inf without sinks), never NaN.
            if row_max == f64::NEG_INFINITY {
                out_row.fill(T::from_f32(0.0));
                write_lse(shared, [b, h, i], sink as f32);
                continue;
            }
            if sink > row_max {
                row_max = sink; // (a NaN row max stays NaN)
            }

            // 3. Weights, shifted by the row max so no exponential overflows. A hidden key's
            // score stays -inf (its weight is exp(-inf) = 0), which step 4 reads to skip it.
            let mut row_sum = if sink == f64::NEG_INFINITY {
                0.0f64
            } else {
                (sink - row_max).exp()
            };
            for &score in &scores[..key_end as usize] {
                row_sum += (score - row_max).exp();
            }

            // 4. Mix the values of the visible keys.
            acc.fill(0.0);
            for j in 0..key_end {
                let score = scores[j as usize];
                if score == f64::NEG_INFINITY {
                    continue; // hidden: its value must not enter, even as 0 * NaN
                }
                let weight = (score - row_max).exp();
                // SAFETY: j < kv_len <= Lk and kv_head < Hkv: a valid value row of Dv elements.
                let v_row: &[KV] =
                    unsafe { row(p.v.data, offset([b, kv_head, j, 0], &p.v.stride), value_dim) };
                let v_multiplier = token_scale(&p.v_scale, j);
                let weight = weight / row_sum;
                for (a, &x) in acc.iter_mut().zip(v_row) {
                    *a += weight * f64::from(dequantize(x, v_multiplier));
                }
            }
            for (o, &a) in out_row.iter_mut().zip(acc.iter()) {
                *o = T::from_f32(a as f32);
            }

            // 5. The natural-log softmax denominator (a +inf score: the log of an infinite sum,
            // though the weights are inf / inf).
            let lse = if row_max == f64::INFINITY {
                f32::INFINITY
            } else {
                (row_max + row_sum.ln()) as f32
            };
            write_lse(shared, [b, h, i], lse);
        }
    }
}

/// Whether key j (< kv_len) is visible to the row at `position` by causality and the window.
fn in_window(p: &AttentionProblem, position: i128, j: i64) -> bool {
    let j = i128::from(j);
    !(p.causal && j > position
        || p.window_left >= 0 && j < position - i128::from(p.window_left)
        || p.window_right >= 0 && j > position + i128::from(p.window_right))
}

/// Whether the bool mask lets row (b, h, i) attend to key j.
fn mask_allows(shared: &SharedProblem, index: [i64; 4]) -> bool {
    let mask = &shared.p.mask;
    // SAFETY: a Bool mask is readable at every index of (B, Hq, Lq, Lk), and index is in bounds.
    unsafe { *mask.data.offset(offset(index, &mask.stride)) != 0 }
}

/// The float mask's bias for row (b, h, i) and key j; 0 without a float mask.
fn mask_bias(shared: &SharedProblem, index: [i64; 4]) -> f64 {
    let mask = &shared.p.mask;
    if mask.kind != MaskKind::Float {
        return 0.0;
    }
    // SAFETY: a Float mask holds float32 elements (aligned: the caller's contract), readable at
    // every index of (B, Hq, Lq, Lk), and index is in bounds.
    unsafe { f64::from(*mask.data.cast::<f32>().offset(offset(index, &mask.stride))) }
}

/// Writes lse[b, h, i] when lse was requested.
fn write_lse(shared: &SharedProblem, index: [i64; 3], value: f32) {
    let lse = &shared.p.lse;
    if lse.is_requested() {
        // SAFETY: lse is (B, Hq, Lq) (checked), index is in bounds, and only the thread owning
        // pair (b, h) writes this element.
        unsafe { *lse.data.offset(offset(index, &lse.stride)) = value };
    }
}
