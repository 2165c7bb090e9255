//! The policy engine: what the host looks like ([`sensors`]), which mode the daemon runs in and
//! what each mode sets ([`mode`]), what the tier thread does in each pass ([`plan`]), and which
//! format each demoted page takes ([`precision`]).
//!
//! Everything here is pure or reads through one injectable host root, so tests drive it with fake
//! sysfs/procfs trees.

pub mod live;
pub mod mode;
pub mod plan;
pub mod precision;
pub mod rate;
pub mod sensors;
