//! resin-kernels: CPU kernels the torch runner calls through `resin._core` where plain torch
//! has no operator for the job. Pure Rust, no Python; the bindings crate checks every shape
//! and index before a kernel touches memory.
//!
//! Modules, one noun each:
//! - [`argmax`]: a row's greedy token, torch's `argmax` in one vectorised scan.
//! - [`bounded_draw`]: a whole-row draw decided from cheap exponentials and an error bound.
//! - [`cheap_exp`]: a row's softmax terms to a stated error bound, summed in blocks.
//! - [`paged_attention`]: attention of a step's queries over the paged KV cache, read in place
//!   through the plan's CSR page table (no gather of K and V).
//! - [`candidates`]: a row's n largest logits and their columns in one read of the row.
//! - [`draw`]: a row's inverse-CDF token from its probabilities (torch's cumsum's bits).
//! - [`linear`]: `x @ w.T (+ bias)` for a decode step's few rows, each weight row read once.
//! - [`nucleus`]: where a row's top-p nucleus ends (the sort's cut) without sorting the row.
//! - [`openmp_team`]: parallel work on the process's OpenMP team (torch's), found at run time.
//! - [`rms_norm`]: HF's RMSNorm of a step's rows, torch's floats (its sum's order) in one pass.
//! - [`rotary`]: the half-split rotary embedding of q / k rows, torch's floats in one pass.
//! - [`sampling`]: the torch sampler's filters and draw of whole rows in one call, its tokens bit for bit.
//! - [`softmax`]: torch's CPU softmax of a float32 row bit for bit (SLEEF's `expf`, its sum order).
//! - [`vector`]: the f32 vector primitives kernels are written in (scalar, and AVX2 + FMA), and
//!   the prefetches a kernel asks for in step with its reads.

pub mod argmax;
pub mod bounded_draw;
pub mod candidates;
pub mod cheap_exp;
pub mod draw;
pub mod linear;
pub mod nucleus;
pub mod openmp_team;
pub mod paged_attention;
pub mod rms_norm;
pub mod rotary;
pub mod sampling;
pub mod softmax;
pub mod vector;
