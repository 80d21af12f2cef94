//! `SamplingParams` and `EngineConfig`: plain settings objects, validated on construction.

use std::collections::BTreeMap;

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use resin_core::{engine_config, request};

use crate::errors::to_py;

/// Integer fields are stored as Python gives them (i64) and range-checked in `to_core`,
/// so a bad value set as an attribute still fails with a ValueError naming the field.
#[pyclass(module = "resin._core", from_py_object)]
#[derive(Clone)]
pub struct SamplingParams {
    #[pyo3(get, set)]
    pub max_tokens: i64,
    #[pyo3(get, set)]
    pub min_tokens: i64,
    #[pyo3(get, set)]
    pub temperature: f32,
    #[pyo3(get, set)]
    pub top_p: f32,
    #[pyo3(get, set)]
    pub top_k: i32,
    #[pyo3(get, set)]
    pub min_p: f32,
    #[pyo3(get, set)]
    pub seed: Option<i64>,
    #[pyo3(get, set)]
    pub stop_token_ids: Vec<i64>,
    #[pyo3(get, set)]
    pub ignore_eos: bool,
    #[pyo3(get, set)]
    pub logprobs: Option<i64>,
    /// Logprobs of the prompt's tokens (after the first), with the top k (vLLM's).
    #[pyo3(get, set)]
    pub prompt_logprobs: Option<i64>,
    #[pyo3(get, set)]
    pub presence_penalty: f32,
    #[pyo3(get, set)]
    pub frequency_penalty: f32,
    #[pyo3(get, set)]
    pub repetition_penalty: f32,
    /// token id -> bias added to its logit (OpenAI's `logit_bias`).
    #[pyo3(get, set)]
    pub logit_bias: BTreeMap<i64, f32>,
    #[pyo3(get, set)]
    pub priority: i32,
    /// False: speculative decoding never drafts for this request.
    #[pyo3(get, set)]
    pub speculate: bool,
}

/// `value` as a u32, or a ValueError naming `owner.field`.
pub fn to_u32(owner: &str, field: &str, value: i64) -> PyResult<u32> {
    u32::try_from(value).map_err(|_| PyValueError::new_err(format!("{owner}.{field}: must be in [0, 2**32), got {value}")))
}

/// A constructor argument as an i64: a ValueError naming `SamplingParams.field` for an int
/// past 64 bits (not an unnamed OverflowError), a TypeError naming it for a non-int.
fn int_arg(field: &str, value: &Bound<'_, PyAny>) -> PyResult<i64> {
    value.extract::<i64>().map_err(|err| {
        if err.is_instance_of::<PyOverflowError>(value.py()) {
            PyValueError::new_err(format!("SamplingParams.{field}: {value} is out of range"))
        } else {
            PyTypeError::new_err(format!("SamplingParams.{field}: {}", err.value(value.py())))
        }
    })
}

/// [`int_arg`] narrowed to an i32 field.
fn i32_arg(field: &str, value: &Bound<'_, PyAny>) -> PyResult<i32> {
    let wide = int_arg(field, value)?;
    i32::try_from(wide).map_err(|_| PyValueError::new_err(format!("SamplingParams.{field}: {wide} is out of range")))
}

/// The integer arguments of `SamplingParams(...)`, read by [`int_arg`] (so an int past 64
/// bits is a ValueError naming its field).
mod args {
    use super::*;

    pub fn max_tokens(v: &Bound<'_, PyAny>) -> PyResult<i64> {
        int_arg("max_tokens", v)
    }
    pub fn min_tokens(v: &Bound<'_, PyAny>) -> PyResult<i64> {
        int_arg("min_tokens", v)
    }
    pub fn top_k(v: &Bound<'_, PyAny>) -> PyResult<i32> {
        i32_arg("top_k", v)
    }
    pub fn priority(v: &Bound<'_, PyAny>) -> PyResult<i32> {
        i32_arg("priority", v)
    }
    pub fn seed(v: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
        optional(v, |v| int_arg("seed", v))
    }
    pub fn logprobs(v: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
        optional(v, |v| int_arg("logprobs", v))
    }
    pub fn prompt_logprobs(v: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
        optional(v, |v| int_arg("prompt_logprobs", v))
    }
    pub fn stop_token_ids(v: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
        optional(v, |v| {
            let items: Vec<Bound<'_, PyAny>> = v
                .extract()
                .map_err(|err: PyErr| PyTypeError::new_err(format!("SamplingParams.stop_token_ids: {}", err.value(v.py()))))?;
            items.iter().map(|t| int_arg("stop_token_ids", t)).collect()
        })
    }
    pub fn logit_bias(v: &Bound<'_, PyAny>) -> PyResult<Option<BTreeMap<i64, f32>>> {
        optional(v, |v| {
            let bad = |err: PyErr| PyTypeError::new_err(format!("SamplingParams.logit_bias: {}", err.value(v.py())));
            let dict = v.cast::<PyDict>().map_err(|err| bad(err.into()))?;
            let mut bias = BTreeMap::new();
            for (token, value) in dict.iter() {
                bias.insert(int_arg("logit_bias", &token)?, value.extract::<f32>().map_err(bad)?);
            }
            Ok(bias)
        })
    }
    fn optional<T>(v: &Bound<'_, PyAny>, read: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>) -> PyResult<Option<T>> {
        if v.is_none() {
            Ok(None)
        } else {
            read(v).map(Some)
        }
    }
}

impl SamplingParams {
    /// The core params, range-checked (errors name the field).
    pub fn to_core(&self) -> PyResult<request::SamplingParams> {
        let field = |name: &str, v: i64| to_u32("SamplingParams", name, v);
        let seed = self
            .seed
            .map(|s| u64::try_from(s).map_err(|_| PyValueError::new_err(format!("SamplingParams.seed: must be >= 0, got {s}"))))
            .transpose()?;
        request::SamplingParams {
            max_tokens: field("max_tokens", self.max_tokens)?,
            min_tokens: field("min_tokens", self.min_tokens)?,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed,
            stop_token_ids: self.stop_token_ids.iter().map(|&t| field("stop_token_ids", t)).collect::<PyResult<_>>()?,
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs.map(|k| field("logprobs", k)).transpose()?,
            prompt_logprobs: self.prompt_logprobs.map(|k| field("prompt_logprobs", k)).transpose()?,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            logit_bias: self
                .logit_bias
                .iter()
                .map(|(&token, &bias)| Ok((to_u32("SamplingParams", "logit_bias", token)?, bias)))
                .collect::<PyResult<_>>()?,
            priority: self.priority,
            speculate: self.speculate,
        }
        .validated()
        .map_err(to_py)
    }
}

#[pymethods]
impl SamplingParams {
    #[new]
    #[pyo3(signature = (max_tokens=16, min_tokens=0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
        stop_token_ids=None, ignore_eos=false, logprobs=None, presence_penalty=0.0, frequency_penalty=0.0,
        repetition_penalty=1.0, priority=0, logit_bias=None, prompt_logprobs=None, speculate=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        #[pyo3(from_py_with = args::max_tokens)] max_tokens: i64,
        #[pyo3(from_py_with = args::min_tokens)] min_tokens: i64,
        temperature: f32,
        top_p: f32,
        #[pyo3(from_py_with = args::top_k)] top_k: i32,
        min_p: f32,
        #[pyo3(from_py_with = args::seed)] seed: Option<i64>,
        #[pyo3(from_py_with = args::stop_token_ids)] stop_token_ids: Option<Vec<i64>>,
        ignore_eos: bool,
        #[pyo3(from_py_with = args::logprobs)] logprobs: Option<i64>,
        presence_penalty: f32,
        frequency_penalty: f32,
        repetition_penalty: f32,
        #[pyo3(from_py_with = args::priority)] priority: i32,
        #[pyo3(from_py_with = args::logit_bias)] logit_bias: Option<BTreeMap<i64, f32>>,
        #[pyo3(from_py_with = args::prompt_logprobs)] prompt_logprobs: Option<i64>,
        speculate: bool,
    ) -> PyResult<Self> {
        let params = SamplingParams {
            max_tokens,
            min_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            stop_token_ids: stop_token_ids.unwrap_or_default(),
            ignore_eos,
            logprobs,
            prompt_logprobs,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            logit_bias: logit_bias.unwrap_or_default(),
            priority,
            speculate,
        };
        let checked = params.to_core()?;
        Ok(SamplingParams { top_k: checked.top_k, ..params })
    }

    fn __repr__(&self) -> String {
        format!(
            "SamplingParams(max_tokens={}, min_tokens={}, temperature={}, top_p={}, top_k={}, min_p={}, seed={:?}, \
             stop_token_ids={:?}, ignore_eos={}, logprobs={:?}, presence_penalty={}, frequency_penalty={}, \
             repetition_penalty={}, priority={}, logit_bias={:?}, prompt_logprobs={:?}, speculate={})",
            self.max_tokens,
            self.min_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.seed,
            self.stop_token_ids,
            self.ignore_eos,
            self.logprobs,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.priority,
            self.logit_bias,
            self.prompt_logprobs,
            if self.speculate { "True" } else { "False" }
        )
    }
}

#[pyclass(module = "resin._core", from_py_object)]
#[derive(Clone)]
pub struct EngineConfig {
    #[pyo3(get, set)]
    pub page_size: i64,
    #[pyo3(get, set)]
    pub num_pages: i64,
    #[pyo3(get, set)]
    pub max_num_seqs: i64,
    #[pyo3(get, set)]
    pub max_num_batched_tokens: i64,
    #[pyo3(get, set)]
    pub max_model_len: i64,
    #[pyo3(get, set)]
    pub enable_prefix_caching: bool,
    #[pyo3(get, set)]
    pub eos_token_ids: Vec<i64>,
    #[pyo3(get, set)]
    pub vocab_size: Option<i64>,
    #[pyo3(get, set)]
    pub policy: String,
    #[pyo3(get, set)]
    pub recurrent_checkpoint_interval: i64,
    #[pyo3(get, set)]
    pub num_speculative_tokens: i64,
    #[pyo3(get, set)]
    pub ngram_prompt_lookup_min: i64,
    #[pyo3(get, set)]
    pub ngram_prompt_lookup_max: i64,
    #[pyo3(get, set)]
    pub cuda_graph_batch_sizes: Vec<i64>,
    /// `Engine.step()` plans and starts the next step before returning this one's outputs
    /// (runners with `begin_forward` / `finish_forward`); a binding setting, not the core's.
    #[pyo3(get, set)]
    pub async_scheduling: bool,
}

impl EngineConfig {
    pub fn to_core(&self) -> PyResult<engine_config::EngineConfig> {
        let policy = match self.policy.as_str() {
            "fcfs" => engine_config::SchedulingPolicy::Fcfs,
            "priority" => engine_config::SchedulingPolicy::Priority,
            other => {
                return Err(PyValueError::new_err(format!("EngineConfig.policy must be \"fcfs\" or \"priority\", got {other:?}")))
            }
        };
        let field = |name: &str, v: i64| to_u32("EngineConfig", name, v);
        let config = engine_config::EngineConfig {
            page_size: field("page_size", self.page_size)?,
            num_pages: field("num_pages", self.num_pages)?,
            max_num_seqs: field("max_num_seqs", self.max_num_seqs)?,
            max_num_batched_tokens: field("max_num_batched_tokens", self.max_num_batched_tokens)?,
            max_model_len: field("max_model_len", self.max_model_len)?,
            enable_prefix_caching: self.enable_prefix_caching,
            eos_token_ids: self.eos_token_ids.iter().map(|&t| field("eos_token_ids", t)).collect::<PyResult<_>>()?,
            vocab_size: self.vocab_size.map(|v| field("vocab_size", v)).transpose()?,
            policy,
            recurrent_checkpoint_interval: field("recurrent_checkpoint_interval", self.recurrent_checkpoint_interval)?,
            num_speculative_tokens: field("num_speculative_tokens", self.num_speculative_tokens)?,
            ngram_prompt_lookup_min: field("ngram_prompt_lookup_min", self.ngram_prompt_lookup_min)?,
            ngram_prompt_lookup_max: field("ngram_prompt_lookup_max", self.ngram_prompt_lookup_max)?,
            cuda_graph_batch_sizes: self
                .cuda_graph_batch_sizes
                .iter()
                .map(|&b| field("cuda_graph_batch_sizes", b))
                .collect::<PyResult<_>>()?,
        };
        config.validate().map_err(to_py)?;
        Ok(config)
    }
}

#[pymethods]
impl EngineConfig {
    #[new]
    #[pyo3(signature = (page_size=16, num_pages=4096, max_num_seqs=256, max_num_batched_tokens=2048,
        max_model_len=4096, enable_prefix_caching=true, eos_token_ids=None, vocab_size=None, policy="fcfs",
        recurrent_checkpoint_interval=256, num_speculative_tokens=0, ngram_prompt_lookup_min=1,
        ngram_prompt_lookup_max=4, cuda_graph_batch_sizes=None, async_scheduling=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        page_size: i64,
        num_pages: i64,
        max_num_seqs: i64,
        max_num_batched_tokens: i64,
        max_model_len: i64,
        enable_prefix_caching: bool,
        eos_token_ids: Option<Vec<i64>>,
        vocab_size: Option<i64>,
        policy: &str,
        recurrent_checkpoint_interval: i64,
        num_speculative_tokens: i64,
        ngram_prompt_lookup_min: i64,
        ngram_prompt_lookup_max: i64,
        cuda_graph_batch_sizes: Option<Vec<i64>>,
        async_scheduling: bool,
    ) -> PyResult<Self> {
        // The signature's literal (a literal so Python sees the default) is the core's.
        const _: () = assert!(engine_config::DEFAULT_RECURRENT_CHECKPOINT_INTERVAL == 256);
        let config = EngineConfig {
            page_size,
            num_pages,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            enable_prefix_caching,
            eos_token_ids: eos_token_ids.unwrap_or_default(),
            vocab_size,
            policy: policy.to_string(),
            recurrent_checkpoint_interval,
            num_speculative_tokens,
            ngram_prompt_lookup_min,
            ngram_prompt_lookup_max,
            cuda_graph_batch_sizes: cuda_graph_batch_sizes.unwrap_or_default(),
            async_scheduling,
        };
        config.to_core()?;
        Ok(config)
    }

    fn __repr__(&self) -> String {
        format!(
            "EngineConfig(page_size={}, num_pages={}, max_num_seqs={}, max_num_batched_tokens={}, max_model_len={}, \
             enable_prefix_caching={}, eos_token_ids={:?}, vocab_size={:?}, policy={:?}, \
             recurrent_checkpoint_interval={}, num_speculative_tokens={}, ngram_prompt_lookup_min={}, \
             ngram_prompt_lookup_max={}, cuda_graph_batch_sizes={:?}, async_scheduling={})",
            self.page_size,
            self.num_pages,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            if self.enable_prefix_caching { "True" } else { "False" },
            self.eos_token_ids,
            self.vocab_size,
            self.policy,
            self.recurrent_checkpoint_interval,
            self.num_speculative_tokens,
            self.ngram_prompt_lookup_min,
            self.ngram_prompt_lookup_max,
            self.cuda_graph_batch_sizes,
            if self.async_scheduling { "True" } else { "False" }
        )
    }
}
