//! resin-core: the headless engine core of Resin.
//!
//! Pure Rust, no Python. It owns every cache page id and every scheduling decision;
//! a runner (in Python, through the `resin-python` bindings) owns every byte of the
//! cache and computes the model. One step is:
//!
//! ```text
//! Engine::schedule() -> BatchPlan  ──►  runner.forward(plan)  ──►  Engine::update(ForwardOutputRef)
//! ```
//!
//! Modules, one noun each:
//! - [`request`]: a request, its sampling parameters and finish reasons;
//! - [`block_hash`]: chained 128-bit hashes of full pages (prefix-cache keys);
//! - [`page_pool`]: the pool of equal-size pages — refcounts, intrusive LRU free queue,
//!   prefix-cache map;
//! - [`kv_spec`]: per-layer cache specs and their grouping into cache groups;
//! - [`cache_manager`]: a request's pages per group: allocation, sliding-window release,
//!   prefix hits, caching full pages;
//! - [`scheduler`]: waiting/running queues, token budget, preemption by recompute;
//! - [`runner_slots`]: the runner-slot table and its lifecycle diff (new / finished slots);
//! - [`plan`]: the immutable `BatchPlan` handed to the runner;
//! - [`output`]: `ForwardOutputRef` validation and `RequestOutput`;
//! - [`engine`]: ties them together (`schedule`, `update`, `abort`, ...);
//! - [`engine_config`]: the engine's settings and their checks;
//! - [`metrics`]: counters, gauges and histograms in Prometheus text format.

pub mod block_hash;
pub mod cache_manager;
pub mod draft;
pub mod engine;
pub mod engine_config;
pub mod error;
pub mod kv_spec;
pub mod metrics;
pub mod output;
pub mod page_pool;
pub mod plan;
pub mod request;
pub mod runner_slots;
pub mod scheduler;

pub use block_hash::BlockHash;
pub use engine::Engine;
pub use engine_config::{EngineConfig, SchedulingPolicy};
pub use error::CoreError;
pub use kv_spec::{CacheGroup, CacheLayout, KvCacheSpec};
pub use output::{ForwardOutputRef, RequestOutput};
pub use page_pool::{PageId, PagePool, NULL_PAGE};
pub use plan::{BatchPlan, GroupPlan, PlanRecycler, SamplingArrays};
pub use request::{FinishReason, SamplingParams};
