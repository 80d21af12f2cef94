//! `Engine`: the core engine behind a mutex, plus the runner it drives.
//!
//! Locking rule: the mutex is only taken with the GIL released (`py.detach`) and never
//! held while Python runs, so a thread stepping the engine and a thread aborting
//! requests cannot deadlock. `runner.forward` runs with the lock free.
//!
//! With `EngineConfig.async_scheduling` and a runner that splits its forward in two
//! (`begin_forward(plan)`: start the model's work, no host synchronisation;
//! `finish_forward() -> ForwardOutput`: sample), `step()` overlaps: it finishes the plan the
//! last call started, commits it, then plans and begins the next one before returning, so
//! the device runs step n + 1 while the caller turns step n's outputs into text and streams.
//! The engine's contract is unchanged (one plan pending; n + 1 is planned after n is
//! committed); what moves is the runner's host synchronisation, from before the caller's
//! output processing to after it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
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
    /// Plans `step()` handed to the runner (`forward` or `begin_forward`; empty plans are
    /// committed without it).
    num_forward_calls: AtomicU64,
    /// `step()` overlaps (module doc): `async_scheduling` on and the runner splits its forward.
    overlap: bool,
    /// Overlapped: the plan the last `step()` began and the next one finishes.
    in_flight: Mutex<Option<Py<BatchPlan>>>,
    /// Overlapped: beginning the next plan failed after this step's outputs were committed;
    /// the next `step()` raises it (those outputs were returned first).
    deferred_error: Mutex<Option<PyErr>>,
}

/// What planning the next step gave: an empty plan, committed at once (its outputs), or a
/// plan the runner has begun.
enum Next {
    Committed(Vec<Py<RequestOutput>>),
    Begun(Py<BatchPlan>),
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

    /// Schedules a plan; an empty one is committed without the runner (`Err`: its outputs).
    fn schedule_rows<'py>(&self, py: Python<'py>) -> PyResult<Result<Bound<'py, BatchPlan>, Vec<Py<RequestOutput>>>> {
        let (plan, recycler) = self.with_core(py, |e| e.schedule().map(|p| (p, e.recycler()))).map_err(to_py)?;
        if plan.num_sequences == 0 {
            let step = plan.step;
            let outputs = self
                .with_core(py, |e| e.update(step, &resin_core::ForwardOutputRef { token_indptr: &[0], ..Default::default() }))
                .map_err(to_py)?;
            recycler.put(plan);
            return Ok(Err(Self::wrap_outputs(py, outputs)?));
        }
        self.num_forward_calls.fetch_add(1, Ordering::Relaxed);
        Ok(Ok(Bound::new(py, BatchPlan::new(plan, recycler))?))
    }

    /// The `StepError` for `plan`, which failed with `cause`, after discarding it. Only this
    /// plan: another thread may have replaced it meanwhile.
    fn fail(&self, py: Python<'_>, plan: &Bound<'_, BatchPlan>, cause: PyErr, in_forward: bool) -> PyErr {
        let step = plan.get().plan.step;
        self.with_core(py, |e| {
            if e.pending_step() == Some(step) {
                e.discard_plan();
            }
        });
        step_error(py, plan.get().plan.request_ids().collect(), cause, in_forward)
    }

    /// Commits `runner.forward`'s (or `finish_forward`'s) result for `plan`; on error the plan
    /// is discarded (nothing was committed, so the next step plans the work again).
    fn commit(
        &self,
        py: Python<'_>,
        plan: &Bound<'_, BatchPlan>,
        result: PyResult<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Py<RequestOutput>>> {
        let result = match result {
            Ok(out) => self.update_inner(py, plan.get().plan.step, &out).map_err(|e| (e, false)),
            Err(e) => Err((e, true)),
        };
        result.map_err(|(cause, in_forward)| self.fail(py, plan, cause, in_forward))
    }

    /// Overlapped: plans the next step and has the runner begin it.
    fn begin_next(&self, py: Python<'_>) -> PyResult<Next> {
        let plan = match self.schedule_rows(py)? {
            Ok(plan) => plan,
            Err(outputs) => return Ok(Next::Committed(outputs)),
        };
        match self.runner.bind(py).call_method1(intern!(py, "begin_forward"), (plan.clone(),)) {
            Ok(_) => Ok(Next::Begun(plan.unbind())),
            Err(cause) => Err(self.fail(py, &plan, cause, true)),
        }
    }

    /// `step()` overlapped (module doc).
    fn step_overlapped(&self, py: Python<'_>) -> PyResult<Vec<Py<RequestOutput>>> {
        if let Some(err) = self.deferred_error.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Err(err);
        }
        let in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner()).take();
        let plan = match in_flight {
            Some(plan) => plan.into_bound(py),
            None => match self.begin_next(py)? {
                Next::Committed(outputs) => return Ok(outputs),
                Next::Begun(plan) => plan.into_bound(py),
            },
        };
        let result = self.runner.bind(py).call_method0(intern!(py, "finish_forward"));
        let mut outputs = self.commit(py, &plan, result)?;
        if self.with_core(py, |e| e.has_unfinished()) {
            match self.begin_next(py) {
                Ok(Next::Committed(more)) => outputs.extend(more),
                Ok(Next::Begun(next)) => *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()) = Some(next),
                // KeyboardInterrupt and the like at once; a failed plan after these outputs.
                Err(err) if !err.is_instance_of::<PyException>(py) => return Err(err),
                Err(err) => *self.deferred_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(err),
            }
        }
        Ok(outputs)
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
        let overlap = config.borrow().async_scheduling
            && runner.hasattr(intern!(py, "begin_forward"))?
            && runner.hasattr(intern!(py, "finish_forward"))?;
        Ok(Engine {
            core: Mutex::new(engine),
            config: config.unbind(),
            layout,
            runner: runner.unbind(),
            num_forward_calls: AtomicU64::new(0),
            overlap,
            in_flight: Mutex::new(None),
            deferred_error: Mutex::new(None),
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

    #[pyo3(signature = (request_id, finish_reason="abort"))]
    fn abort(&self, py: Python<'_>, request_id: &str, finish_reason: &str) -> PyResult<bool> {
        let reason = match finish_reason {
            "abort" => resin_core::FinishReason::Abort,
            "stop" => resin_core::FinishReason::Stop,
            other => {
                return Err(PyValueError::new_err(format!("abort: finish_reason must be \"abort\" or \"stop\", got {other:?}")))
            }
        };
        Ok(self.with_core(py, |e| e.finish_early(request_id, reason)))
    }

    fn schedule(&self, py: Python<'_>) -> PyResult<Py<BatchPlan>> {
        let (plan, recycler) = self.with_core(py, |e| e.schedule().map(|p| (p, e.recycler()))).map_err(to_py)?;
        Py::new(py, BatchPlan::new(plan, recycler))
    }

    fn update(&self, py: Python<'_>, plan: &Bound<'_, BatchPlan>, output: &Bound<'_, PyAny>) -> PyResult<Vec<Py<RequestOutput>>> {
        self.update_inner(py, plan.get().plan.step, output)
    }

    fn discard_plan(&self, py: Python<'_>) {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.with_core(py, |e| e.discard_plan())
    }

    fn step(&self, py: Python<'_>) -> PyResult<Vec<Py<RequestOutput>>> {
        if self.overlap {
            return self.step_overlapped(py);
        }
        let plan = match self.schedule_rows(py)? {
            Ok(plan) => plan,
            Err(outputs) => return Ok(outputs),
        };
        let result = self.runner.bind(py).call_method1(intern!(py, "forward"), (plan.clone(),));
        self.commit(py, &plan, result)
    }

    /// Whether `step()` overlaps (module doc): `EngineConfig.async_scheduling` and a runner
    /// with `begin_forward` / `finish_forward`.
    #[getter]
    fn async_scheduling(&self) -> bool {
        self.overlap
    }

    /// How many plans `step()` has handed to the runner (`forward`, or `begin_forward` when
    /// overlapped; a plan with no rows is committed without it), so a caller can tell an idle
    /// step from one that ran.
    #[getter]
    fn num_forward_calls(&self) -> u64 {
        self.num_forward_calls.load(Ordering::Relaxed)
    }

    /// The engine holds the runner, and runners often hold their engine: let the cycle
    /// collector see the references so such a pair is freed.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.runner)?;
        if let Ok(in_flight) = self.in_flight.try_lock() {
            if let Some(plan) = in_flight.as_ref() {
                visit.call(plan)?;
            }
        }
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
