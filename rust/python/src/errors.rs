//! Maps core errors to Python exceptions: bad input → ValueError, bad state → RuntimeError;
//! and the exceptions `Engine.step()` raises when a plan fails.

use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::PyTypeInfo;
use resin_core::CoreError;

pub fn to_py(err: CoreError) -> PyErr {
    match err {
        CoreError::InvalidArgument(m) => PyValueError::new_err(m),
        CoreError::InvalidState(m) => PyRuntimeError::new_err(m),
    }
}

pyo3::create_exception!(
    resin._core,
    StepError,
    PyRuntimeError,
    "Engine.step() failed: runner.forward raised, or its output was rejected. The plan was \
     discarded first (nothing committed; pages and slots stay with their requests). \
     `request_ids` are the plan's requests; `cause` (also `__cause__`) is the original error."
);

const INVALID_OUTPUT_DOC: &str = "Engine.step() failed because runner.forward returned output the engine rejected \
     (a StepError that is also a ValueError; the message names the field).";

static INVALID_OUTPUT_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `InvalidOutputError(StepError, ValueError)`: a class with two exception bases, which
/// `create_exception!` cannot make, so it is built once by calling `type`.
pub fn invalid_output_error(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    INVALID_OUTPUT_ERROR
        .get_or_try_init(py, || {
            let bases = PyTuple::new(py, [StepError::type_object(py), PyValueError::type_object(py)])?;
            let namespace = PyDict::new(py);
            namespace.set_item("__module__", "resin._core")?;
            namespace.set_item("__doc__", INVALID_OUTPUT_DOC)?;
            let class = PyType::type_object(py).call1(("InvalidOutputError", bases, namespace))?;
            Ok(class.cast_into::<PyType>()?.unbind())
        })
        .map(|class| class.bind(py))
}

/// The error `step()` raises for a failed plan of `request_ids`, with the message of `cause`:
/// what forward raised (`in_forward`) or what `update` rejected. Exceptions that are not
/// `Exception`s (KeyboardInterrupt, SystemExit) pass through unwrapped.
pub fn step_error(py: Python<'_>, request_ids: Vec<&str>, cause: PyErr, in_forward: bool) -> PyErr {
    if !cause.is_instance_of::<PyException>(py) {
        return cause;
    }
    let wrap = || -> PyResult<PyErr> {
        let value = cause.value(py);
        // A rejected output is also a ValueError; anything else (forward raised, or the
        // commit failed for another reason) is a plain StepError.
        let class = if !in_forward && cause.is_instance_of::<PyValueError>(py) {
            invalid_output_error(py)?.clone()
        } else {
            StepError::type_object(py)
        };
        // The message is the original one: the class says the step failed, `cause` says how.
        let err = PyErr::from_type(class, (value.str()?.unbind(),));
        let instance = err.value(py);
        instance.setattr("request_ids", request_ids)?;
        instance.setattr("cause", value)?;
        err.set_cause(py, Some(cause.clone_ref(py)));
        Ok(err)
    };
    wrap().unwrap_or_else(|e| e)
}
