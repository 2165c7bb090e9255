//! The one place that maps daemon errors to gRPC status codes (and to the codes of the fd socket's
//! refusal frames, which use the same numbers). Every error a client gets passes through
//! [`refusal`] once, which counts it by code (`kvmm_rpc_errors_total`).

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

/// The metric label of a code the daemon returns.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::InvalidArgument => "invalid_argument",
        Code::NotFound => "not_found",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Unavailable => "unavailable",
        Code::Internal => "internal",
        Code::DataLoss => "data_loss",
        _ => "other",
    }
}

/// The code a client is refused with for an error of `kind`, counted by code.
pub fn refusal(kind: ErrorKind) -> Code {
    let code = code(kind);
    crate::metrics::count_refusal(code_name(code));
    code
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        let code = refusal(e.kind());
        if code == Code::Internal {
            crate::limited!(error, error = %e, "internal error");
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
