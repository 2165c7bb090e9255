//! Quick start: attach a session with the SmolLM2-135M geometry, append K/V for a few hundred tokens
//! on every layer, run decode attention, and print what the daemon reports.
//!
//! ```text
//! cargo run -p kvmm-daemon --bin kvmmd -- --runtime-dir /tmp/kvmm &
//! cargo run -p kvmm-client --example quickstart -- /tmp/kvmm/kvmm.sock
//! ```

use kvmm_client::{Client, ElementType, Geometry};

fn main() -> Result<(), kvmm_client::Error> {
    let socket = std::env::args().nth(1).map(std::path::PathBuf::from).unwrap_or_else(kvmm_client::default_socket);
    let client = Client::connect(&socket)?;
    // SmolLM2-135M: 30 layers, 3 KV heads, 9 query heads, head_dim 64.
    let geometry = Geometry {
        layers: 30,
        kv_heads: 3,
        q_heads: 9,
        head_dim: 64,
        block_tokens: 32,
        element_type: ElementType::F16,
        max_tokens: 4096,
    };
    let mut session = client.attach(geometry)?;
    println!("attached session {} at {}", session.id(), socket.display());

    let row = (geometry.kv_heads * geometry.head_dim) as usize;
    let mut out = vec![0f32; (geometry.q_heads * geometry.head_dim) as usize];
    for t in 0..300u32 {
        // A real engine computes these from the model; any numbers show the data path.
        let k: Vec<f32> = (0..row).map(|i| ((t as usize * 31 + i) % 97) as f32 / 97.0 - 0.5).collect();
        let v: Vec<f32> = (0..row).map(|i| ((t as usize * 17 + i) % 89) as f32 / 89.0 - 0.5).collect();
        let q: Vec<f32> = (0..out.len()).map(|i| ((t as usize + i) % 13) as f32 / 13.0 - 0.5).collect();
        for layer in 0..geometry.layers {
            session.append(layer, &k, &v)?;
            session.attention(layer, &q, &mut out)?;
        }
    }
    let stats = session.stats()?;
    println!(
        "tokens {} | pages per layer {} | device bytes {} | pages moved by the daemon {}",
        stats.tokens, stats.allocated_blocks, stats.device_bytes, stats.pages_moved
    );
    println!("out[0..4] = {:?}", &out[..4]);
    println!("attention mass of the last layer's pages: {:?}", session.last_mass());
    let wiped = session.detach()?;
    println!("detached; the daemon wiped {wiped} bytes");
    Ok(())
}
