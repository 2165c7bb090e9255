//! The policy engine: what the host looks like ([`sensors`]), which mode the daemon runs in and
//! what each mode sets ([`mode`]), and what the tier thread does in each pass ([`plan`]).
//!
//! Everything here is pure or reads through one injectable host root, so tests drive it with fake
//! sysfs/procfs trees.

pub mod live;
pub mod mode;
pub mod plan;
pub mod rate;
pub mod sensors;
