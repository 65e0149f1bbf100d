//! Parameters, sharding strategies and coalescing buckets: *what* is moved together.
//!
//! The data path: a [`ParamSet`] (validated [`ParamSpec`]s) and a [`Sharding`] go into a
//! [`LayoutBuilder`], which freezes into a validated, immutable [`Layout`]: parameters grouped
//! into [`Bucket`]s of one dtype (gather buckets for parameters, gradient buckets for the
//! trainable ones), each bucket split into equal, aligned per-rank shards whose contents are
//! described by [`Segment`]s derived on demand.
//!
//! No I/O, no threads, no clocks, no unsafe.
//!
//! # Examples
//! ```
//! use collsched_buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
//! let set = ParamSet::new(vec![
//!     ParamSpec::new("h.0.attn.qkv.weight", [3072, 1024], DType::BF16),
//!     ParamSpec::new("h.0.ln.weight", [1024], DType::F32).trainable(false),
//! ])?;
//! let layout = LayoutBuilder::new(&set, Sharding::EvenSplit, 8).bucket_bytes(64 << 20).build()?;
//! let qkv = set.id("h.0.attn.qkv.weight").unwrap();
//! let bucket = layout.bucket(layout.gather_bucket_of(qkv).unwrap()).unwrap();
//! // Rank 3 holds elements 3*393216 .. 4*393216 of the weight.
//! let seg = bucket.segments(3).next().unwrap();
//! assert_eq!((seg.param, seg.param_offset, seg.numel), (qkv, 3 * 393216, 393216));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod dtype;
mod error;
mod layout;
mod param;
mod sharding;

pub use dtype::DType;
pub use error::{LayoutError, ParamError, ParamFileError, ParseDTypeError, ParseShardingError};
pub use layout::{
    Bucket, BucketId, BucketKind, CanonicalSink, GatheredSegment, GatheredSegments, Layout, LayoutBuilder,
    LayoutDiff, Placement, Segment, Segments, DEFAULT_ALIGN, DEFAULT_BUCKET_BYTES,
};
pub use param::{ParamId, ParamSet, ParamSpec};
pub use sharding::Sharding;
