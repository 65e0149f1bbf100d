//! Element types of parameters and payloads.

use std::fmt;
use std::str::FromStr;

/// The element type of a parameter (and of the buckets it is packed into).
///
/// `F64`, `U8` and `I8` exist for payloads (quantized weights, optimizer state); reductions
/// are only defined by the kernels for the floating-point types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE 754 single precision, 4 bytes.
    F32,
    /// IEEE 754 half precision, 2 bytes.
    F16,
    /// bfloat16, 2 bytes.
    BF16,
    /// IEEE 754 double precision, 8 bytes.
    F64,
    /// Unsigned byte (quantized payloads), 1 byte.
    U8,
    /// Signed byte (quantized payloads), 1 byte.
    I8,
}

impl DType {
    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 6] = [DType::F32, DType::F16, DType::BF16, DType::F64, DType::U8, DType::I8];

    /// Size of one element in bytes.
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::DType;
    /// assert_eq!(DType::BF16.size(), 2);
    /// assert_eq!(DType::F64.size(), 8);
    /// ```
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F64 => 8,
            DType::U8 | DType::I8 => 1,
        }
    }

    /// The canonical lower-case name, as the parameter file spells it (`"bf16"`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::U8 => "u8",
            DType::I8 => "i8",
        }
    }

    /// A small stable code, used in the plan fingerprint. Never reorder.
    pub const fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F16 => 2,
            DType::BF16 => 3,
            DType::F64 => 4,
            DType::U8 => 5,
            DType::I8 => 6,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = ParseDTypeError;

    /// Parses a dtype name. Accepted (case-insensitive): `f32`/`float32`/`float`, `f16`/
    /// `float16`/`half`, `bf16`/`bfloat16`, `f64`/`float64`/`double`, `u8`/`uint8`, `i8`/`int8`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        let t = t.strip_prefix("torch.").unwrap_or(&t);
        Ok(match t {
            "f32" | "float32" | "float" => DType::F32,
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "f64" | "float64" | "double" => DType::F64,
            "u8" | "uint8" => DType::U8,
            "i8" | "int8" => DType::I8,
            _ => return Err(ParseDTypeError { given: s.to_string() }),
        })
    }
}

/// A dtype name that is not one of [`DType`]'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype `{given}` (expected one of f32, f16, bf16, f64, u8, i8)")]
pub struct ParseDTypeError {
    /// What was given.
    pub given: String,
}
