//! `BatchPlan` and `SamplingArrays`: read-only numpy views on the plan Rust built.
//!
//! Each array is created on first access as a view whose base object is a
//! `PlanMemory` (an `Arc` of the Rust plan), so no array is copied and a runner pays
//! only for the fields it reads. The plan's vectors are never touched after
//! construction, which keeps the views valid. The views' base is not the `BatchPlan`
//! itself: the plan caches its views, and a view pointing back at the plan would make
//! a reference cycle the garbage collector cannot see (numpy arrays are not GC-tracked).

use std::sync::Arc;

use std::ffi::c_void;
use std::ptr;

use numpy::ndarray::Array2;
use numpy::npyffi::{get_type_object, npy_intp, NpyTypes, PyArrayObject, PY_ARRAY_API};
use numpy::{Element, IntoPyArray, PyArrayDescrMethods, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;
use resin_core::plan as core;

/// A read-only numpy view of `data`, kept alive by `owner`.
///
/// Built with numpy's C API directly so the array is born read-only: going through
/// rust-numpy's `readwrite().make_nonwriteable()` would register and release a dynamic
/// borrow for every view, a measurable cost per plan field per step.
fn view<'py, T: Element>(owner: Bound<'py, PyAny>, data: &[T]) -> Bound<'py, PyAny> {
    view_nd(owner, data, &mut [data.len() as npy_intp])
}

/// `view` with shape `dims` (C order; their product must be `data.len()`).
fn view_nd<'py, T: Element>(owner: Bound<'py, PyAny>, data: &[T], dims: &mut [npy_intp]) -> Bound<'py, PyAny> {
    let py = owner.py();
    debug_assert_eq!(dims.iter().product::<npy_intp>(), data.len() as npy_intp);
    // SAFETY: `data` lives in a plan owned by `owner` and is never reallocated or mutated;
    // `owner` becomes the array's base object (the reference is stolen), so the memory
    // outlives the array. Flags 0: not writeable; numpy derives contiguity and alignment.
    unsafe {
        let ptr = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            get_type_object(py, NpyTypes::PyArray_Type),
            T::get_dtype(py).into_dtype_ptr(),
            dims.len() as i32,
            dims.as_mut_ptr(),
            ptr::null_mut(),
            data.as_ptr() as *mut c_void,
            0,
            ptr::null_mut(),
        );
        let array = Bound::from_owned_ptr(py, ptr);
        PY_ARRAY_API.PyArray_SetBaseObject(py, ptr as *mut PyArrayObject, owner.into_ptr());
        array
    }
}

fn cached<'py>(cell: &PyOnceLock<Py<PyAny>>, py: Python<'py>, make: impl FnOnce() -> Bound<'py, PyAny>) -> Bound<'py, PyAny> {
    cell.get_or_init(py, || make().unbind()).bind(py).clone()
}

type Cell = PyOnceLock<Py<PyAny>>;

/// Declares a struct of lazily filled view cells, one per named array.
macro_rules! views_struct {
    ($name:ident { $($field:ident),* $(,)? }) => {
        struct $name {
            $($field: Cell,)*
        }
        impl Default for $name {
            fn default() -> Self {
                $name { $($field: PyOnceLock::new(),)* }
            }
        }
    };
}

/// The cached view of one plan array.
fn array_view<'py, T: Element>(
    slf: &Bound<'py, BatchPlan>,
    cell: fn(&Views) -> &Cell,
    data: fn(&core::BatchPlan) -> &Vec<T>,
) -> Bound<'py, PyAny> {
    let this = slf.get();
    cached(cell(&this.views), slf.py(), || view(this.memory(slf.py()), data(&this.plan)))
}

/// The cached tuple of per-group views of one group array.
fn group_views<'py, T: Element>(
    slf: &Bound<'py, BatchPlan>,
    cell: fn(&Views) -> &Cell,
    data: fn(&core::GroupPlan) -> &Vec<T>,
) -> Bound<'py, PyAny> {
    let this = slf.get();
    cached(cell(&this.views), slf.py(), || {
        let arrays = this.plan.groups.iter().map(|g| view(this.memory(slf.py()), data(g)));
        PyTuple::new(slf.py(), arrays).expect("tuple of arrays").into_any()
    })
}

/// The cached view of one sampling array.
fn sampling_view<'py, T: Element>(
    slf: &Bound<'py, SamplingArrays>,
    cell: fn(&SamplingViews) -> &Cell,
    data: fn(&core::SamplingArrays) -> &Vec<T>,
) -> Bound<'py, PyAny> {
    let this = slf.get();
    let plan = this.plan.bind(slf.py());
    cached(cell(&this.views), slf.py(), || view(plan.get().memory(slf.py()), data(&plan.get().plan.sampling)))
}

// Lazily created numpy views, one per array field.
views_struct!(Views {
    request_slots,
    input_ids,
    positions,
    prompt_logprob_targets,
    query_indptr,
    num_computed_tokens,
    seq_lens,
    sample_indptr,
    num_draft_tokens,
    num_output_tokens,
    committed_token_indptr,
    committed_token_ids,
    banned_token_indptr,
    banned_token_ids,
    logit_bias_indptr,
    logit_bias_token_ids,
    logit_bias_values,
    new_request_slots,
    new_request_token_indptr,
    new_request_token_ids,
    new_request_num_prompt_tokens,
    finished_request_slots,
    copy_pages,
    zero_pages,
    state_slots,
    has_initial_state,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    slot_mapping,
    block_table,
    request_ids
});

/// A plan that goes back to its engine's recycler when the last reference (the Python
/// `BatchPlan` or a view's `PlanMemory`) is dropped, so its arrays are reused.
pub struct OwnedPlan {
    plan: core::BatchPlan,
    recycler: core::PlanRecycler,
}

impl Drop for OwnedPlan {
    fn drop(&mut self) {
        self.recycler.put(std::mem::take(&mut self.plan));
    }
}

impl std::ops::Deref for OwnedPlan {
    type Target = core::BatchPlan;
    fn deref(&self) -> &core::BatchPlan {
        &self.plan
    }
}

/// Keeps a plan's arrays alive for numpy: the base object of every view.
#[pyclass(module = "resin._core", frozen)]
pub struct PlanMemory {
    _plan: Arc<OwnedPlan>,
}

#[pyclass(module = "resin._core", frozen)]
pub struct BatchPlan {
    pub plan: Arc<OwnedPlan>,
    memory: PyOnceLock<Py<PlanMemory>>,
    views: Views,
}

impl BatchPlan {
    pub fn new(plan: core::BatchPlan, recycler: core::PlanRecycler) -> Self {
        BatchPlan { plan: Arc::new(OwnedPlan { plan, recycler }), memory: PyOnceLock::new(), views: Views::default() }
    }

    /// The owner object views borrow from (created on first use).
    fn memory<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        self.memory
            .get_or_init(py, || Py::new(py, PlanMemory { _plan: self.plan.clone() }).expect("PlanMemory"))
            .bind(py)
            .clone()
            .into_any()
    }
}

#[pymethods]
impl BatchPlan {
    #[getter]
    fn step(&self) -> u64 {
        self.plan.step
    }
    #[getter]
    fn num_sequences(&self) -> u32 {
        self.plan.num_sequences
    }
    #[getter]
    fn num_decode_sequences(&self) -> u32 {
        self.plan.num_decode_sequences
    }
    #[getter]
    fn num_tokens(&self) -> u32 {
        self.plan.num_tokens
    }
    #[getter]
    fn padded_num_sequences(&self) -> u32 {
        self.plan.padded_num_sequences
    }
    #[getter]
    fn page_size(&self) -> u32 {
        self.plan.page_size
    }
    #[getter]
    fn num_cache_groups(&self) -> usize {
        self.plan.groups.len()
    }
    #[getter]
    fn request_ids<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        let this = slf.get();
        cached(&this.views.request_ids, slf.py(), || {
            let ids: Vec<&str> = this.plan.request_ids().collect();
            ids.into_pyobject(slf.py()).expect("list of str").into_any()
        })
    }
    #[getter]
    fn request_slots<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.request_slots, |p| &p.request_slots)
    }
    #[getter]
    fn input_ids<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.input_ids, |p| &p.input_ids)
    }
    #[getter]
    fn positions<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.positions, |p| &p.positions)
    }
    #[getter]
    fn prompt_logprob_targets<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.prompt_logprob_targets, |p| &p.prompt_logprob_targets)
    }
    #[getter]
    fn query_indptr<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.query_indptr, |p| &p.query_indptr)
    }
    #[getter]
    fn num_computed_tokens<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.num_computed_tokens, |p| &p.num_computed_tokens)
    }
    #[getter]
    fn seq_lens<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.seq_lens, |p| &p.seq_lens)
    }
    #[getter]
    fn sample_indptr<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.sample_indptr, |p| &p.sample_indptr)
    }
    #[getter]
    fn num_draft_tokens<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.num_draft_tokens, |p| &p.num_draft_tokens)
    }
    #[getter]
    fn num_output_tokens<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.num_output_tokens, |p| &p.num_output_tokens)
    }
    #[getter]
    fn committed_token_indptr<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.committed_token_indptr, |p| &p.committed_token_indptr)
    }
    #[getter]
    fn committed_token_ids<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.committed_token_ids, |p| &p.committed_token_ids)
    }
    #[getter]
    fn banned_token_indptr<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.banned_token_indptr, |p| &p.banned_token_indptr)
    }
    #[getter]
    fn banned_token_ids<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.banned_token_ids, |p| &p.banned_token_ids)
    }
    #[getter]
    fn logit_bias_indptr<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.logit_bias_indptr, |p| &p.logit_bias_indptr)
    }
    #[getter]
    fn logit_bias_token_ids<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.logit_bias_token_ids, |p| &p.logit_bias_token_ids)
    }
    #[getter]
    fn logit_bias_values<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.logit_bias_values, |p| &p.logit_bias_values)
    }
    #[getter]
    fn new_request_slots<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.new_request_slots, |p| &p.new_request_slots)
    }
    #[getter]
    fn new_request_token_indptr<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.new_request_token_indptr, |p| &p.new_request_token_indptr)
    }
    #[getter]
    fn new_request_token_ids<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.new_request_token_ids, |p| &p.new_request_token_ids)
    }
    #[getter]
    fn new_request_num_prompt_tokens<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.new_request_num_prompt_tokens, |p| &p.new_request_num_prompt_tokens)
    }
    #[getter]
    fn finished_request_slots<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.finished_request_slots, |p| &p.finished_request_slots)
    }
    #[getter]
    fn copy_pages<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        let this = slf.get();
        cached(&this.views.copy_pages, slf.py(), || {
            let data = &this.plan.copy_pages;
            view_nd(this.memory(slf.py()), data, &mut [(data.len() / 2) as npy_intp, 2])
        })
    }
    #[getter]
    fn zero_pages<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        array_view(slf, |v| &v.zero_pages, |p| &p.zero_pages)
    }
    #[getter]
    fn state_slots<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        group_views(slf, |v| &v.state_slots, |g| &g.state_slots)
    }
    #[getter]
    fn has_initial_state<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        group_views(slf, |v| &v.has_initial_state, |g| &g.has_initial_state)
    }
    #[getter]
    fn kv_indptr<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        group_views(slf, |v| &v.kv_indptr, |g| &g.kv_indptr)
    }
    #[getter]
    fn kv_indices<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        group_views(slf, |v| &v.kv_indices, |g| &g.kv_indices)
    }
    #[getter]
    fn kv_last_page_len<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        group_views(slf, |v| &v.kv_last_page_len, |g| &g.kv_last_page_len)
    }
    #[getter]
    fn slot_mapping<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        group_views(slf, |v| &v.slot_mapping, |g| &g.slot_mapping)
    }

    #[getter]
    fn block_table<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        let this = slf.get();
        let py = slf.py();
        cached(&this.views.block_table, py, || {
            let tables = (0..this.plan.groups.len()).map(|g| {
                let (table, cols) = this.plan.block_table(g);
                let array = Array2::from_shape_vec((this.plan.num_sequences as usize, cols), table)
                    .expect("block table shape")
                    .into_pyarray(py);
                array.readwrite().make_nonwriteable();
                array
            });
            PyTuple::new(py, tables).expect("tuple of arrays").into_any()
        })
    }

    /// A new `SamplingArrays` each call: caching it here would make a reference cycle
    /// (plan -> arrays -> plan) that Python's GC cannot see through.
    #[getter]
    fn sampling(slf: &Bound<'_, Self>) -> SamplingArrays {
        SamplingArrays { plan: slf.clone().unbind(), views: Default::default() }
    }

    fn __len__(&self) -> usize {
        self.plan.num_sequences as usize
    }

    fn __repr__(&self) -> String {
        format!(
            "BatchPlan(step={}, num_sequences={}, num_decode_sequences={}, num_tokens={}, num_cache_groups={})",
            self.plan.step,
            self.plan.num_sequences,
            self.plan.num_decode_sequences,
            self.plan.num_tokens,
            self.plan.groups.len()
        )
    }
}

views_struct!(SamplingViews {
    temperature,
    top_p,
    top_k,
    min_p,
    seed,
    num_logprobs,
    num_prompt_logprobs,
    presence_penalty,
    frequency_penalty,
    repetition_penalty
});

/// The plan's per-row sampling parameters; views into the owning plan.
#[pyclass(module = "resin._core", frozen)]
pub struct SamplingArrays {
    plan: Py<BatchPlan>,
    views: SamplingViews,
}

#[pymethods]
impl SamplingArrays {
    #[getter]
    fn temperature<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        sampling_view(slf, |v| &v.temperature, |s| &s.temperature)
    }
    #[getter]
    fn top_p<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        sampling_view(slf, |v| &v.top_p, |s| &s.top_p)
    }
    #[getter]
    fn top_k<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        sampling_view(slf, |v| &v.top_k, |s| &s.top_k)
    }
    #[getter]
    fn min_p<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        sampling_view(slf, |v| &v.min_p, |s| &s.min_p)
    }
    #[getter]
    fn seed<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        sampling_view(slf, |v| &v.seed, |s| &s.seed)
    }
    #[getter]
    fn num_logprobs<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        sampling_view(slf, |v| &v.num_logprobs, |s| &s.num_logprobs)
    }
    #[getter]
    fn num_prompt_logprobs<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        sampling_view(slf, |v| &v.num_prompt_logprobs, |s| &s.num_prompt_logprobs)
    }
    #[getter]
    fn presence_penalty<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        sampling_view(slf, |v| &v.presence_penalty, |s| &s.presence_penalty)
    }
    #[getter]
    fn frequency_penalty<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        sampling_view(slf, |v| &v.frequency_penalty, |s| &s.frequency_penalty)
    }
    #[getter]
    fn repetition_penalty<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyAny> {
        sampling_view(slf, |v| &v.repetition_penalty, |s| &s.repetition_penalty)
    }
}
