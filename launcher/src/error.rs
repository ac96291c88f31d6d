//! The launcher's one error type.

use thiserror::Error;

use oxiflow_collectives::CommError;

#[derive(Debug, Error)]
pub enum LaunchError {
    #[error("usage: {0}")]
    Usage(String),
    #[error("cannot find program {program:?}; looked in: {looked}{hint}")]
    ProgramNotFound {
        program: String,
        looked: String,
        /// `; did you mean ...?` or empty.
        hint: String,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rendezvous store: {0}")]
    Store(#[from] CommError),
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// A variable of oflaunch's environment that the workers would refuse.
    #[error("{0}")]
    Environment(CommError),
}

impl LaunchError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        LaunchError::Io {
            context: context.into(),
            source,
        }
    }
}
