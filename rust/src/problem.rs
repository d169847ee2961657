//! One attention call, described as views over memory the caller owns, and the checks every
//! kernel relies on. Plain Rust: nothing here knows about Python.
//!
//! Twin of `cpp/src/problem.cpp`. Shapes, as in torch's scaled_dot_product_attention:
//!
//! ```text
//! q    (B, Hq,  Lq, D)      k (B, Hkv, Lk, D)      v (B, Hkv, Lk, Dv)
//! out  (B, Hq,  Lq, Dv)     lse (B, Hq, Lq), optional
//! mask (B, Hq,  Lq, Lk), optional: bool (true = may attend) or float32 (additive bias)
//! q_offset (B,), kv_lens (B,)
//! alibi_slopes (B, Hq), sinks (Hq,), optional
//! ```
//!
//! Strides are in elements (not bytes) and may be positive, negative or zero, so a NumPy view
//! such as `x.swapaxes(1, 2)`, `cache[:, :, :n]` or `np.broadcast_to(mask, ...)` is described
//! in place. The last axis of q, k, v and out must have unit stride unless its length is <= 1
//! (or the view is empty).

use std::fmt;

/// The element type of q, k, v and out (all four alike): the problem's `dtype`. C++'s
/// ElementType (problem.hpp), whose enum class has no methods: element_size, element_name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementType {
    Float32 = 0,
    Float16 = 1,
    BFloat16 = 2,
}

impl ElementType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElementType::Float32 => 4,
            ElementType::Float16 | ElementType::BFloat16 => 2,
        }
    }

    /// NumPy's name of the dtype ("float32", "float16", "bfloat16").
    pub fn name(self) -> &'static str {
        match self {
            ElementType::Float32 => "float32",
            ElementType::Float16 => "float16",
            ElementType::BFloat16 => "bfloat16",
        }
    }
}

/// A read-only 4-D view of elements of the problem's dtype (float32, float16 or bfloat16:
/// [`AttentionProblem::dtype`]): element `[a, b, c, d]` lives at
/// `data + (a*stride[0] + b*stride[1] + c*stride[2] + d*stride[3]) * dtype.size()` bytes
/// (the kernels cast `data` to their element type first, then offset by elements).
#[derive(Clone, Copy, Debug)]
pub struct TensorView4 {
    pub data: *const u8,
    pub shape: [i64; 4],
    pub stride: [i64; 4],
}

/// A writeable 4-D view, laid out like [`TensorView4`].
#[derive(Clone, Copy, Debug)]
pub struct MutTensorView4 {
    pub data: *mut u8,
    pub shape: [i64; 4],
    pub stride: [i64; 4],
}

/// The optional (B, Hq, Lq) output of log-sum-exp values. A null `data` means "not requested".
#[derive(Clone, Copy, Debug)]
pub struct LseView {
    pub data: *mut f32,
    pub shape: [i64; 3],
    pub stride: [i64; 3],
}

impl LseView {
    /// No lse requested.
    pub const NONE: LseView = LseView {
        data: std::ptr::null_mut(),
        shape: [0; 3],
        stride: [0; 3],
    };

    pub fn is_requested(&self) -> bool {
        !self.data.is_null()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskKind {
    None,
    /// one byte per element, nonzero = may attend
    Bool,
    /// float32 additive bias; -inf hides the key
    Float,
}

/// The optional mask, of shape (B, Hq, Lq, Lk) ([`check_problem`] checks it against q and k);
/// broadcasting is expressed by zero strides. Strides are in elements (bytes for `Bool`, floats
/// for `Float`) and are arbitrary on every axis, the last one included. Kind `None`: no mask
/// (data and shape unused).
#[derive(Clone, Copy, Debug)]
pub struct MaskView {
    pub kind: MaskKind,
    pub data: *const u8,
    pub shape: [i64; 4],
    pub stride: [i64; 4],
}

impl MaskView {
    /// No mask.
    pub const NONE: MaskView = MaskView {
        kind: MaskKind::None,
        data: std::ptr::null(),
        shape: [0; 4],
        stride: [0; 4],
    };
}

/// A float32 matrix (alibi_slopes, (B, Hq)); a null `data` means "not given". Strides in
/// elements, any sign (a (Hq,) slope vector arrives as a stride-0 (B, Hq) view).
#[derive(Clone, Copy, Debug)]
pub struct ParamView2 {
    pub data: *const f32,
    pub shape: [i64; 2],
    pub stride: [i64; 2],
}

impl ParamView2 {
    /// Not given.
    pub const NONE: ParamView2 = ParamView2 {
        data: std::ptr::null(),
        shape: [0; 2],
        stride: [0; 2],
    };
}

/// A float32 vector (sinks, (Hq,)); a null `data` means "not given".
#[derive(Clone, Copy, Debug)]
pub struct ParamView1 {
    pub data: *const f32,
    pub shape: [i64; 1],
    pub stride: [i64; 1],
}

impl ParamView1 {
    /// Not given.
    pub const NONE: ParamView1 = ParamView1 {
        data: std::ptr::null(),
        shape: [0; 1],
        stride: [0; 1],
    };
}

/// A float32 array of rank 3 (k_scale, v_scale: (B, Hkv, Lk)); a null `data` means "not given".
/// Strides in elements, any sign.
#[derive(Clone, Copy, Debug)]
pub struct ParamView3 {
    pub data: *const f32,
    pub shape: [i64; 3],
    pub stride: [i64; 3],
}

impl ParamView3 {
    /// Not given.
    pub const NONE: ParamView3 = ParamView3 {
        data: std::ptr::null(),
        shape: [0; 3],
        stride: [0; 3],
    };
}

/// Everything one attention call needs: the same fields with the same meaning as C++'s
/// AttentionProblem (cpp/include/twinattn/problem.hpp).
#[derive(Clone, Copy, Debug)]
pub struct AttentionProblem<'a> {
    /// the element type of q, k, v and out (k and v: int8 instead when `kv_int8`; lse, the mask
    /// and the parameters are float32)
    pub dtype: ElementType,
    pub q: TensorView4,
    pub k: TensorView4,
    pub v: TensorView4,
    pub out: MutTensorView4,
    pub lse: LseView,
    /// absolute position of query row 0 of each sequence, B entries: row i sits at
    /// q_offset[b] + i (read when causal, windowed or with ALiBi; >= 0 when causal, any value
    /// otherwise). C++ spells the slice Int64Span, a pointer and a length (C++17 has no slice).
    pub q_offset: &'a [i64],
    /// number of valid keys of each sequence, B entries, each in [0, Lk]; keys j >= kv_lens[b]
    /// are never read
    pub kv_lens: &'a [i64],
    pub mask: MaskView,
    pub causal: bool,
    /// multiplies q . k
    pub scale: f32,
    /// sliding window (flash-attn's convention): key j is visible to position p only if
    /// p - window_left <= j <= p + window_right; -1 leaves that side unbounded
    pub window_left: i64,
    pub window_right: i64,
    /// > 0: each scaled score s becomes softcap * tanh(s / softcap); 0: off
    pub softcap: f32,
    /// ALiBi: adds -alibi_slopes[b, h] * |p - j| to the score (after softcap)
    pub alibi_slopes: ParamView2,
    /// one extra logit per query head (natural-log units, not scaled): softmax mass, no value
    pub sinks: ParamView1,
    /// int8 K/V (docs/kernels.md, "int8 K/V"): k and v hold int8 (q and out keep `dtype`), and
    /// k_scale / v_scale (B, Hkv, Lk), both required, give each token's float32 scale: the kernels
    /// attend over float32(k) * k_scale, float32(v) * v_scale. false: k and v have `dtype`, and
    /// the scales must not be given.
    pub kv_int8: bool,
    pub k_scale: ParamView3,
    pub v_scale: ParamView3,
}

// ---- The backward pass (attention_backward, flash_backward.rs) ----------------------------------

/// A writeable float32 vector (dsinks, (Hq,)); a null `data` means "not requested".
#[derive(Clone, Copy, Debug)]
pub struct MutParamView1 {
    pub data: *mut f32,
    pub shape: [i64; 1],
    pub stride: [i64; 1],
}

impl MutParamView1 {
    /// Not requested.
    pub const NONE: MutParamView1 = MutParamView1 {
        data: std::ptr::null_mut(),
        shape: [0; 1],
        stride: [0; 1],
    };
}

/// One backward call: the forward's problem (its out and lse now inputs, lse required), the
/// gradient of the loss with respect to out, and the gradients, written in place:
///
/// ```text
/// dout (B, Hq, Lq, Dv)    dq (B, Hq, Lq, D)    dk (B, Hkv, Lk, D)    dv (B, Hkv, Lk, Dv)
/// dsinks (Hq,) float32, only together with forward.sinks
/// ```
///
/// dout, dq, dk and dv hold elements of forward.dtype (float32, float16 or bfloat16; int8 k and v
/// carry no gradient); the last axis has unit stride, as q's. C++'s BackwardProblem.
#[derive(Clone, Copy, Debug)]
pub struct BackwardProblem<'a> {
    pub forward: AttentionProblem<'a>,
    pub dout: TensorView4,
    pub dq: MutTensorView4,
    pub dk: MutTensorView4,
    pub dv: MutTensorView4,
    pub dsinks: MutParamView1,
}

/// Row-major (contiguous) views over shape (d0, d1, d2, d3) of float32 elements; a convenience
/// for tests and for callers that own contiguous buffers.
pub fn contiguous_view(data: *const f32, d0: i64, d1: i64, d2: i64, d3: i64) -> TensorView4 {
    TensorView4 {
        data: data.cast(),
        shape: [d0, d1, d2, d3],
        stride: [d1 * d2 * d3, d2 * d3, d3, 1],
    }
}

pub fn contiguous_mut_view(data: *mut f32, d0: i64, d1: i64, d2: i64, d3: i64) -> MutTensorView4 {
    MutTensorView4 {
        data: data.cast(),
        shape: [d0, d1, d2, d3],
        stride: [d1 * d2 * d3, d2 * d3, d3, 1],
    }
}

pub fn contiguous_lse_view(data: *mut f32, d0: i64, d1: i64, d2: i64) -> LseView {
    LseView {
        data,
        shape: [d0, d1, d2],
        stride: [d1 * d2, d2, 1],
    }
}

/// What is wrong with a call: a message naming the argument, what was expected and what was
/// given (the Python binding raises it as ValueError, as C++'s std::invalid_argument), or
/// [`OUT_OF_MEMORY_MESSAGE`] when a kernel's scratch could not be allocated (raised as MemoryError).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProblemError(pub String);

/// The message of a failed scratch allocation; C++'s kOutOfMemoryMessage.
pub const OUT_OF_MEMORY_MESSAGE: &str =
    "out of memory: the kernel's scratch buffers for this call could not be allocated";

impl ProblemError {
    pub fn out_of_memory() -> Self {
        ProblemError(OUT_OF_MEMORY_MESSAGE.to_owned())
    }

    pub fn is_out_of_memory(&self) -> bool {
        self.0 == OUT_OF_MEMORY_MESSAGE
    }
}

impl fmt::Display for ProblemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ProblemError {}

/// A zero-filled vector of `len` elements, or [`ProblemError::out_of_memory`] where `vec!`
/// would abort the process (as C++ throws std::bad_alloc where this returns the error).
pub fn try_filled<T: Clone>(len: usize, value: T) -> Result<Vec<T>, ProblemError> {
    let mut vector = Vec::new();
    vector
        .try_reserve_exact(len)
        .map_err(|_| ProblemError::out_of_memory())?;
    vector.resize(len, value);
    Ok(vector)
}

macro_rules! reject {
    ($($arg:tt)*) => {
        return Err(ProblemError(format!($($arg)*)))
    };
}

/// "(2, 3)", "(2,)": Python's tuple notation, as the C++ twin writes shapes.
fn shape_string(shape: &[i64]) -> String {
    let parts: Vec<String> = shape.iter().map(i64::to_string).collect();
    if parts.len() == 1 {
        format!("({},)", parts[0])
    } else {
        format!("({})", parts.join(", "))
    }
}

/// The address range `[lowest, highest + item)` that a strided view touches, or None when it
/// has no element. Used to tell whether two views may share memory (the same test as NumPy's
/// `may_share_memory`: bounds only, so interleaved views are conservatively reported).
fn byte_extent(data: usize, shape: &[i64], stride: &[i64], item: i64) -> Option<(i128, i128)> {
    if shape.iter().any(|&n| n <= 0) {
        return None;
    }
    let base = data as i128;
    let (mut lowest, mut highest) = (base, base);
    for (&n, &s) in shape.iter().zip(stride) {
        let reach = (n as i128 - 1) * s as i128 * item as i128;
        if reach < 0 {
            lowest += reach;
        } else {
            highest += reach;
        }
    }
    Some((lowest, highest + item as i128))
}

fn extents_overlap(a: Option<(i128, i128)>, b: Option<(i128, i128)>) -> bool {
    match (a, b) {
        (Some((a0, a1)), Some((b0, b1))) => a0 < b1 && b0 < a1,
        _ => false,
    }
}

/// Whether two distinct indices of a view may address the same element. Sufficient test:
/// sorted by |stride|, each axis of length > 1 must step past everything the smaller axes reach.
/// Exotic interleaved layouts that do not overlap may be reported too; outputs never need them.
fn may_overlap_itself(shape: &[i64], stride: &[i64]) -> bool {
    if shape.iter().any(|&n| n <= 0) {
        return false;
    }
    let mut axes: Vec<(i128, i128)> = shape
        .iter()
        .zip(stride)
        .filter(|(&n, _)| n > 1)
        .map(|(&n, &s)| ((s as i128).abs(), n as i128))
        .collect();
    axes.sort();
    let mut reach: i128 = 0; // largest offset the smaller axes reach, in elements
    for (step, n) in axes {
        if step <= reach {
            return true;
        }
        reach += (n - 1) * step;
    }
    false
}

fn check_distinct_elements(name: &str, shape: &[i64], stride: &[i64]) -> Result<(), ProblemError> {
    if may_overlap_itself(shape, stride) {
        reject!(
            "{name}: expected elements that do not overlap each other, got strides {}",
            shape_string(stride)
        );
    }
    Ok(())
}

/// `expected` is only formatted on failure: a small call must not pay for error messages.
fn check_shape(
    name: &str,
    expected: impl FnOnce() -> String,
    shape: &[i64],
    matches: bool,
) -> Result<(), ProblemError> {
    if shape.iter().any(|&n| n < 0) || !matches {
        reject!(
            "{name}: expected shape {}, got {}",
            expected(),
            shape_string(shape)
        );
    }
    Ok(())
}

/// An empty view addresses nothing, so its strides do not matter (NumPy 2 sets them all to 0).
fn check_unit_last_stride(
    name: &str,
    axis_name: &str,
    shape: &[i64; 4],
    stride: &[i64; 4],
) -> Result<(), ProblemError> {
    if shape[3] > 1 && stride[3] != 1 && !shape.contains(&0) {
        reject!(
            "{name}: expected unit stride on the last axis ({axis_name}={}), got stride {} elements",
            shape[3],
            stride[3]
        );
    }
    Ok(())
}

fn check_data(name: &str, null: bool, shape: &[i64]) -> Result<(), ProblemError> {
    if null && shape.iter().all(|&n| n > 0) {
        reject!(
            "{name}: expected data for a non-empty array of shape {}, got a null pointer",
            shape_string(shape)
        );
    }
    Ok(())
}

/// Every element of a float32 vector (rank 1) or matrix (rank 2) finite; names the first that
/// is not, e.g. "sinks: expected finite values, got sinks[3]=nan". The caller checked the shape.
fn check_finite_values(
    name: &str,
    data: *const f32,
    shape: &[i64],
    stride: &[i64],
) -> Result<(), ProblemError> {
    let rank = shape.len();
    let rows = if rank == 2 { shape[0] } else { 1 };
    let columns = shape[rank - 1];
    for row in 0..rows {
        for column in 0..columns {
            let offset = if rank == 2 { row * stride[0] } else { 0 } + column * stride[rank - 1];
            // SAFETY: the view's promise (the caller's, as for every view): each index within
            // its shape addresses a readable float.
            let value = unsafe { *data.offset(offset as isize) };
            if value.is_finite() {
                continue;
            }
            let index = if rank == 2 {
                format!("{row}, {column}")
            } else {
                column.to_string()
            };
            reject!("{name}: expected finite values, got {name}[{index}]={value}");
        }
    }
    Ok(())
}

/// The thread count of a call: an error unless `num_threads >= 1`; the count as a usize
/// otherwise (the kernels start at most one thread per work item).
pub fn check_num_threads(num_threads: i64) -> Result<usize, ProblemError> {
    if num_threads < 1 {
        reject!("num_threads: expected an int >= 1, got {num_threads}");
    }
    Ok(usize::try_from(num_threads).unwrap_or(usize::MAX))
}

/// The number of arrays [`problem_extents`] lists.
const PROBLEM_INPUTS: usize = 9;

/// The byte extents of the arrays a forward call reads (lse last: an output of the forward, an
/// input of the backward), in the order the overlap messages name them.
fn problem_extents(p: &AttentionProblem) -> [(&'static str, Option<(i128, i128)>); PROBLEM_INPUTS] {
    let item = p.dtype.size() as i64; // q and out
    let kv_item = if p.kv_int8 { 1 } else { item }; // k and v
    let lse_extent = if p.lse.is_requested() {
        byte_extent(p.lse.data as usize, &p.lse.shape, &p.lse.stride, 4)
    } else {
        None
    };
    let mask_item = if p.mask.kind == MaskKind::Float { 4 } else { 1 };
    let mask_shape = [p.q.shape[0], p.q.shape[1], p.q.shape[2], p.k.shape[2]];
    [
        (
            "q",
            byte_extent(p.q.data as usize, &p.q.shape, &p.q.stride, item),
        ),
        (
            "k",
            byte_extent(p.k.data as usize, &p.k.shape, &p.k.stride, kv_item),
        ),
        (
            "v",
            byte_extent(p.v.data as usize, &p.v.shape, &p.v.stride, kv_item),
        ),
        (
            "mask",
            match p.mask.kind {
                MaskKind::None => None,
                _ => byte_extent(p.mask.data as usize, &mask_shape, &p.mask.stride, mask_item),
            },
        ),
        (
            "alibi_slopes",
            byte_extent(
                p.alibi_slopes.data as usize,
                &p.alibi_slopes.shape,
                &p.alibi_slopes.stride,
                4,
            )
            .filter(|_| !p.alibi_slopes.data.is_null()),
        ),
        (
            "sinks",
            byte_extent(p.sinks.data as usize, &p.sinks.shape, &p.sinks.stride, 4)
                .filter(|_| !p.sinks.data.is_null()),
        ),
        (
            "k_scale",
            byte_extent(
                p.k_scale.data as usize,
                &p.k_scale.shape,
                &p.k_scale.stride,
                4,
            )
            .filter(|_| !p.k_scale.data.is_null()),
        ),
        (
            "v_scale",
            byte_extent(
                p.v_scale.data as usize,
                &p.v_scale.shape,
                &p.v_scale.stride,
                4,
            )
            .filter(|_| !p.v_scale.data.is_null()),
        ),
        ("lse", lse_extent),
    ]
}

/// Checks everything a kernel relies on, except that the pointers are valid (the caller's
/// promise, see [`crate::reference_kernel::attention_reference`]). Twin of C++'s check_problem:
/// the same checks in the same order (docs/native_api.md lists them side by side).
///
/// Shapes agree (the mask's included); Hq % Hkv == 0; the last axis of q, k, v and out has unit
/// stride; q_offset and kv_lens have B entries, 0 <= kv_lens[b] <= Lk, q_offset[b] >= 0 when
/// causal; scale is finite; the variants' parameters are in range; int8 scales are given exactly
/// when k and v are int8; out and lse do not overlap themselves, each other, or any input.
pub fn check_problem(p: &AttentionProblem) -> Result<(), ProblemError> {
    // 1. Shapes. q names B, Hq, Lq and D; k names Hkv and Lk; v names Dv.
    let [batch, q_heads, q_len, head_dim] = p.q.shape;
    check_shape("q", || "(B, Hq, Lq, D)".to_owned(), &p.q.shape, true)?;
    let [_, kv_heads, k_len, _] = p.k.shape;
    check_shape(
        "k",
        || format!("(B={batch}, Hkv, Lk, D={head_dim})"),
        &p.k.shape,
        p.k.shape[0] == batch && p.k.shape[3] == head_dim,
    )?;
    let value_dim = p.v.shape[3];
    check_shape(
        "v",
        || format!("(B={batch}, Hkv={kv_heads}, Lk={k_len}, Dv)"),
        &p.v.shape,
        p.v.shape[..3] == [batch, kv_heads, k_len],
    )?;
    check_shape(
        "out",
        || format!("(B={batch}, Hq={q_heads}, Lq={q_len}, Dv={value_dim})"),
        &p.out.shape,
        p.out.shape == [batch, q_heads, q_len, value_dim],
    )?;
    if p.lse.is_requested() {
        check_shape(
            "lse",
            || format!("(B={batch}, Hq={q_heads}, Lq={q_len})"),
            &p.lse.shape,
            p.lse.shape == [batch, q_heads, q_len],
        )?;
    }
    let mask_shape = [batch, q_heads, q_len, k_len];
    if p.mask.kind != MaskKind::None {
        check_shape(
            "mask",
            || format!("(B={batch}, Hq={q_heads}, Lq={q_len}, Lk={k_len})"),
            &p.mask.shape,
            p.mask.shape == mask_shape,
        )?;
    }

    // 2. Grouped-query heads: query head h reads KV head h / (Hq / Hkv).
    if q_heads > 0 && (kv_heads == 0 || q_heads % kv_heads != 0) {
        reject!(
            "k: expected Hkv dividing Hq={q_heads} (query head h reads KV head h // (Hq // Hkv)), got Hkv={kv_heads}"
        );
    }

    // 3. Memory: data present when non-empty, unit stride on the feature axes.
    check_data("q", p.q.data.is_null(), &p.q.shape)?;
    check_data("k", p.k.data.is_null(), &p.k.shape)?;
    check_data("v", p.v.data.is_null(), &p.v.shape)?;
    check_data("out", p.out.data.is_null(), &p.out.shape)?;
    if p.mask.kind != MaskKind::None {
        check_data("mask", p.mask.data.is_null(), &mask_shape)?;
    }
    check_unit_last_stride("q", "D", &p.q.shape, &p.q.stride)?;
    check_unit_last_stride("k", "D", &p.k.shape, &p.k.stride)?;
    check_unit_last_stride("v", "Dv", &p.v.shape, &p.v.stride)?;
    check_unit_last_stride("out", "Dv", &p.out.shape, &p.out.stride)?;

    // 4. Per-sequence lengths and positions: B entries each.
    let batch_len = batch as usize;
    for (name, values) in [("q_offset", p.q_offset), ("kv_lens", p.kv_lens)] {
        if values.len() != batch_len {
            reject!(
                "{name}: expected shape (B={batch},), got ({},)",
                values.len()
            );
        }
    }
    if let Some((b, &kv_len)) = p
        .kv_lens
        .iter()
        .enumerate()
        .find(|(_, &n)| !(0..=k_len).contains(&n))
    {
        reject!("kv_lens: expected values in [0, Lk={k_len}], got kv_lens[{b}]={kv_len}");
    }
    if p.causal {
        if let Some((b, &offset)) = p.q_offset.iter().enumerate().find(|(_, &o)| o < 0) {
            reject!("q_offset: expected values >= 0 when causal, got q_offset[{b}]={offset}");
        }
    }

    // 5. Scale.
    if !p.scale.is_finite() {
        reject!("scale: expected a finite number, got {}", p.scale);
    }

    // 6. Variants: window sides, softcap, ALiBi slopes (B, Hq) and sinks (Hq,), all finite.
    if p.window_left < -1 {
        reject!(
            "window_left: expected an int >= -1 (-1: unbounded), got {}",
            p.window_left
        );
    }
    if p.window_right < -1 {
        reject!(
            "window_right: expected an int >= -1 (-1: unbounded), got {}",
            p.window_right
        );
    }
    if !p.softcap.is_finite() || p.softcap < 0.0 {
        reject!(
            "softcap: expected a finite number >= 0 (0: off), got {}",
            p.softcap
        );
    }
    if !p.alibi_slopes.data.is_null() {
        check_shape(
            "alibi_slopes",
            || format!("(B={batch}, Hq={q_heads})"),
            &p.alibi_slopes.shape,
            p.alibi_slopes.shape == [batch, q_heads],
        )?;
        check_finite_values(
            "alibi_slopes",
            p.alibi_slopes.data,
            &p.alibi_slopes.shape,
            &p.alibi_slopes.stride,
        )?;
    }
    if !p.sinks.data.is_null() {
        check_shape(
            "sinks",
            || format!("(Hq={q_heads},)"),
            &p.sinks.shape,
            p.sinks.shape == [q_heads],
        )?;
        check_finite_values("sinks", p.sinks.data, &p.sinks.shape, &p.sinks.stride)?;
    }
    // int8 K/V: both scales (B, Hkv, Lk), any values (a NaN scale acts like a NaN in K or V).
    for (name, view) in [("k_scale", &p.k_scale), ("v_scale", &p.v_scale)] {
        if p.kv_int8 && view.data.is_null() {
            reject!("{name}: required with int8 k and v (float32, shape (B, Hkv, Lk)), got None");
        }
        if !p.kv_int8 && !view.data.is_null() {
            reject!(
                "{name}: expected None with {} k and v (scales are only for int8), got an array",
                p.dtype.name()
            );
        }
        if !view.data.is_null() {
            check_shape(
                name,
                || format!("(B={batch}, Hkv={kv_heads}, Lk={k_len})"),
                &view.shape,
                view.shape == [batch, kv_heads, k_len],
            )?;
        }
    }

    // 7. Outputs: every element written once, by one thread, never read as input.
    check_distinct_elements("out", &p.out.shape, &p.out.stride)?;
    if p.lse.is_requested() {
        check_distinct_elements("lse", &p.lse.shape, &p.lse.stride)?;
    }
    let inputs = problem_extents(p);
    let out_extent = byte_extent(
        p.out.data as usize,
        &p.out.shape,
        &p.out.stride,
        p.dtype.size() as i64,
    );
    let lse_extent = inputs[PROBLEM_INPUTS - 1].1;
    for (output, extent) in [("out", out_extent), ("lse", lse_extent)] {
        for &(input, input_extent) in &inputs {
            if input != output && extents_overlap(extent, input_extent) {
                reject!("{output}: expected memory disjoint from {input}, got arrays that overlap");
            }
        }
    }
    Ok(())
}

/// check_problem's checks on the forward part (lse required, k and v not int8), then dout, dq,
/// dk, dv and dsinks: shapes, data, unit last strides, dsinks only with sinks, and the gradients
/// written once each (no element twice, no overlap with each other or any input). Twin of C++'s
/// check_backward: the same checks in the same order.
pub fn check_backward(bp: &BackwardProblem) -> Result<(), ProblemError> {
    let p = &bp.forward;
    // 1. The forward part: float keys and values, lse given, then check_problem's checks.
    if p.kv_int8 {
        reject!("k: expected q's dtype, got int8 (int8 keys and values carry no gradient)");
    }
    if !p.lse.is_requested() {
        reject!("lse: required (the forward's lse, float32, shape (B, Hq, Lq)), got None");
    }
    check_problem(p)?;

    // 2. Shapes: dout as out, dq as q, dk as k, dv as v.
    let [batch, q_heads, q_len, head_dim] = p.q.shape;
    let [_, kv_heads, k_len, _] = p.k.shape;
    let value_dim = p.v.shape[3];
    let gradients = [
        ("dout", &bp.dout.shape, [batch, q_heads, q_len, value_dim]),
        ("dq", &bp.dq.shape, [batch, q_heads, q_len, head_dim]),
        ("dk", &bp.dk.shape, [batch, kv_heads, k_len, head_dim]),
        ("dv", &bp.dv.shape, [batch, kv_heads, k_len, value_dim]),
    ];
    for (name, shape, expected) in gradients {
        let [b, h, l, d] = expected;
        let (h_name, l_name, d_name) = match name {
            "dout" => ("Hq", "Lq", "Dv"),
            "dq" => ("Hq", "Lq", "D"),
            "dk" => ("Hkv", "Lk", "D"),
            _ => ("Hkv", "Lk", "Dv"),
        };
        check_shape(
            name,
            || format!("(B={b}, {h_name}={h}, {l_name}={l}, {d_name}={d})"),
            shape,
            *shape == expected,
        )?;
    }

    // 3. Memory: data present when non-empty, unit stride on the feature axes.
    check_data("dout", bp.dout.data.is_null(), &bp.dout.shape)?;
    check_data("dq", bp.dq.data.is_null(), &bp.dq.shape)?;
    check_data("dk", bp.dk.data.is_null(), &bp.dk.shape)?;
    check_data("dv", bp.dv.data.is_null(), &bp.dv.shape)?;
    check_unit_last_stride("dout", "Dv", &bp.dout.shape, &bp.dout.stride)?;
    check_unit_last_stride("dq", "D", &bp.dq.shape, &bp.dq.stride)?;
    check_unit_last_stride("dk", "D", &bp.dk.shape, &bp.dk.stride)?;
    check_unit_last_stride("dv", "Dv", &bp.dv.shape, &bp.dv.stride)?;

    // 4. dsinks: the sinks' gradient, (Hq,), only with sinks.
    let has_dsinks = !bp.dsinks.data.is_null();
    if has_dsinks && p.sinks.data.is_null() {
        reject!("dsinks: expected None without sinks (it is the sinks' gradient), got an array");
    }
    if has_dsinks {
        check_shape(
            "dsinks",
            || format!("(Hq={q_heads},)"),
            &bp.dsinks.shape,
            bp.dsinks.shape == [q_heads],
        )?;
    }

    // 5. Gradients: every element written once, by one thread, never read as input.
    check_distinct_elements("dq", &bp.dq.shape, &bp.dq.stride)?;
    check_distinct_elements("dk", &bp.dk.shape, &bp.dk.stride)?;
    check_distinct_elements("dv", &bp.dv.shape, &bp.dv.stride)?;
    if has_dsinks {
        check_distinct_elements("dsinks", &bp.dsinks.shape, &bp.dsinks.stride)?;
    }
    let item = p.dtype.size() as i64;
    let extent =
        |data: usize, shape: &[i64; 4], stride: &[i64; 4]| byte_extent(data, shape, stride, item);
    let mut inputs = problem_extents(p).to_vec();
    inputs.push((
        "out",
        extent(p.out.data as usize, &p.out.shape, &p.out.stride),
    ));
    inputs.push((
        "dout",
        extent(bp.dout.data as usize, &bp.dout.shape, &bp.dout.stride),
    ));
    let outputs = [
        (
            "dq",
            extent(bp.dq.data as usize, &bp.dq.shape, &bp.dq.stride),
        ),
        (
            "dk",
            extent(bp.dk.data as usize, &bp.dk.shape, &bp.dk.stride),
        ),
        (
            "dv",
            extent(bp.dv.data as usize, &bp.dv.shape, &bp.dv.stride),
        ),
        (
            "dsinks",
            byte_extent(
                bp.dsinks.data as usize,
                &bp.dsinks.shape,
                &bp.dsinks.stride,
                4,
            )
            .filter(|_| has_dsinks),
        ),
    ];
    for (index, &(output, output_extent)) in outputs.iter().enumerate() {
        for &(input, input_extent) in &inputs {
            if extents_overlap(output_extent, input_extent) {
                reject!("{output}: expected memory disjoint from {input}, got arrays that overlap");
            }
        }
        for &(other, other_extent) in &outputs[..index] {
            if extents_overlap(output_extent, other_extent) {
                reject!("{output}: expected memory disjoint from {other}, got arrays that overlap");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_overlap() {
        assert!(!may_overlap_itself(&[2, 3, 4, 5], &[60, 20, 5, 1]));
        assert!(!may_overlap_itself(&[2, 3, 4, 5], &[5, 40, 10, -1]));
        assert!(may_overlap_itself(&[2, 3, 4, 5], &[60, 0, 5, 1]));
        assert!(may_overlap_itself(&[2, 3, 4, 5], &[60, 20, 4, 1]));
        assert!(!may_overlap_itself(&[2, 1, 4, 5], &[20, 0, 5, 1]));
        assert!(!may_overlap_itself(&[0, 3, 4, 5], &[0, 0, 0, 0]));
    }

    #[test]
    fn extents() {
        assert_eq!(byte_extent(100, &[2, 3], &[3, 1], 4), Some((100, 124)));
        assert_eq!(byte_extent(100, &[2, 3], &[-3, 1], 4), Some((88, 112)));
        assert_eq!(byte_extent(100, &[2, 0], &[3, 1], 4), None);
        assert!(extents_overlap(Some((0, 8)), Some((4, 12))));
        assert!(!extents_overlap(Some((0, 8)), Some((8, 12))));
    }
}
