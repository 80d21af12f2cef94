//! Errors the core returns. Every message names the offending field or value so a
//! user can act on it; the bindings map `InvalidArgument` to `ValueError` and
//! `InvalidState` to `RuntimeError`.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// Bad user input (request, params, config, runner output). Nothing was changed.
    InvalidArgument(String),
    /// The call does not fit the engine's state (e.g. a plan is already pending).
    InvalidState(String),
}

impl CoreError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        CoreError::InvalidArgument(msg.into())
    }
    pub fn state(msg: impl Into<String>) -> Self {
        CoreError::InvalidState(msg.into())
    }
    pub fn message(&self) -> &str {
        match self {
            CoreError::InvalidArgument(m) | CoreError::InvalidState(m) => m,
        }
    }
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for CoreError {}
