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

mod boundary;
mod dtype;
mod layout;
mod param;
mod sharding;

pub use boundary::{Boundary, ModuleKey, ParseBoundaryError, MAX_DEPTH};
pub use dtype::{DType, ParseDTypeError};
pub use layout::{
    Bucket, BucketId, BucketKind, CanonicalSink, GatheredSegment, GatheredSegments, Layout, LayoutBuilder,
    LayoutDiff, LayoutError, Placement, Segment, Segments, DEFAULT_ALIGN, DEFAULT_BUCKET_BYTES, MAX_ALIGN,
};
pub use param::{ParamError, ParamFileError, ParamId, ParamSet, ParamSpec};
pub use sharding::{ParseShardingError, Sharding};

/// The entry point of the `parse_params` fuzz target (`fuzz/`): parses `text` with
/// [`ParamSet::from_json`] and, when it is a valid set, buckets it by module (layer keys, and
/// depth 2 with packing) on one rank, which derives the module key of every name. Returns the
/// number of gather buckets of both layouts.
///
/// # Errors
/// What [`ParamSet::from_json`] returns for bad input, or a [`LayoutError`] (e.g. an alignment
/// that is not a multiple of a dtype's size cannot happen here; sizes that overflow can).
#[doc(hidden)]
pub fn fuzz_parse_params(text: &str) -> Result<usize, Box<dyn std::error::Error>> {
    let set = ParamSet::from_json(text)?;
    let mut buckets = 0;
    for boundary in [Boundary::LAYER, Boundary::Module { key: ModuleKey::Depth(2), pack: true }] {
        let layout = LayoutBuilder::new(&set, Sharding::EvenSplit, 1)
            .bucket_bytes(1 << 20)
            .boundary(boundary)
            .build()?;
        buckets += layout.gather_buckets().len();
    }
    Ok(buckets)
}
