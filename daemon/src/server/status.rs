//! The one place that maps daemon errors to gRPC status codes (and to the codes of the fd socket's
//! refusal frames, which use the same numbers).

use tonic::{Code, Status};

use crate::error::{Error, ErrorKind};

/// The gRPC code for an error kind.
pub fn code(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::PermissionDenied => Code::PermissionDenied,
        ErrorKind::ResourceExhausted => Code::ResourceExhausted,
        ErrorKind::FailedPrecondition => Code::FailedPrecondition,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Internal => Code::Internal,
        ErrorKind::DataLoss => Code::DataLoss,
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        let code = code(e.kind());
        if code == Code::Internal {
            tracing::error!(error = %e, "internal error");
        }
        Status::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_errors_become_resource_exhausted_with_the_numbers() {
        let s: Status = Error::Exhausted { tier: "device", requested: 4096, available: 1024, budget: 8192 }.into();
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert!(s.message().contains("device") && s.message().contains("4096") && s.message().contains("1024"));
    }

    #[test]
    fn unknown_sessions_are_not_found() {
        let s: Status = Error::UnknownSession(7).into();
        assert_eq!(s.code(), Code::NotFound);
        assert!(s.message().contains('7'));
    }
}
