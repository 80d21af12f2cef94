//! `LayerCacheSpec`, `CacheGroup`, `CacheLayout`: the runner ↔ engine cache handshake.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use resin_core::kv_spec;
use resin_core::KvCacheSpec;

#[pyclass(module = "resin._core", frozen, eq, from_py_object)]
#[derive(Clone, PartialEq)]
pub struct LayerCacheSpec {
    pub spec: KvCacheSpec,
}

#[pymethods]
impl LayerCacheSpec {
    #[staticmethod]
    fn full(bytes_per_token: u64) -> Self {
        LayerCacheSpec { spec: KvCacheSpec::Full { bytes_per_token } }
    }

    #[staticmethod]
    fn sliding_window(window: u32, bytes_per_token: u64) -> PyResult<Self> {
        if window == 0 {
            return Err(PyValueError::new_err("LayerCacheSpec.sliding_window: window must be >= 1 token"));
        }
        Ok(LayerCacheSpec { spec: KvCacheSpec::SlidingWindow { window, bytes_per_token } })
    }

    #[staticmethod]
    fn recurrent(state_bytes: u64) -> Self {
        LayerCacheSpec { spec: KvCacheSpec::Recurrent { state_bytes } }
    }

    #[staticmethod]
    fn compressed(ratio: u32, bytes_per_entry: u64) -> PyResult<Self> {
        if ratio == 0 {
            return Err(PyValueError::new_err("LayerCacheSpec.compressed: ratio must be >= 1 token"));
        }
        Ok(LayerCacheSpec { spec: KvCacheSpec::Compressed { ratio, bytes_per_entry } })
    }

    #[getter]
    fn kind(&self) -> &'static str {
        self.spec.kind()
    }

    #[getter]
    fn bytes_per_token(&self) -> u64 {
        match self.spec {
            KvCacheSpec::Full { bytes_per_token } | KvCacheSpec::SlidingWindow { bytes_per_token, .. } => bytes_per_token,
            KvCacheSpec::Recurrent { .. } | KvCacheSpec::Compressed { .. } => 0,
        }
    }

    #[getter]
    fn window(&self) -> Option<u32> {
        self.spec.window()
    }

    #[getter]
    fn ratio(&self) -> Option<u32> {
        self.spec.ratio()
    }

    #[getter]
    fn bytes_per_entry(&self) -> Option<u64> {
        match self.spec {
            KvCacheSpec::Compressed { bytes_per_entry, .. } => Some(bytes_per_entry),
            _ => None,
        }
    }

    #[getter]
    fn state_bytes(&self) -> Option<u64> {
        match self.spec {
            KvCacheSpec::Recurrent { state_bytes } => Some(state_bytes),
            _ => None,
        }
    }

    fn __repr__(&self) -> String {
        match self.spec {
            KvCacheSpec::Full { bytes_per_token } => format!("LayerCacheSpec.full({bytes_per_token})"),
            KvCacheSpec::SlidingWindow { window, bytes_per_token } => {
                format!("LayerCacheSpec.sliding_window({window}, {bytes_per_token})")
            }
            KvCacheSpec::Recurrent { state_bytes } => format!("LayerCacheSpec.recurrent({state_bytes})"),
            KvCacheSpec::Compressed { ratio, bytes_per_entry } => {
                format!("LayerCacheSpec.compressed({ratio}, {bytes_per_entry})")
            }
        }
    }
}

#[pyclass(module = "resin._core", frozen)]
pub struct CacheGroup {
    group: kv_spec::CacheGroup,
    page_size: u32,
}

#[pymethods]
impl CacheGroup {
    #[getter]
    fn spec(&self) -> LayerCacheSpec {
        LayerCacheSpec { spec: self.group.spec }
    }

    #[getter]
    fn layer_indices(&self) -> Vec<u32> {
        self.group.layer_indices.clone()
    }

    #[getter]
    fn pages_per_state(&self) -> u32 {
        self.group.pages_per_state
    }

    #[getter]
    fn entries_per_page(&self) -> u32 {
        self.group.spec.entries_per_page(self.page_size)
    }

    #[getter]
    fn page_bytes(&self) -> u64 {
        self.group.spec.page_bytes(self.page_size)
    }

    fn __repr__(&self) -> String {
        format!(
            "CacheGroup(spec={}, layer_indices={:?})",
            LayerCacheSpec { spec: self.group.spec }.__repr__(),
            self.group.layer_indices
        )
    }
}

#[pyclass(module = "resin._core", frozen)]
pub struct CacheLayout {
    pub layout: kv_spec::CacheLayout,
}

#[pymethods]
impl CacheLayout {
    #[getter]
    fn num_pages(&self) -> u32 {
        self.layout.num_pages
    }

    #[getter]
    fn page_size(&self) -> u32 {
        self.layout.page_size
    }

    #[getter]
    fn page_bytes(&self) -> u64 {
        self.layout.page_bytes
    }

    #[getter]
    fn num_layer_slots(&self) -> u32 {
        self.layout.num_layer_slots
    }

    #[getter]
    fn groups(&self) -> Vec<CacheGroup> {
        self.layout.groups.iter().map(|g| CacheGroup { group: g.clone(), page_size: self.layout.page_size }).collect()
    }

    /// The layout an engine would build for `specs` (one per layer) at `page_size`, for
    /// sizing a pool before building one.
    #[staticmethod]
    #[pyo3(signature = (specs, page_size, num_pages = 2))]
    fn from_specs(specs: Vec<PyRef<'_, LayerCacheSpec>>, page_size: u32, num_pages: u32) -> PyResult<Self> {
        let specs: Vec<KvCacheSpec> = specs.iter().map(|s| s.spec).collect();
        kv_spec::CacheLayout::from_layer_specs(&specs, num_pages, page_size)
            .map(|layout| CacheLayout { layout })
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Most pages one request of `max_model_len` tokens holds at once, over all groups (what
    /// `Engine` requires the pool to hold besides the null page).
    #[pyo3(signature = (max_model_len, max_num_batched_tokens, enable_prefix_caching = true, num_speculative_tokens = 0))]
    fn pages_per_request(
        &self,
        max_model_len: u32,
        max_num_batched_tokens: u32,
        enable_prefix_caching: bool,
        num_speculative_tokens: u32,
    ) -> u32 {
        self.layout.pages_per_request(max_model_len, max_num_batched_tokens, enable_prefix_caching, num_speculative_tokens > 0)
    }

    fn group_of_layer(&self, layer_index: u32) -> PyResult<usize> {
        self.layout
            .group_of_layer(layer_index)
            .ok_or_else(|| PyValueError::new_err(format!("CacheLayout.group_of_layer: no layer {layer_index}")))
    }

    fn __repr__(&self) -> String {
        format!(
            "CacheLayout(num_pages={}, page_size={}, num_groups={})",
            self.layout.num_pages,
            self.layout.page_size,
            self.layout.groups.len()
        )
    }
}
