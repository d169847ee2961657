//! The "amxbf16" instruction set (docs/kernels.md, "Reduced precision"): avx512bf16 plus
//! AMX-TILE and AMX-BF16, whose TDPBF16PS multiplies bfloat16 pair tiles into float32 tiles, for
//! bfloat16 prefill. Twin of `cpp/src/flash_amx.cpp`, tile instruction for tile instruction (the
//! same tiles, loads, products and stores in the same order: the same bits). core::arch's AMX
//! intrinsics are unstable, so the tile instructions are inline asm on fixed tmm registers.
//!
//! Everything but bfloat16 prefill is avx512bf16's (dispatch.rs builds the table from it).
//! bfloat16 prefill is the dot path (flash_avx512bf16.rs: the same K pair panels, raw Q pairs, P
//! rounded to bfloat16 pairs, V pair rows, the same masking and softmax) with its two products on
//! tiles. Every tile is 16 rows x 64 bytes (palette 1, tmm0-7; LDTILECFG at the start of a work
//! item, TILERELEASE at its end); C(i, j) = tmm(2 i + j), A(i) = tmm(4 + i), B(j) = tmm(6 + j):
//!   S: A = 16 Q pair rows x 16 pairs of D (row stride D2 pairs), B = 16 pairs of D x 16 keys of
//!     a K pair panel (row stride KEY_PANEL pairs: the panel layout is already the B tile's), C =
//!     16 rows x 16 keys of scores. Per 2 (or 1) row tiles and per K panel (its 2 key tiles):
//!     C = 0; for each 16 pairs of D in order: load A, B, then C(i, j) += A(i) B(j) in the order
//!     (0,0) (0,1) (1,0) (1,1); store C; then S = C * q_multiplier in float32 (rows < `rows`).
//!     Whole panels: keys up to n rounded up to KEY_PANEL.
//!   P.V: rows whose alpha is not 1 are rescaled in memory first (O *= alpha, AVX-512). A = 16 P
//!     pair rows x 16 key pairs, B = 16 key pairs x 16 columns of the V pair rows (row stride
//!     value_stride pairs), C = 16 rows x 16 columns of O, loaded from O and stored back. Per 2
//!     (or 1) row tiles and per 2 (or 1) column tiles: for each 16 key pairs in order: as S.
//!     Key pairs up to n rounded up to 32 keys (KEY_GRANULE): P is 0 past n (round_probs writes
//!     whole 32-key groups), the V pairs past the packed keys are zero (the packing pads to 32),
//!     and a block whose P.V could meet a non-finite V at a key of weight 0 (masked, or n not a
//!     multiple of 32) takes the convert path's safe P.V, as the dot path decides for its pairs.
//!   Rows past `rows` (up to 16 per tile) are computed and ignored: Q pad rows are zero, the P
//!   and O rows there are scratch.
//! Needs D a multiple of 32 (whole tiles of D); other D run the dot path (the same packing).
//! TDPBF16PS treats bfloat16 subnormal inputs as zero and flushes subnormal results (fixed, as
//! VDPBF16PS): accepted, and the same in both ports.

use std::arch::asm;
use std::arch::x86_64::*;

use crate::backward_kernel::{BackwardTiles, TileProduct};
use crate::constants::{KEY_BLOCK, KEY_PANEL};
use crate::flash_avx512bf16::{
    attend_rows as attend_pairs, backward_round_pairs, pack_pairs, DotProducts, PairProducts,
    PAIRS_PER_BLOCK,
};
use crate::flash_kernel::{FlashKernels, FlashPlan, ThreadScratch, WorkItem};

/// Bytes per tile row: 16 pairs of bfloat16, or 16 floats.
const TILE_BYTES: usize = 64;
const TILE_ROWS: usize = 16;

/// LDTILECFG's 64-byte operand: palette 1, tiles 0-7 of 16 rows x 64 bytes (bytes 16-31: the
/// tiles' bytes per row, 16-bit; bytes 48-63: their rows).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const TILE_CONFIG: TileConfig = {
    let mut config = [0u8; 64];
    config[0] = 1;
    let mut t = 0;
    while t < 8 {
        config[16 + 2 * t] = TILE_BYTES as u8;
        config[48 + t] = TILE_ROWS as u8;
        t += 1;
    }
    TileConfig(config)
};

// ---- The tile instructions (fixed registers; `const` operands pick them) ----------------------

/// # Safety
/// AMX usable (dispatch.rs); the tile configuration loaded; base + r * stride + 64 readable for
/// the tile's 16 rows r.
#[inline(always)]
unsafe fn tile_load<const T: usize>(base: *const u8, stride: usize) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        asm!("tileloadd tmm{t}, [{base} + {stride}*1]", t = const T, base = in(reg) base,
             stride = in(reg) stride, options(nostack, readonly, preserves_flags));
    }
}

/// # Safety
/// As [`tile_load`], base + r * stride + 64 writable.
#[inline(always)]
unsafe fn tile_store<const T: usize>(base: *mut u8, stride: usize) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        asm!("tilestored [{base} + {stride}*1], tmm{t}", t = const T, base = in(reg) base,
             stride = in(reg) stride, options(nostack, preserves_flags));
    }
}

/// # Safety
/// AMX usable; the tile configuration loaded.
#[inline(always)]
unsafe fn tile_zero<const T: usize>() {
    // SAFETY: forwarded from this function's contract.
    unsafe { asm!("tilezero tmm{t}", t = const T, options(nostack, nomem, preserves_flags)) };
}

/// tmm C += tmm A . tmm B (TDPBF16PS).
///
/// # Safety
/// AMX-BF16 usable; the tile configuration loaded.
#[inline(always)]
unsafe fn tile_dot<const C: usize, const A: usize, const B: usize>() {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
             options(nostack, nomem, preserves_flags));
    }
}

/// # Safety
/// AMX usable.
#[inline(always)]
unsafe fn tile_load_config(config: &TileConfig) {
    // SAFETY: forwarded from this function's contract; the operand is 64 readable bytes.
    unsafe {
        asm!("ldtilecfg [{0}]", in(reg) config.0.as_ptr(), options(nostack, readonly, preserves_flags));
    }
}

/// # Safety
/// AMX usable.
#[inline(always)]
unsafe fn tile_release() {
    // SAFETY: forwarded from this function's contract.
    unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
}

// ---- The products --------------------------------------------------------------------------

/// C(i, j) (+)= sum over `chunks` steps of A(i) B(j): RT row tiles (A rows 16 apart) by CT
/// column tiles (B and C 64 bytes apart); step k reads A at +64 k bytes and B at +16 k rows. C
/// starts at zero or at c (accumulate). Strides in bytes.
///
/// # Safety
/// AMX-BF16 usable, the configuration loaded; every tile read or written lies in its buffer.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile_product<const RT: usize, const CT: usize>(
    a: *const u8,
    a_stride: usize,
    b: *const u8,
    b_stride: usize,
    chunks: usize,
    c: *mut u8,
    c_stride: usize,
    accumulate: bool,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        if accumulate {
            tile_load::<0>(c, c_stride);
            if CT == 2 {
                tile_load::<1>(c.add(TILE_BYTES), c_stride);
            }
            if RT == 2 {
                tile_load::<2>(c.add(TILE_ROWS * c_stride), c_stride);
            }
            if RT == 2 && CT == 2 {
                tile_load::<3>(c.add(TILE_ROWS * c_stride + TILE_BYTES), c_stride);
            }
        } else {
            tile_zero::<0>();
            if CT == 2 {
                tile_zero::<1>();
            }
            if RT == 2 {
                tile_zero::<2>();
            }
            if RT == 2 && CT == 2 {
                tile_zero::<3>();
            }
        }
        for k in 0..chunks {
            tile_load::<4>(a.add(k * TILE_BYTES), a_stride);
            if RT == 2 {
                tile_load::<5>(a.add(TILE_ROWS * a_stride + k * TILE_BYTES), a_stride);
            }
            tile_load::<6>(b.add(k * TILE_ROWS * b_stride), b_stride);
            if CT == 2 {
                tile_load::<7>(b.add(k * TILE_ROWS * b_stride + TILE_BYTES), b_stride);
            }
            tile_dot::<0, 4, 6>();
            if CT == 2 {
                tile_dot::<1, 4, 7>();
            }
            if RT == 2 {
                tile_dot::<2, 5, 6>();
            }
            if RT == 2 && CT == 2 {
                tile_dot::<3, 5, 7>();
            }
        }
        tile_store::<0>(c, c_stride);
        if CT == 2 {
            tile_store::<1>(c.add(TILE_BYTES), c_stride);
        }
        if RT == 2 {
            tile_store::<2>(c.add(TILE_ROWS * c_stride), c_stride);
        }
        if RT == 2 && CT == 2 {
            tile_store::<3>(c.add(TILE_ROWS * c_stride + TILE_BYTES), c_stride);
        }
    }
}

/// C = A B over the row tiles of `rows` (2 at a time, then 1) and `columns` column tiles (2 at
/// a time, then 1): A's row tile t at a + 16 t a_stride, B's column tile u at b + 64 u, C's
/// (t, u) at c + 16 t c_stride + 64 u.
///
/// # Safety
/// As [`tile_product`], for every tile.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile_products(
    a: *const u8,
    a_stride: usize,
    rows: usize,
    b: *const u8,
    b_stride: usize,
    columns: usize,
    chunks: usize,
    c: *mut u8,
    c_stride: usize,
    accumulate: bool,
) {
    type TileProductFn = unsafe fn(*const u8, usize, *const u8, usize, usize, *mut u8, usize, bool);
    const BLOCKS: [[TileProductFn; 2]; 2] = [
        [tile_product::<1, 1>, tile_product::<1, 2>],
        [tile_product::<2, 1>, tile_product::<2, 2>],
    ];
    let row_tiles = rows.div_ceil(TILE_ROWS);
    // SAFETY: forwarded from this function's contract.
    unsafe {
        for t in (0..row_tiles).step_by(2) {
            let two_rows = t + 2 <= row_tiles;
            for u in (0..columns).step_by(2) {
                let two_columns = u + 2 <= columns;
                BLOCKS[usize::from(two_rows)][usize::from(two_columns)](
                    a.add(t * TILE_ROWS * a_stride),
                    a_stride,
                    b.add(u * TILE_BYTES),
                    b_stride,
                    chunks,
                    c.add(t * TILE_ROWS * c_stride + u * TILE_BYTES),
                    c_stride,
                    accumulate,
                );
            }
        }
    }
}

/// The tile configuration on the calling thread, before a work item's products.
///
/// # Safety
/// AMX usable.
unsafe fn begin_tiles() {
    // SAFETY: forwarded from this function's contract.
    unsafe { tile_load_config(&TILE_CONFIG) };
}

/// The tiles released, after a work item's products.
///
/// # Safety
/// AMX usable.
unsafe fn end_tiles() {
    // SAFETY: forwarded from this function's contract.
    unsafe { tile_release() };
}

/// The backward's tile product ([`TileProduct`]): tile_products, as prefill runs them.
///
/// # Safety
/// AMX-BF16 usable, [`begin_tiles`] on this thread; every tile read or written lies in its buffer.
unsafe fn backward_tile_product(t: &TileProduct) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        tile_products(
            t.a,
            t.a_stride,
            t.rows,
            t.b,
            t.b_stride,
            t.columns,
            t.chunks,
            t.c,
            t.c_stride,
            t.accumulate,
        );
    }
}

/// The tile path's products (flash_avx512bf16.rs's [`PairProducts`]).
struct AmxProducts;

impl PairProducts for AmxProducts {
    const KEY_GRANULE: usize = 32;
    const ROW_GRANULE: usize = TILE_ROWS;

    #[inline(always)]
    unsafe fn begin_item() {
        // SAFETY: forwarded from this function's contract.
        unsafe { begin_tiles() };
    }

    #[inline(always)]
    unsafe fn end_item() {
        // SAFETY: forwarded from this function's contract.
        unsafe { end_tiles() };
    }

    #[inline(always)]
    unsafe fn block_scores(
        q_pairs: *const u32,
        d2_len: usize,
        rows: usize,
        panels: *const u32,
        n: usize,
        scores: *mut f32,
        q_multiplier: f32,
    ) {
        let panel_count = n.div_ceil(KEY_PANEL);
        // SAFETY: forwarded from this function's contract (rows rounded up to 16 lie in the
        // Q tile and the scores, KEY_BLOCK >= n rounded up to KEY_PANEL).
        unsafe {
            for panel in 0..panel_count {
                tile_products(
                    q_pairs.cast(),
                    d2_len * 4,
                    rows,
                    panels.add(panel * d2_len * KEY_PANEL).cast(),
                    KEY_PANEL * 4,
                    KEY_PANEL / 16,
                    d2_len / 16,
                    scores.add(panel * KEY_PANEL).cast(),
                    KEY_BLOCK * 4,
                    false,
                );
            }
            let multiplier = _mm512_set1_ps(q_multiplier);
            for r in 0..rows {
                for j in (0..panel_count * KEY_PANEL).step_by(16) {
                    let s = scores.add(r * KEY_BLOCK + j);
                    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_loadu_ps(s), multiplier));
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn block_values(
        probs_pairs: *const u32,
        rows: usize,
        pairs: usize,
        v_pairs: *const u32,
        value_stride: usize,
        out_acc: *mut f32,
        rescale: *const f32,
    ) {
        // SAFETY: forwarded from this function's contract (as block_scores).
        unsafe {
            for r in 0..rows {
                let alpha = *rescale.add(r);
                if alpha == 1.0 {
                    continue;
                }
                let alpha = _mm512_set1_ps(alpha);
                for c in (0..value_stride).step_by(16) {
                    let o = out_acc.add(r * value_stride + c);
                    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha));
                }
            }
            tile_products(
                probs_pairs.cast(),
                PAIRS_PER_BLOCK * 4,
                rows,
                v_pairs.cast(),
                value_stride * 4,
                value_stride / 16,
                pairs / 16,
                out_acc.cast(),
                value_stride * 4,
                true,
            );
        }
    }
}

/// D a multiple of 32 takes the tiles; any other D the dot path (the packing is the same).
///
/// # Safety
/// AMX-BF16 usable (and avx512bf16's features); otherwise as flash_avx512bf16.rs's attend_rows.
unsafe fn attend_rows(plan: &FlashPlan, item: &WorkItem, s: &ThreadScratch) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        if plan.head_dim.is_multiple_of(32) {
            attend_pairs::<AmxProducts>(plan, item, s)
        } else {
            attend_pairs::<DotProducts>(plan, item, s)
        }
    }
}

/// The amxbf16 table: avx512bf16's, with bfloat16 prefill on tiles.
pub const fn flash_kernels_amxbf16() -> FlashKernels {
    let mut kernels = crate::flash_avx512bf16::flash_kernels_avx512bf16();
    kernels.isa = "amxbf16";
    kernels.attend_rows[crate::problem::ElementType::BFloat16 as usize] = attend_rows;
    kernels.pack_pairs = Some(pack_pairs::<AmxProducts>);
    // bfloat16 backward products and roundings on tiles (flash_backward.rs's tile path).
    kernels.backward.tiles = Some(backward_tiles_amxbf16());
    kernels
}

/// The backward's bfloat16 tile products and roundings (backward_kernel.rs, [`BackwardTiles`]):
/// tile_products, as prefill runs them.
pub const fn backward_tiles_amxbf16() -> BackwardTiles {
    BackwardTiles {
        begin: begin_tiles,
        product: backward_tile_product,
        round: backward_round_pairs,
        end: end_tiles,
    }
}

// Whether this CPU has AMX-TILE and AMX-BF16 and the OS grants the tile data: amx_bf16_usable(),
// shared with build.rs (which marks the amxbf16 tests ignored where it is false).
include!("amx_usable.rs");

/// measure_peak's TDPBF16PS loop: 4 independent accumulator tiles of 16 x 16 floats, each step
/// C += A B over 16 x 32 bfloat16 of small values (2^-10: the sums grow by 2^-15 per
/// instruction, never near overflow). Returns the flop done (16 x 16 x 32 multiply-adds, 16384
/// flop, per instruction).
///
/// # Safety
/// AMX-BF16 usable.
pub unsafe fn peak_bf16tile_amxbf16(instructions: u64) -> u64 {
    #[repr(C, align(64))]
    struct Tile([u32; TILE_ROWS * 16]);
    let operand = Tile([0x3a80_3a80; TILE_ROWS * 16]); // (2^-10, 2^-10)
    let mut result = Tile([0; TILE_ROWS * 16]);
    let mut done = 0;
    // SAFETY: forwarded from this function's contract; the tiles are 16 rows of 64 bytes.
    unsafe {
        tile_load_config(&TILE_CONFIG);
        tile_zero::<0>();
        tile_zero::<1>();
        tile_zero::<2>();
        tile_zero::<3>();
        tile_load::<4>(operand.0.as_ptr().cast(), TILE_BYTES);
        tile_load::<6>(operand.0.as_ptr().cast(), TILE_BYTES);
        while done < instructions {
            tile_dot::<0, 4, 6>();
            tile_dot::<1, 4, 6>();
            tile_dot::<2, 4, 6>();
            tile_dot::<3, 4, 6>();
            done += 4;
        }
        tile_store::<0>(result.0.as_mut_ptr().cast(), TILE_BYTES);
        tile_release();
    }
    std::hint::black_box(result.0[0]); // the loop's result is used
    16384 * done
}
