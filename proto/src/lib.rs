//! kvmm's wire protocol: the session API (`kvmm.sock`) and the admin API (`kvmm-admin.sock`).
//!
//! The `.proto` files under `proto/kvmm/v1/` are the source of truth; this crate only includes the
//! code generated from them.

#![allow(missing_debug_implementations)]
#![allow(clippy::all)]

/// Version 1 of the protocol.
pub mod v1 {
    tonic::include_proto!("kvmm.v1");
}
