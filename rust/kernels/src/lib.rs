//! resin-kernels: CPU kernels the torch runner calls through `resin._core` where plain torch
//! has no operator for the job. Pure Rust, no Python; the bindings crate checks every shape
//! and index before a kernel touches memory.
//!
//! Modules, one noun each:
//! - [`paged_attention`]: attention of a step's queries over the paged KV cache, read in place
//!   through the plan's CSR page table (no gather of K and V).

pub mod paged_attention;
