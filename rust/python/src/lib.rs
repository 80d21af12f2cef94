//! PyO3 bindings for `resin-core`, built by maturin as the private module `resin._core`.
//!
//! Thin by rule: no engine logic lives here. Each file wraps one noun: `params`
//! (SamplingParams, EngineConfig), `cache` (LayerCacheSpec, CacheGroup, CacheLayout),
//! `plan` (BatchPlan, SamplingArrays), `output` (ForwardOutput, RequestOutput) and
//! `engine` (Engine), `errors` (StepError, InvalidOutputError), `kernels` (the `resin-kernels`
//! CPU kernels on numpy views: `paged_attention`, `rotary_embedding`, `rms_norm`, `nucleus_cut`,
//! `top_candidates`, `linear`, `softmax`, `sample_rows`; and
//! `openmp_team_available`, `kernels_vectorised`). The GIL is released while Rust works; plan
//! arrays are numpy views on memory the plan owns (no copy).

mod cache;
mod engine;
mod errors;
mod kernels;
mod output;
mod params;
mod plan;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<params::SamplingParams>()?;
    m.add_class::<params::EngineConfig>()?;
    m.add_class::<cache::LayerCacheSpec>()?;
    m.add_class::<cache::CacheGroup>()?;
    m.add_class::<cache::CacheLayout>()?;
    m.add_class::<plan::BatchPlan>()?;
    m.add_class::<plan::SamplingArrays>()?;
    m.add_class::<output::ForwardOutput>()?;
    m.add_class::<output::RequestOutput>()?;
    m.add_class::<engine::Engine>()?;
    m.add_function(wrap_pyfunction!(kernels::paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::openmp_team_available, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::kernels_vectorised, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::rotary_embedding, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::nucleus_cut, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::top_candidates, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::argmax, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::inverse_cdf, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::linear, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::softmax, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::sample_rows, m)?)?;
    m.add("StepError", m.py().get_type::<errors::StepError>())?;
    m.add("InvalidOutputError", errors::invalid_output_error(m.py())?)?;
    Ok(())
}
