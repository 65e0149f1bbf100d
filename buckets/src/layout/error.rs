//! Why a layout could not be built.

use crate::{BucketId, DType, ParamError, ParamId};

/// Why a layout could not be built by [`LayoutBuilder::build`](crate::LayoutBuilder::build) or
/// changed by [`Layout::with_trainable`](crate::Layout::with_trainable).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A world of zero ranks.
    #[error("world size is 0: it must be at least 1 rank")]
    ZeroWorld,
    /// `Hybrid(0)`.
    #[error("hybrid group size is 0: use hybrid:G with G >= 1 dividing the world size {world}")]
    ZeroGroup {
        /// The world size.
        world: u32,
    },
    /// `Hybrid(g)` with `g` not dividing the world.
    #[error("hybrid group size {group} does not divide the world size {world}: pick a divisor of {world}")]
    GroupNotDivisor {
        /// The group size.
        group: u32,
        /// The world size.
        world: u32,
    },
    /// Module boundaries of depth 0 (every parameter would be in one module).
    #[error("module depth 0 puts every parameter in one module: use a depth of at least 1 (module:2 keeps `h.0` of `h.0.attn.qkv.weight`), or bucket by size")]
    ZeroModuleDepth,
    /// A bucket cap of zero bytes.
    #[error("bucket size is 0 bytes: give a positive bucket size (e.g. --bucket-mb 64)")]
    ZeroBucketBytes,
    /// An alignment that is not a power of two.
    #[error("alignment {align} bytes is not a power of two: use e.g. 256")]
    AlignNotPowerOfTwo {
        /// The alignment in bytes.
        align: usize,
    },
    /// An alignment above [`MAX_ALIGN`](crate::MAX_ALIGN): every shard would be padded to it.
    #[error("alignment {align} bytes is above the limit of {max} bytes (every shard is padded to a multiple of it): use e.g. 256")]
    AlignTooLarge {
        /// The alignment in bytes.
        align: usize,
        /// The limit.
        max: usize,
    },
    /// An alignment smaller than (so not a multiple of) a parameter's element size.
    #[error("alignment {align} bytes is not a multiple of the {dtype} element size ({size} bytes) of parameter `{param}`: use at least {size}")]
    AlignNotMultipleOfDType {
        /// The alignment in bytes.
        align: usize,
        /// The dtype.
        dtype: DType,
        /// Its element size.
        size: usize,
        /// The first parameter of that dtype.
        param: String,
    },
    /// An execution order that names a parameter id outside the set.
    #[error("execution order entry #{index} is parameter id {param}, but there are only {count} parameters")]
    OrderUnknownParam {
        /// Position in the order.
        index: usize,
        /// The id.
        param: ParamId,
        /// Parameters in the set.
        count: usize,
    },
    /// An execution order that names a parameter twice.
    #[error("execution order names parameter `{name}` twice (entries #{first} and #{second}): list each at most once")]
    OrderDuplicate {
        /// The parameter.
        name: String,
        /// First position.
        first: usize,
        /// Second position.
        second: usize,
    },
    /// Offsets or sizes overflow the address space.
    #[error(
        "bucket {bucket}: sizes overflow the address space (world {world}): use fewer or smaller parameters"
    )]
    Overflow {
        /// The bucket being built.
        bucket: BucketId,
        /// The world size.
        world: u32,
    },
    /// More buckets than a [`BucketId`] can number.
    #[error("more than {max} buckets: raise the bucket size", max = u32::MAX)]
    TooManyBuckets,
    /// A trainability mask that does not fit the parameter set.
    #[error(transparent)]
    Param(#[from] ParamError),
}
