//! Building layouts and plans: a Llama-70B-shaped parameter list (80 layers, 723 tensors) and
//! a 100,000-tensor list, at worlds 8, 64 and 1024, for each strategy.
//!
//! Run: `cargo bench --bench plan` (or `-- 100k/even` for one group; `-- 100k-modules` for
//! the bucket-boundary variants). The cost should grow
//! with the number of parameters, not with parameters x world: compare the world 8 and world
//! 1024 columns of one list.

use std::hint::black_box;
use std::time::Duration;

use collsched::buckets::{Boundary, DType, LayoutBuilder, ModuleKey, ParamSet, ParamSpec, Sharding};
use collsched::schedule::Plan;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

/// Llama-3-70B: hidden 8192, MLP 28672, 64 query / 8 key-value heads of 128, vocabulary
/// 128256, 80 layers, bf16.
fn llama70b() -> ParamSet {
    let (h, ffn, kv, vocab) = (8192usize, 28672usize, 1024usize, 128256usize);
    let mut specs = vec![ParamSpec::new("model.embed_tokens.weight", [vocab, h], DType::BF16)];
    for l in 0..80 {
        let p =
            |n: &str, shape: Vec<usize>| ParamSpec::new(format!("model.layers.{l}.{n}"), shape, DType::BF16);
        specs.extend([
            p("input_layernorm.weight", vec![h]),
            p("self_attn.q_proj.weight", vec![h, h]),
            p("self_attn.k_proj.weight", vec![kv, h]),
            p("self_attn.v_proj.weight", vec![kv, h]),
            p("self_attn.o_proj.weight", vec![h, h]),
            p("post_attention_layernorm.weight", vec![h]),
            p("mlp.gate_proj.weight", vec![ffn, h]),
            p("mlp.up_proj.weight", vec![ffn, h]),
            p("mlp.down_proj.weight", vec![h, ffn]),
        ]);
    }
    specs.push(ParamSpec::new("model.norm.weight", [h], DType::BF16));
    specs.push(ParamSpec::new("lm_head.weight", [vocab, h], DType::BF16));
    ParamSet::new(specs).expect("valid")
}

/// 100,000 tensors of 1 to 2^20 elements (log-uniform, a fixed pseudo-random sequence),
/// mostly bf16 with f32 norms, one in ten frozen.
fn many(n: usize) -> ParamSet {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let specs = (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let numel = 1 + (x % (1 << (x >> 59).min(20))) as usize;
            let dtype = if i % 5 == 0 { DType::F32 } else { DType::BF16 };
            ParamSpec::new(format!("t{i}"), [numel], dtype).trainable(i % 10 != 0)
        })
        .collect();
    ParamSet::new(specs).expect("valid")
}

fn build(set: &ParamSet, sharding: Sharding, world: u32) -> Plan {
    Plan::new(LayoutBuilder::new(set, sharding, world).bucket_bytes(64 << 20).build().expect("valid"))
}

fn bench_lists(c: &mut Criterion) {
    let lists = [("llama70b", llama70b()), ("100k", many(100_000))];
    for (name, set) in &lists {
        for (sname, sharding) in [
            ("even", Sharding::EvenSplit),
            ("flat", Sharding::Flat),
            ("greedy", Sharding::Greedy),
            ("hybrid8", Sharding::Hybrid(8)),
        ] {
            let mut group = c.benchmark_group(format!("{name}/{sname}"));
            group
                .sample_size(10)
                .warm_up_time(Duration::from_millis(300))
                .measurement_time(Duration::from_secs(2));
            for world in [8u32, 64, 1024] {
                group.bench_with_input(BenchmarkId::from_parameter(world), &world, |b, &w| {
                    b.iter(|| black_box(build(set, sharding, w)))
                });
            }
            group.finish();
        }
    }
}

/// The 100,000-tensor list named like a model of 16-tensor blocks
/// (`model.layers.{i / 16}.t{i}.weight`), at world 1024, bucketed by size and by module (with
/// and without packing): the cost of deriving and comparing module keys.
fn bench_boundaries(c: &mut Criterion) {
    let base = many(100_000);
    let specs = base
        .specs()
        .iter()
        .enumerate()
        .map(|(i, s)| ParamSpec { name: format!("model.layers.{}.t{i}.weight", i / 16), ..s.clone() })
        .collect();
    let set = ParamSet::new(specs).expect("valid");
    let mut group = c.benchmark_group("100k-modules/even/1024");
    group.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    for (name, boundary) in [
        ("size", Boundary::Size),
        ("module", Boundary::LAYER),
        ("module+pack", Boundary::Module { key: ModuleKey::Layer, pack: true }),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let layout = LayoutBuilder::new(&set, Sharding::EvenSplit, 1024)
                    .bucket_bytes(64 << 20)
                    .boundary(boundary)
                    .build()
                    .expect("valid");
                black_box(Plan::new(layout))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_lists, bench_boundaries);
criterion_main!(benches);
