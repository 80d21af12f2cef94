//! `Engine`: the core engine behind a mutex, plus the runner it drives.
//!
//! Locking rule: the mutex is only taken with the GIL released (`py.detach`) and never
//! held while Python runs, so a thread stepping the engine and a thread aborting
//! requests cannot deadlock. `runner.forward` runs with the lock free.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};
use resin_core::{engine as core, KvCacheSpec};

use crate::cache::{CacheLayout, LayerCacheSpec};
use crate::errors::{step_error, to_py};
use crate::output::{CopiedOutput, RequestOutput};
use crate::params::{EngineConfig, SamplingParams};
use crate::plan::BatchPlan;

#[pyclass(module = "resin._core", frozen)]
pub struct Engine {
    core: Mutex<core::Engine>,
    #[pyo3(get)]
    config: Py<EngineConfig>,
    #[pyo3(get)]
    layout: Py<CacheLayout>,
    #[pyo3(get)]
    runner: Py<PyAny>,
    /// Times `step()` called `runner.forward` (empty plans do not call it).
    num_forward_calls: AtomicU64,
}

impl Engine {
    fn lock(&self) -> MutexGuard<'_, core::Engine> {
        // A panic inside the core is a bug; keep serving the state it left rather than
        // poisoning every later call.
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn with_core<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut core::Engine) -> T + Send) -> T {
        py.detach(|| f(&mut self.lock()))
    }

    /// One Python object per output. They hold no Python references, so they can never be
    /// part of a reference cycle: untracking them keeps the cyclic GC from scanning (and
    /// promoting) the thousand objects a large step makes, as CPython does for tuples of atoms.
    fn wrap_outputs(py: Python<'_>, outputs: Vec<resin_core::RequestOutput>) -> PyResult<Vec<Py<RequestOutput>>> {
        outputs
            .into_iter()
            .map(|out| {
                let obj = Py::new(py, RequestOutput { out })?;
                // SAFETY: a live object we own; untracking is always allowed (dealloc untracks again, a no-op).
                unsafe { pyo3::ffi::PyObject_GC_UnTrack(obj.as_ptr().cast()) };
                Ok(obj)
            })
            .collect()
    }

    /// Checks `output` for `plan` and commits it. Leaves the plan pending on error.
    fn update_inner(&self, py: Python<'_>, step: u64, output: &Bound<'_, PyAny>) -> PyResult<Vec<Py<RequestOutput>>> {
        let copied = CopiedOutput::new(output)?;
        let view = copied.as_ref();
        let outputs = self.with_core(py, |e| e.update(step, &view)).map_err(to_py)?;
        Self::wrap_outputs(py, outputs)
    }
}

/// The layer specs a runner declares, or none (one full-attention group) without `cache_spec`.
fn runner_layer_specs(runner: &Bound<'_, PyAny>) -> PyResult<Vec<KvCacheSpec>> {
    if !runner.hasattr(intern!(runner.py(), "cache_spec"))? {
        return Ok(Vec::new());
    }
    let specs = runner.call_method0(intern!(runner.py(), "cache_spec"))?;
    let mut out = Vec::new();
    for (i, item) in specs.try_iter()?.enumerate() {
        let item = item?;
        let spec = item.cast::<LayerCacheSpec>().map_err(|_| {
            PyValueError::new_err(format!(
                "runner.cache_spec()[{i}] must be a resin.LayerCacheSpec, got {}",
                item.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?;
        out.push(spec.get().spec);
    }
    Ok(out)
}

#[pymethods]
impl Engine {
    #[new]
    fn new(py: Python<'_>, config: Bound<'_, EngineConfig>, runner: Bound<'_, PyAny>) -> PyResult<Self> {
        if !runner.hasattr(intern!(py, "forward"))? {
            return Err(PyValueError::new_err("runner must have a forward(plan) -> ForwardOutput method"));
        }
        let core_config = config.borrow().to_core()?;
        let specs = runner_layer_specs(&runner)?;
        let engine = core::Engine::new(core_config, &specs).map_err(to_py)?;
        let layout = Py::new(py, CacheLayout { layout: engine.layout().clone() })?;
        if runner.hasattr(intern!(py, "bind_cache"))? {
            runner.call_method1(intern!(py, "bind_cache"), (layout.clone_ref(py),))?;
        }
        Ok(Engine {
            core: Mutex::new(engine),
            config: config.unbind(),
            layout,
            runner: runner.unbind(),
            num_forward_calls: AtomicU64::new(0),
        })
    }

    #[pyo3(signature = (request_id, prompt_token_ids, params=None))]
    fn add_request(
        &self,
        py: Python<'_>,
        request_id: &str,
        prompt_token_ids: Vec<i64>,
        params: Option<SamplingParams>,
    ) -> PyResult<()> {
        let prompt = prompt_token_ids
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                u32::try_from(t).map_err(|_| {
                    PyValueError::new_err(format!("request {request_id:?}: prompt_token_ids[{i}] = {t} is not a valid token id"))
                })
            })
            .collect::<PyResult<Vec<u32>>>()?;
        let params = match params {
            Some(p) => p.to_core()?,
            None => resin_core::SamplingParams::default(),
        };
        self.with_core(py, |e| e.add_request(request_id, prompt, params)).map_err(to_py)
    }

    fn abort(&self, py: Python<'_>, request_id: &str) -> bool {
        self.with_core(py, |e| e.abort(request_id))
    }

    fn schedule(&self, py: Python<'_>) -> PyResult<Py<BatchPlan>> {
        let (plan, recycler) = self.with_core(py, |e| e.schedule().map(|p| (p, e.recycler()))).map_err(to_py)?;
        Py::new(py, BatchPlan::new(plan, recycler))
    }

    fn update(&self, py: Python<'_>, plan: &Bound<'_, BatchPlan>, output: &Bound<'_, PyAny>) -> PyResult<Vec<Py<RequestOutput>>> {
        self.update_inner(py, plan.get().plan.step, output)
    }

    fn discard_plan(&self, py: Python<'_>) {
        self.with_core(py, |e| e.discard_plan())
    }

    fn step(&self, py: Python<'_>) -> PyResult<Vec<Py<RequestOutput>>> {
        let (plan, recycler) = self.with_core(py, |e| e.schedule().map(|p| (p, e.recycler()))).map_err(to_py)?;
        let step = plan.step;
        if plan.num_sequences == 0 {
            // Nothing to run: commit the empty step without calling the runner.
            let outputs = self
                .with_core(py, |e| e.update(step, &resin_core::ForwardOutputRef { token_indptr: &[0], ..Default::default() }))
                .map_err(to_py)?;
            recycler.put(plan);
            return Self::wrap_outputs(py, outputs);
        }
        let plan = Bound::new(py, BatchPlan::new(plan, recycler))?;
        self.num_forward_calls.fetch_add(1, Ordering::Relaxed);
        let result = match self.runner.bind(py).call_method1(intern!(py, "forward"), (plan.clone(),)) {
            Ok(out) => self.update_inner(py, step, &out).map_err(|e| (e, false)),
            Err(e) => Err((e, true)),
        };
        result.map_err(|(cause, in_forward)| {
            // Forward raised or returned a bad output: nothing was committed, so dropping
            // the plan leaves the engine as it was and the next step plans the work again.
            // Only this step's plan: another thread may have replaced it meanwhile.
            self.with_core(py, |e| {
                if e.pending_step() == Some(step) {
                    e.discard_plan();
                }
            });
            step_error(py, plan.get().plan.request_ids().collect(), cause, in_forward)
        })
    }

    /// How many times `step()` has called `runner.forward` (a plan with no rows is
    /// committed without it), so a caller can tell an idle step from one that ran.
    #[getter]
    fn num_forward_calls(&self) -> u64 {
        self.num_forward_calls.load(Ordering::Relaxed)
    }

    /// The engine holds the runner, and runners often hold their engine: let the cycle
    /// collector see the references so such a pair is freed.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.runner)?;
        visit.call(&self.config)?;
        visit.call(&self.layout)
    }

    fn has_unfinished(&self, py: Python<'_>) -> bool {
        self.with_core(py, |e| e.has_unfinished())
    }

    #[getter]
    fn num_waiting(&self, py: Python<'_>) -> usize {
        self.with_core(py, |e| e.num_waiting())
    }

    #[getter]
    fn num_running(&self, py: Python<'_>) -> usize {
        self.with_core(py, |e| e.num_running())
    }

    #[getter]
    fn num_free_pages(&self, py: Python<'_>) -> u32 {
        self.with_core(py, |e| e.num_free_pages())
    }

    fn reset_prefix_cache(&self, py: Python<'_>) {
        self.with_core(py, |e| e.reset_prefix_cache())
    }

    fn metrics_text(&self, py: Python<'_>) -> String {
        self.with_core(py, |e| e.metrics_text())
    }

    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        self.with_core(py, |e| e.check_integrity()).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (w, r, f) = self.with_core(py, |e| (e.num_waiting(), e.num_running(), e.num_free_pages()));
        format!("Engine(num_waiting={w}, num_running={r}, num_free_pages={f})")
    }
}
