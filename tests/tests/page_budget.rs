//! Query-aware sparse attention through the client: with a page budget, one `attention` call reads at
//! most that many pages (always the first and the two most recent); with a budget that covers the
//! layer it is exactly full attention; a budget below 3 is refused.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvmm_tests::{Daemon, fields, spawn_client};

#[test]
fn a_page_budget_bounds_the_pages_read_and_is_exact_when_it_covers_the_layer() {
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    // 640 tokens: 20 pages per layer.
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "640", "--no-attend", "--seed", "4"]);
    c.expect_line("appended");

    c.send("sparse 10 5");
    let f = fields(&c.expect_line("sparse"));
    println!("budget 5 of 20 pages (random K/V, flat attention): {f:?}");
    assert_eq!(f["pages"], "20");
    assert!(f["max_read"].parse::<usize>().unwrap() <= 5);

    c.send("sparse 5 20");
    let f = fields(&c.expect_line("sparse"));
    assert_eq!(f["max_rel_err"].parse::<f64>().unwrap(), 0.0, "a covering budget is full attention: {f:?}");

    c.send("bad-budget");
    let e = c.expect_line("error");
    assert_eq!(fields(&e)["code"], "InvalidArgument", "{e}");

    c.send("exit");
    c.expect_line("detached");
    assert!(c.wait(Duration::from_secs(10)).success());
    assert!(daemon.stop().success());
}
