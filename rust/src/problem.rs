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

impl MutTensorView4 {
    /// Not given (an optional output: out32).
    pub const NONE: MutTensorView4 = MutTensorView4 {
        data: std::ptr::null_mut(),
        shape: [0; 4],
        stride: [0; 4],
    };
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

/// Paged keys and values (attention_paged; docs/kernels.md, "Key rows"): a null `data` means k,
/// v, k_scale and v_scale are the dense (B, Hkv, Lk, ...) views. Otherwise the problem holds one
/// sequence (B = 1) whose key j lives in page `data[(j / block_size) * stride]`, slot
/// `j % block_size`: axis 0 of k, v, k_scale and v_scale then steps pages (its stride is the page
/// stride), axis 2 steps slots within a page, and only the pages of keys j < kv_lens[0] are read.
#[derive(Clone, Copy, Debug)]
pub struct KeyPages {
    pub data: *const i32,
    /// in elements, between consecutive entries of the sequence's block table
    pub stride: i64,
    pub block_size: i64,
}

impl KeyPages {
    /// Dense keys.
    pub const NONE: KeyPages = KeyPages {
        data: std::ptr::null(),
        stride: 0,
        block_size: 1,
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
    /// Paged K/V ([`KeyPages`]): set by attention_paged for its per-sequence problems only.
    pub pages: KeyPages,
    /// float16 / bfloat16 only, optional (null `data`: none): float32 (B, Hq, Lq, Dv), the output
    /// before its rounding to `dtype`, which the forward writes beside out (for the backward's D;
    /// on the bfloat16 pair paths with P.V's remainder added, flash_avx512bf16.rs).
    pub out32: MutTensorView4,
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
    /// forward.out holds float32 (the forward's out32) instead of forward.dtype: D = rowsum(dout *
    /// out) is then taken from the output before its rounding (for a float32 problem it changes
    /// nothing).
    pub out_float32: bool,
    /// Optional (null `data`: none): float32 (B, Hq, Lq), the loss's gradient with respect to lse,
    /// folded into the row term: dS = P (dP - (D - dlse)).
    pub dlse: ParamView3,
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
pub fn byte_extent(data: usize, shape: &[i64], stride: &[i64], item: i64) -> Option<(i128, i128)> {
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

/// Whether two address ranges from `byte_extent` share a byte (an empty view shares none).
pub fn extents_overlap(a: Option<(i128, i128)>, b: Option<(i128, i128)>) -> bool {
    match (a, b) {
        (Some((a0, a1)), Some((b0, b1))) => a0 < b1 && b0 < a1,
        _ => false,
    }
}

/// Whether two distinct indices of a view may address the same element. Sufficient test:
/// sorted by |stride|, each axis of length > 1 must step past everything the smaller axes reach.
/// Exotic interleaved layouts that do not overlap may be reported too; outputs never need them.
pub fn may_overlap_itself(shape: &[i64], stride: &[i64]) -> bool {
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
    shape: &[i64],
    stride: &[i64],
) -> Result<(), ProblemError> {
    let last = shape.len() - 1;
    if shape[last] > 1 && stride[last] != 1 && !shape.contains(&0) {
        reject!(
            "{name}: expected unit stride on the last axis ({axis_name}={}), got stride {} elements",
            shape[last],
            stride[last]
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
    check_group("k", q_heads, kv_heads)?;

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
    check_variants(
        p.window_left,
        p.window_right,
        p.softcap,
        &p.alibi_slopes,
        &p.sinks,
        batch,
        q_heads,
    )?;
    // int8 K/V: both scales (B, Hkv, Lk), any values (a NaN scale acts like a NaN in K or V).
    for (name, view) in [("k_scale", &p.k_scale), ("v_scale", &p.v_scale)] {
        check_scale_given(
            name,
            !view.data.is_null(),
            p.kv_int8,
            p.dtype,
            "(B, Hkv, Lk)",
        )?;
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
    check_outputs_disjoint(out_extent, lse_extent, &inputs)?;

    // 8. out32 (float16 / bfloat16 only): out's shape, unit last stride, every element written
    // once, disjoint from every input, out and lse.
    if p.out32.data.is_null() {
        return Ok(());
    }
    if p.dtype == ElementType::Float32 {
        reject!(
            "out32: expected None for a float32 problem (out is float32 already), got an array"
        );
    }
    check_shape(
        "out32",
        || format!("(B={batch}, Hq={q_heads}, Lq={q_len}, Dv={value_dim})"),
        &p.out32.shape,
        p.out32.shape == [batch, q_heads, q_len, value_dim],
    )?;
    check_unit_last_stride("out32", "Dv", &p.out32.shape, &p.out32.stride)?;
    check_distinct_elements("out32", &p.out32.shape, &p.out32.stride)?;
    let out32_extent = byte_extent(p.out32.data as usize, &p.out32.shape, &p.out32.stride, 4);
    for &(input, input_extent) in inputs.iter().chain([("out", out_extent)].iter()) {
        if extents_overlap(out32_extent, input_extent) {
            reject!("out32: expected memory disjoint from {input}, got arrays that overlap");
        }
    }
    Ok(())
}

/// Step 2 of every problem: query head h reads KV head h / (Hq / Hkv).
fn check_group(name: &str, q_heads: i64, kv_heads: i64) -> Result<(), ProblemError> {
    if q_heads > 0 && (kv_heads == 0 || q_heads % kv_heads != 0) {
        reject!(
            "{name}: expected Hkv dividing Hq={q_heads} (query head h reads KV head h // (Hq // Hkv)), got Hkv={kv_heads}"
        );
    }
    Ok(())
}

/// Step 6 of every problem: window sides, softcap, ALiBi slopes (B, Hq) and sinks (Hq,), all
/// finite.
fn check_variants(
    window_left: i64,
    window_right: i64,
    softcap: f32,
    alibi_slopes: &ParamView2,
    sinks: &ParamView1,
    batch: i64,
    q_heads: i64,
) -> Result<(), ProblemError> {
    if window_left < -1 {
        reject!("window_left: expected an int >= -1 (-1: unbounded), got {window_left}");
    }
    if window_right < -1 {
        reject!("window_right: expected an int >= -1 (-1: unbounded), got {window_right}");
    }
    if !softcap.is_finite() || softcap < 0.0 {
        reject!("softcap: expected a finite number >= 0 (0: off), got {softcap}");
    }
    if !alibi_slopes.data.is_null() {
        check_shape(
            "alibi_slopes",
            || format!("(B={batch}, Hq={q_heads})"),
            &alibi_slopes.shape,
            alibi_slopes.shape == [batch, q_heads],
        )?;
        check_finite_values(
            "alibi_slopes",
            alibi_slopes.data,
            &alibi_slopes.shape,
            &alibi_slopes.stride,
        )?;
    }
    if !sinks.data.is_null() {
        check_shape(
            "sinks",
            || format!("(Hq={q_heads},)"),
            &sinks.shape,
            sinks.shape == [q_heads],
        )?;
        check_finite_values("sinks", sinks.data, &sinks.shape, &sinks.stride)?;
    }
    Ok(())
}

/// An int8 scale (k_scale, v_scale) is given exactly when k and v are int8; `shape` names its
/// axes.
fn check_scale_given(
    name: &str,
    given: bool,
    kv_int8: bool,
    dtype: ElementType,
    shape: &str,
) -> Result<(), ProblemError> {
    if kv_int8 && !given {
        reject!("{name}: required with int8 k and v (float32, shape {shape}), got None");
    }
    if !kv_int8 && given {
        reject!(
            "{name}: expected None with {} k and v (scales are only for int8), got an array",
            dtype.name()
        );
    }
    Ok(())
}

/// Step 7's last part: out and lse disjoint from every input (and from each other).
fn check_outputs_disjoint(
    out: Option<(i128, i128)>,
    lse: Option<(i128, i128)>,
    inputs: &[(&str, Option<(i128, i128)>)],
) -> Result<(), ProblemError> {
    for (output, extent) in [("out", out), ("lse", lse)] {
        for &(input, input_extent) in inputs {
            if input != output && extents_overlap(extent, input_extent) {
                reject!("{output}: expected memory disjoint from {input}, got arrays that overlap");
            }
        }
    }
    Ok(())
}

/// check_problem's checks on the forward part (lse required, k and v not int8), then dout, dq,
/// dk, dv, dsinks, out_float32 and dlse: shapes, data, unit last strides, dsinks only with sinks, and the gradients
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

    // 4. dsinks: the sinks' gradient, (Hq,), only with sinks; dlse (B, Hq, Lq).
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
    if !bp.dlse.data.is_null() {
        check_shape(
            "dlse",
            || format!("(B={batch}, Hq={q_heads}, Lq={q_len})"),
            &bp.dlse.shape,
            bp.dlse.shape == [batch, q_heads, q_len],
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
    let out_item = if bp.out_float32 { 4 } else { item };
    inputs.push((
        "out",
        byte_extent(p.out.data as usize, &p.out.shape, &p.out.stride, out_item),
    ));
    if !bp.dlse.data.is_null() {
        inputs.push((
            "dlse",
            byte_extent(bp.dlse.data as usize, &bp.dlse.shape, &bp.dlse.stride, 4),
        ));
    }
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

// ---- Packed (varlen) and paged batches (docs/native_api.md, attention_varlen / attention_paged)

/// A rank-3 view of packed rows, (total, H, D): strides in elements, the last axis unit stride;
/// elements of the problem's dtype (int8 for int8 k and v).
#[derive(Clone, Copy, Debug)]
pub struct TensorView3 {
    pub data: *const u8,
    pub shape: [i64; 3],
    pub stride: [i64; 3],
}

/// A writeable [`TensorView3`].
#[derive(Clone, Copy, Debug)]
pub struct MutTensorView3 {
    pub data: *mut u8,
    pub shape: [i64; 3],
    pub stride: [i64; 3],
}

/// lse of packed rows, (Hq, total_q) (flash-attn's layout); a null `data`: not requested.
#[derive(Clone, Copy, Debug)]
pub struct LseView2 {
    pub data: *mut f32,
    pub shape: [i64; 2],
    pub stride: [i64; 2],
}

impl LseView2 {
    /// No lse requested.
    pub const NONE: LseView2 = LseView2 {
        data: std::ptr::null_mut(),
        shape: [0; 2],
        stride: [0; 2],
    };
}

/// The block table, int32 (B, max_blocks), strides in elements.
#[derive(Clone, Copy, Debug)]
pub struct BlockTableView {
    pub data: *const i32,
    pub shape: [i64; 2],
    pub stride: [i64; 2],
}

/// What attention_varlen and attention_paged share: the options of [`AttentionProblem`] (same
/// meaning), alibi_slopes (B, Hq) with B the number of sequences.
#[derive(Clone, Copy, Debug)]
pub struct PackedOptions {
    pub dtype: ElementType,
    pub kv_int8: bool,
    pub causal: bool,
    pub scale: f32,
    pub window_left: i64,
    pub window_right: i64,
    pub softcap: f32,
    pub alibi_slopes: ParamView2,
    pub sinks: ParamView1,
}

impl Default for PackedOptions {
    fn default() -> Self {
        PackedOptions {
            dtype: ElementType::Float32,
            kv_int8: false,
            causal: false,
            scale: 1.0,
            window_left: -1,
            window_right: -1,
            softcap: 0.0,
            alibi_slopes: ParamView2::NONE,
            sinks: ParamView1::NONE,
        }
    }
}

/// Sequences packed one after another: sequence b has query rows cu_seqlens_q[b] ..
/// cu_seqlens_q[b + 1] and keys cu_seqlens_k[b] .. cu_seqlens_k[b + 1]; its query row i sits at
/// position (Lk_b - Lq_b) + i (bottom-right).
///
/// ```text
/// q (total_q, Hq, D)   k (total_k, Hkv, D)   v (total_k, Hkv, Dv)   out (total_q, Hq, Dv)
/// lse (Hq, total_q)    cu_seqlens_q, cu_seqlens_k (B + 1,)   k_scale, v_scale (total_k, Hkv)
/// ```
#[derive(Clone, Copy, Debug)]
pub struct VarlenProblem<'a> {
    pub q: TensorView3,
    pub k: TensorView3,
    pub v: TensorView3,
    pub out: MutTensorView3,
    pub lse: LseView2,
    pub cu_seqlens_q: &'a [i64],
    pub cu_seqlens_k: &'a [i64],
    pub options: PackedOptions,
    pub k_scale: ParamView2,
    pub v_scale: ParamView2,
}

/// Keys in pages: key j of sequence b at k_cache[block_table[b, j / block_size], j % block_size];
/// sequence b has seq_lens[b] keys and query rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1], its
/// last positions (row i at seq_lens[b] - Lq_b + i).
///
/// ```text
/// q (total_q, Hq, D)   k_cache (num_blocks, block_size, Hkv, D)   v_cache (.., Hkv, Dv)
/// out (total_q, Hq, Dv)   lse (Hq, total_q)   block_table (B, max_blocks)   seq_lens (B,)
/// cu_seqlens_q (B + 1,)   k_scale, v_scale (num_blocks, block_size, Hkv)
/// ```
#[derive(Clone, Copy, Debug)]
pub struct PagedProblem<'a> {
    pub q: TensorView3,
    pub k_cache: TensorView4,
    pub v_cache: TensorView4,
    pub out: MutTensorView3,
    pub lse: LseView2,
    pub block_table: BlockTableView,
    pub seq_lens: &'a [i64],
    pub cu_seqlens_q: &'a [i64],
    pub options: PackedOptions,
    pub k_scale: ParamView3,
    pub v_scale: ParamView3,
}

/// cu_seqlens (B + 1,): cu[0] == 0, non-decreasing, cu[B] == total (the rows of `total_name`).
/// batch None: this argument defines B (at least one entry).
fn check_cu_seqlens(
    name: &str,
    cu: &[i64],
    batch: Option<i64>,
    total_name: &str,
    total: i64,
) -> Result<(), ProblemError> {
    match batch {
        None if cu.is_empty() => reject!("{name}: expected shape (B + 1,) with B >= 0, got (0,)"),
        Some(batch) if cu.len() as i64 != batch + 1 => reject!(
            "{name}: expected shape (B + 1={},), got ({},)",
            batch + 1,
            cu.len()
        ),
        _ => {}
    }
    if cu[0] != 0 {
        reject!("{name}: expected {name}[0]=0, got {}", cu[0]);
    }
    for b in 1..cu.len() {
        if cu[b] < cu[b - 1] {
            reject!(
                "{name}: expected non-decreasing values, got {name}[{b}]={} after {name}[{}]={}",
                cu[b],
                b - 1,
                cu[b - 1]
            );
        }
    }
    let last = cu.len() - 1;
    if cu[last] != total {
        reject!(
            "{name}: expected {name}[{last}]={total_name}={total}, got {}",
            cu[last]
        );
    }
    Ok(())
}

/// Steps 1 (q, out, lse) of a packed problem: q (total_q, Hq, D) defines total_q, Hq and D;
/// out (total_q, Hq, Dv) with Dv given; lse (Hq, total_q).
fn check_packed_rows(
    q: &TensorView3,
    out: &MutTensorView3,
    lse: &LseView2,
    value_dim: i64,
) -> Result<(), ProblemError> {
    check_shape("q", || "(total_q, Hq, D)".to_owned(), &q.shape, true)?;
    let [total_q, q_heads, _] = q.shape;
    check_shape(
        "out",
        || format!("(total_q={total_q}, Hq={q_heads}, Dv={value_dim})"),
        &out.shape,
        out.shape == [total_q, q_heads, value_dim],
    )?;
    if !lse.data.is_null() {
        check_shape(
            "lse",
            || format!("(Hq={q_heads}, total_q={total_q})"),
            &lse.shape,
            lse.shape == [q_heads, total_q],
        )?;
    }
    Ok(())
}

/// Step 3 (the memory of q and out) of a packed problem.
fn check_packed_memory(q: &TensorView3, out: &MutTensorView3) -> Result<(), ProblemError> {
    check_data("q", q.data.is_null(), &q.shape)?;
    check_data("out", out.data.is_null(), &out.shape)?;
    check_unit_last_stride("q", "D", &q.shape, &q.stride)?;
    check_unit_last_stride("out", "Dv", &out.shape, &out.stride)
}

/// Steps 5 to 7 for a packed problem (scale, variants with B sequences, outputs): `inputs` are
/// the problem's own (k, v, block_table, scales); q, alibi_slopes and sinks are added here.
fn check_packed_options(
    o: &PackedOptions,
    q: &TensorView3,
    out: &MutTensorView3,
    lse: &LseView2,
    batch: i64,
    mut inputs: Vec<(&str, Option<(i128, i128)>)>,
) -> Result<(), ProblemError> {
    if !o.scale.is_finite() {
        reject!("scale: expected a finite number, got {}", o.scale);
    }
    check_variants(
        o.window_left,
        o.window_right,
        o.softcap,
        &o.alibi_slopes,
        &o.sinks,
        batch,
        q.shape[1],
    )?;
    check_distinct_elements("out", &out.shape, &out.stride)?;
    if !lse.data.is_null() {
        check_distinct_elements("lse", &lse.shape, &lse.stride)?;
    }
    let item = o.dtype.size() as i64;
    let lse_extent =
        byte_extent(lse.data as usize, &lse.shape, &lse.stride, 4).filter(|_| !lse.data.is_null());
    inputs.insert(
        0,
        ("q", byte_extent(q.data as usize, &q.shape, &q.stride, item)),
    );
    let slopes = &o.alibi_slopes;
    inputs.push((
        "alibi_slopes",
        byte_extent(slopes.data as usize, &slopes.shape, &slopes.stride, 4)
            .filter(|_| !slopes.data.is_null()),
    ));
    inputs.push((
        "sinks",
        byte_extent(o.sinks.data as usize, &o.sinks.shape, &o.sinks.stride, 4)
            .filter(|_| !o.sinks.data.is_null()),
    ));
    inputs.push(("lse", lse_extent));
    let out_extent = byte_extent(out.data as usize, &out.shape, &out.stride, item);
    check_outputs_disjoint(out_extent, lse_extent, &inputs)
}

/// The int8 scales of a packed problem (name, data, shape, strides: (total_k, Hkv) or
/// (num_blocks, block_size, Hkv)): given exactly with int8 k and v, of shape `dims`; added to
/// `inputs`.
#[allow(clippy::type_complexity)]
fn check_packed_scales<'n>(
    scales: [(&'n str, *const f32, &[i64], &[i64]); 2],
    o: &PackedOptions,
    shape: &str,
    dims: &[i64],
    expected: impl Fn() -> String,
    inputs: &mut Vec<(&'n str, Option<(i128, i128)>)>,
) -> Result<(), ProblemError> {
    for (name, data, view_shape, view_stride) in scales {
        check_scale_given(name, !data.is_null(), o.kv_int8, o.dtype, shape)?;
        if data.is_null() {
            continue;
        }
        check_shape(name, &expected, view_shape, view_shape == dims)?;
        inputs.push((name, byte_extent(data as usize, view_shape, view_stride, 4)));
    }
    Ok(())
}

/// `data` offset by `offset` elements of `item` bytes (no arithmetic for 0: data may be null).
fn element_at(data: *const u8, offset: i64, item: i64) -> *const u8 {
    if offset == 0 {
        data
    } else {
        data.wrapping_offset((offset * item) as isize)
    }
}

/// The dense problem of sequence b (B = 1): its query rows [row_begin, row_begin + rows) of q
/// and out, its lse columns, its ALiBi row; q_offset and kv_len from `position` (two entries).
/// The caller sets k, v, the scales (and pages).
#[allow(clippy::too_many_arguments)]
fn sequence_problem<'a>(
    q: &TensorView3,
    out: &MutTensorView3,
    lse: &LseView2,
    o: &PackedOptions,
    b: i64,
    row_begin: i64,
    rows: i64,
    position: &'a [i64],
) -> AttentionProblem<'a> {
    let item = o.dtype.size() as i64;
    let mut sequence_lse = LseView {
        data: std::ptr::null_mut(),
        shape: [1, q.shape[1], rows],
        stride: [0; 3],
    };
    if !lse.data.is_null() {
        sequence_lse.data = lse
            .data
            .wrapping_offset((row_begin * lse.stride[1]) as isize);
        sequence_lse.stride = [0, lse.stride[0], lse.stride[1]];
    }
    let slopes = &o.alibi_slopes;
    AttentionProblem {
        dtype: o.dtype,
        q: TensorView4 {
            data: element_at(q.data, row_begin * q.stride[0], item),
            shape: [1, q.shape[1], rows, q.shape[2]],
            stride: [0, q.stride[1], q.stride[0], q.stride[2]],
        },
        k: TensorView4 {
            data: std::ptr::null(),
            shape: [0; 4],
            stride: [0; 4],
        },
        v: TensorView4 {
            data: std::ptr::null(),
            shape: [0; 4],
            stride: [0; 4],
        },
        out: MutTensorView4 {
            data: element_at(out.data, row_begin * out.stride[0], item).cast_mut(),
            shape: [1, out.shape[1], rows, out.shape[2]],
            stride: [0, out.stride[1], out.stride[0], out.stride[2]],
        },
        lse: sequence_lse,
        q_offset: &position[..1],
        kv_lens: &position[1..2],
        mask: MaskView::NONE,
        causal: o.causal,
        scale: o.scale,
        window_left: o.window_left,
        window_right: o.window_right,
        softcap: o.softcap,
        alibi_slopes: if slopes.data.is_null() {
            ParamView2::NONE
        } else {
            ParamView2 {
                data: slopes.data.wrapping_offset((b * slopes.stride[0]) as isize),
                shape: [1, slopes.shape[1]],
                stride: [0, slopes.stride[1]],
            }
        },
        sinks: o.sinks,
        kv_int8: o.kv_int8,
        k_scale: ParamView3::NONE,
        v_scale: ParamView3::NONE,
        pages: KeyPages::NONE,
        out32: MutTensorView4::NONE,
    }
}

/// A per-token scale of packed keys (total_k, Hkv) as the (1, Hkv, Lk_b) view of sequence rows
/// [key_begin, key_begin + keys).
fn scale_rows(scale: &ParamView2, key_begin: i64, keys: i64) -> ParamView3 {
    if scale.data.is_null() {
        return ParamView3::NONE;
    }
    ParamView3 {
        data: scale
            .data
            .wrapping_offset((key_begin * scale.stride[0]) as isize),
        shape: [1, scale.shape[1], keys],
        stride: [0, scale.stride[1], scale.stride[0]],
    }
}

/// The checks of [`check_problem`] for a packed batch (same order, same style of message), then
/// one dense problem (B = 1) per sequence with query rows, views into the caller's arrays (no
/// copy); `positions` receives per sequence its q_offset and kv_len, which the problems borrow.
/// Twin of C++'s varlen_sequences.
pub fn varlen_sequences<'a>(
    p: &VarlenProblem,
    positions: &'a mut Vec<i64>,
) -> Result<Vec<AttentionProblem<'a>>, ProblemError> {
    let o = &p.options;
    // 1. Shapes: q defines total_q, Hq, D; k total_k and Hkv; v Dv.
    let head_dim = p.q.shape[2];
    check_shape("q", || "(total_q, Hq, D)".to_owned(), &p.q.shape, true)?;
    check_shape(
        "k",
        || format!("(total_k, Hkv, D={head_dim})"),
        &p.k.shape,
        p.k.shape[2] == head_dim,
    )?;
    let [total_k, kv_heads, _] = p.k.shape;
    check_shape(
        "v",
        || format!("(total_k={total_k}, Hkv={kv_heads}, Dv)"),
        &p.v.shape,
        p.v.shape[..2] == [total_k, kv_heads],
    )?;
    check_packed_rows(&p.q, &p.out, &p.lse, p.v.shape[2])?;
    // 2. Grouped-query heads.
    check_group("k", p.q.shape[1], kv_heads)?;
    // 3. Memory.
    check_packed_memory(&p.q, &p.out)?;
    check_data("k", p.k.data.is_null(), &p.k.shape)?;
    check_data("v", p.v.data.is_null(), &p.v.shape)?;
    check_unit_last_stride("k", "D", &p.k.shape, &p.k.stride)?;
    check_unit_last_stride("v", "Dv", &p.v.shape, &p.v.stride)?;
    // 4. The sequences.
    check_cu_seqlens(
        "cu_seqlens_q",
        p.cu_seqlens_q,
        None,
        "total_q",
        p.q.shape[0],
    )?;
    let batch = p.cu_seqlens_q.len() as i64 - 1;
    check_cu_seqlens(
        "cu_seqlens_k",
        p.cu_seqlens_k,
        Some(batch),
        "total_k",
        total_k,
    )?;
    // 5 - 7. Scale, variants, int8 scales (total_k, Hkv), outputs.
    let kv_item = if o.kv_int8 { 1 } else { o.dtype.size() as i64 };
    let mut inputs = vec![
        (
            "k",
            byte_extent(p.k.data as usize, &p.k.shape, &p.k.stride, kv_item),
        ),
        (
            "v",
            byte_extent(p.v.data as usize, &p.v.shape, &p.v.stride, kv_item),
        ),
    ];
    let scales = [
        (
            "k_scale",
            p.k_scale.data,
            &p.k_scale.shape[..],
            &p.k_scale.stride[..],
        ),
        (
            "v_scale",
            p.v_scale.data,
            &p.v_scale.shape[..],
            &p.v_scale.stride[..],
        ),
    ];
    let dims = [total_k, kv_heads];
    let expected = || format!("(total_k={total_k}, Hkv={kv_heads})");
    check_packed_scales(scales, o, "(total_k, Hkv)", &dims, expected, &mut inputs)?;
    check_packed_options(o, &p.q, &p.out, &p.lse, batch, inputs)?;

    let cu_q = p.cu_seqlens_q;
    let cu_k = p.cu_seqlens_k;
    positions.clear();
    for b in 0..batch as usize {
        let keys = cu_k[b + 1] - cu_k[b];
        positions.extend([keys - (cu_q[b + 1] - cu_q[b]), keys]); // bottom-right
    }
    let positions: &'a [i64] = positions;
    let mut sequences = Vec::new();
    for b in 0..batch as usize {
        let rows = cu_q[b + 1] - cu_q[b];
        let (key_begin, keys) = (cu_k[b], cu_k[b + 1] - cu_k[b]);
        if rows == 0 {
            continue;
        }
        let position = &positions[2 * b..2 * b + 2];
        let mut s = sequence_problem(&p.q, &p.out, &p.lse, o, b as i64, cu_q[b], rows, position);
        s.k = TensorView4 {
            data: element_at(p.k.data, key_begin * p.k.stride[0], kv_item),
            shape: [1, kv_heads, keys, p.k.shape[2]],
            stride: [0, p.k.stride[1], p.k.stride[0], p.k.stride[2]],
        };
        s.v = TensorView4 {
            data: element_at(p.v.data, key_begin * p.v.stride[0], kv_item),
            shape: [1, kv_heads, keys, p.v.shape[2]],
            stride: [0, p.v.stride[1], p.v.stride[0], p.v.stride[2]],
        };
        s.k_scale = scale_rows(&p.k_scale, key_begin, keys);
        s.v_scale = scale_rows(&p.v_scale, key_begin, keys);
        sequences.push(s);
    }
    Ok(sequences)
}

/// As [`varlen_sequences`] for keys in pages (twin of C++'s paged_sequences).
pub fn paged_sequences<'a>(
    p: &PagedProblem,
    positions: &'a mut Vec<i64>,
) -> Result<Vec<AttentionProblem<'a>>, ProblemError> {
    let o = &p.options;
    // 1. Shapes: q defines total_q, Hq, D; k_cache num_blocks, block_size and Hkv; v_cache Dv;
    // block_table B and max_blocks.
    check_shape("q", || "(total_q, Hq, D)".to_owned(), &p.q.shape, true)?;
    let head_dim = p.q.shape[2];
    check_shape(
        "k_cache",
        || format!("(num_blocks, block_size, Hkv, D={head_dim})"),
        &p.k_cache.shape,
        p.k_cache.shape[3] == head_dim,
    )?;
    let [num_blocks, block_size, kv_heads, _] = p.k_cache.shape;
    if block_size < 1 {
        reject!(
            "k_cache: expected block_size >= 1, got shape {}",
            shape_string(&p.k_cache.shape)
        );
    }
    check_shape(
        "v_cache",
        || format!("(num_blocks={num_blocks}, block_size={block_size}, Hkv={kv_heads}, Dv)"),
        &p.v_cache.shape,
        p.v_cache.shape[..3] == [num_blocks, block_size, kv_heads],
    )?;
    check_packed_rows(&p.q, &p.out, &p.lse, p.v_cache.shape[3])?;
    let table = &p.block_table;
    check_shape(
        "block_table",
        || "(B, max_blocks)".to_owned(),
        &table.shape,
        true,
    )?;
    let [batch, max_blocks] = table.shape;
    // 2. Grouped-query heads.
    check_group("k_cache", p.q.shape[1], kv_heads)?;
    // 3. Memory.
    check_packed_memory(&p.q, &p.out)?;
    check_data("k_cache", p.k_cache.data.is_null(), &p.k_cache.shape)?;
    check_data("v_cache", p.v_cache.data.is_null(), &p.v_cache.shape)?;
    check_data("block_table", table.data.is_null(), &table.shape)?;
    check_unit_last_stride("k_cache", "D", &p.k_cache.shape, &p.k_cache.stride)?;
    check_unit_last_stride("v_cache", "Dv", &p.v_cache.shape, &p.v_cache.stride)?;
    // 4. The sequences: lengths, query rows, the blocks they use.
    if p.seq_lens.len() as i64 != batch {
        reject!(
            "seq_lens: expected shape (B={batch},), got ({},)",
            p.seq_lens.len()
        );
    }
    check_cu_seqlens(
        "cu_seqlens_q",
        p.cu_seqlens_q,
        Some(batch),
        "total_q",
        p.q.shape[0],
    )?;
    for b in 0..batch as usize {
        let (keys, rows) = (p.seq_lens[b], p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b]);
        if keys < 0 || keys / block_size + i64::from(keys % block_size != 0) > max_blocks {
            let capacity =
                (i128::from(max_blocks) * i128::from(block_size)).min(i128::from(i64::MAX));
            reject!("seq_lens: expected values in [0, max_blocks * block_size={capacity}], got seq_lens[{b}]={keys}");
        }
        if rows > keys {
            reject!(
                "cu_seqlens_q: expected at most seq_lens[b] query rows in sequence b, got {rows} rows in sequence {b} (seq_lens[{b}]={keys})"
            );
        }
        let mut entry = 0i64;
        while entry * block_size < keys {
            // SAFETY: the view's promise (the caller's): (b, entry) is inside its shape.
            let block = unsafe {
                *table
                    .data
                    .offset((b as i64 * table.stride[0] + entry * table.stride[1]) as isize)
            };
            if block < 0 || i64::from(block) >= num_blocks {
                reject!(
                    "block_table: expected block ids in [0, num_blocks={num_blocks}) for the blocks sequence b uses, got block_table[{b}, {entry}]={block}"
                );
            }
            entry += 1;
        }
    }
    // 5 - 7. Scale, variants, int8 scales (num_blocks, block_size, Hkv), outputs.
    let kv_item = if o.kv_int8 { 1 } else { o.dtype.size() as i64 };
    let mut inputs = vec![
        (
            "k_cache",
            byte_extent(
                p.k_cache.data as usize,
                &p.k_cache.shape,
                &p.k_cache.stride,
                kv_item,
            ),
        ),
        (
            "v_cache",
            byte_extent(
                p.v_cache.data as usize,
                &p.v_cache.shape,
                &p.v_cache.stride,
                kv_item,
            ),
        ),
        (
            "block_table",
            byte_extent(table.data as usize, &table.shape, &table.stride, 4),
        ),
    ];
    let scales = [
        (
            "k_scale",
            p.k_scale.data,
            &p.k_scale.shape[..],
            &p.k_scale.stride[..],
        ),
        (
            "v_scale",
            p.v_scale.data,
            &p.v_scale.shape[..],
            &p.v_scale.stride[..],
        ),
    ];
    let dims = [num_blocks, block_size, kv_heads];
    let expected = || format!("(num_blocks={num_blocks}, block_size={block_size}, Hkv={kv_heads})");
    check_packed_scales(
        scales,
        o,
        "(num_blocks, block_size, Hkv)",
        &dims,
        expected,
        &mut inputs,
    )?;
    check_packed_options(o, &p.q, &p.out, &p.lse, batch, inputs)?;

    let cu_q = p.cu_seqlens_q;
    positions.clear();
    for b in 0..batch as usize {
        let keys = p.seq_lens[b];
        positions.extend([keys - (cu_q[b + 1] - cu_q[b]), keys]); // the sequence's last positions
    }
    let positions: &'a [i64] = positions;
    let mut sequences = Vec::new();
    for b in 0..batch as usize {
        let (rows, keys) = (cu_q[b + 1] - cu_q[b], p.seq_lens[b]);
        if rows == 0 {
            continue;
        }
        let position = &positions[2 * b..2 * b + 2];
        let mut s = sequence_problem(&p.q, &p.out, &p.lse, o, b as i64, cu_q[b], rows, position);
        // Axis 0 steps pages, axis 2 slots (KeyPages).
        let paged = |cache: &TensorView4| TensorView4 {
            data: cache.data,
            shape: [1, kv_heads, keys, cache.shape[3]],
            stride: [
                cache.stride[0],
                cache.stride[2],
                cache.stride[1],
                cache.stride[3],
            ],
        };
        s.k = paged(&p.k_cache);
        s.v = paged(&p.v_cache);
        let paged_scale = |scale: &ParamView3| {
            if scale.data.is_null() {
                ParamView3::NONE
            } else {
                ParamView3 {
                    data: scale.data,
                    shape: [1, kv_heads, keys],
                    stride: [scale.stride[0], scale.stride[2], scale.stride[1]],
                }
            }
        };
        s.k_scale = paged_scale(&p.k_scale);
        s.v_scale = paged_scale(&p.v_scale);
        s.pages = KeyPages {
            data: table
                .data
                .wrapping_offset((b as i64 * table.stride[0]) as isize),
            stride: table.stride[1],
            block_size,
        };
        sequences.push(s);
    }
    Ok(sequences)
}
