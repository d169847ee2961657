//! The PyO3 binding, imported as `twinattn._rust`. It only converts: NumPy arrays into an
//! AttentionProblem without copying or casting (TypeError / ValueError when an argument cannot
//! be viewed so), releases the GIL and calls the kernel, whose core checks the problem
//! (check_problem). The contract is docs/native_api.md. Twin of `cpp/python/bindings.cpp`: same
//! steps, same messages. Nothing here panics on user input.

use numpy::{
    dtype, PyArray1, PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyImportError, PyMemoryError, PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString};

use crate::constants::*;
use crate::problem::{
    check_num_threads, AttentionProblem, BackwardProblem, BlockTableView, ElementType, KeyPages,
    LseView, LseView2, MaskKind, MaskView, MutParamView1, MutTensorView3, MutTensorView4,
    PackedOptions, PagedProblem, ParamView1, ParamView2, ParamView3, ProblemError, TensorView3,
    TensorView4, VarlenProblem,
};

/// Which kernel a call runs.
#[derive(Clone, Copy)]
enum Kernel {
    /// the fast kernel with the dispatched instruction set (flash_attention.rs)
    Fast,
    /// the plain reference kernel (reference_kernel.rs)
    Reference,
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|name| name.to_string())
        .unwrap_or_else(|_| "?".to_owned())
}

/// "(2, 3)", "(2,)", "()": Python's tuple notation.
fn tuple_string<T: ToString>(values: &[T]) -> String {
    let parts: Vec<String> = values.iter().map(T::to_string).collect();
    if parts.len() == 1 {
        format!("({},)", parts[0])
    } else {
        format!("({})", parts.join(", "))
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Dtype {
    Float32,
    Int64,
    BoolOrFloat32,
    /// q: float32, float16 or bfloat16
    Element,
    /// k, v, out: q's element type, whose NumPy name is given
    Like(ElementType, &'static str),
    /// k: q's element type (its NumPy name given) or int8
    LikeOrInt8(ElementType, &'static str),
    /// v when k is int8
    Int8,
    /// the backward's out: q's element type (its NumPy name given), or float32 when that is
    /// float16 / bfloat16 (the forward's out32)
    LikeOrFloat32(ElementType, &'static str),
}

/// NumPy's float16 dtype, made once for the life of the process.
fn float16_dtype(py: Python<'_>) -> PyResult<Bound<'_, PyArrayDescr>> {
    static STORED: pyo3::sync::PyOnceLock<Py<PyArrayDescr>> = pyo3::sync::PyOnceLock::new();
    Ok(STORED
        .get_or_try_init(py, || PyArrayDescr::new(py, "float16").map(Bound::unbind))?
        .bind(py)
        .clone())
}

/// ml_dtypes.bfloat16's dtype, imported once for the life of the process.
fn bfloat16_dtype(py: Python<'_>) -> PyResult<Bound<'_, PyArrayDescr>> {
    static STORED: pyo3::sync::PyOnceLock<Py<PyArrayDescr>> = pyo3::sync::PyOnceLock::new();
    Ok(STORED
        .get_or_try_init(py, || {
            let bfloat16 = py.import("ml_dtypes")?.getattr("bfloat16")?;
            PyArrayDescr::new(py, &bfloat16).map(Bound::unbind)
        })?
        .bind(py)
        .clone())
}

/// The element type of a float32, float16 (NumPy's) or bfloat16 (ml_dtypes') array of native
/// byte order; None for any other dtype. bfloat16 is a NumPy user dtype (kind 'V'), recognised
/// as the specification says: char 'E', name "bfloat16", itemsize 2 (the same test as C++), or
/// by identity as ml_dtypes' own dtype object (the one its arrays share: no attribute read).
fn element_type_of(descr: &Bound<'_, PyArrayDescr>) -> Option<ElementType> {
    if descr.is_native_byteorder() == Some(false) || descr.has_fields() {
        return None;
    }
    if descr.is_equiv_to(&dtype::<f32>(descr.py())) {
        return Some(ElementType::Float32);
    }
    match (descr.char(), descr.itemsize()) {
        (b'e', 2) if descr.kind() == b'f' => Some(ElementType::Float16),
        (b'E', 2)
            if bfloat16_dtype(descr.py()).is_ok_and(|bfloat16| descr.is(&bfloat16))
                || descr
                    .getattr("name")
                    .and_then(|name| name.extract::<String>())
                    .is_ok_and(|name| name == "bfloat16") =>
        {
            Some(ElementType::BFloat16)
        }
        _ => None,
    }
}

// ---- DLPack capsules (docs/native_api.md, "DLPack capsules") -----------------------------------
// The DLPack ABI (dlpack.h, versions 0.x and 1.x), the fields read here. A capsule named
// "dltensor" holds a DLManagedTensor, one named "dltensor_versioned" a DLManagedTensorVersioned.

#[repr(C)]
struct DLDevice {
    /// 1: kDLCPU
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    /// 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut std::ffi::c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    /// in elements; null: row-major and compact
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut std::ffi::c_void,
    /// never called here
    deleter: *mut std::ffi::c_void,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut std::ffi::c_void,
    /// never called here
    deleter: *mut std::ffi::c_void,
    /// bit 0: read-only
    flags: u64,
    dl_tensor: DLTensor,
}

const DL_CPU: i32 = 1;
const DL_READ_ONLY_FLAG: u64 = 1;

/// The NumPy dtype of a DLPack element type (ml_dtypes.bfloat16 for bfloat 16); None for one
/// NumPy has not (vectors of lanes, float8, ...).
fn numpy_dtype_of<'py>(
    py: Python<'py>,
    code: u8,
    bits: u8,
    lanes: u16,
) -> PyResult<Option<Bound<'py, PyArrayDescr>>> {
    if lanes != 1 {
        return Ok(None);
    }
    Ok(Some(match (code, bits) {
        (0, 8) => dtype::<i8>(py),
        (0, 16) => dtype::<i16>(py),
        (0, 32) => dtype::<i32>(py),
        (0, 64) => dtype::<i64>(py),
        (1, 8) => dtype::<u8>(py),
        (1, 16) => dtype::<u16>(py),
        (1, 32) => dtype::<u32>(py),
        (1, 64) => dtype::<u64>(py),
        (2, 16) => float16_dtype(py)?,
        (2, 32) => dtype::<f32>(py),
        (2, 64) => dtype::<f64>(py),
        (4, 16) => bfloat16_dtype(py)?,
        (5, 64) => PyArrayDescr::new(py, "complex64")?,
        (5, 128) => PyArrayDescr::new(py, "complex128")?,
        (6, 8) => dtype::<bool>(py),
        _ => return Ok(None),
    }))
}

/// An ndarray viewing the tensor of a DLPack capsule, the capsule its base. The capsule is read,
/// not consumed: it keeps its name, and its producer's tensor (which it owns) lives as long as
/// the capsule, through the call that was handed it.
fn dlpack_view<'py>(
    capsule: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<Bound<'py, PyUntypedArray>> {
    let py = capsule.py();
    // SAFETY: `capsule` is a live capsule (checked by the caller); its name is a C string it owns.
    let capsule_name = unsafe { pyo3::ffi::PyCapsule_GetName(capsule.as_ptr()) };
    if capsule_name.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: as above.
    let capsule_name = unsafe { std::ffi::CStr::from_ptr(capsule_name) };
    let (tensor, read_only): (&DLTensor, bool) = match capsule_name.to_bytes() {
        b"dltensor" => {
            // SAFETY: a "dltensor" capsule holds a DLManagedTensor (the DLPack specification),
            // which lives as long as the capsule, held by the caller through this call.
            let managed =
                unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr()) }
                    .cast::<DLManagedTensor>();
            if managed.is_null() {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: as above.
            (unsafe { &(*managed).dl_tensor }, false)
        }
        b"dltensor_versioned" => {
            // SAFETY: a "dltensor_versioned" capsule holds a DLManagedTensorVersioned, as above.
            let managed = unsafe {
                pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor_versioned".as_ptr())
            }
            .cast::<DLManagedTensorVersioned>();
            if managed.is_null() {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: as above.
            let managed = unsafe { &*managed };
            if managed.version.major != 1 {
                return Err(PyTypeError::new_err(format!(
                    "{name}: expected a DLPack capsule of version 1, got version {}.{}",
                    managed.version.major, managed.version.minor
                )));
            }
            (&managed.dl_tensor, managed.flags & DL_READ_ONLY_FLAG != 0)
        }
        other => {
            let other = String::from_utf8_lossy(other);
            let consumed = if other.starts_with("used_") {
                " (already consumed)"
            } else {
                ""
            };
            return Err(PyTypeError::new_err(format!(
                "{name}: expected a DLPack capsule named \"dltensor\" or \"dltensor_versioned\", got a capsule named \"{other}\"{consumed}"
            )));
        }
    };
    if tensor.device.device_type != DL_CPU {
        return Err(PyValueError::new_err(format!(
            "{name}: twinattn runs on the CPU; expected a DLPack tensor on the CPU (device type 1), got device type {}",
            tensor.device.device_type
        )));
    }
    let DLDataType { code, bits, lanes } = tensor.dtype;
    let Some(descr) = numpy_dtype_of(py, code, bits, lanes)? else {
        return Err(PyTypeError::new_err(format!(
            "{name}: expected a DLPack tensor of a NumPy dtype, got type code {code} with {bits} bits and {lanes} lanes"
        )));
    };
    if !(0..=32).contains(&tensor.ndim) {
        return Err(PyValueError::new_err(format!(
            "{name}: expected a DLPack tensor of at most 32 dimensions, got {}",
            tensor.ndim
        )));
    }
    let ndim = tensor.ndim as usize;
    let item = descr.itemsize() as i64;
    let mut shape = vec![0 as numpy::npyffi::npy_intp; ndim];
    let mut strides = vec![0 as numpy::npyffi::npy_intp; ndim];
    let mut compact = item; // a null strides pointer: row-major and compact
    for axis in (0..ndim).rev() {
        // SAFETY: shape (and strides, when not null) hold ndim entries (the DLPack specification).
        let extent = unsafe { *tensor.shape.add(axis) };
        if extent < 0 {
            return Err(PyValueError::new_err(format!(
                "{name}: expected a DLPack tensor of extents >= 0, got {extent} on axis {axis}"
            )));
        }
        shape[axis] = extent as numpy::npyffi::npy_intp;
        strides[axis] = if tensor.strides.is_null() {
            compact
        } else {
            // SAFETY: as above.
            (unsafe { *tensor.strides.add(axis) }) * item
        } as numpy::npyffi::npy_intp;
        compact *= extent.max(1);
    }
    let data = tensor
        .data
        .cast::<u8>()
        .wrapping_add(tensor.byte_offset as usize);
    let flags = if read_only {
        0
    } else {
        numpy::npyffi::NPY_ARRAY_WRITEABLE
    };
    // SAFETY: NumPy's C API under the GIL: a new array of `descr` (its reference stolen) viewing
    // `data` with the tensor's shape and byte strides; then its base, the capsule (that
    // reference stolen too), which keeps the tensor alive as long as the view.
    unsafe {
        let api = &numpy::npyffi::PY_ARRAY_API;
        let subtype = numpy::npyffi::get_type_object(py, numpy::npyffi::NpyTypes::PyArray_Type);
        let array = api.PyArray_NewFromDescr(
            py,
            subtype,
            descr.into_dtype_ptr(),
            ndim as std::ffi::c_int,
            shape.as_mut_ptr(),
            strides.as_mut_ptr(),
            data.cast(),
            flags,
            std::ptr::null_mut(),
        );
        if array.is_null() {
            return Err(PyErr::fetch(py));
        }
        let array = Bound::from_owned_ptr(py, array);
        if api.PyArray_SetBaseObject(py, array.as_ptr().cast(), capsule.clone().into_ptr()) != 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(array.cast_into_unchecked::<PyUntypedArray>())
    }
}

/// The argument as an ndarray: itself, or the view of a DLPack capsule's tensor.
fn ndarray_of<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyUntypedArray>> {
    // SAFETY: a type check of a live object.
    if unsafe { pyo3::ffi::PyCapsule_CheckExact(obj.as_ptr()) } != 0 {
        return dlpack_view(obj, name);
    }
    obj.cast::<PyUntypedArray>().cloned().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name}: expected a numpy.ndarray, got {}",
            type_name(obj)
        ))
    })
}

/// The argument (an ndarray or a DLPack capsule) as an ndarray of the expected dtype and rank
/// whose elements can be addressed by element strides (byte strides multiples of the item size,
/// data aligned). Nothing is copied.
fn as_array<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    expected: Dtype,
    ndim: usize,
    axes: &str,
) -> PyResult<Bound<'py, PyUntypedArray>> {
    let py = obj.py();
    let array = ndarray_of(obj, name)?;
    // equivalence also rejects non-native byte order
    let given = array.dtype();
    let is_float32 = given.is_equiv_to(&dtype::<f32>(py));
    let ok = match expected {
        Dtype::Float32 => is_float32,
        Dtype::Int64 => given.is_equiv_to(&dtype::<i64>(py)),
        Dtype::BoolOrFloat32 => is_float32 || given.is_equiv_to(&dtype::<bool>(py)),
        Dtype::Element => element_type_of(&given).is_some(),
        Dtype::Like(element, _) => element_type_of(&given) == Some(element),
        Dtype::LikeOrInt8(element, _) => {
            element_type_of(&given) == Some(element) || given.is_equiv_to(&dtype::<i8>(py))
        }
        Dtype::Int8 => given.is_equiv_to(&dtype::<i8>(py)),
        Dtype::LikeOrFloat32(element, _) => element_type_of(&given) == Some(element) || is_float32,
    };
    if !ok {
        let expected = match expected {
            Dtype::Float32 => "float32".to_owned(),
            Dtype::Int64 => "int64".to_owned(),
            Dtype::BoolOrFloat32 => "bool or float32".to_owned(),
            Dtype::Element => "float32, float16 or bfloat16".to_owned(),
            Dtype::Like(_, name) => format!("{name} (q's dtype)"),
            Dtype::LikeOrInt8(_, name) => format!("{name} (q's dtype) or int8"),
            Dtype::Int8 => "int8 (k's dtype)".to_owned(),
            Dtype::LikeOrFloat32(ElementType::Float32, name) => format!("{name} (q's dtype)"),
            Dtype::LikeOrFloat32(_, name) => {
                format!("{name} (q's dtype) or float32 (the forward's out32)")
            }
        };
        return Err(PyTypeError::new_err(format!(
            "{name}: expected dtype {expected}, got {given}"
        )));
    }
    if array.ndim() != ndim {
        return Err(PyValueError::new_err(format!(
            "{name}: expected {ndim} dimensions {axes}, got shape {}",
            tuple_string(array.shape())
        )));
    }
    if array.is_empty() {
        return Ok(array); // no element to address
    }
    let item = given.itemsize() as isize;
    if array.strides().iter().any(|&s| s % item != 0) {
        return Err(PyValueError::new_err(format!(
            "{name}: expected byte strides that are multiples of the item size {item}, got strides {}",
            tuple_string(array.strides())
        )));
    }
    if !(data_of(&array) as usize).is_multiple_of(item as usize) {
        return Err(PyValueError::new_err(format!(
            "{name}: expected data aligned to its item size {item}, got a misaligned array"
        )));
    }
    Ok(array)
}

fn data_of(array: &Bound<'_, PyUntypedArray>) -> *mut u8 {
    // SAFETY: `array` is a live NumPy array (its type was checked); reading its data field is
    // what NumPy's own PyArray_DATA macro does.
    unsafe {
        (*numpy::npyffi::objects::_PyArray_GET_ITEM_DATA(array.as_array_ptr()))
            .data
            .cast::<u8>()
    }
}

/// ValueError unless NumPy says the array is writeable.
fn require_writeable(array: &Bound<'_, PyUntypedArray>, name: &str) -> PyResult<()> {
    // SAFETY: as in data_of; the flags field is what NumPy's PyArray_FLAGS macro reads, and far
    // cheaper than `array.flags.writeable`.
    let flags =
        unsafe { (*numpy::npyffi::objects::_PyArray_GET_ITEM_DATA(array.as_array_ptr())).flags };
    if flags & numpy::npyffi::NPY_ARRAY_WRITEABLE == 0 {
        return Err(PyValueError::new_err(format!(
            "{name}: expected a writeable array, got a read-only one"
        )));
    }
    Ok(())
}

fn shape_of<const N: usize>(array: &Bound<'_, PyUntypedArray>) -> [i64; N] {
    std::array::from_fn(|axis| array.shape()[axis] as i64)
}

/// Element strides (the byte strides divided by the item size).
fn strides_of<const N: usize>(array: &Bound<'_, PyUntypedArray>) -> [i64; N] {
    let item = array.dtype().itemsize() as i64;
    std::array::from_fn(|axis| array.strides()[axis] as i64 / item)
}

fn tensor_view(array: &Bound<'_, PyUntypedArray>) -> TensorView4 {
    TensorView4 {
        data: data_of(array).cast_const(),
        shape: shape_of(array),
        stride: strides_of(array),
    }
}

/// A per-sequence int64 vector (q_offset, kv_lens) copied into a Vec (its length is the core's
/// to check; the copy frees the kernel from its strides); None: `batch` copies of `fill`.
fn per_sequence(
    obj: Option<&Bound<'_, PyAny>>,
    name: &str,
    batch: usize,
    fill: i64,
) -> PyResult<Vec<i64>> {
    let Some(obj) = obj else {
        return Ok(vec![fill; batch]);
    };
    int64_vector(obj, name, "(B,)")
}

/// An int64 vector (any stride) copied into a Vec: per_sequence's arrays, cu_seqlens_q,
/// cu_seqlens_k, seq_lens.
fn int64_vector(obj: &Bound<'_, PyAny>, name: &str, axes: &str) -> PyResult<Vec<i64>> {
    let array = &as_array(obj, name, Dtype::Int64, 1, axes)?;
    let stride = array.strides()[0] / 8; // checked: a multiple of the item size
    let data = data_of(array).cast::<i64>().cast_const();
    Ok((0..array.shape()[0] as isize)
        // SAFETY: an aligned (checked) int64 array of shape()[0] elements `stride` apart, read
        // under the GIL.
        .map(|i| unsafe { *data.offset(i * stride) })
        .collect())
}

/// A float32 parameter array (alibi_slopes, sinks, k_scale, v_scale) of rank N as its data,
/// shape and strides; None: not given (a null pointer).
fn param_parts<const N: usize>(
    obj: Option<&Bound<'_, PyAny>>,
    name: &str,
    axes: &str,
) -> PyResult<(*const f32, [i64; N], [i64; N])> {
    let Some(obj) = obj else {
        return Ok((std::ptr::null(), [0; N], [0; N]));
    };
    let array = &as_array(obj, name, Dtype::Float32, N, axes)?;
    Ok((
        data_of(array).cast::<f32>().cast_const(),
        shape_of(array),
        strides_of(array),
    ))
}

/// `param_view!(ParamViewN, obj, name, axes)`: [`param_parts`] as that view type (the three
/// ParamView types differ only in their rank), returning early on a conversion error. C++ does
/// the same with one template (bindings.cpp, param_view).
macro_rules! param_view {
    ($view:ident, $obj:expr, $name:expr, $axes:expr) => {{
        let (data, shape, stride) = param_parts($obj, $name, $axes)?;
        $view {
            data,
            shape,
            stride,
        }
    }};
}

// Python scalars, converted by hand so that both ports treat every type alike (a bool is not a
// number here).
fn as_bool(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    match obj.cast::<PyBool>() {
        Ok(value) => Ok(value.is_true()),
        Err(_) => Err(PyTypeError::new_err(format!(
            "{name}: expected a bool, got {}",
            type_name(obj)
        ))),
    }
}

fn as_float(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    // f64 extraction is PyFloat_AsDouble, as in C++
    match obj.extract::<f64>() {
        Ok(value) if !obj.is_instance_of::<PyBool>() => Ok(value),
        _ => Err(PyTypeError::new_err(format!(
            "{name}: expected a float, got {}",
            type_name(obj)
        ))),
    }
}

/// Any int (operator.index), saturated to i64: the core then says what range it accepts.
fn as_int64(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i64> {
    let type_error =
        || PyTypeError::new_err(format!("{name}: expected an int, got {}", type_name(obj)));
    if obj.is_instance_of::<PyBool>() {
        return Err(type_error());
    }
    match obj.extract::<i64>() {
        Ok(value) => Ok(value),
        Err(error) if error.is_instance_of::<PyOverflowError>(obj.py()) => {
            Ok(if obj.lt(0)? { i64::MIN } else { i64::MAX })
        }
        Err(_) => Err(type_error()),
    }
}

/// ValueError, or MemoryError for a failed scratch allocation: C++'s std::invalid_argument and
/// std::bad_alloc.
fn raise(error: ProblemError) -> PyErr {
    if error.is_out_of_memory() {
        PyMemoryError::new_err(error.0)
    } else {
        PyValueError::new_err(error.0)
    }
}

/// A checked problem handed to the thread that computes while the GIL is released. Raw pointers
/// are not Send, so Rust needs this wrapper; C++ does not.
struct DetachedProblem<'a>(AttentionProblem<'a>);

// SAFETY: the views point into NumPy arrays that the calling frame keeps alive until the detached
// computation has returned.
unsafe impl Send for DetachedProblem<'_> {}

impl DetachedProblem<'_> {
    fn run(self, num_threads: usize, kernel: Kernel) -> Result<(), ProblemError> {
        // SAFETY: every view was built from a live, aligned NumPy array of exactly that shape and
        // those strides; the kernel runs check_problem (outputs overlapping neither each other
        // nor the inputs, indices in bounds) before it touches memory. As in C++ (and NumPy),
        // another thread that writes these arrays during the call races with it; that is the
        // caller's to avoid.
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

/// A checked backward problem handed to the thread that computes while the GIL is released (as
/// [`DetachedProblem`]).
struct DetachedBackward<'a>(BackwardProblem<'a>);

// SAFETY: as DetachedProblem's: the views point into NumPy arrays that the calling frame keeps
// alive until the detached computation has returned.
unsafe impl Send for DetachedBackward<'_> {}

impl DetachedBackward<'_> {
    fn run(self, num_threads: usize) -> Result<(), ProblemError> {
        // SAFETY: as DetachedProblem::run; attention_backward runs check_backward (gradients
        // overlapping neither each other nor the inputs, indices in bounds) before it touches
        // memory.
        unsafe { crate::flash_backward::attention_backward(&self.0, num_threads) }
    }
}

/// One `#[pyfunction]` per kernel, the same arguments for both, handed to [`run_kernel`] (a macro:
/// PyO3 needs a function each; C++ instantiates one template twice, bindings.cpp).
macro_rules! attention_py {
    ($(#[$doc:meta])* $name:ident, $kernel:expr) => {
        $(#[$doc])*
        #[pyfunction]
        #[pyo3(signature = (q, k, v, out, *, scale, lse=None, q_offset=None, kv_lens=None, mask=None, causal=None, num_threads=None, window_left=None, window_right=None, softcap=None, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None, out32=None))]
        #[allow(clippy::too_many_arguments)]
        fn $name<'py>(
            q: &Bound<'py, PyAny>,
            k: &Bound<'py, PyAny>,
            v: &Bound<'py, PyAny>,
            out: &Bound<'py, PyAny>,
            scale: &Bound<'py, PyAny>,
            lse: Option<&Bound<'py, PyAny>>,
            q_offset: Option<&Bound<'py, PyAny>>,
            kv_lens: Option<&Bound<'py, PyAny>>,
            mask: Option<&Bound<'py, PyAny>>,
            causal: Option<&Bound<'py, PyAny>>,
            num_threads: Option<&Bound<'py, PyAny>>,
            window_left: Option<&Bound<'py, PyAny>>,
            window_right: Option<&Bound<'py, PyAny>>,
            softcap: Option<&Bound<'py, PyAny>>,
            alibi_slopes: Option<&Bound<'py, PyAny>>,
            sinks: Option<&Bound<'py, PyAny>>,
            k_scale: Option<&Bound<'py, PyAny>>,
            v_scale: Option<&Bound<'py, PyAny>>,
            out32: Option<&Bound<'py, PyAny>>,
        ) -> PyResult<()> {
            run_kernel(
                $kernel,
                [q, k, v, out, scale],
                [
                    lse,
                    q_offset,
                    kv_lens,
                    mask,
                    causal,
                    num_threads,
                    window_left,
                    window_right,
                    softcap,
                    alibi_slopes,
                    sinks,
                    k_scale,
                    v_scale,
                ],
                out32,
            )
        }
    };
}

attention_py!(
    /// attention_forward(q, k, v, out, *, scale, lse=None, q_offset=None, kv_lens=None,
    ///     mask=None, causal=None, num_threads=None, window_left=None, window_right=None,
    ///     softcap=None, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None, out32=None)
    /// --
    ///
    /// Computes out (and lse, out32 when given) in place with the fast kernel and the instruction set in
    /// use (set_isa). None means a keyword's default. See docs/native_api.md.
    attention_forward,
    Kernel::Fast
);

attention_py!(
    /// attention_reference(q, k, v, out, *, scale, lse=None, q_offset=None, kv_lens=None,
    ///     mask=None, causal=None, num_threads=None, window_left=None, window_right=None,
    ///     softcap=None, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None, out32=None)
    /// --
    ///
    /// As attention_forward, with the plain reference kernel (the scalar twin every fast path is
    /// tested against).
    attention_reference,
    Kernel::Reference
);

/// The forward's arguments converted ([`run_kernel`]; attention_backward_py, whose out and lse
/// are inputs): the problem (its per-sequence slices empty: the caller points them at q_offset
/// and kv_lens, which C++ does inside convert_problem), those vectors, and num_threads.
struct ConvertedProblem {
    problem: AttentionProblem<'static>,
    q_offset: Vec<i64>,
    kv_lens: Vec<i64>,
    num_threads: i64,
    /// out is float32 (the backward: the forward's out32 of a half q)
    out_float32: bool,
}

impl ConvertedProblem {
    /// The problem with its per-sequence slices.
    fn problem(&self) -> AttentionProblem<'_> {
        AttentionProblem {
            q_offset: &self.q_offset,
            kv_lens: &self.kv_lens,
            ..self.problem
        }
    }
}

/// Converts the forward's arguments. `outputs`: out and lse are written (the forward:
/// writeable), else read (the backward). `required`: q, k, v, out and scale; `keywords`: the
/// others in signature order, None (or absent) meaning the keyword's default.
fn convert_problem(
    outputs: bool,
    required: [&Bound<'_, PyAny>; 5],
    keywords: [Option<&Bound<'_, PyAny>>; 13],
) -> PyResult<ConvertedProblem> {
    let [q, k, v, out, scale] = required;
    let [lse, q_offset, kv_lens, mask, causal, num_threads, window_left, window_right, softcap, alibi_slopes, sinks, k_scale, v_scale] =
        keywords;
    // 1. Arrays, each whole (dtype, rank, strides, alignment) before the next: q, k, v and out
    // of q's dtype (float32, float16 or bfloat16), or k and v both int8 (docs/kernels.md,
    // "int8 K/V"); writeable outputs.
    let q = &as_array(q, "q", Dtype::Element, 4, "(B, Hq, Lq, D)")?;
    let element = element_type_of(&q.dtype()).expect("checked by as_array");
    let like = Dtype::Like(element, element.name());
    let k = &as_array(
        k,
        "k",
        Dtype::LikeOrInt8(element, element.name()),
        4,
        "(B, Hkv, Lk, D)",
    )?;
    let kv_int8 = k.dtype().is_equiv_to(&dtype::<i8>(k.py()));
    let v_dtype = if kv_int8 { Dtype::Int8 } else { like };
    let v = &as_array(v, "v", v_dtype, 4, "(B, Hkv, Lk, Dv)")?;
    let out_dtype = if outputs {
        like
    } else {
        Dtype::LikeOrFloat32(element, element.name())
    };
    let out = &as_array(out, "out", out_dtype, 4, "(B, Hq, Lq, Dv)")?;
    if outputs {
        require_writeable(out, "out")?;
    }
    let out_float32 = out.dtype().is_equiv_to(&dtype::<f32>(out.py()));
    let lse = match lse {
        None => LseView::NONE,
        Some(lse) => {
            let lse = &as_array(lse, "lse", Dtype::Float32, 3, "(B, Hq, Lq)")?;
            if outputs {
                require_writeable(lse, "lse")?;
            }
            LseView {
                data: data_of(lse).cast::<f32>(),
                shape: shape_of(lse),
                stride: strides_of(lse),
            }
        }
    };
    let mask = match mask {
        None => MaskView::NONE,
        Some(mask) => {
            let mask = &as_array(mask, "mask", Dtype::BoolOrFloat32, 4, "(B, Hq, Lq, Lk)")?;
            MaskView {
                kind: match mask.dtype().is_equiv_to(&dtype::<bool>(mask.py())) {
                    true => MaskKind::Bool,
                    false => MaskKind::Float,
                },
                data: data_of(mask).cast_const(),
                shape: shape_of(mask),
                stride: strides_of(mask),
            }
        }
    };
    let batch = q.shape()[0];
    let q_offset = per_sequence(q_offset, "q_offset", batch, 0)?;
    let kv_lens = per_sequence(kv_lens, "kv_lens", batch, k.shape()[2] as i64)?;

    // 2. Scalars; then the parameter arrays.
    let (options, num_threads) = convert_options(
        scale,
        [
            causal,
            num_threads,
            window_left,
            window_right,
            softcap,
            alibi_slopes,
            sinks,
        ],
    )?;
    let k_scale = param_view!(ParamView3, k_scale, "k_scale", "(B, Hkv, Lk)");
    let v_scale = param_view!(ParamView3, v_scale, "v_scale", "(B, Hkv, Lk)");

    let problem = AttentionProblem {
        dtype: element,
        q: tensor_view(q),
        k: tensor_view(k),
        v: tensor_view(v),
        out: MutTensorView4 {
            data: data_of(out),
            shape: shape_of(out),
            stride: strides_of(out),
        },
        lse,
        q_offset: &[],
        kv_lens: &[],
        mask,
        causal: options.causal,
        scale: options.scale,
        window_left: options.window_left,
        window_right: options.window_right,
        softcap: options.softcap,
        alibi_slopes: options.alibi_slopes,
        sinks: options.sinks,
        kv_int8,
        k_scale,
        v_scale,
        pages: KeyPages::NONE,
        out32: MutTensorView4::NONE,
    };

    Ok(ConvertedProblem {
        problem,
        q_offset,
        kv_lens,
        num_threads,
        out_float32,
    })
}

/// Runs `compute` (which calls a kernel with the checked thread count) without the GIL; the
/// kernel checks its problem first, once per call.
fn run_without_gil(
    py: Python<'_>,
    num_threads: i64,
    compute: impl FnOnce(usize) -> Result<(), ProblemError> + Send,
) -> PyResult<()> {
    let threads = check_num_threads(num_threads).map_err(raise)?;
    py.detach(move || compute(threads)).map_err(raise)
}

/// out32 (attention_forward, attention_reference): float32 (B, Hq, Lq, Dv), writeable (the core
/// checks it against the problem); None: not requested.
fn convert_out32(out32: Option<&Bound<'_, PyAny>>) -> PyResult<MutTensorView4> {
    let Some(out32) = out32 else {
        return Ok(MutTensorView4::NONE);
    };
    let array = &as_array(out32, "out32", Dtype::Float32, 4, "(B, Hq, Lq, Dv)")?;
    require_writeable(array, "out32")?;
    Ok(MutTensorView4 {
        data: data_of(array),
        shape: shape_of(array),
        stride: strides_of(array),
    })
}

/// Converts the arguments into an AttentionProblem and runs `kernel` without the GIL; the
/// kernel checks the problem first (check_problem: shapes against each other, lengths, ranges,
/// scales required or not, overlaps), once per call.
fn run_kernel(
    kernel: Kernel,
    required: [&Bound<'_, PyAny>; 5],
    keywords: [Option<&Bound<'_, PyAny>>; 13],
    out32: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let converted = convert_problem(true, required, keywords)?;
    let problem = AttentionProblem {
        out32: convert_out32(out32)?,
        ..converted.problem()
    };
    let job = DetachedProblem(problem);
    run_without_gil(required[0].py(), converted.num_threads, move |threads| {
        job.run(threads, kernel)
    })
}

/// attention_backward(q, k, v, out, dout, lse, dq, dk, dv, *, scale, q_offset=None,
///     kv_lens=None, mask=None, causal=None, num_threads=None, window_left=None,
///     window_right=None, softcap=None, alibi_slopes=None, sinks=None, dsinks=None, dlse=None)
/// --
///
/// The gradients of attention_forward with respect to q, k, v (and sinks: dsinks) from dout,
/// the forward's out (q's dtype, or float32 for float16 / bfloat16: the forward's out32) and lse,
/// written into dq, dk, dv (and dsinks); dlse, lse's gradient, when given. Conversion order: the
/// forward's arguments as the forward converts them, then dout, dq, dk, dv, dsinks and dlse; then
/// the core's checks (check_backward). See docs/native_api.md.
#[pyfunction]
#[pyo3(name = "attention_backward")]
#[pyo3(signature = (q, k, v, out, dout, lse, dq, dk, dv, *, scale, q_offset=None, kv_lens=None, mask=None, causal=None, num_threads=None, window_left=None, window_right=None, softcap=None, alibi_slopes=None, sinks=None, dsinks=None, dlse=None))]
#[allow(clippy::too_many_arguments)]
fn attention_backward_py<'py>(
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    dout: &Bound<'py, PyAny>,
    lse: &Bound<'py, PyAny>,
    dq: &Bound<'py, PyAny>,
    dk: &Bound<'py, PyAny>,
    dv: &Bound<'py, PyAny>,
    scale: &Bound<'py, PyAny>,
    q_offset: Option<&Bound<'py, PyAny>>,
    kv_lens: Option<&Bound<'py, PyAny>>,
    mask: Option<&Bound<'py, PyAny>>,
    causal: Option<&Bound<'py, PyAny>>,
    num_threads: Option<&Bound<'py, PyAny>>,
    window_left: Option<&Bound<'py, PyAny>>,
    window_right: Option<&Bound<'py, PyAny>>,
    softcap: Option<&Bound<'py, PyAny>>,
    alibi_slopes: Option<&Bound<'py, PyAny>>,
    sinks: Option<&Bound<'py, PyAny>>,
    dsinks: Option<&Bound<'py, PyAny>>,
    dlse: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    // lse is positional but may be None, as in C++: then the core says it is required.
    let converted = convert_problem(
        false,
        [q, k, v, out, scale],
        [
            (!lse.is_none()).then_some(lse),
            q_offset,
            kv_lens,
            mask,
            causal,
            num_threads,
            window_left,
            window_right,
            softcap,
            alibi_slopes,
            sinks,
            None,
            None,
        ],
    )?;
    let forward = converted.problem();
    let element = forward.dtype;
    let like = Dtype::Like(element, element.name());
    let dout = tensor_view(&as_array(dout, "dout", like, 4, "(B, Hq, Lq, Dv)")?);
    let mut gradients = [MutTensorView4 {
        data: std::ptr::null_mut(),
        shape: [0; 4],
        stride: [0; 4],
    }; 3];
    let named = [
        ("dq", dq, "(B, Hq, Lq, D)"),
        ("dk", dk, "(B, Hkv, Lk, D)"),
        ("dv", dv, "(B, Hkv, Lk, Dv)"),
    ];
    for (gradient, (name, obj, axes)) in gradients.iter_mut().zip(named) {
        let array = &as_array(obj, name, like, 4, axes)?;
        require_writeable(array, name)?;
        *gradient = MutTensorView4 {
            data: data_of(array),
            shape: shape_of(array),
            stride: strides_of(array),
        };
    }
    let dsinks = match dsinks {
        None => MutParamView1::NONE,
        Some(dsinks) => {
            let array = &as_array(dsinks, "dsinks", Dtype::Float32, 1, "(Hq,)")?;
            require_writeable(array, "dsinks")?;
            MutParamView1 {
                data: data_of(array).cast::<f32>(),
                shape: shape_of(array),
                stride: strides_of(array),
            }
        }
    };
    let out_float32 = element != ElementType::Float32 && converted.out_float32;
    let dlse = param_view!(ParamView3, dlse, "dlse", "(B, Hq, Lq)");
    let [dq, dk, dv] = gradients;
    let job = DetachedBackward(BackwardProblem {
        forward,
        dout,
        dq,
        dk,
        dv,
        dsinks,
        out_float32,
        dlse,
    });
    run_without_gil(q.py(), converted.num_threads, move |threads| {
        job.run(threads)
    })
}

/// The scalars and the variants' parameter arrays every entry takes, converted in this order:
/// causal, scale, num_threads (returned), window_left, window_right, softcap, alibi_slopes,
/// sinks. `keywords`: causal, num_threads, window_left, window_right, softcap, alibi_slopes,
/// sinks.
fn convert_options(
    scale: &Bound<'_, PyAny>,
    keywords: [Option<&Bound<'_, PyAny>>; 7],
) -> PyResult<(PackedOptions, i64)> {
    let [causal, num_threads, window_left, window_right, softcap, alibi_slopes, sinks] = keywords;
    let causal = causal.map_or(Ok(false), |x| as_bool(x, "causal"))?;
    let scale = as_float(scale, "scale")?;
    let num_threads = num_threads.map_or(Ok(1), |x| as_int64(x, "num_threads"))?;
    let options = PackedOptions {
        causal,
        scale: scale as f32, // beyond float32's range becomes inf: rejected
        window_left: window_left.map_or(Ok(-1), |x| as_int64(x, "window_left"))?,
        window_right: window_right.map_or(Ok(-1), |x| as_int64(x, "window_right"))?,
        softcap: softcap.map_or(Ok(0.0), |x| as_float(x, "softcap"))? as f32, // likewise
        alibi_slopes: param_view!(ParamView2, alibi_slopes, "alibi_slopes", "(B, Hq)"),
        sinks: param_view!(ParamView1, sinks, "sinks", "(Hq,)"),
        ..PackedOptions::default()
    };
    Ok((options, num_threads))
}

// ---- attention_varlen and attention_paged (docs/native_api.md) -------------------------------

/// A packed or paged problem handed to the thread that computes while the GIL is released (as
/// [`DetachedProblem`]).
struct DetachedCall<P>(P);

// SAFETY: as DetachedProblem: the views point into NumPy arrays that the calling frame keeps
// alive until the detached computation has returned.
unsafe impl<P> Send for DetachedCall<P> {}

/// The arrays of a packed call, each converted whole before the next.
struct PackedArrays<'py> {
    q: Bound<'py, PyUntypedArray>,
    k: Bound<'py, PyUntypedArray>,
    v: Bound<'py, PyUntypedArray>,
    out: Bound<'py, PyUntypedArray>,
    kv_int8: bool,
}

/// q (total_q, Hq, D) of float32, float16 or bfloat16; k and v of rank `kv_rank`, q's dtype or
/// both int8; out (total_q, Hq, Dv) writeable; each whole before the next.
fn packed_arrays<'py>(
    arrays: [&Bound<'py, PyAny>; 4],
    names: [&str; 2],
    kv_rank: usize,
    axes: [&str; 2],
) -> PyResult<PackedArrays<'py>> {
    let [q, k, v, out] = arrays;
    let q = as_array(q, "q", Dtype::Element, 3, "(total_q, Hq, D)")?;
    let element = element_type_of(&q.dtype()).expect("checked by as_array");
    let like = Dtype::Like(element, element.name());
    let k = as_array(
        k,
        names[0],
        Dtype::LikeOrInt8(element, element.name()),
        kv_rank,
        axes[0],
    )?;
    let kv_int8 = k.dtype().is_equiv_to(&dtype::<i8>(k.py()));
    let v = as_array(
        v,
        names[1],
        if kv_int8 { Dtype::Int8 } else { like },
        kv_rank,
        axes[1],
    )?;
    let out = as_array(out, "out", like, 3, "(total_q, Hq, Dv)")?;
    require_writeable(&out, "out")?;
    Ok(PackedArrays {
        q,
        k,
        v,
        out,
        kv_int8,
    })
}

/// q and out of a packed problem.
fn packed_rows(arrays: &PackedArrays) -> (TensorView3, MutTensorView3) {
    let out = MutTensorView3 {
        data: data_of(&arrays.out),
        shape: shape_of(&arrays.out),
        stride: strides_of(&arrays.out),
    };
    (view3(&arrays.q), out)
}

fn view3(array: &Bound<'_, PyUntypedArray>) -> TensorView3 {
    TensorView3 {
        data: data_of(array).cast_const(),
        shape: shape_of(array),
        stride: strides_of(array),
    }
}

/// lse (Hq, total_q), writeable, float32; None: not requested.
fn packed_lse(lse: Option<&Bound<'_, PyAny>>) -> PyResult<LseView2> {
    let Some(lse) = lse else {
        return Ok(LseView2::NONE);
    };
    let lse = &as_array(lse, "lse", Dtype::Float32, 2, "(Hq, total_q)")?;
    require_writeable(lse, "lse")?;
    Ok(LseView2 {
        data: data_of(lse).cast::<f32>(),
        shape: shape_of(lse),
        stride: strides_of(lse),
    })
}

/// The options (convert_options, after the arrays) with the arrays' dtype; and num_threads.
fn packed_options(
    arrays: &PackedArrays,
    scale: &Bound<'_, PyAny>,
    keywords: [Option<&Bound<'_, PyAny>>; 7],
) -> PyResult<(PackedOptions, i64)> {
    let (options, num_threads) = convert_options(scale, keywords)?;
    let options = PackedOptions {
        dtype: element_type_of(&arrays.q.dtype()).expect("checked by as_array"),
        kv_int8: arrays.kv_int8,
        ..options
    };
    Ok((options, num_threads))
}

/// attention_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, *, scale, lse=None, causal=None,
///     num_threads=None, window_left=None, window_right=None, softcap=None, alibi_slopes=None,
///     sinks=None, k_scale=None, v_scale=None)
/// --
///
/// Attention over sequences packed one after another (flash-attn's varlen layout) into out (and
/// lse); see docs/native_api.md.
#[pyfunction]
#[pyo3(signature = (q, k, v, out, cu_seqlens_q, cu_seqlens_k, *, scale, lse=None, causal=None, num_threads=None, window_left=None, window_right=None, softcap=None, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None))]
#[allow(clippy::too_many_arguments)]
#[pyo3(name = "attention_varlen")]
fn attention_varlen_py<'py>(
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    cu_seqlens_q: &Bound<'py, PyAny>,
    cu_seqlens_k: &Bound<'py, PyAny>,
    scale: &Bound<'py, PyAny>,
    lse: Option<&Bound<'py, PyAny>>,
    causal: Option<&Bound<'py, PyAny>>,
    num_threads: Option<&Bound<'py, PyAny>>,
    window_left: Option<&Bound<'py, PyAny>>,
    window_right: Option<&Bound<'py, PyAny>>,
    softcap: Option<&Bound<'py, PyAny>>,
    alibi_slopes: Option<&Bound<'py, PyAny>>,
    sinks: Option<&Bound<'py, PyAny>>,
    k_scale: Option<&Bound<'py, PyAny>>,
    v_scale: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    // 1. Arrays; 2. scalars and parameter arrays; 3. the kernel (its core checks the problem).
    let arrays = packed_arrays(
        [q, k, v, out],
        ["k", "v"],
        3,
        ["(total_k, Hkv, D)", "(total_k, Hkv, Dv)"],
    )?;
    let (q_view, out_view) = packed_rows(&arrays);
    let lse = packed_lse(lse)?;
    let cu_seqlens_q = int64_vector(cu_seqlens_q, "cu_seqlens_q", "(B + 1,)")?;
    let cu_seqlens_k = int64_vector(cu_seqlens_k, "cu_seqlens_k", "(B + 1,)")?;
    let (options, num_threads) = packed_options(
        &arrays,
        scale,
        [
            causal,
            num_threads,
            window_left,
            window_right,
            softcap,
            alibi_slopes,
            sinks,
        ],
    )?;
    let problem = VarlenProblem {
        q: q_view,
        k: view3(&arrays.k),
        v: view3(&arrays.v),
        out: out_view,
        lse,
        cu_seqlens_q: &cu_seqlens_q,
        cu_seqlens_k: &cu_seqlens_k,
        options,
        k_scale: param_view!(ParamView2, k_scale, "k_scale", "(total_k, Hkv)"),
        v_scale: param_view!(ParamView2, v_scale, "v_scale", "(total_k, Hkv)"),
    };
    let threads = check_num_threads(num_threads).map_err(raise)?;
    let job = DetachedCall(problem);
    arrays
        .q
        .py()
        .detach(move || {
            let job = job;
            // SAFETY: as DetachedProblem::run: views of live, aligned NumPy arrays, checked by
            // the core before any memory is touched.
            unsafe { crate::flash_attention::attention_varlen(&job.0, threads) }
        })
        .map_err(raise)
}

/// attention_paged(q, k_cache, v_cache, out, block_table, seq_lens, cu_seqlens_q, *, scale,
///     lse=None, causal=None, num_threads=None, window_left=None, window_right=None,
///     softcap=None, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None)
/// --
///
/// Attention of packed query rows over keys and values in a paged cache (block table) into out
/// (and lse); see docs/native_api.md.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, out, block_table, seq_lens, cu_seqlens_q, *, scale, lse=None, causal=None, num_threads=None, window_left=None, window_right=None, softcap=None, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None))]
#[allow(clippy::too_many_arguments)]
#[pyo3(name = "attention_paged")]
fn attention_paged_py<'py>(
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    block_table: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    cu_seqlens_q: &Bound<'py, PyAny>,
    scale: &Bound<'py, PyAny>,
    lse: Option<&Bound<'py, PyAny>>,
    causal: Option<&Bound<'py, PyAny>>,
    num_threads: Option<&Bound<'py, PyAny>>,
    window_left: Option<&Bound<'py, PyAny>>,
    window_right: Option<&Bound<'py, PyAny>>,
    softcap: Option<&Bound<'py, PyAny>>,
    alibi_slopes: Option<&Bound<'py, PyAny>>,
    sinks: Option<&Bound<'py, PyAny>>,
    k_scale: Option<&Bound<'py, PyAny>>,
    v_scale: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let arrays = packed_arrays(
        [q, k_cache, v_cache, out],
        ["k_cache", "v_cache"],
        4,
        [
            "(num_blocks, block_size, Hkv, D)",
            "(num_blocks, block_size, Hkv, Dv)",
        ],
    )?;
    let (q_view, out_view) = packed_rows(&arrays);
    let lse = packed_lse(lse)?;
    let table = &ndarray_of(block_table, "block_table")?;
    if !table.dtype().is_equiv_to(&dtype::<i32>(table.py())) {
        return Err(PyTypeError::new_err(format!(
            "block_table: expected dtype int32, got {}",
            table.dtype()
        )));
    }
    if table.ndim() != 2 {
        return Err(PyValueError::new_err(format!(
            "block_table: expected 2 dimensions (B, max_blocks), got shape {}",
            tuple_string(table.shape())
        )));
    }
    if !table.is_empty()
        && (table.strides().iter().any(|&s| s % 4 != 0)
            || !(data_of(table) as usize).is_multiple_of(4))
    {
        return Err(PyValueError::new_err(format!(
            "block_table: expected byte strides that are multiples of the item size 4 and aligned data, got strides {}",
            tuple_string(table.strides())
        )));
    }
    let seq_lens = int64_vector(seq_lens, "seq_lens", "(B,)")?;
    let cu_seqlens_q = int64_vector(cu_seqlens_q, "cu_seqlens_q", "(B + 1,)")?;
    let (options, num_threads) = packed_options(
        &arrays,
        scale,
        [
            causal,
            num_threads,
            window_left,
            window_right,
            softcap,
            alibi_slopes,
            sinks,
        ],
    )?;
    let scale_axes = "(num_blocks, block_size, Hkv)";
    let problem = PagedProblem {
        q: q_view,
        k_cache: tensor_view(&arrays.k),
        v_cache: tensor_view(&arrays.v),
        out: out_view,
        lse,
        block_table: BlockTableView {
            data: data_of(table).cast::<i32>().cast_const(),
            shape: shape_of(table),
            stride: strides_of(table),
        },
        seq_lens: &seq_lens,
        cu_seqlens_q: &cu_seqlens_q,
        options,
        k_scale: param_view!(ParamView3, k_scale, "k_scale", scale_axes),
        v_scale: param_view!(ParamView3, v_scale, "v_scale", scale_axes),
    };
    let threads = check_num_threads(num_threads).map_err(raise)?;
    let job = DetachedCall(problem);
    arrays
        .q
        .py()
        .detach(move || {
            let job = job;
            // SAFETY: as in attention_varlen.
            unsafe { crate::flash_attention::attention_paged(&job.0, threads) }
        })
        .map_err(raise)
}

/// softcap_tanh(x) -> ndarray
/// --
///
/// tanh of a float32 vector (any stride) with the fast kernel's vectorised tanh (softcap) and
/// the instruction set in use, into a new array: the kernel's own code, for tests.
#[pyfunction]
#[pyo3(name = "softcap_tanh")]
fn softcap_tanh_py<'py>(x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let x = &as_array(x, "x", Dtype::Float32, 1, "(n,)")?;
    let n = x.shape()[0];
    let stride = strides_of::<1>(x)[0] as isize;
    let data = data_of(x).cast::<f32>().cast_const();
    let values = crate::flash_attention::softcap_tanh((0..n).map(|i| {
        // SAFETY: i < n, the array's length, and as_array checked that its strides address
        // whole, aligned floats.
        unsafe { *data.offset(i as isize * stride) }
    }))
    .map_err(raise)?;
    Ok(PyArray1::from_vec(x.py(), values))
}

/// measure_peak(kind, num_threads, seconds) -> float
/// --
///
/// GFLOP/s of a register-resident loop of independent 'fma32' (AVX-512 / AVX2 FMA),
/// 'bf16dot' (VDPBF16PS) or 'bf16tile' (AMX TDPBF16PS) operations on num_threads threads for
/// about `seconds`. Conversion order as C++: kind (a str), num_threads (an int), seconds (a
/// float, > 0 and <= 1e6, said with Python's repr), then the core's checks (kind known, kind
/// runnable here, num_threads >= 1).
#[pyfunction]
#[pyo3(name = "measure_peak")]
fn measure_peak_py(
    kind: &Bound<'_, PyAny>,
    num_threads: &Bound<'_, PyAny>,
    seconds: &Bound<'_, PyAny>,
) -> PyResult<f64> {
    let kind = kind.cast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!("kind: expected a str, got {}", type_name(kind)))
    })?;
    let num_threads = as_int64(num_threads, "num_threads")?;
    let seconds_value = as_float(seconds, "seconds")?;
    if !(seconds_value > 0.0 && seconds_value <= 1e6) {
        let repr = pyo3::types::PyFloat::new(seconds.py(), seconds_value).repr()?;
        return Err(PyValueError::new_err(format!(
            "seconds: expected a number > 0 and <= 1e6, got {repr}"
        )));
    }
    let kind = kind.to_cow()?.into_owned();
    seconds
        .py()
        .detach(move || crate::measure_peak::measure_peak(&kind, num_threads, seconds_value))
        .map_err(raise)
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
    // bfloat16's path with the instruction set in use ("dot" or "convert"), the instruction set
    // chosen at first use, and the measurement that chose it (None where none was needed).
    info.set_item("isa_default", crate::dispatch::default_isa())?;
    info.set_item("bfloat16_path", crate::dispatch::bfloat16_path())?;
    info.set_item("bf16dot_over_fma32", crate::dispatch::bf16dot_over_fma32())?;
    // Every shared constant (constants.rs), keyed by its name lowercased.
    let constants = PyDict::new(py);
    constants.set_item("q_tile_rows", Q_TILE_ROWS)?;
    constants.set_item("micro_rows", MICRO_ROWS)?;
    constants.set_item("key_block", KEY_BLOCK)?;
    constants.set_item("key_panel", KEY_PANEL)?;
    constants.set_item("split_key_chunk", SPLIT_KEY_CHUNK)?;
    constants.set_item("prefill_pack_bytes", PREFILL_PACK_BYTES)?;
    constants.set_item("pool_spin_microseconds", POOL_SPIN_MICROSECONDS)?;
    constants.set_item("serial_work", SERIAL_WORK)?;
    constants.set_item("direct_score_rows", DIRECT_SCORE_ROWS)?;
    constants.set_item("decode_prefetch_bytes", DECODE_PREFETCH_BYTES)?;
    constants.set_item("decode_near_prefetch_bytes", DECODE_NEAR_PREFETCH_BYTES)?;
    constants.set_item("score_prefetch_bytes", SCORE_PREFETCH_BYTES)?;
    constants.set_item("value_key_chunk", VALUE_KEY_CHUNK)?;
    constants.set_item("value_panel", VALUE_PANEL)?;
    constants.set_item("backward_key_block", BACKWARD_KEY_BLOCK)?;
    constants.set_item("backward_tile_rows", BACKWARD_TILE_ROWS)?;
    constants.set_item("backward_tile_group", BACKWARD_TILE_GROUP)?;
    constants.set_item("backward_chunk_tiles", BACKWARD_CHUNK_TILES)?;
    constants.set_item("avx512_score_vectors", AVX512_SCORE_VECTORS)?;
    constants.set_item("avx512_value_vectors", AVX512_VALUE_VECTORS)?;
    constants.set_item("avx2_score_vectors", AVX2_SCORE_VECTORS)?;
    constants.set_item("avx2_value_vectors", AVX2_VALUE_VECTORS)?;
    constants.set_item("neon_score_vectors", NEON_SCORE_VECTORS)?;
    constants.set_item("neon_value_vectors", NEON_VALUE_VECTORS)?;
    constants.set_item("scalar_width", SCALAR_WIDTH)?;
    constants.set_item("scalar_score_vectors", SCALAR_SCORE_VECTORS)?;
    constants.set_item("scalar_value_vectors", SCALAR_VALUE_VECTORS)?;
    constants.set_item("avx512_direct_strip_rows", AVX512_DIRECT_STRIP_ROWS)?;
    constants.set_item("avx2_direct_strip_rows", AVX2_DIRECT_STRIP_ROWS)?;
    constants.set_item("neon_direct_strip_rows", NEON_DIRECT_STRIP_ROWS)?;
    constants.set_item("scalar_direct_strip_rows", SCALAR_DIRECT_STRIP_ROWS)?;
    constants.set_item("exp2_degree", EXP2_DEGREE)?;
    let floats = |values: &[f32]| values.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    constants.set_item("exp2_coefficients", floats(&EXP2_COEFFICIENTS))?;
    constants.set_item("exp2_min", f64::from(EXP2_MIN))?;
    constants.set_item("log2_e", f64::from(LOG2_E))?;
    constants.set_item("ln2", f64::from(LN2))?;
    constants.set_item("tanh_degree", TANH_DEGREE)?;
    constants.set_item("tanh_coefficients", floats(&TANH_COEFFICIENTS))?;
    constants.set_item("tanh_small", f64::from(TANH_SMALL))?;
    constants.set_item("bf16_dot_min_ratio", BF16_DOT_MIN_RATIO)?;
    constants.set_item("bf16_choice_rounds", BF16_CHOICE_ROUNDS)?;
    constants.set_item("bf16_choice_instructions", BF16_CHOICE_INSTRUCTIONS)?;
    info.set_item("constants", constants)?;
    Ok(info)
}

/// set_isa(name) -> None: switches the instruction set of attention_forward among
/// build_info()["isa_available"]; ValueError naming the available ones otherwise.
#[pyfunction]
#[pyo3(name = "set_isa")]
fn set_isa_py(name: &Bound<'_, PyAny>) -> PyResult<()> {
    let name = name.cast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!("name: expected a str, got {}", type_name(name)))
    })?;
    crate::dispatch::set_isa(&name.to_cow()?).map_err(PyValueError::new_err)
}

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // A TWINATTN_ISA this build or CPU cannot run fails the import, loudly: ImportError with
    // the message, as pybind11 raises C++'s std::invalid_argument there.
    crate::dispatch::init_isa_from_environment().map_err(PyImportError::new_err)?;
    m.add_function(wrap_pyfunction!(attention_forward, m)?)?;
    m.add_function(wrap_pyfunction!(attention_reference, m)?)?;
    m.add_function(wrap_pyfunction!(attention_backward_py, m)?)?;
    m.add_function(wrap_pyfunction!(attention_varlen_py, m)?)?;
    m.add_function(wrap_pyfunction!(attention_paged_py, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(set_isa_py, m)?)?;
    m.add_function(wrap_pyfunction!(softcap_tanh_py, m)?)?;
    m.add_function(wrap_pyfunction!(measure_peak_py, m)?)?;
    Ok(())
}
