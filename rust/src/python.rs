//! The PyO3 binding, imported as `twinattn._rust`. Thin: it converts NumPy arrays to views
//! without copying, checks what the kernel relies on, releases the GIL and calls the kernel.
//! The contract is docs/native_api.md. Twin of `cpp/python/bindings.cpp`.
//!
//! Errors: TypeError for a wrong type or dtype, ValueError for a wrong rank, shape, stride,
//! range or overlap. Nothing here panics on user input; should the kernel ever panic, PyO3
//! turns the panic into a Python exception instead of aborting the interpreter.

use numpy::{
    dtype, PyArray1, PyArray3, PyArray4, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray4,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::constants::ConstantValue;
use crate::problem::{AttentionProblem, LseView, MaskKind, MaskView, MutTensorView4, TensorView4};

/// Which kernel a call runs.
#[derive(Clone, Copy)]
enum Kernel {
    /// the fast kernel with the dispatched instruction set (flash_attention.rs)
    Fast,
    /// the plain reference kernel (reference_kernel.rs)
    Reference,
}

/// `obj` as a NumPy array whose dtype is one of `dtypes`, with `ndim` dimensions, aligned,
/// every byte stride a multiple of the item size. Returns the array and the index of its dtype.
fn checked_array<'a, 'py>(
    name: &str,
    obj: &'a Bound<'py, PyAny>,
    dtypes: &[(&str, Bound<'py, numpy::PyArrayDescr>)],
    ndim: usize,
    axes: &str,
) -> PyResult<(&'a Bound<'py, PyUntypedArray>, usize)> {
    // formatted only on failure: a small call must not pay for error messages
    let expected = || {
        let labels: Vec<&str> = dtypes.iter().map(|(label, _)| *label).collect();
        labels.join(" or ")
    };
    let array = obj.cast::<PyUntypedArray>().map_err(|_| {
        let type_name = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".to_owned());
        PyTypeError::new_err(format!(
            "{name}: expected a numpy.ndarray of {}, got {type_name}",
            expected()
        ))
    })?;
    let given = array.dtype();
    let Some(kind) = dtypes.iter().position(|(_, d)| given.is_equiv_to(d)) else {
        return Err(PyTypeError::new_err(format!(
            "{name}: expected {}, got {given}",
            expected()
        )));
    };
    if array.ndim() != ndim {
        return Err(PyValueError::new_err(format!(
            "{name}: expected a {ndim}-dimensional array {axes}, got {} dimensions",
            array.ndim()
        )));
    }
    let item = given.itemsize() as isize;
    if array.strides().iter().any(|&s| s % item != 0) {
        return Err(PyValueError::new_err(format!(
            "{name}: every byte stride must be a multiple of the item size {item}, got strides {:?}",
            array.strides()
        )));
    }
    if !array.is_aligned() {
        return Err(PyValueError::new_err(format!(
            "{name}: expected an aligned array (data aligned to {item} bytes)"
        )));
    }
    Ok((array, kind))
}

fn shape_of<const N: usize>(array: &Bound<'_, PyUntypedArray>) -> [i64; N] {
    std::array::from_fn(|axis| array.shape()[axis] as i64)
}

/// Element strides of an array whose byte strides are multiples of its item size.
fn strides_of<const N: usize>(array: &Bound<'_, PyUntypedArray>) -> [i64; N] {
    let item = array.dtype().itemsize() as i64;
    std::array::from_fn(|axis| array.strides()[axis] as i64 / item)
}

fn float32_view<'a, 'py>(
    name: &str,
    obj: &'a Bound<'py, PyAny>,
    axes: &str,
) -> PyResult<&'a Bound<'py, PyArray4<f32>>> {
    let py = obj.py();
    let (array, _) = checked_array(name, obj, &[("float32", dtype::<f32>(py))], 4, axes)?;
    Ok(array.cast::<PyArray4<f32>>()?)
}

/// A (B,) int64 array copied into a Vec (B numbers; the big arrays are never copied). Copied
/// while the GIL is held, without rust-numpy's borrow tracking (which costs more than the copy
/// on a small call): only this module takes writeable borrows, and only of float32 outputs.
fn int64_vector(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let (array, _) = checked_array(name, obj, &[("int64", dtype::<i64>(obj.py()))], 1, "(B,)")?;
    let len = array.shape()[0];
    let stride = array.strides()[0] / 8; // checked: a multiple of the item size
    let data = array.cast::<PyArray1<i64>>()?.data().cast_const();
    Ok((0..len)
        .map(|i| {
            // SAFETY: an aligned (checked) int64 array of `len` elements `stride` apart, read
            // under the GIL.
            unsafe { *data.offset(i as isize * stride) }
        })
        .collect())
}

/// ValueError unless NumPy says the array is writeable (checked before the overlap checks, so a
/// read-only broadcast `out` is reported as read-only).
fn require_writeable(name: &str, array: &Bound<'_, PyUntypedArray>) -> PyResult<()> {
    // SAFETY: `array` is a live NumPy array (its type was checked); reading the flags field is
    // what NumPy's own PyArray_FLAGS macro does, and far cheaper than `array.flags.writeable`.
    let flags =
        unsafe { (*numpy::npyffi::objects::_PyArray_GET_ITEM_DATA(array.as_array_ptr())).flags };
    if flags & numpy::npyffi::NPY_ARRAY_WRITEABLE == 0 {
        return Err(PyValueError::new_err(format!(
            "{name}: expected a writeable array, got a read-only one"
        )));
    }
    Ok(())
}

fn borrow_error(name: &str, error: numpy::BorrowError) -> PyErr {
    PyValueError::new_err(match error {
        numpy::BorrowError::NotWriteable => format!("{name}: expected a writeable array, got a read-only one"),
        // AlreadyBorrowed (non_exhaustive enum, hence the wildcard)
        _ => format!(
            "{name}: its memory is in use by another argument of this call or by a concurrent call; \
             pass a separate output array"
        ),
    })
}

/// A checked problem handed to the thread that computes while the GIL is released. Raw pointers
/// are not Send, so Rust needs this wrapper; C++ does not.
struct DetachedProblem<'a>(AttentionProblem<'a>);

// SAFETY: the views point into NumPy arrays that the calling frame keeps alive and borrowed
// (readonly for the inputs, readwrite for the outputs, through rust-numpy's borrow tracking)
// until the detached computation has returned.
unsafe impl Send for DetachedProblem<'_> {}

impl DetachedProblem<'_> {
    fn run(self, num_threads: usize, kernel: Kernel) -> Result<(), crate::problem::ProblemError> {
        // SAFETY: every view was built from a live, aligned NumPy array of exactly that shape
        // and those strides, and the borrows taken by the caller keep Rust code from writing the
        // inputs or touching the outputs during the call.
        unsafe {
            match kernel {
                Kernel::Fast => crate::flash_attention::attention_forward(&self.0, num_threads),
                Kernel::Reference => {
                    crate::reference_kernel::attention_reference(&self.0, num_threads)
                }
            }
        }
    }
}

/// attention_forward(q, k, v, out, lse, q_offset, kv_lens, mask, causal, scale, num_threads)
/// --
///
/// Computes out (and lse when given) in place with the fast kernel and the instruction set in
/// use (set_isa). See docs/native_api.md.
#[pyfunction]
#[pyo3(signature = (q, k, v, out, lse, q_offset, kv_lens, mask, causal, scale, num_threads))]
#[allow(clippy::too_many_arguments)]
fn attention_forward<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    lse: Option<&Bound<'py, PyAny>>,
    q_offset: &Bound<'py, PyAny>,
    kv_lens: &Bound<'py, PyAny>,
    mask: Option<&Bound<'py, PyAny>>,
    causal: bool,
    scale: f64,
    num_threads: i64,
) -> PyResult<()> {
    run_kernel(
        py,
        q,
        k,
        v,
        out,
        lse,
        q_offset,
        kv_lens,
        mask,
        causal,
        scale,
        num_threads,
        Kernel::Fast,
    )
}

/// attention_reference(q, k, v, out, lse, q_offset, kv_lens, mask, causal, scale, num_threads)
/// --
///
/// As attention_forward, with the plain reference kernel (the scalar twin every fast path is
/// tested against).
#[pyfunction]
#[pyo3(signature = (q, k, v, out, lse, q_offset, kv_lens, mask, causal, scale, num_threads))]
#[allow(clippy::too_many_arguments)]
fn attention_reference<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    lse: Option<&Bound<'py, PyAny>>,
    q_offset: &Bound<'py, PyAny>,
    kv_lens: &Bound<'py, PyAny>,
    mask: Option<&Bound<'py, PyAny>>,
    causal: bool,
    scale: f64,
    num_threads: i64,
) -> PyResult<()> {
    run_kernel(
        py,
        q,
        k,
        v,
        out,
        lse,
        q_offset,
        kv_lens,
        mask,
        causal,
        scale,
        num_threads,
        Kernel::Reference,
    )
}

#[allow(clippy::too_many_arguments)]
fn run_kernel<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    lse: Option<&Bound<'py, PyAny>>,
    q_offset: &Bound<'py, PyAny>,
    kv_lens: &Bound<'py, PyAny>,
    mask: Option<&Bound<'py, PyAny>>,
    causal: bool,
    scale: f64,
    num_threads: i64,
    kernel: Kernel,
) -> PyResult<()> {
    // 1. Types, ranks and strides of every argument.
    let q = float32_view("q", q, "(B, Hq, Lq, D)")?;
    let k = float32_view("k", k, "(B, Hkv, Lk, D)")?;
    let v = float32_view("v", v, "(B, Hkv, Lk, Dv)")?;
    let out = float32_view("out", out, "(B, Hq, Lq, Dv)")?;
    let lse = match lse {
        None => None,
        Some(obj) => {
            let (array, _) = checked_array(
                "lse",
                obj,
                &[("float32", dtype::<f32>(py))],
                3,
                "(B, Hq, Lq)",
            )?;
            Some(array.cast::<PyArray3<f32>>()?)
        }
    };
    let mask = match mask {
        None => None,
        Some(obj) => {
            let dtypes = [("bool", dtype::<bool>(py)), ("float32", dtype::<f32>(py))];
            let (array, kind) = checked_array("mask", obj, &dtypes, 4, "(B, Hq, Lq, Lk)")?;
            let kind = if kind == 0 {
                MaskKind::Bool
            } else {
                MaskKind::Float
            };
            let (b, h, lq, lk) = (q.shape()[0], q.shape()[1], q.shape()[2], k.shape()[2]);
            if array.shape() != [b, h, lq, lk] {
                return Err(PyValueError::new_err(format!(
                    "mask: expected shape (B={b}, Hq={h}, Lq={lq}, Lk={lk}) (broadcast it first), got ({})",
                    array.shape().iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
                )));
            }
            Some((array, kind))
        }
    };
    require_writeable("out", out.as_untyped())?;
    if let Some(lse) = lse {
        require_writeable("lse", lse.as_untyped())?;
    }
    let q_offset = int64_vector("q_offset", q_offset)?;
    let kv_lens = int64_vector("kv_lens", kv_lens)?;
    if num_threads < 1 {
        return Err(PyValueError::new_err(format!(
            "num_threads: expected an int >= 1, got {num_threads}"
        )));
    }

    // 2. The problem, checked before any memory is touched.
    let tensor = |array: &Bound<'py, PyArray4<f32>>| TensorView4 {
        data: array.data().cast_const(),
        shape: shape_of(array.as_untyped()),
        stride: strides_of(array.as_untyped()),
    };
    let problem = AttentionProblem {
        q: tensor(q),
        k: tensor(k),
        v: tensor(v),
        out: MutTensorView4 {
            data: out.data(),
            shape: shape_of(out.as_untyped()),
            stride: strides_of(out.as_untyped()),
        },
        lse: match lse {
            None => LseView::NONE,
            Some(lse) => LseView {
                data: lse.data(),
                shape: shape_of(lse.as_untyped()),
                stride: strides_of(lse.as_untyped()),
            },
        },
        q_offset: &q_offset,
        kv_lens: &kv_lens,
        mask: match mask {
            None => MaskView::NONE,
            Some((array, kind)) => MaskView {
                kind,
                data: match kind {
                    MaskKind::Bool => array
                        .cast::<PyArray4<bool>>()?
                        .data()
                        .cast_const()
                        .cast::<u8>(),
                    _ => array
                        .cast::<PyArray4<f32>>()?
                        .data()
                        .cast_const()
                        .cast::<u8>(),
                },
                stride: strides_of(array),
            },
        },
        causal,
        scale: scale as f32,
    };
    crate::problem::check_problem(&problem).map_err(|e| PyValueError::new_err(e.0))?;

    // 3. Borrows held for the whole computation: readonly inputs, readwrite outputs.
    let _inputs: [PyReadonlyArray4<f32>; 3] = [
        q.try_readonly().map_err(|e| borrow_error("q", e))?,
        k.try_readonly().map_err(|e| borrow_error("k", e))?,
        v.try_readonly().map_err(|e| borrow_error("v", e))?,
    ];
    let (_bool_mask_borrow, _float_mask_borrow) = match mask {
        Some((array, MaskKind::Bool)) => {
            let array = array.cast::<PyArray4<bool>>()?;
            (
                Some(array.try_readonly().map_err(|e| borrow_error("mask", e))?),
                None,
            )
        }
        Some((array, _)) => {
            let array = array.cast::<PyArray4<f32>>()?;
            (
                None,
                Some(array.try_readonly().map_err(|e| borrow_error("mask", e))?),
            )
        }
        None => (None, None),
    };
    let _out_borrow = out.try_readwrite().map_err(|e| borrow_error("out", e))?;
    let _lse_borrow = match lse {
        Some(lse) => Some(lse.try_readwrite().map_err(|e| borrow_error("lse", e))?),
        None => None,
    };

    // 4. Compute without the GIL.
    let job = DetachedProblem(problem);
    let threads = usize::try_from(num_threads).unwrap_or(usize::MAX);
    py.detach(move || job.run(threads, kernel))
        .map_err(|e| PyValueError::new_err(e.0))
}

/// build_info() -> dict: the instruction set chosen at run time, those available (fastest
/// first), the compiler, the package version and the shared constants (constants.rs).
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let info = PyDict::new(py);
    info.set_item("isa", crate::dispatch::current_isa())?;
    info.set_item("isa_available", crate::dispatch::available_isas())?;
    info.set_item("compiler", env!("TWINATTN_RUSTC_VERSION"))?;
    info.set_item("version", env!("CARGO_PKG_VERSION"))?;
    let constants = PyDict::new(py);
    for (name, value) in crate::constants::shared_constants() {
        match value {
            ConstantValue::Int(x) => constants.set_item(name, x)?,
            ConstantValue::Float(x) => constants.set_item(name, f64::from(x))?,
            ConstantValue::Floats(xs) => {
                constants.set_item(name, xs.iter().map(|&x| f64::from(x)).collect::<Vec<_>>())?
            }
        }
    }
    info.set_item("constants", constants)?;
    Ok(info)
}

/// set_isa(name) -> None: switches the instruction set of attention_forward among
/// build_info()["isa_available"]; ValueError naming the available ones otherwise.
#[pyfunction]
fn set_isa(name: &str) -> PyResult<()> {
    crate::dispatch::set_isa(name).map_err(PyValueError::new_err)
}

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // A TWINATTN_ISA this build or CPU cannot run fails the import, loudly.
    crate::dispatch::init_isa_from_environment().map_err(PyValueError::new_err)?;
    m.add_function(wrap_pyfunction!(attention_forward, m)?)?;
    m.add_function(wrap_pyfunction!(attention_reference, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(set_isa, m)?)?;
    Ok(())
}
