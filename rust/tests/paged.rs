//! Packed and paged batches (docs/kernels.md, "Packed and paged batches"), on every instruction
//! set (twin of cpp/tests/test_paged.cpp):
//! - attention_varlen against the reference kernel run on each sequence alone, its rows and keys
//!   copied into contiguous (1, H, L, D) arrays, within 1e-4 (1 + |ref|) for out and lse;
//!   sequences with no rows, decode rows, prefill tiles, split-key chunks; causal (bottom-right),
//!   a window, GQA;
//! - attention_paged over the same keys in shuffled pages of 1, 3 and 16 slots, NaN in every
//!   unused slot and page, -1 past each sequence's blocks: bit-identical to attention_varlen;
//! - a cascade: sequences whose block tables start with the same 18 blocks (288 keys, their
//!   shared prefix read once), against the reference on each sequence's keys;
//! - the checks' messages for a bad block id, a bad cu_seqlens and too many query rows.

use crate::common;

use common::Rng;
use twinattn::dispatch::{available_isas, set_isa};
use twinattn::flash_attention::{attention_paged, attention_varlen};
use twinattn::problem::{
    contiguous_lse_view, contiguous_mut_view, contiguous_view, AttentionProblem, BlockTableView,
    KeyPages, LseView2, MaskView, MutTensorView3, PackedOptions, PagedProblem, ParamView1,
    ParamView2, ParamView3, TensorView3, TensorView4, VarlenProblem,
};
use twinattn::reference_kernel::attention_reference;

const TOLERANCE: f64 = 1e-4;

const HQ: i64 = 4;
const HKV: i64 = 2;
const D: i64 = 12;
const DV: i64 = 8;

/// Query rows and keys per sequence: none, decode, a prefill longer than a tile, split-key decode.
const ROWS: [i64; 5] = [3, 0, 60, 1, 2];
const KEYS: [i64; 5] = [5, 4, 70, 1100, 9];

fn cumulative(lengths: &[i64]) -> Vec<i64> {
    let mut cu = vec![0];
    for &n in lengths {
        cu.push(cu[cu.len() - 1] + n);
    }
    cu
}

struct Packed {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    cu_q: Vec<i64>,
    cu_k: Vec<i64>,
}

fn make_packed(rng: &mut Rng, rows: &[i64], keys: &[i64]) -> Packed {
    let (cu_q, cu_k) = (cumulative(rows), cumulative(keys));
    let (total_q, total_k) = (cu_q[rows.len()], cu_k[keys.len()]);
    let mut values = |n: i64| (0..n).map(|_| rng.next()).collect::<Vec<f32>>();
    Packed {
        q: values(total_q * HQ * D),
        k: values(total_k * HKV * D),
        v: values(total_k * HKV * DV),
        cu_q,
        cu_k,
    }
}

fn options(causal: bool, window_left: i64) -> PackedOptions {
    PackedOptions {
        causal,
        scale: 0.3,
        window_left,
        ..PackedOptions::default()
    }
}

fn view3(data: &[f32], rows: i64, heads: i64, dim: i64) -> TensorView3 {
    TensorView3 {
        data: data.as_ptr().cast(),
        shape: [rows, heads, dim],
        stride: [heads * dim, dim, 1],
    }
}

fn near(got: f32, want: f32) -> bool {
    let (got, want) = (f64::from(got), f64::from(want));
    if want.is_infinite() {
        return got == want;
    }
    (got - want).abs() <= TOLERANCE * (1.0 + want.abs())
}

/// varlen against the reference kernel on each sequence's own contiguous arrays.
fn check_against_reference(p: &Packed, out: &[f32], lse: &[f32], o: &PackedOptions) {
    let batch = p.cu_q.len() - 1;
    let total_q = p.cu_q[batch];
    for b in 0..batch {
        let (rows, keys) = (p.cu_q[b + 1] - p.cu_q[b], p.cu_k[b + 1] - p.cu_k[b]);
        if rows == 0 {
            continue;
        }
        let gather = |packed: &[f32], first: i64, len: i64, heads: i64, dim: i64| {
            let mut x = vec![0.0f32; (heads * len * dim) as usize];
            for h in 0..heads {
                for i in 0..len {
                    for d in 0..dim {
                        x[((h * len + i) * dim + d) as usize] =
                            packed[(((first + i) * heads + h) * dim + d) as usize];
                    }
                }
            }
            x
        };
        let q = gather(&p.q, p.cu_q[b], rows, HQ, D);
        let k = gather(&p.k, p.cu_k[b], keys, HKV, D);
        let v = gather(&p.v, p.cu_k[b], keys, HKV, DV);
        let mut reference = vec![0.0f32; (HQ * rows * DV) as usize];
        let mut reference_lse = vec![0.0f32; (HQ * rows) as usize];
        let (q_offset, kv_lens) = ([keys - rows], [keys]);
        let problem = AttentionProblem {
            dtype: twinattn::problem::ElementType::Float32,
            q: contiguous_view(q.as_ptr(), 1, HQ, rows, D),
            k: contiguous_view(k.as_ptr(), 1, HKV, keys, D),
            v: contiguous_view(v.as_ptr(), 1, HKV, keys, DV),
            out: contiguous_mut_view(reference.as_mut_ptr(), 1, HQ, rows, DV),
            lse: contiguous_lse_view(reference_lse.as_mut_ptr(), 1, HQ, rows),
            q_offset: &q_offset,
            kv_lens: &kv_lens,
            mask: MaskView::NONE,
            causal: o.causal,
            scale: o.scale,
            window_left: o.window_left,
            window_right: -1,
            softcap: 0.0,
            alibi_slopes: ParamView2::NONE,
            sinks: ParamView1::NONE,
            kv_int8: false,
            k_scale: ParamView3::NONE,
            v_scale: ParamView3::NONE,
            pages: KeyPages::NONE,
            out32: twinattn::problem::MutTensorView4::NONE,
        };
        // SAFETY: every view covers its vector.
        unsafe { attention_reference(&problem, 1) }.unwrap();
        for h in 0..HQ {
            for i in 0..rows {
                let row = p.cu_q[b] + i;
                for c in 0..DV {
                    let got = out[((row * HQ + h) * DV + c) as usize];
                    let want = reference[((h * rows + i) * DV + c) as usize];
                    assert!(
                        near(got, want),
                        "sequence {b} head {h} row {i}: {got} vs {want}"
                    );
                }
                let (got, want) = (
                    lse[(h * total_q + row) as usize],
                    reference_lse[(h * rows + i) as usize],
                );
                assert!(
                    near(got, want),
                    "lse of sequence {b} head {h} row {i}: {got} vs {want}"
                );
            }
        }
    }
}

/// The packed keys of p in shuffled pages of block_size slots; NaN elsewhere, -1 past the blocks.
/// The first shared_blocks blocks of every sequence are the first sequence's (a cascade: the
/// caller made those keys equal).
struct Pages {
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    block_table: Vec<i32>,
    seq_lens: Vec<i64>,
    num_blocks: i64,
    max_blocks: i64,
}

fn make_pages(p: &Packed, block_size: i64, rng: &mut Rng, shared_blocks: i64) -> Pages {
    let lengths: Vec<i64> = p.cu_k.windows(2).map(|w| w[1] - w[0]).collect();
    let used: Vec<i64> = lengths
        .iter()
        .map(|&n| (n + block_size - 1) / block_size)
        .collect();
    let max_blocks = used.iter().max().unwrap() + 1;
    let num_blocks = used.iter().sum::<i64>() + 2;
    let mut order: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..order.len()).rev() {
        let j = ((rng.next() + 1.0) * 0.5 * (i + 1) as f32) as usize;
        order.swap(i, j.min(i));
    }
    let mut pages = Pages {
        k_cache: vec![f32::NAN; (num_blocks * block_size * HKV * D) as usize],
        v_cache: vec![f32::NAN; (num_blocks * block_size * HKV * DV) as usize],
        block_table: vec![-1; lengths.len() * max_blocks as usize],
        seq_lens: lengths.clone(),
        num_blocks,
        max_blocks,
    };
    let mut taken = 0;
    for (b, &keys) in lengths.iter().enumerate() {
        for j in 0..keys {
            let entry = b * max_blocks as usize + (j / block_size) as usize;
            if j % block_size == 0 && b > 0 && j / block_size < shared_blocks {
                pages.block_table[entry] = pages.block_table[(j / block_size) as usize];
            } else if j % block_size == 0 {
                pages.block_table[entry] = order[taken];
                taken += 1;
            }
            let slot = i64::from(pages.block_table[entry]) * block_size + j % block_size;
            let key = p.cu_k[b] + j;
            let (k_row, v_row) = ((HKV * D) as usize, (HKV * DV) as usize);
            pages.k_cache[slot as usize * k_row..][..k_row]
                .copy_from_slice(&p.k[key as usize * k_row..][..k_row]);
            pages.v_cache[slot as usize * v_row..][..v_row]
                .copy_from_slice(&p.v[key as usize * v_row..][..v_row]);
        }
    }
    pages
}

fn paged_problem<'a>(
    p: &'a Packed,
    pages: &'a Pages,
    block_size: i64,
    out: &mut [f32],
    o: PackedOptions,
) -> PagedProblem<'a> {
    let total_q = p.cu_q[p.cu_q.len() - 1];
    PagedProblem {
        q: view3(&p.q, total_q, HQ, D),
        k_cache: TensorView4 {
            data: pages.k_cache.as_ptr().cast(),
            shape: [pages.num_blocks, block_size, HKV, D],
            stride: [block_size * HKV * D, HKV * D, D, 1],
        },
        v_cache: TensorView4 {
            data: pages.v_cache.as_ptr().cast(),
            shape: [pages.num_blocks, block_size, HKV, DV],
            stride: [block_size * HKV * DV, HKV * DV, DV, 1],
        },
        out: MutTensorView3 {
            data: out.as_mut_ptr().cast(),
            shape: [total_q, HQ, DV],
            stride: [HQ * DV, DV, 1],
        },
        lse: LseView2::NONE,
        block_table: BlockTableView {
            data: pages.block_table.as_ptr(),
            shape: [pages.seq_lens.len() as i64, pages.max_blocks],
            stride: [pages.max_blocks, 1],
        },
        seq_lens: &pages.seq_lens,
        cu_seqlens_q: &p.cu_q,
        options: o,
        k_scale: ParamView3::NONE,
        v_scale: ParamView3::NONE,
    }
}

fn varlen_problem<'a>(
    p: &'a Packed,
    out: &mut [f32],
    lse: &mut [f32],
    o: PackedOptions,
) -> VarlenProblem<'a> {
    let (total_q, total_k) = (p.cu_q[ROWS.len()], p.cu_k[KEYS.len()]);
    VarlenProblem {
        q: view3(&p.q, total_q, HQ, D),
        k: view3(&p.k, total_k, HKV, D),
        v: view3(&p.v, total_k, HKV, DV),
        out: MutTensorView3 {
            data: out.as_mut_ptr().cast(),
            shape: [total_q, HQ, DV],
            stride: [HQ * DV, DV, 1],
        },
        lse: LseView2 {
            data: lse.as_mut_ptr(),
            shape: [HQ, total_q],
            stride: [total_q, 1],
        },
        cu_seqlens_q: &p.cu_q,
        cu_seqlens_k: &p.cu_k,
        options: o,
        k_scale: ParamView2::NONE,
        v_scale: ParamView2::NONE,
    }
}

#[test]
fn every_isa() {
    let _isa = common::isa_switch();
    let mut rng = Rng::new(3);
    let p = make_packed(&mut rng, &ROWS, &KEYS);
    let total_q = p.cu_q[ROWS.len()];
    for isa in available_isas() {
        set_isa(isa).unwrap();
        for o in [options(false, -1), options(true, -1), options(true, 7)] {
            let mut out = vec![f32::NAN; (total_q * HQ * DV) as usize];
            let mut lse = vec![f32::NAN; (HQ * total_q) as usize];
            // SAFETY: every view covers its vector.
            unsafe { attention_varlen(&varlen_problem(&p, &mut out, &mut lse, o), 2) }.unwrap();
            check_against_reference(&p, &out, &lse, &o);
            for block_size in [1, 3, 16] {
                let pages = make_pages(&p, block_size, &mut rng, 0);
                let mut paged = vec![f32::NAN; out.len()];
                let problem = paged_problem(&p, &pages, block_size, &mut paged, o);
                // SAFETY: as above.
                unsafe { attention_paged(&problem, 2) }.unwrap();
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&paged), bits(&out), "{isa}, block size {block_size}");
            }
        }
    }
    set_isa(available_isas()[0]).unwrap();
}

/// Three sequences share their first 18 blocks of 16 keys: the shared prefix pass and each
/// sequence's own keys, merged, against the reference on the sequence's keys.
#[test]
fn cascade() {
    let _isa = common::isa_switch();
    let mut rng = Rng::new(7);
    let mut p = make_packed(&mut rng, &[1, 2, 1], &[300, 310, 340]);
    let prefix = 18 * 16;
    let total_q = p.cu_q[3];
    for b in 1..3 {
        // the same first 288 keys and values in every sequence
        let (k_row, v_row) = ((HKV * D) as usize, (HKV * DV) as usize);
        let start = p.cu_k[b] as usize;
        p.k.copy_within(0..prefix * k_row, start * k_row);
        p.v.copy_within(0..prefix * v_row, start * v_row);
    }
    let o = options(true, -1);
    for isa in available_isas() {
        set_isa(isa).unwrap();
        let pages = make_pages(&p, 16, &mut rng, 18);
        let mut out = vec![f32::NAN; (total_q * HQ * DV) as usize];
        let mut lse = vec![f32::NAN; (HQ * total_q) as usize];
        let mut problem = paged_problem(&p, &pages, 16, &mut out, o);
        problem.lse = LseView2 {
            data: lse.as_mut_ptr(),
            shape: [HQ, total_q],
            stride: [total_q, 1],
        };
        // SAFETY: every view covers its vector.
        unsafe { attention_paged(&problem, 2) }.unwrap();
        check_against_reference(&p, &out, &lse, &o);
    }
    set_isa(available_isas()[0]).unwrap();
}

#[test]
fn checks() {
    let mut rng = Rng::new(5);
    let p = make_packed(&mut rng, &ROWS, &KEYS);
    let o = options(true, -1);
    let total_q = p.cu_q[ROWS.len()];
    let mut out = vec![0.0f32; (total_q * HQ * DV) as usize];
    let mut lse = vec![0.0f32; (HQ * total_q) as usize];
    let mut pages = make_pages(&p, 4, &mut rng, 0);
    pages.block_table[(3 * pages.max_blocks + 2) as usize] = pages.num_blocks as i32;
    let error = |result: Result<(), twinattn::problem::ProblemError>| result.unwrap_err().0;
    // SAFETY (every call below): every view covers its vector; the checks fail before any read.
    let message = error(unsafe { attention_paged(&paged_problem(&p, &pages, 4, &mut out, o), 1) });
    let n = pages.num_blocks;
    assert_eq!(
        message,
        format!("block_table: expected block ids in [0, num_blocks={n}) for the blocks sequence b uses, got block_table[3, 2]={n}")
    );
    let mut pages = make_pages(&p, 4, &mut rng, 0);
    pages.seq_lens[0] = 2; // 3 query rows
    let message = error(unsafe { attention_paged(&paged_problem(&p, &pages, 4, &mut out, o), 1) });
    assert_eq!(message, "cu_seqlens_q: expected at most seq_lens[b] query rows in sequence b, got 3 rows in sequence 0 (seq_lens[0]=2)");
    let mut bad = make_packed(&mut rng, &ROWS, &KEYS);
    bad.cu_k.swap(1, 2);
    let message =
        error(unsafe { attention_varlen(&varlen_problem(&bad, &mut out, &mut lse, o), 1) });
    assert_eq!(
        message,
        "cu_seqlens_k: expected non-decreasing values, got cu_seqlens_k[2]=5 after cu_seqlens_k[1]=9"
    );
}
