//! Sharding strategies: how a bucket's elements are split over ranks.

use std::fmt;
use std::str::FromStr;

/// A sharding strategy: the parameter-to-rank map of every bucket.
///
/// Text form (the `--strategy` flag): `even`, `flat`, `greedy`, `hybrid:G`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sharding {
    /// Every parameter is split into `world` equal chunks (the last ones padded); rank `r`
    /// owns chunk `r` of every parameter (DeepSpeed ZeRO-3, FSDP2).
    EvenSplit,
    /// A bucket's parameters are concatenated (each start aligned) and the concatenation is
    /// split evenly, so a shard may span parameter boundaries (FSDP1's `FlatParameter`).
    Flat,
    /// Whole parameters go to the least-loaded rank of the bucket by bytes (largest first);
    /// shards are padded to the most loaded rank (fairscale OSS, ZeRO-1/2).
    Greedy,
    /// Even split inside groups of `G` consecutive ranks, replicated across the groups (HSDP,
    /// ZeRO++ hpZ, MiCS). `G` must divide the world size.
    Hybrid(u32),
}

impl Sharding {
    /// A small stable code, used in the plan fingerprint. Never reorder.
    pub const fn code(self) -> u64 {
        match self {
            Sharding::EvenSplit => 1,
            Sharding::Flat => 2,
            Sharding::Greedy => 3,
            Sharding::Hybrid(g) => 4 | ((g as u64) << 8),
        }
    }
}

impl Default for Sharding {
    /// [`Sharding::EvenSplit`].
    fn default() -> Self {
        Sharding::EvenSplit
    }
}

impl fmt::Display for Sharding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sharding::EvenSplit => f.write_str("even"),
            Sharding::Flat => f.write_str("flat"),
            Sharding::Greedy => f.write_str("greedy"),
            Sharding::Hybrid(g) => write!(f, "hybrid:{g}"),
        }
    }
}

impl FromStr for Sharding {
    type Err = ParseShardingError;

    /// Parses `even`, `flat`, `greedy` or `hybrid:G` (`G` a positive integer; whether it
    /// divides the world is checked when the layout is built).
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::Sharding;
    /// assert_eq!("hybrid:8".parse::<Sharding>().unwrap(), Sharding::Hybrid(8));
    /// assert!("hybrid:x".parse::<Sharding>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "even" => Ok(Sharding::EvenSplit),
            "flat" => Ok(Sharding::Flat),
            "greedy" => Ok(Sharding::Greedy),
            _ => match s.strip_prefix("hybrid:") {
                Some(g) => match g.parse::<u32>() {
                    Ok(g) if g > 0 => Ok(Sharding::Hybrid(g)),
                    _ => Err(ParseShardingError::BadGroup { given: s.to_string() }),
                },
                None => Err(ParseShardingError::Unknown { given: s.to_string() }),
            },
        }
    }
}

/// A sharding strategy name that is not `even`, `flat`, `greedy` or `hybrid:G`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
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
