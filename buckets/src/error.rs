//! Errors of this crate: one enum per operation, each variant carrying the offending values.

use thiserror::Error;

use crate::{BucketId, DType, ParamId};

/// A dtype name that is not one of [`DType`]'s.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("unknown dtype `{given}` (expected one of f32, f16, bf16, f64, u8, i8)")]
pub struct ParseDTypeError {
    /// What was given.
    pub given: String,
}

/// A sharding strategy name that is not `even`, `flat`, `greedy` or `hybrid:G`.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ParseShardingError {
    /// Not one of the known names.
    #[error("unknown sharding strategy `{given}` (expected even, flat, greedy or hybrid:G)")]
    Unknown {
        /// What was given.
        given: String,
    },
    /// `hybrid:G` with a `G` that is not a positive integer.
    #[error("bad group size in `{given}`: G in hybrid:G must be a positive integer (e.g. hybrid:8)")]
    BadGroup {
        /// What was given.
        given: String,
    },
}

/// A `--bucket-by` value that is not `size`, `module`, `module:D` (each `module` form with an
/// optional `+pack`).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ParseBoundaryError {
    /// Not one of the known forms.
    #[error("unknown bucket boundary `{given}` (expected size, module or module:DEPTH, a module form optionally with +pack, e.g. module:3+pack)")]
    Unknown {
        /// What was given.
        given: String,
    },
    /// `module:D` with a `D` that is not a positive integer.
    #[error("bad module depth in `{given}`: D in module:D must be a positive integer (e.g. module:2 keeps `h.0` of `h.0.attn.qkv.weight`)")]
    BadDepth {
        /// What was given.
        given: String,
    },
}

/// Why a parameter list was rejected by [`ParamSet::new`](crate::ParamSet::new).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ParamError {
    /// The list holds no parameters.
    #[error("the parameter list is empty: give at least one parameter")]
    Empty,
    /// A parameter without a name.
    #[error("parameter #{index} has an empty name: every parameter needs a unique name")]
    EmptyName {
        /// Position in the list.
        index: usize,
    },
    /// A parameter whose explicit module name is empty.
    #[error("parameter `{name}` has an empty module name: leave `module` out (it is then derived from the name) or name the module, e.g. \"h.0\"")]
    EmptyModule {
        /// The parameter.
        name: String,
    },
    /// Two parameters share a name.
    #[error("duplicate parameter name `{name}` (entries #{first} and #{second}): names must be unique")]
    DuplicateName {
        /// The name.
        name: String,
        /// Position of its first occurrence.
        first: usize,
        /// Position of its second occurrence.
        second: usize,
    },
    /// A dimension of size zero.
    #[error(
        "parameter `{name}` has shape {shape:?} with a zero in dimension {dim}: sizes must be at least 1"
    )]
    ZeroDim {
        /// The parameter.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The first zero dimension.
        dim: usize,
    },
    /// The element count or byte size does not fit the address space.
    #[error("parameter `{name}` with shape {shape:?} of {dtype} is too large to address")]
    TooLarge {
        /// The parameter.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Its dtype.
        dtype: DType,
    },
    /// More parameters than a [`ParamId`] can number.
    #[error("{count} parameters: at most {max} are supported", max = u32::MAX)]
    TooMany {
        /// How many were given.
        count: usize,
    },
    /// A trainability mask whose length is not the number of parameters.
    #[error("trainability mask has {got} entries but there are {expected} parameters")]
    MaskLength {
        /// Entries in the mask.
        got: usize,
        /// Parameters in the set.
        expected: usize,
    },
}

/// Why a parameter file (JSON) was rejected by [`ParamSet::from_json`](crate::ParamSet::from_json).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ParamFileError {
    /// Not valid JSON, or not the expected shape.
    #[error("parameter file, line {line} column {column}: {message} (expected {{\"params\": [{{\"name\", \"shape\", \"dtype\", \"trainable\", \"module\"}}, ...]}})")]
    Json {
        /// 1-based line of the problem.
        line: usize,
        /// 1-based column of the problem.
        column: usize,
        /// What is wrong there.
        message: String,
    },
    /// A dtype name that is not one of [`DType`]'s.
    #[error("parameter `{name}` (entry #{index}): unknown dtype `{dtype}` (expected one of f32, f16, bf16, f64, u8, i8)")]
    UnknownDType {
        /// The parameter.
        name: String,
        /// Position in the list.
        index: usize,
        /// The dtype as given.
        dtype: String,
    },
    /// The list parsed but is not a valid parameter set.
    #[error(transparent)]
    Param(#[from] ParamError),
}

/// Why a layout could not be built by [`LayoutBuilder::build`](crate::LayoutBuilder::build) or
/// changed by [`Layout::with_trainable`](crate::Layout::with_trainable).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
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
