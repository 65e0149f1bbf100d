//! Machine topology, rank groups and the collective cost model: *where* things move.

#![warn(missing_docs)]
