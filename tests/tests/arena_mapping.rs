//! A client maps its trust domain's arena once: its sessions share the mapping, which outlives
//! each of them, so a new session's pages in frames an earlier one used need no page faults. Two
//! clients (connections) map it once each; a session attached after another detached reads and
//! writes its own pages through the shared mapping.

#![allow(clippy::unwrap_used)]

use kvmm_client::Client;
use kvmm_tests::Daemon;
use kvmm_tests::rows::{self, DIM, Q, attend, rows, worst_error};

/// This process's mappings of a uid's arena memfd (`/memfd:kvmm-arena-uid…` in its maps).
fn arena_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains("/memfd:kvmm-arena-uid")).count()
}

#[test]
fn a_clients_sessions_share_one_mapping_of_the_arena_that_outlives_them() {
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let before = arena_mappings();
    let client = Client::connect(daemon.socket()).unwrap();
    let geometry = rows::geometry(2);
    let (k, v) = (rows(100, 1), rows(100, 2));
    let q = rows(3, 3)[..Q * DIM].to_vec();

    let mut first = client.attach(geometry).unwrap();
    let mut second = client.attach(geometry).unwrap();
    assert_eq!(arena_mappings(), before + 1, "two sessions of one client map the arena once");
    for session in [&mut first, &mut second] {
        session.append(0, &k, &v).unwrap();
    }
    first.detach().unwrap();
    assert_eq!(arena_mappings(), before + 1, "the mapping stays while the client has a session");
    second.detach().unwrap();
    assert_eq!(arena_mappings(), before + 1, "and while the client lives");

    // A session attached now gets frames the first two used; it writes and reads them through
    // the same mapping, and sees only its own tokens.
    let mut third = client.attach(geometry).unwrap();
    assert_eq!(arena_mappings(), before + 1);
    let (k3, v3) = (rows(40, 7), rows(40, 8));
    third.append(0, &k3, &v3).unwrap();
    assert_eq!(third.tokens(0), 40);
    let error = worst_error(&attend(&mut third, 0, &q), &k3, &v3, &q);
    assert!(error < 1e-2, "attention over the third session's own tokens: relative error {error}");

    // Another connection maps the arena for itself.
    let other = Client::connect(daemon.socket()).unwrap();
    let mut fourth = other.attach(geometry).unwrap();
    assert_eq!(arena_mappings(), before + 2, "a second client maps the arena once more");
    fourth.append(0, &k3, &v3).unwrap();
    drop((third, fourth));
    drop(client);
    assert_eq!(arena_mappings(), before + 1, "a client's mapping goes with it and its sessions");
    drop(other);
    assert_eq!(arena_mappings(), before);
}
