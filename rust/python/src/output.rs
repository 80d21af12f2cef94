//! `ForwardOutput` (runner → engine) and `RequestOutput` (engine → caller).

use numpy::ndarray::{Dimension, Ix1, Ix2};
use numpy::{Element, PyArray, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use resin_core::output as core;

/// What a runner returns. Holds the objects as given; the engine checks them in `update`.
#[pyclass(module = "resin._core", frozen)]
pub struct ForwardOutput {
    #[pyo3(get)]
    token_ids: Py<PyAny>,
    #[pyo3(get)]
    token_indptr: Py<PyAny>,
    #[pyo3(get)]
    logprobs: Option<Py<PyAny>>,
    #[pyo3(get)]
    top_logprob_ids: Option<Py<PyAny>>,
    #[pyo3(get)]
    top_logprobs: Option<Py<PyAny>>,
    #[pyo3(get)]
    draft_token_ids: Option<Py<PyAny>>,
    #[pyo3(get)]
    draft_indptr: Option<Py<PyAny>>,
    #[pyo3(get)]
    prompt_logprobs: Option<Py<PyAny>>,
    #[pyo3(get)]
    prompt_top_logprob_ids: Option<Py<PyAny>>,
    #[pyo3(get)]
    prompt_top_logprobs: Option<Py<PyAny>>,
}

#[pymethods]
impl ForwardOutput {
    #[new]
    #[pyo3(signature = (token_ids, token_indptr, logprobs=None, top_logprob_ids=None, top_logprobs=None,
        draft_token_ids=None, draft_indptr=None, prompt_logprobs=None, prompt_top_logprob_ids=None,
        prompt_top_logprobs=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        token_ids: Py<PyAny>,
        token_indptr: Py<PyAny>,
        logprobs: Option<Py<PyAny>>,
        top_logprob_ids: Option<Py<PyAny>>,
        top_logprobs: Option<Py<PyAny>>,
        draft_token_ids: Option<Py<PyAny>>,
        draft_indptr: Option<Py<PyAny>>,
        prompt_logprobs: Option<Py<PyAny>>,
        prompt_top_logprob_ids: Option<Py<PyAny>>,
        prompt_top_logprobs: Option<Py<PyAny>>,
    ) -> Self {
        ForwardOutput {
            token_ids,
            token_indptr,
            logprobs,
            top_logprob_ids,
            top_logprobs,
            draft_token_ids,
            draft_indptr,
            prompt_logprobs,
            prompt_top_logprob_ids,
            prompt_top_logprobs,
        }
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("ForwardOutput(token_ids={}, token_indptr={})", self.token_ids.bind(py), self.token_indptr.bind(py))
    }
}

/// What `obj` is, for error messages.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    match obj.cast::<PyUntypedArray>() {
        Ok(a) => format!("a numpy array of dtype {} and shape {:?}", a.dtype(), a.shape()),
        Err(_) => format!("an object of type {}", obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()),
    }
}

/// The elements and shape of `obj`, a numpy array of element `T` and dimension `D`, copied
/// out while the GIL is held; or a ValueError naming `ForwardOutput.{field}` and saying what
/// was given instead. Copying (a few KB per step) is what lets the engine validate and
/// commit with the GIL released: another Python thread may write to the runner's arrays
/// meanwhile, and the engine must commit exactly what it validated.
fn copied_array<T: Element + Copy, D: Dimension>(
    obj: &Bound<'_, PyAny>,
    field: &str,
    dtype: &str,
) -> PyResult<(Vec<T>, Vec<usize>)> {
    let ndim = D::NDIM.unwrap_or(0);
    let array = obj.cast::<PyArray<T, D>>().map_err(|_| {
        PyValueError::new_err(format!(
            "ForwardOutput.{field} must be a {ndim}-D numpy array of dtype {dtype}, got {}",
            describe(obj)
        ))
    })?;
    let ro = array.try_readonly().map_err(|e| PyValueError::new_err(format!("ForwardOutput.{field}: {e}")))?;
    let data = ro
        .as_slice()
        .map_err(|_| {
            PyValueError::new_err(format!("ForwardOutput.{field} must be C-contiguous and aligned (use np.ascontiguousarray)"))
        })?
        .to_vec();
    Ok((data, ro.shape().to_vec()))
}

/// An optional 1-D array field, copied (None when not given).
fn copied_vector<T: Element + Copy>(
    obj: &Option<Py<PyAny>>,
    py: Python<'_>,
    field: &str,
    dtype: &str,
) -> PyResult<Option<Vec<T>>> {
    Ok(obj.as_ref().map(|a| copied_array::<T, Ix1>(a.bind(py), field, dtype)).transpose()?.map(|a| a.0))
}

/// A pair of [N, k] top arrays (ids, logprobs), copied: (ids, logprobs, k). Both must have
/// one shape; whether both are given is the core's check (`ForwardOutputRef::validate`).
type TopPair = (Option<Vec<u32>>, Option<Vec<f32>>, usize);

fn copied_top_pair(py: Python<'_>, ids: &Option<Py<PyAny>>, lps: &Option<Py<PyAny>>, fields: [&str; 2]) -> PyResult<TopPair> {
    let ids = ids.as_ref().map(|a| copied_array::<u32, Ix2>(a.bind(py), fields[0], "uint32")).transpose()?;
    let lps = lps.as_ref().map(|a| copied_array::<f32, Ix2>(a.bind(py), fields[1], "float32")).transpose()?;
    if let (Some((_, ids_shape)), Some((_, lps_shape))) = (&ids, &lps) {
        if ids_shape != lps_shape {
            return Err(PyValueError::new_err(format!(
                "ForwardOutput.{} has shape {ids_shape:?} but {} has shape {lps_shape:?}",
                fields[0], fields[1]
            )));
        }
    }
    let k = match (&ids, &lps) {
        (Some((_, shape)), _) | (None, Some((_, shape))) => shape[1],
        (None, None) => 0,
    };
    Ok((ids.map(|a| a.0), lps.map(|a| a.0), k))
}

/// A `ForwardOutput`'s arrays, checked for dtype and layout and copied out of numpy.
pub struct CopiedOutput {
    token_ids: Vec<u32>,
    token_indptr: Vec<u32>,
    logprobs: Option<Vec<f32>>,
    /// The [N, k] top arrays and k (0 without them).
    top: TopPair,
    draft_token_ids: Option<Vec<u32>>,
    draft_indptr: Option<Vec<u32>>,
    prompt_logprobs: Option<Vec<f32>>,
    /// The [M, k] prompt top arrays and k.
    prompt_top: TopPair,
}

impl CopiedOutput {
    pub fn new(out: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = out.py();
        let out = out.cast::<ForwardOutput>().map_err(|_| {
            PyValueError::new_err(format!("runner.forward must return a resin.ForwardOutput, got {}", describe(out)))
        })?;
        let o = out.get();
        Ok(CopiedOutput {
            token_ids: copied_array::<u32, Ix1>(o.token_ids.bind(py), "token_ids", "uint32")?.0,
            token_indptr: copied_array::<u32, Ix1>(o.token_indptr.bind(py), "token_indptr", "uint32")?.0,
            logprobs: copied_vector(&o.logprobs, py, "logprobs", "float32")?,
            top: copied_top_pair(py, &o.top_logprob_ids, &o.top_logprobs, ["top_logprob_ids", "top_logprobs"])?,
            draft_token_ids: copied_vector(&o.draft_token_ids, py, "draft_token_ids", "uint32")?,
            draft_indptr: copied_vector(&o.draft_indptr, py, "draft_indptr", "uint32")?,
            prompt_logprobs: copied_vector(&o.prompt_logprobs, py, "prompt_logprobs", "float32")?,
            prompt_top: copied_top_pair(
                py,
                &o.prompt_top_logprob_ids,
                &o.prompt_top_logprobs,
                ["prompt_top_logprob_ids", "prompt_top_logprobs"],
            )?,
        })
    }

    /// The core's view of the copies.
    pub fn as_ref(&self) -> core::ForwardOutputRef<'_> {
        core::ForwardOutputRef {
            token_ids: &self.token_ids,
            token_indptr: &self.token_indptr,
            logprobs: self.logprobs.as_deref(),
            top_logprob_ids: self.top.0.as_deref(),
            top_logprobs: self.top.1.as_deref(),
            num_top_logprobs: self.top.2,
            draft_token_ids: self.draft_token_ids.as_deref(),
            draft_indptr: self.draft_indptr.as_deref(),
            prompt_logprobs: self.prompt_logprobs.as_deref(),
            prompt_top_logprob_ids: self.prompt_top.0.as_deref(),
            prompt_top_logprobs: self.prompt_top.1.as_deref(),
            num_prompt_top_logprobs: self.prompt_top.2,
        }
    }
}

/// A request's state after a step. Lists are built on access from the shared token log.
#[pyclass(module = "resin._core", frozen)]
pub struct RequestOutput {
    pub out: core::RequestOutput,
}

#[pymethods]
impl RequestOutput {
    #[getter]
    fn request_id(&self) -> &str {
        self.out.request_id()
    }
    #[getter]
    fn prompt_token_ids(&self) -> Vec<u32> {
        self.out.record.prompt_token_ids.clone()
    }
    #[getter]
    fn token_ids(&self) -> Vec<u32> {
        self.out.token_ids()
    }
    #[getter]
    fn new_token_ids(&self) -> Vec<u32> {
        self.out.new_token_ids()
    }
    #[getter]
    fn finished(&self) -> bool {
        self.out.finished
    }
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.out.finish_reason.map(|r| r.as_str())
    }
    #[getter]
    fn num_output_tokens(&self) -> usize {
        self.out.num_output_tokens
    }
    #[getter]
    fn num_cached_tokens(&self) -> u32 {
        self.out.num_cached_tokens
    }
    #[getter]
    fn logprobs<'py>(&self, py: Python<'py>) -> PyResult<Option<Vec<Bound<'py, PyDict>>>> {
        logprob_dicts(py, self.out.logprobs())
    }

    fn logprobs_from<'py>(&self, py: Python<'py>, start: usize) -> PyResult<Option<Vec<Bound<'py, PyDict>>>> {
        logprob_dicts(py, self.out.logprobs_from(start))
    }

    /// None unless asked for; else one entry per prompt token: None for the first (nothing
    /// predicts it), then {token id: logprob} with the prompt token and the top k (vLLM's
    /// `prompt_logprobs`).
    #[getter]
    fn prompt_logprobs<'py>(&self, py: Python<'py>) -> PyResult<Option<Vec<Option<Bound<'py, PyDict>>>>> {
        let Some(dicts) = logprob_dicts(py, self.out.prompt_logprobs())? else { return Ok(None) };
        Ok(Some(std::iter::once(None).chain(dicts.into_iter().map(Some)).collect()))
    }

    fn __repr__(&self) -> String {
        format!(
            "RequestOutput(request_id={:?}, num_output_tokens={}, finished={}, finish_reason={:?}, num_cached_tokens={})",
            self.out.request_id(),
            self.out.num_output_tokens,
            self.out.finished,
            self.out.finish_reason.map(|r| r.as_str()),
            self.out.num_cached_tokens
        )
    }
}

fn logprob_dicts(py: Python<'_>, per_token: Option<Vec<Vec<(u32, f32)>>>) -> PyResult<Option<Vec<Bound<'_, PyDict>>>> {
    let Some(per_token) = per_token else { return Ok(None) };
    per_token
        .into_iter()
        .map(|pairs| {
            let d = PyDict::new(py);
            for (id, lp) in pairs {
                d.set_item(id, lp)?;
            }
            Ok(d)
        })
        .collect::<PyResult<Vec<_>>>()
        .map(Some)
}
