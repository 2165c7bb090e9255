//! An engine appends a whole prompt in one call: the pages hold what token-by-token appends would
//! have left, bit for bit. Where the budget runs out partway through the prompt, the tokens that fit
//! in the pages the client could have stay appended and are read correctly, the call fails with
//! `RESOURCE_EXHAUSTED` naming the device tier, and once room is made the rest of the prompt goes
//! on from there.

#![allow(clippy::unwrap_used)]

use kvmm_client::{Client, Geometry};
use kvmm_tests::Daemon;
use kvmm_tests::rows::{self, DIM, Q, ROW, attend, rows, worst_error};

const LAYERS: u32 = 2;

fn geometry() -> Geometry {
    rows::geometry(LAYERS)
}

#[test]
fn a_prompt_in_one_call_fills_the_pages_token_by_token_appends_would() {
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let client = Client::connect(daemon.socket()).unwrap();
    let (k, v) = (rows(1000, 1), rows(1000, 2));
    let q = rows(3, 3)[..Q * DIM].to_vec();
    let mut prompt = client.attach(geometry()).unwrap();
    let mut stepped = client.attach(geometry()).unwrap();
    for layer in 0..LAYERS {
        prompt.append(layer, &k, &v).unwrap();
        for t in 0..1000 {
            stepped.append(layer, &k[t * ROW..(t + 1) * ROW], &v[t * ROW..(t + 1) * ROW]).unwrap();
        }
    }
    // 1,000 tokens end in block 31: the prompt holds exactly its 32 pages a layer.
    assert_eq!(prompt.allocated_blocks(), 32);
    for layer in 0..LAYERS {
        assert_eq!(prompt.tokens(layer), 1000);
        let out = attend(&mut prompt, layer, &q);
        assert_eq!(out, attend(&mut stepped, layer, &q), "layer {layer}: the same pages, the same bits");
        assert!(worst_error(&out, &k, &v, &q) < 1e-5);
    }
    prompt.detach().unwrap();
    stepped.detach().unwrap();
    assert!(daemon.stop().success());
}

#[test]
fn a_prompt_past_the_budget_keeps_what_fits_and_goes_on_once_room_is_made() {
    // No DRAM tier: nothing can be demoted to make room, so the device budget is a hard wall.
    let daemon = Daemon::start(&["--device-budget", "2MiB", "--dram-budget", "0"]);
    let client = Client::connect(daemon.socket()).unwrap();
    // Another session holds part of the budget.
    let mut other = client.attach(geometry()).unwrap();
    let filler = rows(200, 9);
    other.append(0, &filler, &filler).unwrap();

    let (k, v) = (rows(4000, 4), rows(4000, 5));
    let q = rows(3, 6)[..Q * DIM].to_vec();
    let mut session = client.attach(geometry()).unwrap();
    let err = session.append(0, &k, &v).unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    // The last refusal is for the one block the next token needs (a page of 25,408 bytes in each
    // of 2 layers), after a batch of 4 blocks did not fit: the client asked page by page before
    // giving up.
    assert!(err.to_string().contains("the device tier cannot fit this request: 50816 bytes requested"), "{err}");
    let kept = session.tokens(0) as usize;
    let pages = session.allocated_blocks() as usize;
    println!("kept {kept} tokens in {pages} pages a layer: {err}");
    assert!(kept > 0 && kept < 4000, "some of the prompt fit, not all: {kept}");
    assert_eq!(kept, pages * 32, "every page it could have is full");
    assert_eq!(session.tokens(1), 0);
    let out = attend(&mut session, 0, &q);
    let worst = worst_error(&out, &k[..kept * ROW], &v[..kept * ROW], &q);
    assert!(worst < 1e-5, "attention over the kept tokens: {worst}");
    // Nothing more fits: the same call fails again and changes nothing.
    let again = session.append(0, &k[kept * ROW..], &v[kept * ROW..]).unwrap_err();
    assert_eq!(again.code(), tonic::Code::ResourceExhausted);
    assert_eq!(session.tokens(0) as usize, kept);

    // Room made, the prompt goes on where it stopped.
    other.detach().unwrap();
    let more = (kept + 200).min(4000);
    session.append(0, &k[kept * ROW..more * ROW], &v[kept * ROW..more * ROW]).unwrap();
    assert_eq!(session.tokens(0) as usize, more);
    let out = attend(&mut session, 0, &q);
    assert!(worst_error(&out, &k[..more * ROW], &v[..more * ROW], &q) < 1e-5);
    session.detach().unwrap();
    assert!(daemon.stop().success());
}
