//! The simulator tests' small transformer: 4 heads, a vocabulary of 1000, 128 tokens, 2
//! sequences a rank, bf16; the caller names the architecture, depth, width and checkpointing.

use collsched::sim::workload::{Architecture, TransformerConfig};

pub fn small_config(
    name: &str,
    architecture: Architecture,
    layers: u32,
    hidden: u64,
    checkpointing: bool,
) -> TransformerConfig {
    TransformerConfig {
        name: name.to_owned(),
        architecture,
        layers,
        hidden,
        heads: 4,
        kv_heads: None,
        ffn_hidden: None,
        vocab: 1000,
        sequence: 128,
        batch_per_rank: 2,
        activation_checkpointing: checkpointing,
        dtype: "bf16".to_owned(),
    }
}
