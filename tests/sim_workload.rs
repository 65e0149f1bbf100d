//! Workloads: preset sizes match the published ones, orders and FLOPs follow the formulas.

use collsched::sim::workload::{Architecture, TransformerConfig, Workload, WorkloadError, PRESETS};

/// Parameter count from the architecture's closed form, computed here independently of the
/// generator.
fn formula(c: &TransformerConfig) -> u64 {
    let (l, h, v, s) = (u64::from(c.layers), c.hidden, c.vocab, c.sequence);
    let kv = h / c.heads * c.kv_heads.unwrap_or(c.heads);
    let f = c.ffn_hidden.unwrap_or(4 * h);
    match c.architecture {
        // Blocks: qkv + out + up + down weights and biases, two LayerNorms; embeddings; ln_f.
        Architecture::Gpt2 => l * (4 * h * h + 2 * h * f + 9 * h + f) + v * h + s * h + 2 * h,
        // Blocks: q, k, v, o, gate, up, down, two RMSNorms; embedding, final norm, output.
        Architecture::Llama => l * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + 2 * v * h + h,
        // Embeddings (+2 position rows, 1 token type, LayerNorm); blocks; LM head dense + LN + bias.
        Architecture::Roberta => {
            v * h + (s + 2) * h + h + 2 * h + l * (4 * h * h + 2 * h * f + 9 * h + f) + h * h + h + 2 * h + v
        }
    }
}

#[test]
fn presets_match_published_sizes() {
    // Published sizes: GPT-2 XL "1.5B"; LLaMA 7B "6.7B" (paper, table 2); Llama 2 "70B";
    // the RoBERTa-style encoders "about 10 and 52 billion" (issue 6).
    let published = [
        ("gpt2-1.5b", 1.5e9),
        ("llama-7b", 6.7e9),
        ("llama-70b", 70e9),
        ("roberta-10b", 10e9),
        ("roberta-50b", 52e9),
    ];
    assert_eq!(published.len(), PRESETS.len());
    for (name, size) in published {
        let cfg = TransformerConfig::preset(name).unwrap();
        let w = cfg.workload().unwrap();
        assert_eq!(w.param_count(), formula(&cfg), "{name}: generator vs closed form");
        let rel = (w.param_count() as f64 - size) / size;
        assert!(
            rel.abs() < 0.05,
            "{name}: {} parameters vs published {size:e} ({:+.1}%)",
            w.param_count(),
            rel * 100.0
        );
        assert!(w.params.iter().all(|p| p.dtype == "bf16" && p.trainable));
    }
}

#[test]
fn fetch_orders_and_layers() {
    for name in PRESETS {
        let cfg = TransformerConfig::preset(name).unwrap();
        let w = cfg.workload().unwrap();
        let mut expect = vec!["embed".to_owned()];
        expect.extend((0..cfg.layers).map(|i| format!("block.{i}")));
        expect.push("head".to_owned());
        assert_eq!(w.forward_order, expect, "{name}");
        expect.reverse();
        assert_eq!(w.backward_order, expect, "{name}");
        // Every parameter is fetched by some layer.
        for p in &w.params {
            assert!(
                w.layers.iter().any(|l| l.params.contains(&p.name)),
                "{name}: {} is never fetched",
                p.name
            );
        }
        // Tied output weights are fetched by the head too.
        let head = w.layer("head").unwrap();
        let tied = head.params.iter().any(|p| p == "embed.tokens.weight");
        assert_eq!(tied, cfg.architecture != Architecture::Llama, "{name}");
    }
}

#[test]
fn flops_follow_the_formulas() {
    for name in PRESETS {
        let cfg = TransformerConfig::preset(name).unwrap();
        let w = cfg.workload().unwrap();
        let t = (cfg.sequence * cfg.batch_per_rank) as f64;
        let (h, s, v) = (cfg.hidden as f64, cfg.sequence as f64, cfg.vocab as f64);
        // A block's forward: 2 T x (its matmul weights) + attention 4 T s h.
        let block = w.layer("block.0").unwrap();
        let matmul_weights: u64 = w
            .params
            .iter()
            .filter(|p| block.params.contains(&p.name) && p.shape.len() == 2)
            .map(|p| p.shape[0] * p.shape[1])
            .sum();
        let fwd = 2.0 * t * matmul_weights as f64 + 4.0 * t * s * h;
        assert!((block.forward_flops - fwd).abs() <= 1e-9 * fwd, "{name}");
        assert_eq!(block.backward_flops, 2.0 * block.forward_flops);
        assert_eq!(block.recompute_flops, block.forward_flops, "{name}: checkpointing recomputes");
        let head = w.layer("head").unwrap();
        assert!(head.forward_flops >= 2.0 * t * h * v);
        // Model FLOPs are close to the 6 N T rule of thumb (attention and embeddings differ).
        let rule = 6.0 * w.param_count() as f64 * t;
        assert!((w.model_flops() / rule - 1.0).abs() < 0.15, "{name}: {} vs {rule}", w.model_flops());
        // Recomputation is executed, not counted as model FLOPs.
        let recompute: f64 =
            (0..cfg.layers).map(|i| w.layer(&format!("block.{i}")).unwrap().forward_flops).sum();
        assert!((w.executed_flops() - w.model_flops() - recompute).abs() <= 1e-9 * recompute);
        let no_ckpt = TransformerConfig { activation_checkpointing: false, ..cfg }.workload().unwrap();
        assert_eq!(no_ckpt.executed_flops(), no_ckpt.model_flops());
    }
}

#[test]
fn json_forms_round_trip() {
    let w = TransformerConfig::preset("gpt2-1.5b").unwrap().workload().unwrap();
    assert_eq!(Workload::from_json(&w.to_json()).unwrap(), w);
    // The parameter list is what `collsched plan --params` reads.
    let v: serde_json::Value = serde_json::from_str(&w.params_json()).unwrap();
    let params = v["params"].as_array().unwrap();
    assert_eq!(params.len(), w.params.len());
    assert_eq!(params[0]["name"], "embed.tokens.weight");
    assert_eq!(params[0]["shape"], serde_json::json!([50257, 1600]));
    assert_eq!((params[0]["dtype"].as_str(), params[0]["trainable"].as_bool()), (Some("bf16"), Some(true)));
    // A generator config file.
    let cfg = TransformerConfig {
        name: "small".into(),
        layers: 2,
        ..TransformerConfig::preset("llama-7b").unwrap()
    };
    let text =
        serde_json::json!({"format": "collsched-workload", "version": 1, "transformer": cfg}).to_string();
    let small = Workload::from_json(&text).unwrap();
    assert_eq!(small, cfg.workload().unwrap());
    assert_eq!(small.layers.len(), 4);
}

#[test]
fn bad_workloads_are_clear_errors() {
    let cfg = TransformerConfig::preset("llama-7b").unwrap();
    let e = TransformerConfig { heads: 30, ..cfg.clone() }.workload().unwrap_err();
    assert!(matches!(e, WorkloadError::Config { field: "heads", .. }), "{e}");
    let e = TransformerConfig { dtype: "f8".into(), ..cfg.clone() }.workload().unwrap_err();
    assert!(e.to_string().contains("`f8` is unknown"), "{e}");
    let e = TransformerConfig { layers: 0, ..cfg.clone() }.workload().unwrap_err();
    assert!(matches!(e, WorkloadError::Config { field: "layers", .. }));
    assert!(matches!(TransformerConfig::preset("gpt5"), Err(WorkloadError::Unknown { .. })));

    let good = TransformerConfig { layers: 1, ..cfg }.workload().unwrap();
    let mutate = |f: &dyn Fn(&mut Workload)| {
        let mut w = good.clone();
        f(&mut w);
        Workload::from_json(&w.to_json()).unwrap_err().to_string()
    };
    assert!(mutate(&|w| w.params[1].shape = vec![4096, 0]).contains("every dimension must be > 0"));
    assert!(mutate(&|w| w.params[1].dtype = "int3".into()).contains("unknown dtype `int3`"));
    assert!(mutate(&|w| w.params.push(w.params[0].clone())).contains("appears twice"));
    assert!(mutate(&|w| w.layers[1].params.push("nope".into())).contains("unknown parameter `nope`"));
    assert!(mutate(&|w| w.layers[1].forward_flops = -1.0).contains("forward_flops"));
    assert!(mutate(&|w| w.update_flops = -2.0).contains("update_flops = -2; give a finite number >= 0"));
    assert!(mutate(&|w| w.loss_flops = -1.0).contains("loss_flops = -1"));
    assert!(mutate(&|w| w.hook_s = -1e-6).contains("hook_s = -0.000001"));
    // The step's compute outside the layers goes through the file; absent, it is 0.
    let mut outside = good.clone();
    (outside.loss_flops, outside.update_flops, outside.hook_s) = (3e9, 7e9, 2.5e-4);
    assert_eq!(Workload::from_json(&outside.to_json()).unwrap(), outside);
    assert!(!good.to_json().contains("update_flops"), "0 is left out");
    assert_eq!(Workload::from_json(&good.to_json()).unwrap().update_flops, 0.0);
    assert!(mutate(&|w| {
        w.forward_order.pop();
    })
    .contains("never runs layer `head`"));
    assert!(mutate(&|w| w.backward_order.push("embed".into())).contains("twice"));
    let e = Workload::from_json("{\"format\": \"collsched-workload\", \"version\": 1}").unwrap_err();
    assert!(e.to_string().contains("neither"), "{e}");
    let e = Workload::from_json("[1, 2").unwrap_err();
    assert!(e.to_string().contains("line"), "{e}");
    assert!(matches!(Workload::resolve("no-such-model"), Err(WorkloadError::Unknown { .. })));
}
