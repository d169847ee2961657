//! The backward pass (flash_backward.rs): attention_backward against a naive float64 backward
//! written here (P from the float64 forward, FlashAttention-2's formulas), on small asymmetric
//! problems (Lq != Lk, Hq = 2 Hkv, D != Dv, odd sizes) with every variant, a problem crossing
//! query tiles and key blocks on several threads, and the checks of bad input. Twin of
//! cpp/tests/test_backward.cpp, with the same cases.
//!
//! Tolerance: each gradient element is a float32 sum of L terms (L = Lk for dq, Lq G for dk and
//! dv) of products of P and dS, where P's relative error is about the unit roundoff times the
//! size of the scores and lse (S and lse are float32) and dS = P (dP - Drow) inherits dP's and
//! Drow's absolute errors. So |got - want| <= 4 u (sqrt(L) + size) M, with u = 2^-24, size = 2 +
//! max |S| + max |lse| + sqrt(max(D, Dv)) and M the element's sum of absolute terms (as
//! tests/test_backward_native.py).

use crate::common;

use common::Rng;
use twinattn::dispatch::{available_isas, set_isa};
use twinattn::element::{bf16_to_f32, f32_to_bf16};
use twinattn::flash_attention::attention_forward;
use twinattn::flash_backward::attention_backward;
use twinattn::problem::{
    contiguous_lse_view, contiguous_mut_view, contiguous_view, AttentionProblem, BackwardProblem,
    ElementType, KeyPages, MaskKind, MaskView, MutParamView1, ParamView1, ParamView2, ParamView3,
};

const UNIT_ROUNDOFF: f64 = 1.0 / 16_777_216.0; // 2^-24

#[derive(Clone)]
struct Case {
    name: &'static str,
    shape: [i64; 7], // B, Hq, Hkv, Lq, Lk, D, Dv
    causal: bool,
    q_offset: Vec<i64>, // empty: 0
    kv_lens: Vec<i64>,  // empty: Lk
    window: (i64, i64),
    softcap: f32,
    alibi: bool,
    sinks: bool,
    mask: u8, // 0 none, 1 bool (with a row that sees nothing), 2 float (with -inf)
    threads: usize,
}

impl Case {
    fn new(name: &'static str) -> Case {
        Case {
            name,
            shape: [2, 4, 2, 5, 7, 8, 6],
            causal: false,
            q_offset: vec![],
            kv_lens: vec![],
            window: (-1, -1),
            softcap: 0.0,
            alibi: false,
            sinks: false,
            mask: 0,
            threads: 1,
        }
    }
}

/// Everything one case owns.
struct Data {
    c: Case,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    out: Vec<f32>,
    dout: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    slopes: Vec<f32>,
    sinks: Vec<f32>,
    dsinks: Vec<f32>,
    bias: Vec<f32>,
    allowed: Vec<u8>,
    q_offset: Vec<i64>,
    kv_lens: Vec<i64>,
    scale: f32,
}

impl Data {
    fn new(c: &Case) -> Data {
        let [b, hq, hkv, lq, lk, d, dv] = c.shape.map(|n| n as usize);
        let mut rng = Rng::new(7);
        let mut fill = |n: usize| (0..n).map(|_| 2.0 * rng.next()).collect::<Vec<f32>>();
        let (q, k, v, dout) = (
            fill(b * hq * lq * d),
            fill(b * hkv * lk * d),
            fill(b * hkv * lk * dv),
            fill(b * hq * lq * dv),
        );
        let cells = b * hq * lq * lk;
        let mut allowed: Vec<u8> = (0..cells).map(|_| u8::from(rng.next() < 0.4)).collect();
        for j in 0..lk {
            allowed[((hq + 2) * lq + 3) * lk + j] = 0; // row (1, 2, 3) sees nothing
        }
        let bias = (0..cells)
            .map(|_| match rng.next() {
                x if x < -0.5 => f32::NEG_INFINITY,
                x => 2.0 * x,
            })
            .collect();
        Data {
            q_offset: if c.q_offset.is_empty() {
                vec![0; b]
            } else {
                c.q_offset.clone()
            },
            kv_lens: if c.kv_lens.is_empty() {
                vec![lk as i64; b]
            } else {
                c.kv_lens.clone()
            },
            out: vec![0.0; b * hq * lq * dv],
            lse: vec![0.0; b * hq * lq],
            dq: vec![f32::NAN; q.len()],
            dk: vec![f32::NAN; k.len()],
            dv: vec![f32::NAN; v.len()],
            slopes: (0..b * hq).map(|i| 0.05 * (i % 5 + 1) as f32).collect(),
            sinks: (0..hq).map(|h| 0.5 * h as f32 - 1.0).collect(),
            dsinks: vec![f32::NAN; hq],
            c: c.clone(),
            q,
            k,
            v,
            dout,
            bias,
            allowed,
            scale: 0.4,
        }
    }

    fn forward(&mut self) -> AttentionProblem<'_> {
        let [b, hq, hkv, lq, lk, d, dv] = self.c.shape;
        let mask_stride = [hq * lq * lk, lq * lk, lk, 1];
        AttentionProblem {
            dtype: ElementType::Float32,
            q: contiguous_view(self.q.as_ptr(), b, hq, lq, d),
            k: contiguous_view(self.k.as_ptr(), b, hkv, lk, d),
            v: contiguous_view(self.v.as_ptr(), b, hkv, lk, dv),
            out: contiguous_mut_view(self.out.as_mut_ptr(), b, hq, lq, dv),
            lse: contiguous_lse_view(self.lse.as_mut_ptr(), b, hq, lq),
            q_offset: &self.q_offset,
            kv_lens: &self.kv_lens,
            mask: match self.c.mask {
                1 => MaskView {
                    kind: MaskKind::Bool,
                    data: self.allowed.as_ptr(),
                    shape: [b, hq, lq, lk],
                    stride: mask_stride,
                },
                2 => MaskView {
                    kind: MaskKind::Float,
                    data: self.bias.as_ptr().cast(),
                    shape: [b, hq, lq, lk],
                    stride: mask_stride,
                },
                _ => MaskView::NONE,
            },
            causal: self.c.causal,
            scale: self.scale,
            window_left: self.c.window.0,
            window_right: self.c.window.1,
            softcap: self.c.softcap,
            alibi_slopes: match self.c.alibi {
                true => ParamView2 {
                    data: self.slopes.as_ptr(),
                    shape: [b, hq],
                    stride: [hq, 1],
                },
                false => ParamView2::NONE,
            },
            sinks: match self.c.sinks {
                true => ParamView1 {
                    data: self.sinks.as_ptr(),
                    shape: [hq],
                    stride: [1],
                },
                false => ParamView1::NONE,
            },
            kv_int8: false,
            k_scale: ParamView3::NONE,
            v_scale: ParamView3::NONE,
            pages: KeyPages::NONE,
            out32: twinattn::problem::MutTensorView4::NONE,
        }
    }

    fn backward(&mut self) -> BackwardProblem<'_> {
        let [b, hq, hkv, lq, lk, d, dv] = self.c.shape;
        let dout = contiguous_view(self.dout.as_ptr(), b, hq, lq, dv);
        let dq = contiguous_mut_view(self.dq.as_mut_ptr(), b, hq, lq, d);
        let dk = contiguous_mut_view(self.dk.as_mut_ptr(), b, hkv, lk, d);
        let dv_view = contiguous_mut_view(self.dv.as_mut_ptr(), b, hkv, lk, dv);
        let dsinks = match self.c.sinks {
            true => MutParamView1 {
                data: self.dsinks.as_mut_ptr(),
                shape: [hq],
                stride: [1],
            },
            false => MutParamView1::NONE,
        };
        BackwardProblem {
            forward: self.forward(),
            dout,
            dq,
            dk,
            dv: dv_view,
            dsinks,
            out_float32: false,
            dlse: twinattn::problem::ParamView3::NONE,
        }
    }
}

/// The float64 gradients and each element's bound (see the top of the file), in the order
/// dq, dk, dv, dsinks.
struct Expected {
    grads: [Vec<f64>; 4],
    bounds: [Vec<f64>; 4],
}

fn naive_backward(x: &Data) -> Expected {
    let c = &x.c;
    let [batch, hq, hkv, lq, lk, d_len, dv_len] = c.shape.map(|n| n as usize);
    let group = hq / hkv;
    let scale = f64::from(x.scale);
    let mut grads = [
        vec![0.0; x.q.len()],
        vec![0.0; x.k.len()],
        vec![0.0; x.v.len()],
        vec![0.0; hq],
    ];
    let mut bounds = grads.clone();
    let mut size = 2.0 + (d_len.max(dv_len) as f64).sqrt();
    let (mut max_score, mut max_lse) = (0.0f64, 0.0f64);
    for b in 0..batch {
        for h in 0..hq {
            for i in 0..lq {
                let kv = h / group;
                let row = (b * hq + h) * lq + i;
                let position = x.q_offset[b] + i as i64;
                let sink = f64::from(x.sinks[h]);
                let mut top = if c.sinks { sink } else { f64::NEG_INFINITY };
                let mut s = vec![f64::NEG_INFINITY; lk];
                let mut t = vec![0.0; lk];
                for j in 0..lk {
                    let key = (b * hkv + kv) * lk + j;
                    let dot: f64 = (0..d_len)
                        .map(|d| f64::from(x.q[row * d_len + d]) * f64::from(x.k[key * d_len + d]))
                        .sum();
                    let mut score = scale * dot;
                    if c.softcap > 0.0 {
                        t[j] = (score / f64::from(c.softcap)).tanh();
                        score = f64::from(c.softcap) * t[j];
                    }
                    if c.alibi {
                        score -=
                            f64::from(x.slopes[b * hq + h]) * (position - j as i64).abs() as f64;
                    }
                    let j64 = j as i64;
                    let mut visible = j64 < x.kv_lens[b]
                        && (!c.causal || j64 <= position)
                        && (c.window.0 < 0 || j64 >= position - c.window.0)
                        && (c.window.1 < 0 || j64 <= position + c.window.1);
                    let cell = row * lk + j;
                    if c.mask == 1 {
                        visible &= x.allowed[cell] != 0;
                    }
                    if c.mask == 2 {
                        visible &= x.bias[cell] != f32::NEG_INFINITY;
                        if visible {
                            score += f64::from(x.bias[cell]);
                        }
                    }
                    if visible {
                        s[j] = score;
                        max_score = max_score.max(score.abs());
                        top = top.max(score);
                    }
                }
                let mut total = if c.sinks { (sink - top).exp() } else { 0.0 };
                total += s
                    .iter()
                    .filter(|&&v| v != f64::NEG_INFINITY)
                    .map(|&v| (v - top).exp())
                    .sum::<f64>();
                let lse = if total == 0.0 {
                    f64::NEG_INFINITY
                } else {
                    top + total.ln()
                };
                if total != 0.0 {
                    max_lse = max_lse.max(lse.abs());
                }
                // Drow from the out the kernel is given
                let delta: f64 = (0..dv_len)
                    .map(|cc| {
                        f64::from(x.dout[row * dv_len + cc]) * f64::from(x.out[row * dv_len + cc])
                    })
                    .sum();
                for j in 0..lk {
                    if s[j] == f64::NEG_INFINITY {
                        continue;
                    }
                    let key = (b * hkv + kv) * lk + j;
                    let p = (s[j] - lse).exp();
                    let dp: f64 = (0..dv_len)
                        .map(|cc| {
                            f64::from(x.dout[row * dv_len + cc]) * f64::from(x.v[key * dv_len + cc])
                        })
                        .sum();
                    let capped = if c.softcap > 0.0 {
                        1.0 - t[j] * t[j]
                    } else {
                        1.0
                    };
                    let ds = p * (dp - delta) * capped;
                    let ds_abs = p * (dp.abs() + delta.abs()) * capped;
                    for d in 0..d_len {
                        let (q_d, k_d) = (
                            f64::from(x.q[row * d_len + d]),
                            f64::from(x.k[key * d_len + d]),
                        );
                        grads[0][row * d_len + d] += scale * ds * k_d;
                        bounds[0][row * d_len + d] += scale * ds_abs * k_d.abs();
                        grads[1][key * d_len + d] += scale * ds * q_d;
                        bounds[1][key * d_len + d] += scale * ds_abs * q_d.abs();
                    }
                    for cc in 0..dv_len {
                        let dout_c = f64::from(x.dout[row * dv_len + cc]);
                        grads[2][key * dv_len + cc] += p * dout_c;
                        bounds[2][key * dv_len + cc] += p * dout_c.abs();
                    }
                }
                if c.sinks && total != 0.0 {
                    let sink_prob = (sink - lse).exp();
                    grads[3][h] -= sink_prob * delta;
                    bounds[3][h] += sink_prob * delta.abs();
                }
            }
        }
    }
    size += max_score + max_lse;
    let terms = [lk, lq * group, lq * group, batch * lq];
    for (bound, terms) in bounds.iter_mut().zip(terms) {
        for value in bound.iter_mut() {
            *value *= 4.0 * UNIT_ROUNDOFF * ((terms as f64).sqrt() + size);
        }
    }
    Expected { grads, bounds }
}

fn assert_close(name: &str, gradient: &str, got: &[f32], want: &[f64], bound: &[f64]) {
    for (n, ((&got, &want), &bound)) in got.iter().zip(want).zip(bound).enumerate() {
        // NaN (an element left unwritten) fails
        assert!(
            (f64::from(got) - want).abs() <= bound,
            "{name}: {gradient}[{n}] = {got}, expected {want} +- {bound}"
        );
    }
}

fn run_case(c: &Case) {
    let mut x = Data::new(c);
    // SAFETY: every view covers its vector of Data, alive for the call.
    unsafe { attention_forward(&x.forward(), 1) }.unwrap();
    unsafe { attention_backward(&x.backward(), c.threads) }.unwrap();
    let want = naive_backward(&x);
    let got = [&x.dq, &x.dk, &x.dv, &x.dsinks];
    for (index, gradient) in ["dq", "dk", "dv", "dsinks"].iter().enumerate() {
        if index < 3 || c.sinks {
            assert_close(
                c.name,
                gradient,
                got[index],
                &want.grads[index],
                &want.bounds[index],
            );
        }
    }
    // The thread count changes nothing.
    let mut serial = Data::new(c);
    serial.out.clone_from(&x.out);
    serial.lse.clone_from(&x.lse);
    // SAFETY: as above.
    unsafe { attention_backward(&serial.backward(), 1) }.unwrap();
    let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(&x.dq), bits(&serial.dq), "{}", c.name);
    assert_eq!(bits(&x.dk), bits(&serial.dk), "{}", c.name);
    assert_eq!(bits(&x.dv), bits(&serial.dv), "{}", c.name);
}

#[test]
fn small_problems_match_float64() {
    let mut cases = Vec::new();
    let mut add = |name: &'static str, set: &dyn Fn(&mut Case)| {
        let mut c = Case::new(name);
        set(&mut c);
        cases.push(c);
    };
    add("plain", &|_| {});
    add("causal_offset", &|c| {
        c.causal = true;
        c.q_offset = vec![2, 0];
    });
    add("kv_lens", &|c| c.kv_lens = vec![7, 3]);
    add("kv_len_zero_causal", &|c| {
        c.causal = true;
        c.kv_lens = vec![0, 4];
    });
    add("window", &|c| {
        c.window = (2, 1);
        c.q_offset = vec![1, 3];
    });
    add("softcap", &|c| c.softcap = 2.5);
    add("alibi", &|c| {
        c.alibi = true;
        c.q_offset = vec![1, 2];
    });
    add("sinks", &|c| {
        c.sinks = true;
        c.kv_lens = vec![5, 0];
    });
    add("bool_mask", &|c| c.mask = 1);
    add("float_mask", &|c| c.mask = 2);
    add("everything", &|c| {
        c.causal = true;
        c.q_offset = vec![2, 1];
        c.kv_lens = vec![6, 5];
        c.window = (3, -1);
        c.softcap = 4.0;
        c.alibi = true;
        c.sinks = true;
        c.mask = 2;
    });
    // 4 heads on one KV head over 60 positions: 240 packed rows (5 query tiles, two chunks of the
    // fused pass); 150 keys (3 key blocks); 3 threads, which run passes 2 and 3 on its 2
    // (sequence, KV head) pairs, checked bit for bit against 1 thread, which runs the fused pass.
    add("tiles", &|c| {
        c.shape = [2, 4, 1, 60, 150, 20, 12];
        c.causal = true;
        c.q_offset = vec![120, 40];
        c.kv_lens = vec![150, 101];
        c.window = (90, -1);
        c.softcap = 5.0;
        c.sinks = true;
        c.threads = 3;
    });
    // Every instruction set: the backward's inner products are each one's own kernels.
    let _isa = common::isa_switch();
    for isa in available_isas() {
        set_isa(isa).unwrap();
        for c in &cases {
            run_case(c);
        }
    }
    set_isa(available_isas()[0]).unwrap();
}

/// The bfloat16 tile path (avx512bf16 and amxbf16: bfloat16 with D a multiple of 32, products
/// on bfloat16 pairs, VDPBF16PS or AMX tiles, P and dS rounded to bfloat16; docs/kernels.md,
/// "Backward"), on a case of 3 query tiles and 3 key blocks: 1 and 3 threads give the same bits;
/// the result is not avx512's (float32 products) but within bfloat16's rounding of it (2^-5 of each gradient's largest element: P
/// and dS carry 2^-8 each, the result's rounding 2^-9); NaN in the keys no row sees (past
/// sequence 0's last position, below its kv_len) gives finite gradients as close, and 0 for
/// those keys. Twin of test_bf16_tile_path in cpp/tests/test_backward.cpp.
#[test]
#[cfg_attr(
    not(twinattn_cpu_avx512bf16),
    ignore = "AVX512_BF16 (the tile path's VDPBF16PS) is not available on this CPU"
)]
fn bf16_tile_path() {
    let _isa = common::isa_switch();
    for isa in ["avx512bf16", "amxbf16"] {
        if available_isas().contains(&isa) {
            bf16_tile_path_on(isa);
        }
    }
    set_isa(available_isas()[0]).unwrap();
}

fn bf16_tile_path_on(isa: &str) {
    let mut c = Case::new("bf16_tiles");
    c.shape = [2, 8, 2, 70, 150, 64, 32];
    c.causal = true;
    c.q_offset = vec![60, 0];
    c.kv_lens = vec![150, 111];
    c.softcap = 5.0;
    c.sinks = true;
    let [_, _, hkv, _, lk, d, dv] = c.shape.map(|n| n as usize);
    let mut x = Data::new(&c);
    let rounded = |values: &[f32]| values.iter().map(|&v| f32_to_bf16(v)).collect::<Vec<u16>>();
    let (q, mut k, mut v, dout) = (
        rounded(&x.q),
        rounded(&x.k),
        rounded(&x.v),
        rounded(&x.dout),
    );
    let mut out = vec![0u16; x.out.len()];
    // dq, dk, dv of one call on the instruction set in use
    let mut run = |k: &[u16], v: &[u16], threads: usize, forward: bool| {
        let mut grads = [
            vec![0u16; q.len()],
            vec![0u16; k.len()],
            vec![0u16; v.len()],
        ];
        let mut bp = x.backward();
        bp.forward.dtype = ElementType::BFloat16;
        bp.forward.q.data = q.as_ptr().cast();
        bp.forward.k.data = k.as_ptr().cast();
        bp.forward.v.data = v.as_ptr().cast();
        bp.forward.out.data = out.as_mut_ptr().cast();
        bp.dout.data = dout.as_ptr().cast();
        bp.dq.data = grads[0].as_mut_ptr().cast();
        bp.dk.data = grads[1].as_mut_ptr().cast();
        bp.dv.data = grads[2].as_mut_ptr().cast();
        // SAFETY: every view covers its vector, alive for the call, of the dtype's elements.
        unsafe {
            if forward {
                attention_forward(&bp.forward, 1).unwrap();
            }
            attention_backward(&bp, threads).unwrap();
        }
        grads
    };
    // max |a - b| <= 2^-5 max |b| per gradient, every element finite; returns whether a != b
    let close = |a: &[Vec<u16>; 3], b: &[Vec<u16>; 3]| {
        let mut differ = true;
        for (a, b) in a.iter().zip(b) {
            let largest = b
                .iter()
                .fold(0.0f64, |m, &x| m.max(f64::from(bf16_to_f32(x)).abs()));
            let mut error = 0.0f64;
            for (&x, &y) in a.iter().zip(b) {
                assert!(bf16_to_f32(x).is_finite());
                error = error.max((f64::from(bf16_to_f32(x)) - f64::from(bf16_to_f32(y))).abs());
            }
            assert!(error <= largest / 32.0, "{error} > {largest} / 32");
            differ = differ && a != b;
        }
        differ
    };
    set_isa(isa).unwrap();
    let tiles = run(&k, &v, 1, true);
    assert_eq!(run(&k, &v, 3, false), tiles);
    set_isa("avx512").unwrap();
    let floats = run(&k, &v, 1, false);
    assert!(close(&tiles, &floats));
    set_isa(isa).unwrap();
    for kv_head in 0..hkv {
        for key in 130..lk {
            // sequence 0's positions end at 60 + 69
            k[(kv_head * lk + key) * d..(kv_head * lk + key + 1) * d].fill(0x7fc0);
            v[(kv_head * lk + key) * dv..(kv_head * lk + key + 1) * dv].fill(0x7fc0);
        }
    }
    let poisoned = run(&k, &v, 1, false);
    close(&poisoned, &tiles);
    for kv_head in 0..hkv {
        let keys = kv_head * lk + 130..(kv_head + 1) * lk;
        assert!(poisoned[1][keys.start * d..keys.end * d]
            .iter()
            .all(|&x| bf16_to_f32(x) == 0.0));
        assert!(poisoned[2][keys.start * dv..keys.end * dv]
            .iter()
            .all(|&x| bf16_to_f32(x) == 0.0));
    }
}

#[test]
fn bad_input_is_rejected() {
    let mut x = Data::new(&Case::new("bad"));
    // SAFETY: every view covers its vector of Data, alive for the call; the bad problems are
    // rejected before memory is touched.
    unsafe { attention_forward(&x.forward(), 1) }.unwrap();
    let q_data = x.q.as_ptr().cast_mut().cast::<u8>();
    let dk_data = x.dk.as_mut_ptr().cast::<u8>();
    let dsinks_data = x.dsinks.as_mut_ptr();
    let expect = |bp: BackwardProblem, threads: usize, message: &str| {
        let error = unsafe { attention_backward(&bp, threads) }.unwrap_err().0;
        assert!(error.contains(message), "{error:?} lacks {message:?}");
    };
    let mut bp = x.backward();
    bp.dq.shape[3] = 9;
    expect(
        bp,
        1,
        "dq: expected shape (B=2, Hq=4, Lq=5, D=8), got (2, 4, 5, 9)",
    );
    let mut bp = x.backward();
    bp.forward.lse.data = std::ptr::null_mut();
    expect(bp, 1, "lse: required");
    let mut bp = x.backward();
    bp.dsinks = MutParamView1 {
        data: dsinks_data,
        shape: [4],
        stride: [1],
    };
    expect(bp, 1, "dsinks: expected None without sinks");
    let mut bp = x.backward();
    bp.forward.kv_int8 = true;
    expect(bp, 1, "int8 keys and values carry no gradient");
    let mut bp = x.backward();
    bp.dq.data = q_data;
    expect(
        bp,
        1,
        "dq: expected memory disjoint from q, got arrays that overlap",
    );
    let mut bp = x.backward();
    bp.dv.data = dk_data; // dv over dk (both have 2 * 2 * 7 rows; Dv < D)
    expect(
        bp,
        1,
        "dv: expected memory disjoint from dk, got arrays that overlap",
    );
    let mut bp = x.backward();
    bp.dk.stride[1] = 0;
    expect(
        bp,
        1,
        "dk: expected elements that do not overlap each other",
    );
    expect(x.backward(), 0, "num_threads: expected an int >= 1, got 0");
}
