//! The plan JSON: what `collsched plan --json` prints and `collsched.plan` returns (a
//! contract scripts read). [`Plan::json`] gives a [`serde::Serialize`] view; the caller picks
//! the writer (the CLI streams it to stdout, the Python bindings make a string), so nothing
//! here does I/O.
//!
//! One JSON object:
//! - `world`, `strategy` (as given), then `bucket_by` only when it is not `size`,
//!   `fingerprint` (16 hex digits);
//! - `params`: `{name, numel, dtype, trainable}` in input order, canonical dtype names;
//! - `buckets`: `{id, kind: gather|grad, dtype, params: [names], shard_numel, shards: [{rank,
//!   segments: [{param, param_offset, numel, shard_offset}]}]}`, one shard entry per rank of
//!   the world (Hybrid replicas included);
//! - `ops`: `{kind: all_gather|reduce_scatter|all_reduce|broadcast, bucket, group: [ranks],
//!   bytes_per_rank}`, one entry per group. A broadcast's root is the one rank whose shard has
//!   segments.
//!
//! The per-rank segments are derived while serializing, never all held in memory: a plan of a
//! large world streams in the memory of its layout.
//!
//! The golden file `tests/data/params/small.hybrid2.plan.json` pins the format (see
//! `tests/cli_plan.rs` to regenerate it after an intended change).

use serde::ser::{Serialize, SerializeMap, Serializer};

use collsched_buckets::{Boundary, Bucket, Layout, ParamSpec, Segment};

use super::{Op, Plan};

/// A [`Plan`] as its JSON object (the format in [`plan::json`](self)); made by [`Plan::json`].
///
/// # Examples
/// ```
/// use collsched_buckets::{Boundary, Sharding};
/// use collsched_schedule::plan_from_json;
/// let text = r#"{"params": [{"name": "w", "shape": [3], "dtype": "f32"}]}"#;
/// // Two ranks, shard offsets aligned to 4 bytes (one f32).
/// let plan = plan_from_json(text, Sharding::EvenSplit, 2, 64 << 20, 4, Boundary::Size).unwrap();
/// // Any serde serializer: the CLI streams it to stdout with serde_json.
/// let v = serde_json::to_value(plan.json()).unwrap();
/// assert_eq!(v["world"], 2);
/// // `w`'s three elements: two on rank 0, one on rank 1 (chunks of ceil(3 / 2)).
/// let shards = v["buckets"][0]["shards"].as_array().unwrap();
/// assert_eq!(shards[0]["segments"][0]["numel"], 2);
/// assert_eq!(shards[1]["segments"][0]["param_offset"], 2);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct PlanJson<'a>(&'a Plan);

impl Plan {
    /// This plan as its JSON object, for any serde serializer (the format is
    /// [`plan::json`](crate::plan::json)'s rustdoc).
    pub fn json(&self) -> PlanJson<'_> {
        PlanJson(self)
    }
}

impl Serialize for PlanJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let plan = self.0;
        let l = plan.layout();
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("world", &l.world())?;
        m.serialize_entry("strategy", &l.sharding().to_string())?;
        // Only when not the default, so the output of `--bucket-by size` is unchanged.
        if l.boundary() != Boundary::Size {
            m.serialize_entry("bucket_by", &l.boundary().to_string())?;
        }
        m.serialize_entry("fingerprint", &plan.fingerprint().to_string())?;
        m.serialize_entry(
            "params",
            &Seq(|| l.params().specs().iter().zip(l.params().numels()).map(ParamJson)),
        )?;
        m.serialize_entry("buckets", &Seq(|| l.buckets().iter().map(|b| BucketJson(l, b))))?;
        m.serialize_entry("ops", &Seq(|| plan.ops().iter().flat_map(op_groups)))?;
        m.end()
    }
}

/// A sequence serialized from an iterator made on demand.
struct Seq<F>(F);

impl<F, I> Serialize for Seq<F>
where
    F: Fn() -> I,
    I: Iterator,
    I::Item: Serialize,
{
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq((self.0)())
    }
}

struct ParamJson<'a>((&'a ParamSpec, &'a usize));

impl Serialize for ParamJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (spec, numel) = self.0;
        let mut m = s.serialize_map(Some(4))?;
        m.serialize_entry("name", &spec.name)?;
        m.serialize_entry("numel", numel)?;
        m.serialize_entry("dtype", spec.dtype.name())?;
        m.serialize_entry("trainable", &spec.trainable)?;
        m.end()
    }
}

struct BucketJson<'a>(&'a Layout, &'a Bucket);

impl Serialize for BucketJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (l, b) = (self.0, self.1);
        let set = l.params();
        let mut m = s.serialize_map(Some(6))?;
        m.serialize_entry("id", &b.id().0)?;
        m.serialize_entry("kind", b.kind().name())?;
        m.serialize_entry("dtype", b.dtype().name())?;
        m.serialize_entry("params", &Seq(|| b.params().iter().map(|&p| set.name(p))))?;
        m.serialize_entry("shard_numel", &b.shard_numel())?;
        m.serialize_entry("shards", &Seq(|| (0..l.world()).map(|rank| ShardJson(l, b, rank))))?;
        m.end()
    }
}

struct ShardJson<'a>(&'a Layout, &'a Bucket, u32);

impl Serialize for ShardJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (l, b, rank) = (self.0, self.1, self.2);
        let mut m = s.serialize_map(Some(2))?;
        m.serialize_entry("rank", &rank)?;
        m.serialize_entry("segments", &Seq(|| b.segments(rank).map(|seg| SegmentJson(l, seg))))?;
        m.end()
    }
}

struct SegmentJson<'a>(&'a Layout, Segment);

impl Serialize for SegmentJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let seg = &self.1;
        let mut m = s.serialize_map(Some(4))?;
        m.serialize_entry("param", self.0.params().name(seg.param))?;
        m.serialize_entry("param_offset", &seg.param_offset)?;
        m.serialize_entry("numel", &seg.numel)?;
        m.serialize_entry("shard_offset", &seg.shard_offset)?;
        m.end()
    }
}

/// One JSON op per rank group of `op`.
fn op_groups(op: &Op) -> impl Iterator<Item = OpJson<'_>> {
    (0..op.groups().count()).map(move |g| OpJson(op, g))
}

struct OpJson<'a>(&'a Op, u32);

impl Serialize for OpJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (op, g) = (self.0, self.1);
        let mut m = s.serialize_map(Some(4))?;
        m.serialize_entry("kind", op.kind().name())?;
        m.serialize_entry("bucket", &op.bucket().0)?;
        m.serialize_entry("group", &Seq(|| op.groups().ranks(g)))?;
        m.serialize_entry("bytes_per_rank", &op.bytes_per_rank())?;
        m.end()
    }
}
