//! Test helpers: owned strided tensors, a safe way to run the kernel on them, and a naive float64
//! attention written straight from the contract (docs/native_api.md) to compare against.
#![allow(dead_code)] // each test file uses its own subset

use std::cell::Cell;
use std::sync::{Mutex, MutexGuard};
use twinattn::element::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use twinattn::problem::ElementType;
use twinattn::problem::{
    AttentionProblem, LseView, MaskKind, MaskView, MutTensorView4, ParamView1, ParamView2,
    ParamView3, ProblemError, TensorView4,
};
use twinattn::reference_kernel::attention_reference;

/// Which kernel [`Case::run`] calls on this thread: the plain reference kernel, or the fast
/// kernel with one instruction set's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Reference,
    Fast(&'static str),
}

thread_local! {
    static KERNEL: Cell<Kernel> = const { Cell::new(Kernel::Reference) };
}

/// Runs `test` with `kernel` selected on this thread (each test runs on its own thread). The tests
/// of an instruction set this CPU lacks are `#[ignore]`d at build time (build.rs); reaching one
/// here means the test binary runs on another CPU than the one that built it, which fails.
pub fn with_kernel(kernel: Kernel, test: fn()) {
    if let Kernel::Fast(isa) = kernel {
        assert!(
            twinattn::dispatch::kernels_for(isa).is_some(),
            "{isa} is not available on this CPU, but this test binary was built to run it \
             (build.rs saw it on the CPU that built the tests); rebuild the tests here"
        );
    }
    KERNEL.with(|k| k.set(kernel));
    test();
}

/// Held by each test that switches the process-wide instruction set (`dispatch::set_isa`, which
/// the backward and the packed / paged entry points follow), so such tests run one at a time; each
/// restores the default before it lets go.
pub fn isa_switch() -> MutexGuard<'static, ()> {
    static ISA_SWITCH: Mutex<()> = Mutex::new(());
    ISA_SWITCH
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs `case` with `kernel` (whose instruction set must be available), then restores this
/// thread's selection.
pub fn run_with(kernel: Kernel, case: &Case, threads: usize) -> Output {
    let previous = KERNEL.with(|k| k.replace(kernel));
    let result = case.run(threads).unwrap();
    KERNEL.with(|k| k.set(previous));
    result
}

/// The kernel selected on this thread.
pub fn kernel() -> Kernel {
    KERNEL.with(|k| k.get())
}

/// Exactly equal for the reference kernel; within 2 ulp for the fast kernel, whose base-2
/// softmax turns ln into log2 and back (lse = ln 2 * (m + log2 l)).
pub fn assert_lse_eq(got: f32, want: f32) {
    if kernel() == Kernel::Reference {
        assert_eq!(got, want);
    } else {
        assert!(
            (got - want).abs() <= 2.0 * f32::EPSILON * want.abs().max(1.0),
            "{got} vs {want}"
        );
    }
}

/// A small deterministic generator (xorshift64*), so tests need no crates.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// Uniform in [-1, 1).
    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 bits
        bits as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// An owned 4-D float32 tensor: a buffer and a strided view into it. Construction checks that
/// every in-bounds index lands inside the buffer, which is what makes [`Case::run`] safe.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub buffer: Vec<f32>,
    pub origin: usize,
    pub shape: [i64; 4],
    pub stride: [i64; 4],
}

fn contiguous_strides(shape: [i64; 4]) -> [i64; 4] {
    [
        shape[1] * shape[2] * shape[3],
        shape[2] * shape[3],
        shape[3],
        1,
    ]
}

impl Tensor {
    pub fn from_fn(shape: [i64; 4], f: impl FnMut([i64; 4]) -> f32) -> Tensor {
        let size = shape.iter().product::<i64>() as usize;
        Tensor::with_layout(shape, contiguous_strides(shape), 0, size, f)
    }

    pub fn zeros(shape: [i64; 4]) -> Tensor {
        Tensor::from_fn(shape, |_| 0.0)
    }

    pub fn random(shape: [i64; 4], rng: &mut Rng) -> Tensor {
        Tensor::from_fn(shape, |_| rng.next())
    }

    /// From nested rows, shape (1, 1, rows, cols).
    pub fn rows(rows: &[&[f32]]) -> Tensor {
        let cols = rows.first().map_or(0, |r| r.len());
        Tensor::from_fn([1, 1, rows.len() as i64, cols as i64], |[_, _, i, d]| {
            rows[i as usize][d as usize]
        })
    }

    /// A tensor at `origin` with `stride` inside a NaN-filled buffer of `buffer_len` floats:
    /// every float the view does not cover is NaN, so a kernel reading outside it shows.
    /// Panics unless every index of the view lands inside the buffer.
    pub fn with_layout(
        shape: [i64; 4],
        stride: [i64; 4],
        origin: usize,
        buffer_len: usize,
        mut f: impl FnMut([i64; 4]) -> f32,
    ) -> Tensor {
        let mut t = Tensor {
            buffer: vec![f32::NAN; buffer_len],
            origin,
            shape,
            stride,
        };
        let mut index = [0i64; 4];
        if shape.iter().all(|&n| n > 0) {
            loop {
                let at = t.position(index);
                t.buffer[at] = f(index);
                if !next_index(&mut index, &shape) {
                    break;
                }
            }
        }
        t
    }

    /// The same values in a new layout: axes stored in the order `order` (outermost first), the
    /// axes listed in `reversed` stored backwards (negative strides), `pad` spare floats between
    /// rows of the last axis. Values outside the view are NaN.
    pub fn relayout(&self, order: [usize; 4], reversed: &[usize], pad: i64) -> Tensor {
        let mut stride = [0i64; 4];
        let mut step = 1i64;
        for (rank, &axis) in order.iter().enumerate().rev() {
            stride[axis] = step;
            step *= self.shape[axis] + if rank == 3 { pad } else { 0 };
        }
        let size = step.max(1) as usize;
        let mut origin = 0i64;
        for &axis in reversed {
            origin += (self.shape[axis] - 1) * stride[axis];
            stride[axis] = -stride[axis];
        }
        Tensor::with_layout(self.shape, stride, origin as usize, size, |index| {
            self.at(index)
        })
    }

    fn position(&self, index: [i64; 4]) -> usize {
        let at = self.origin as i64
            + index
                .iter()
                .zip(&self.stride)
                .map(|(i, s)| i * s)
                .sum::<i64>();
        assert!(
            at >= 0 && (at as usize) < self.buffer.len(),
            "view reaches outside its buffer"
        );
        at as usize
    }

    pub fn at(&self, index: [i64; 4]) -> f32 {
        self.buffer[self.position(index)]
    }

    pub fn set(&mut self, index: [i64; 4], value: f32) {
        let at = self.position(index);
        self.buffer[at] = value;
    }

    pub fn view(&self) -> TensorView4 {
        TensorView4 {
            data: self.buffer.as_ptr().wrapping_add(self.origin).cast(),
            shape: self.shape,
            stride: self.stride,
        }
    }

    pub fn view_mut(&mut self) -> MutTensorView4 {
        MutTensorView4 {
            data: self.buffer.as_mut_ptr().wrapping_add(self.origin).cast(),
            shape: self.shape,
            stride: self.stride,
        }
    }

    /// Every float of the buffer (inside the view or not) rounded to `dtype` and back.
    pub fn rounded(&self, dtype: ElementType) -> Tensor {
        let mut t = self.clone();
        for x in &mut t.buffer {
            *x = round_to(dtype, *x);
        }
        t
    }

    /// The buffer as halves of `dtype` (float16 or bfloat16), the same layout.
    fn halves(&self, dtype: ElementType) -> HalfBuffer {
        HalfBuffer(self.buffer.iter().map(|&x| half_bits(dtype, x)).collect())
    }

    /// All values in index order.
    pub fn values(&self) -> Vec<f32> {
        let mut values = Vec::new();
        let mut index = [0i64; 4];
        if self.shape.iter().all(|&n| n > 0) {
            loop {
                values.push(self.at(index));
                if !next_index(&mut index, &self.shape) {
                    break;
                }
            }
        }
        values
    }

    /// Rows `range` of axis 2 (the sequence axis), as a new contiguous tensor.
    pub fn seq(&self, range: std::ops::Range<i64>) -> Tensor {
        let shape = [
            self.shape[0],
            self.shape[1],
            range.end - range.start,
            self.shape[3],
        ];
        Tensor::from_fn(shape, |[b, h, i, d]| self.at([b, h, range.start + i, d]))
    }
}

/// A tensor's buffer stored as float16 or bfloat16 bits.
struct HalfBuffer(Vec<u16>);

impl HalfBuffer {
    fn view(&self, like: &Tensor) -> TensorView4 {
        TensorView4 {
            data: self.0.as_ptr().wrapping_add(like.origin).cast(),
            shape: like.shape,
            stride: like.stride,
        }
    }
}

/// x rounded to `dtype` (the kernels' rounding, element.rs) and converted back, exactly.
pub fn round_to(dtype: ElementType, x: f32) -> f32 {
    match dtype {
        ElementType::Float32 => x,
        ElementType::Float16 => f16_to_f32(f32_to_f16(x)),
        ElementType::BFloat16 => bf16_to_f32(f32_to_bf16(x)),
    }
}

fn half_bits(dtype: ElementType, x: f32) -> u16 {
    match dtype {
        ElementType::Float16 => f32_to_f16(x),
        ElementType::BFloat16 => f32_to_bf16(x),
        ElementType::Float32 => unreachable!("float32 is not stored as halves"),
    }
}

fn half_value(dtype: ElementType, h: u16) -> f32 {
    match dtype {
        ElementType::Float16 => f16_to_f32(h),
        ElementType::BFloat16 => bf16_to_f32(h),
        ElementType::Float32 => unreachable!("float32 is not stored as halves"),
    }
}

/// Advances a row-major index; false after the last one.
pub fn next_index(index: &mut [i64; 4], shape: &[i64; 4]) -> bool {
    for axis in (0..4).rev() {
        index[axis] += 1;
        if index[axis] < shape[axis] {
            return true;
        }
        index[axis] = 0;
    }
    false
}

/// A mask over (B, Hq, Lq, Lk), owned; `stride` may hold zeros (broadcast).
#[derive(Clone, Debug)]
pub enum Mask {
    None,
    Bool { buffer: Vec<u8>, stride: [i64; 4] },
    Float { buffer: Vec<f32>, stride: [i64; 4] },
}

impl Mask {
    pub fn bool_from_fn(shape: [i64; 4], mut f: impl FnMut([i64; 4]) -> bool) -> Mask {
        let t = Tensor::from_fn(shape, |index| if f(index) { 1.0 } else { 0.0 });
        Mask::Bool {
            buffer: t.buffer.iter().map(|&x| x as u8).collect(),
            stride: t.stride,
        }
    }

    pub fn float_from_fn(shape: [i64; 4], f: impl FnMut([i64; 4]) -> f32) -> Mask {
        let t = Tensor::from_fn(shape, f);
        Mask::Float {
            buffer: t.buffer,
            stride: t.stride,
        }
    }

    fn offset(stride: &[i64; 4], index: [i64; 4]) -> usize {
        index.iter().zip(stride).map(|(i, s)| i * s).sum::<i64>() as usize
    }

    /// (visible by the mask, bias)
    pub fn at(&self, index: [i64; 4]) -> (bool, f64) {
        match self {
            Mask::None => (true, 0.0),
            Mask::Bool { buffer, stride } => (buffer[Mask::offset(stride, index)] != 0, 0.0),
            Mask::Float { buffer, stride } => {
                (true, f64::from(buffer[Mask::offset(stride, index)]))
            }
        }
    }
}

/// int8 K/V: the per-token scales of k and v, (B, Hkv, Lk) views of owned buffers (any
/// non-negative strides, 0 included). With them the case's k and v hold integers in [-127, 127],
/// stored as int8 by [`Case::run_into`] (layouts kept).
#[derive(Clone, Debug)]
pub struct KvScales {
    pub k: Vec<f32>,
    pub k_stride: [i64; 3],
    pub v: Vec<f32>,
    pub v_stride: [i64; 3],
}

impl KvScales {
    fn view(buffer: &[f32], stride: [i64; 3], shape: [i64; 3]) -> ParamView3 {
        if shape.iter().all(|&n| n > 0) {
            let reach: i64 = shape.iter().zip(&stride).map(|(n, s)| (n - 1) * s).sum();
            assert!(
                stride.iter().all(|&s| s >= 0) && (reach as usize) < buffer.len(),
                "scale buffer too small"
            );
        }
        ParamView3 {
            data: buffer.as_ptr(),
            shape,
            stride,
        }
    }

    pub fn at(buffer: &[f32], stride: [i64; 3], index: [i64; 3]) -> f32 {
        buffer[index.iter().zip(&stride).map(|(i, s)| i * s).sum::<i64>() as usize]
    }
}

/// One attention call with owned inputs.
#[derive(Clone, Debug)]
pub struct Case {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub q_offset: Vec<i64>,
    pub kv_lens: Vec<i64>,
    pub mask: Mask,
    pub causal: bool,
    pub scale: f32,
    /// Variants (issue 13): window sides (-1 unbounded), softcap (0 off), ALiBi slopes (B, Hq)
    /// row-major, sinks (Hq,).
    pub window_left: i64,
    pub window_right: i64,
    pub softcap: f32,
    pub alibi_slopes: Option<Vec<f32>>,
    pub sinks: Option<Vec<f32>>,
    /// the storage of q, k, v and out: float32, or float16 / bfloat16 (then [`Case::run_into`]
    /// stores q, k, v as halves of that type, the layouts kept, rounding each float, and returns
    /// out's halves converted back to float32)
    pub dtype: ElementType,
    /// int8 K/V (issue 15): None, or the scales (k and v then hold the int8 values)
    pub kv_scales: Option<KvScales>,
}

/// The kernel's results: out (B, Hq, Lq, Dv) and lse (B, Hq, Lq) flattened row-major.
#[derive(Clone, Debug)]
pub struct Output {
    pub out: Tensor,
    pub lse: Vec<f32>,
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Tensor) -> bool {
        self.shape == other.shape && bits(&self.values()) == bits(&other.values())
    }
}

/// Asserts two outputs are bit-identical (NaN and -inf included).
pub fn assert_identical(a: &Output, b: &Output) {
    assert_eq!(a.out.shape, b.out.shape);
    assert_eq!(
        bits(&a.out.values()),
        bits(&b.out.values()),
        "out differs:\n{:?}\n{:?}",
        a.out.values(),
        b.out.values()
    );
    assert_eq!(
        bits(&a.lse),
        bits(&b.lse),
        "lse differs:\n{:?}\n{:?}",
        a.lse,
        b.lse
    );
}

pub fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|x| x.to_bits()).collect()
}

/// The bits of `values` each rounded to `dtype` (as float32 values: [`round_to`]).
pub fn rounded_bits(dtype: ElementType, values: &[f32]) -> Vec<u32> {
    values
        .iter()
        .map(|&x| round_to(dtype, x).to_bits())
        .collect()
}

/// A case of random q (B, Hq, Lq, D), k (B, Hkv, Lk, D) and v (B, Hkv, Lk, Dv) for the shape
/// (B, Hq, Hkv, Lq, Lk, D, Dv).
pub fn random_case(rng: &mut Rng, shape: (i64, i64, i64, i64, i64, i64, i64)) -> Case {
    let (b, hq, hkv, lq, lk, d, dv) = shape;
    Case::new(
        Tensor::random([b, hq, lq, d], rng),
        Tensor::random([b, hkv, lk, d], rng),
        Tensor::random([b, hkv, lk, dv], rng),
    )
}

/// The fast kernel on every instruction set this build and CPU can run.
pub fn fast_kernels() -> Vec<Kernel> {
    twinattn::dispatch::available_isas()
        .into_iter()
        .map(Kernel::Fast)
        .collect()
}

impl Case {
    /// Defaults: not causal, q_offset 0, every key valid, no mask, scale 1/sqrt(D).
    pub fn new(q: Tensor, k: Tensor, v: Tensor) -> Case {
        let batch = q.shape[0] as usize;
        let scale = 1.0 / (q.shape[3].max(1) as f32).sqrt();
        Case {
            kv_lens: vec![k.shape[2]; batch],
            q_offset: vec![0; batch],
            mask: Mask::None,
            causal: false,
            scale,
            window_left: -1,
            window_right: -1,
            softcap: 0.0,
            alibi_slopes: None,
            sinks: None,
            dtype: ElementType::Float32,
            kv_scales: None,
            q,
            k,
            v,
        }
    }

    /// The same case with int8 K/V: each (b, kv_head, token) row of k and v quantized as the
    /// contract says (scale = max |x| / 127, x / scale rounded to nearest even, clipped to
    /// +-127, in float32), the scales laid out with `stride` (k's and v's alike; zero strides
    /// broadcast the first token's scale: then the rows are quantized with that shared scale).
    pub fn quantized(&self, k_stride: [i64; 3], v_stride: [i64; 3]) -> Case {
        fn quantize(t: &Tensor, stride: [i64; 3]) -> (Tensor, Vec<f32>) {
            let [b, h, l, d] = t.shape;
            let len = [b, h, l]
                .iter()
                .zip(&stride)
                .map(|(n, s)| (n - 1).max(0) * s)
                .sum::<i64>() as usize
                + 1;
            let mut scales = vec![f32::NAN; len];
            for bi in 0..b {
                for hi in 0..h {
                    for j in 0..l {
                        let at = KvScales::at(&scales, stride, [bi, hi, j]);
                        if at.is_nan() {
                            let amax =
                                (0..d).fold(0.0f32, |m, x| m.max(t.at([bi, hi, j, x]).abs()));
                            let offset = [bi, hi, j]
                                .iter()
                                .zip(&stride)
                                .map(|(i, s)| i * s)
                                .sum::<i64>();
                            scales[offset as usize] = amax / 127.0;
                        }
                    }
                }
            }
            let quantized = Tensor::with_layout(
                t.shape,
                t.stride,
                t.origin,
                t.buffer.len(),
                |[bi, hi, j, x]| {
                    let scale = KvScales::at(&scales, stride, [bi, hi, j]);
                    if scale == 0.0 {
                        0.0
                    } else {
                        (t.at([bi, hi, j, x]) / scale)
                            .round_ties_even()
                            .clamp(-127.0, 127.0)
                    }
                },
            );
            (quantized, scales)
        }
        let mut case = self.clone();
        let (k, k_scales) = quantize(&self.k, k_stride);
        let (v, v_scales) = quantize(&self.v, v_stride);
        case.k = k;
        case.v = v;
        case.kv_scales = Some(KvScales {
            k: k_scales,
            k_stride,
            v: v_scales,
            v_stride,
        });
        case
    }

    /// An int8 case's float32 twin: k and v dequantized (float32(x) * scale, one float32
    /// multiply), the layouts kept.
    pub fn dequantized(&self) -> Case {
        let scales = self.kv_scales.as_ref().expect("an int8 case");
        let mut case = self.clone();
        let dequantize = |t: &Tensor, buffer: &[f32], stride: [i64; 3]| {
            Tensor::with_layout(
                t.shape,
                t.stride,
                t.origin,
                t.buffer.len(),
                |[b, h, j, d]| t.at([b, h, j, d]) * KvScales::at(buffer, stride, [b, h, j]),
            )
        };
        case.k = dequantize(&self.k, &scales.k, scales.k_stride);
        case.v = dequantize(&self.v, &scales.v, scales.v_stride);
        case.kv_scales = None;
        case
    }

    /// The same case stored as `dtype`, its q, k and v rounded to it (so the float32 case of
    /// `rounded(dtype)` with dtype float32 holds exactly the values the half case computes on).
    pub fn stored_as(&self, dtype: ElementType) -> Case {
        let mut case = self.clone();
        case.q = self.q.rounded(dtype);
        case.k = self.k.rounded(dtype);
        case.v = self.v.rounded(dtype);
        case.dtype = dtype;
        case
    }

    pub fn causal(mut self, q_offset: &[i64]) -> Case {
        self.causal = true;
        self.q_offset = q_offset.to_vec();
        self
    }

    pub fn out_shape(&self) -> [i64; 4] {
        [
            self.q.shape[0],
            self.q.shape[1],
            self.q.shape[2],
            self.v.shape[3],
        ]
    }

    fn mask_shape(&self) -> [i64; 4] {
        [
            self.q.shape[0],
            self.q.shape[1],
            self.q.shape[2],
            self.k.shape[2],
        ]
    }

    /// Runs the kernel into a fresh contiguous out (pre-filled with NaN: every element must be
    /// written) and lse.
    pub fn run(&self, num_threads: usize) -> Result<Output, ProblemError> {
        let shape = self.out_shape();
        let mut out = Tensor::from_fn(shape, |_| f32::NAN);
        let mut lse = vec![f32::NAN; (shape[0] * shape[1] * shape[2]) as usize];
        self.run_into(&mut out, Some(&mut lse), num_threads)?;
        Ok(Output { out, lse })
    }

    /// Runs the kernel into `out` (any layout) and, when given, a contiguous lse.
    pub fn run_into(
        &self,
        out: &mut Tensor,
        lse: Option<&mut Vec<f32>>,
        num_threads: usize,
    ) -> Result<(), ProblemError> {
        self.with_problem_into(out, lse, |problem| {
            // SAFETY: every view comes from an owned buffer that Tensor::with_layout (or
            // assert_mask_fits, KvScales::view) checked covers the view's whole shape when the
            // shapes are consistent; when they are not, check_problem rejects the problem before
            // any memory is touched. The buffers are borrowed (shared for inputs, exclusive for
            // out and lse) for the whole call.
            unsafe {
                match kernel() {
                    Kernel::Reference => attention_reference(problem, num_threads),
                    Kernel::Fast(isa) => twinattn::flash_attention::attention_forward_with(
                        problem,
                        num_threads,
                        twinattn::dispatch::kernels_for(isa).expect("checked by with_kernel"),
                    ),
                }
            }
        })
    }

    /// `f` on the problem of this case (into a fresh out and lse), e.g. to edit it and check it.
    pub fn with_problem<R>(&self, f: impl FnOnce(&mut AttentionProblem) -> R) -> R {
        let shape = self.out_shape();
        let mut out = Tensor::from_fn(shape, |_| f32::NAN);
        let mut lse = vec![f32::NAN; (shape[0] * shape[1] * shape[2]) as usize];
        self.with_problem_into(&mut out, Some(&mut lse), f)
    }

    /// Builds the problem over this case's buffers, `out` and `lse`, and hands it to `f`.
    fn with_problem_into<R>(
        &self,
        out: &mut Tensor,
        lse: Option<&mut Vec<f32>>,
        f: impl FnOnce(&mut AttentionProblem) -> R,
    ) -> R {
        let [batch, q_heads, q_len, _] = self.q.shape;
        let lse = match lse {
            Some(lse) => {
                assert_eq!(
                    lse.len() as i64,
                    batch.max(0) * q_heads.max(0) * q_len.max(0)
                );
                LseView {
                    data: lse.as_mut_ptr(),
                    shape: [batch, q_heads, q_len],
                    stride: [q_heads * q_len, q_len, 1],
                }
            }
            None => LseView::NONE,
        };
        let mask_shape = self.mask_shape();
        let mask = match &self.mask {
            Mask::None => MaskView::NONE,
            Mask::Bool { buffer, stride } => {
                assert_mask_fits(buffer.len(), stride, &mask_shape);
                MaskView {
                    kind: MaskKind::Bool,
                    data: buffer.as_ptr(),
                    shape: mask_shape,
                    stride: *stride,
                }
            }
            Mask::Float { buffer, stride } => {
                assert_mask_fits(buffer.len(), stride, &mask_shape);
                MaskView {
                    kind: MaskKind::Float,
                    data: buffer.as_ptr().cast(),
                    shape: mask_shape,
                    stride: *stride,
                }
            }
        };
        let half = self.dtype != ElementType::Float32;
        let halves = half
            .then(|| [&self.q, &self.k, &self.v, &*out].map(|tensor| tensor.halves(self.dtype)));
        let mut out_halves = halves.as_ref().map(|[_, _, _, o]| HalfBuffer(o.0.clone()));
        let (q, k, v) = match &halves {
            Some([q, k, v, _]) => (q.view(&self.q), k.view(&self.k), v.view(&self.v)),
            None => (self.q.view(), self.k.view(), self.v.view()),
        };
        let out_view = match &mut out_halves {
            Some(buffer) => MutTensorView4 {
                data: buffer.0.as_mut_ptr().wrapping_add(out.origin).cast(),
                shape: out.shape,
                stride: out.stride,
            },
            None => out.view_mut(),
        };
        // int8 K/V: the int8 copies of k's and v's buffers (layouts kept) and the scales' views.
        let int8_buffers = self.kv_scales.as_ref().map(|_| {
            [&self.k, &self.v].map(|t| {
                for x in t.values() {
                    assert!(x == x.round() && x.abs() <= 127.0, "{x} is not an int8");
                }
                // (the buffer's NaN padding outside the view becomes 0, never read)
                t.buffer.iter().map(|&x| x as i8).collect::<Vec<i8>>()
            })
        });
        let (k, v) = match &int8_buffers {
            Some([k_bytes, v_bytes]) => (
                TensorView4 {
                    data: k_bytes.as_ptr().wrapping_add(self.k.origin).cast(),
                    shape: self.k.shape,
                    stride: self.k.stride,
                },
                TensorView4 {
                    data: v_bytes.as_ptr().wrapping_add(self.v.origin).cast(),
                    shape: self.v.shape,
                    stride: self.v.stride,
                },
            ),
            None => (k, v),
        };
        let [_, kv_heads, k_len, _] = self.k.shape;
        let (k_scale, v_scale) = match &self.kv_scales {
            Some(scales) => (
                KvScales::view(&scales.k, scales.k_stride, [batch, kv_heads, k_len]),
                KvScales::view(&scales.v, scales.v_stride, [batch, kv_heads, k_len]),
            ),
            None => (ParamView3::NONE, ParamView3::NONE),
        };
        let mut problem = AttentionProblem {
            dtype: self.dtype,
            kv_int8: self.kv_scales.is_some(),
            k_scale,
            v_scale,
            q,
            k,
            v,
            out: out_view,
            lse,
            q_offset: &self.q_offset,
            kv_lens: &self.kv_lens,
            mask,
            causal: self.causal,
            scale: self.scale,
            window_left: self.window_left,
            window_right: self.window_right,
            softcap: self.softcap,
            alibi_slopes: match &self.alibi_slopes {
                None => ParamView2::NONE,
                Some(slopes) => ParamView2 {
                    // the view covers the whole vector: B * Hq entries
                    data: {
                        assert_eq!(slopes.len() as i64, batch * q_heads);
                        slopes.as_ptr()
                    },
                    shape: [batch, q_heads],
                    stride: [q_heads, 1],
                },
            },
            sinks: match &self.sinks {
                None => ParamView1::NONE,
                Some(sinks) => ParamView1 {
                    data: sinks.as_ptr(),
                    shape: [sinks.len() as i64],
                    stride: [1],
                },
            },
            pages: twinattn::problem::KeyPages::NONE,
            out32: twinattn::problem::MutTensorView4::NONE,
        };
        let result = f(&mut problem);
        if let Some(buffer) = out_halves {
            for (x, &h) in out.buffer.iter_mut().zip(&buffer.0) {
                *x = half_value(self.dtype, h);
            }
        }
        result
    }
}

fn assert_mask_fits(len: usize, stride: &[i64; 4], shape: &[i64; 4]) {
    if shape.iter().any(|&n| n <= 0) {
        return;
    }
    let reach: i64 = shape.iter().zip(stride).map(|(n, s)| (n - 1) * s).sum();
    assert!(
        stride.iter().all(|&s| s >= 0) && (reach as usize) < len,
        "mask buffer too small"
    );
}

/// Attention straight from the contract, in float64, one row at a time: returns out (B, Hq, Lq, Dv)
/// and lse (B, Hq, Lq) flattened row-major.
pub fn naive(case: &Case) -> (Vec<f64>, Vec<f64>) {
    let [batch, q_heads, q_len, head_dim] = case.q.shape;
    let [_, kv_heads, k_len, _] = case.k.shape;
    let value_dim = case.v.shape[3];
    let mut out = Vec::new();
    let mut lse = Vec::new();
    for b in 0..batch {
        for h in 0..q_heads {
            let kv_head = h / (q_heads / kv_heads);
            for i in 0..q_len {
                let mut visible = Vec::new(); // (j, score)
                for j in 0..k_len {
                    let in_sequence = j < case.kv_lens[b as usize];
                    let in_past = !case.causal || j <= case.q_offset[b as usize] + i;
                    let (allowed, bias) = case.mask.at([b, h, i, j]);
                    if in_sequence && in_past && allowed {
                        let dot: f64 = (0..head_dim)
                            .map(|d| {
                                f64::from(case.q.at([b, h, i, d]))
                                    * f64::from(case.k.at([b, kv_head, j, d]))
                            })
                            .sum();
                        let score = f64::from(case.scale) * dot + bias;
                        if score > f64::NEG_INFINITY {
                            visible.push((j, score));
                        }
                    }
                }
                if visible.is_empty() {
                    out.extend(std::iter::repeat_n(0.0, value_dim as usize));
                    lse.push(f64::NEG_INFINITY);
                    continue;
                }
                let row_max = visible
                    .iter()
                    .map(|&(_, s)| s)
                    .fold(f64::NEG_INFINITY, f64::max);
                let row_sum: f64 = visible.iter().map(|&(_, s)| (s - row_max).exp()).sum();
                for d in 0..value_dim {
                    out.push(
                        visible
                            .iter()
                            .map(|&(j, s)| {
                                (s - row_max).exp() / row_sum
                                    * f64::from(case.v.at([b, kv_head, j, d]))
                            })
                            .sum(),
                    );
                }
                lse.push(row_max + row_sum.ln());
            }
        }
    }
    (out, lse)
}

/// Asserts the kernel's output agrees with the naive float64 computation to float32 precision
/// (the reference kernel computes in float64 and rounds once; the fast kernel accumulates in
/// float32 and gets a tolerance that grows with the number of keys and the head width).
pub fn assert_matches_naive(case: &Case, got: &Output) {
    let tolerance = match kernel() {
        Kernel::Reference => 1e-6,
        Kernel::Fast(_) => {
            let terms = (case.k.shape[2].max(1) + case.q.shape[3].max(1)) as f64;
            8.0 * f64::from(f32::EPSILON) * terms.sqrt().max(4.0)
        }
    };
    assert_close_to_naive(case, got, tolerance);
}

/// Asserts |got - want| <= tolerance * (1 + |want|) for every out and lse element.
pub fn assert_close_to_naive(case: &Case, got: &Output, tolerance: f64) {
    let (want_out, want_lse) = naive(case);
    let got_out = got.out.values();
    assert_eq!(got_out.len(), want_out.len());
    for (n, (&g, &w)) in got_out.iter().zip(&want_out).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= tolerance * (1.0 + w.abs()),
            "out element {n}: got {g}, want {w}"
        );
    }
    for (n, (&g, &w)) in got.lse.iter().zip(&want_lse).enumerate() {
        let agree = if w == f64::NEG_INFINITY {
            g == f32::NEG_INFINITY
        } else {
            (f64::from(g) - w).abs() <= tolerance * (1.0 + w.abs())
        };
        assert!(agree, "lse element {n}: got {g}, want {w}");
    }
}
