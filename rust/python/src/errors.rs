//! Maps core errors to Python exceptions: bad input → ValueError, bad state → RuntimeError.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::PyErr;
use resin_core::CoreError;

pub fn to_py(err: CoreError) -> PyErr {
    match err {
        CoreError::InvalidArgument(m) => PyValueError::new_err(m),
        CoreError::InvalidState(m) => PyRuntimeError::new_err(m),
    }
}
